"""Absent keys answered from one listing after many misses (store/listing.py), in the action
cache and the state file: the shortcut never hides a key this process filed, and a listed key
is still asked of the store (it may have been collected since)."""

from __future__ import annotations

import sqlite3

from build_graph.model import ActionResult, Digester
from build_graph.store.action_cache import LocalActionCache
from build_graph.store.listing import MissListing
from build_graph.store.state import STATE_FILE, BuildState

B3 = Digester("blake3")
RESULT = ActionResult("t" * 64, 0, "o" * 64, "e" * 64, 0.1)


def test_the_listing_is_read_once_at_the_threshold_and_keeps_what_is_filed_after():
    reads = []

    def read_all():
        reads.append(1)
        return ["a", "b"]
    listing = MissListing(read_all, after=3)
    for _ in range(2):
        listing.missed()
    assert not listing.absent("zz") and not reads  # below the threshold: every key is asked for
    listing.missed()
    assert reads == [1] and listing.absent("zz") and not listing.absent("a")
    listing.added("zz")
    assert not listing.absent("zz")
    for _ in range(5):
        listing.missed()
    assert reads == [1]


def test_an_unreadable_listing_leaves_every_lookup_to_the_store():
    def broken():
        raise OSError("gone")
    listing = MissListing(broken, after=1)
    listing.missed()
    assert not listing.absent("anything")


def test_action_cache_misses_stop_opening_files_but_see_its_own_and_listed_entries(tmp_path, monkeypatch):
    other = LocalActionCache(tmp_path, tmp_path)
    other.put("1" * 64, RESULT)  # filed before the listing, by another process
    ac = LocalActionCache(tmp_path, tmp_path)
    monkeypatch.setattr(ac, "_listing", MissListing(ac.keys, after=2))
    assert ac.get("2" * 64) is None and ac.get("3" * 64) is None  # the second miss lists ac/
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    assert ac.get("4" * 64) is None and not opened  # known absent: no file opened
    assert ac.get("1" * 64) == RESULT and opened  # listed: read from its file
    ac.put("5" * 64, RESULT)
    assert ac.get("5" * 64) == RESULT  # filed by this process after the listing
    other.put("6" * 64, RESULT)  # filed by another process after the listing: a miss (a rerun)
    assert ac.get("6" * 64) is None
    ac.remove("1" * 64)  # collected since it was listed: the file decides
    assert ac.get("1" * 64) is None


def test_state_file_misses_stop_querying_but_see_rows_filed_here(tmp_path, monkeypatch):
    first = BuildState(tmp_path / STATE_FILE)
    first.put_result("a" * 64, RESULT, None)
    first.put_trace("//p:a", "d" * 64, b"{}")
    first.close()
    state = BuildState(tmp_path / STATE_FILE)
    monkeypatch.setattr(state, "_listed_results", MissListing(lambda: state._column("SELECT key FROM results"), 2))
    monkeypatch.setattr(state, "_listed_traces", MissListing(lambda: state._column("SELECT label FROM traces"), 2))
    for k in ("b", "c"):
        assert state.result(k * 64, B3) is None and state.trace(f"//p:{k}") is None
    queries = []
    monkeypatch.setattr(state, "_query", lambda sql, args: queries.append(args) or BuildState._query(state, sql, args))
    assert state.result("x" * 64, B3) is None and state.trace("//p:x") is None and not queries
    assert state.result("a" * 64, B3)[0] == RESULT and state.trace("//p:a") == {} and len(queries) == 2
    state.put_result("y" * 64, RESULT, None)
    state.put_trace("//p:y", "e" * 64, b'{"actions": {}}')
    state.flush()  # no longer pending: the listing must still know them
    assert state.result("y" * 64, B3)[0] == RESULT and state.trace_digest("//p:y") == "e" * 64
    db = sqlite3.connect(tmp_path / STATE_FILE)
    db.execute("DELETE FROM results WHERE key = ?", ("a" * 64,))  # collected by another process
    db.commit()
    db.close()
    assert state.result("a" * 64, B3) is None
    state.close()
