"""`bgraph build`'s fast path: an unchanged request is answered from its record (store/uptodate.py)
before the workspace is loaded, and an edit takes what it does not reach from the per-target memo
(store/memo.py). Both are the stored answer of the one decision procedure: the engine files them
at the end of a successful build (Engine.remember), as a row of the cache's state file; this
module only reads them, and drops the record a build that records nothing relinks over.

Records live in the cache (like Bazel's output base), not in bgraph-out/: a user who removes
bgraph-out/ (`make clean`) gets the links back from the record at no-op cost when nothing else
changed."""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from build_graph.roots import state_file, workspace_root
from build_graph.store import memo, uptodate
from build_graph.store.statefile import StateFile

if TYPE_CHECKING:
    from rich.console import Console

# Flags that ask a build for more than its outputs: each of these takes the full path.
_FULL_PATH_FLAGS = ("dry_run", "check", "check_sample", "check_against", "profile", "remote_upload")
# The environment that chooses the cache, the config file or the host's platform.
_ENV = ("BGRAPH_CACHE", "BGRAPH_CONFIG", "XDG_CONFIG_HOME", "HOME")


@dataclasses.dataclass(frozen=True)
class Request:
    """One request's record: its workspace, its name, and the directory it is kept in."""

    root: Path
    digest: str
    state: Path  # the cache's state file (store/statefile.py), whose `records` row is the record
    # The request less its targets and the directory it was run from: builds of other targets in
    # the same workspace, cache and configuration share it, and the last one's memo serves a
    # request that has no record yet. (A target's plan never reads the current directory: only
    # the request's own labels, which may be relative, and the links it prints do.)
    family: str = ""


def request(args) -> Request | None:
    """The record of this build, or None where the build must take the full path whatever
    changed (a dry run, --check, --profile, uploads, an unreadable WORKSPACE.toml)."""
    if any(getattr(args, flag, None) for flag in _FULL_PATH_FLAGS):
        return None
    return _request(args)


def overridden(args) -> Request | None:
    """The record a build with a full-path flag (--check, --profile, --check-against, uploads)
    overrides: the same request without the flag. Such a build relinks bgraph-out/ but records
    nothing, so it must drop that record and its family's pointer (`drop`)."""
    if getattr(args, "dry_run", None) or not any(getattr(args, f, None) for f in _FULL_PATH_FLAGS):
        return None
    return _request(args)


def drop(asked: Request) -> None:
    """Forget the request's record, its memo and its family's pointer to it."""
    StateFile(asked.state, create=False).drop_record(asked.digest, asked.family)


def _request(args) -> Request | None:
    root = workspace_root(args.workspace)
    state = state_file(args.cache_dir, root)
    if state is None:
        return None
    parts = {
        "root": str(root), "cwd": os.getcwd(), "targets": args.targets, "platform": args.platform,
        "host_platform": args.host_platform, "machine": platform.machine(), "cache_dir": args.cache_dir,
        # every flag that changes which origins a build trusts (store/origins.py): a build with
        # other ones is never answered from the record of one that took results they do not
        "remote": [args.remote_cache, args.remote_signing_key, args.remote_trusted_key,
                   getattr(args, "remote_allow_unsigned", False), getattr(args, "remote_executor", None),
                   getattr(args, "remote_accept_cached", False)],
        "env": {k: os.environ.get(k) for k in _ENV},
    }
    family = uptodate.request_digest({k: v for k, v in parts.items() if k not in ("targets", "cwd")})
    return Request(root, uptodate.request_digest(parts), state, family)


class Previous:
    """The last successful build of a request, as far as it still holds."""

    def __init__(self, asked: Request):
        self.asked, self.started, self.started_ns = asked, time.monotonic(), time.time_ns()
        self.digest = asked.digest  # whose record this is: the request's own, or its family's last
        self.rows = StateFile(asked.state, create=False)
        self.record = uptodate.load(self.rows, asked.digest)
        if self.record is None and asked.family:
            last = self.rows.family(asked.family)
            if last is not None:
                self.digest, self.record = last, uptodate.load(self.rows, last)
        self.own = self.digest == asked.digest
        self.scanned: dict[str, Any] = {}  # the workspace as this check found it (if it got that far)
        # None: more than file contents changed (or no record); empty: nothing in the workspace did
        self.changed = uptodate.changed_files(self.record, self.scanned) if self.record is not None else None

    def answer(self, console: Console, as_json: bool = False) -> bool:
        """If nothing changed and the outputs are in place, say so as a build would (with
        `as_json`, the summary `--json` prints, every action a hit) and return True; else False
        (the caller builds)."""
        s = self.record.summary if self.changed == set() else {}
        if not (self.own and isinstance(s.get("outputs"), dict) and isinstance(s.get("actions"), int)):
            return False  # changed, another request's, a query's, or damaged
        if as_json and s.get("remote"):
            return False  # --json reports the remote's figures: only the full path has them
        entries = memo.decode(self.rows.memo(self.digest)) if as_json else None
        if as_json and entries is None:
            return False  # the memo lists the actions; without it, the full path does
        try:
            restored = uptodate.restore_links(self.record, self.asked.state.parent.parent)
        except (OSError, TypeError, ValueError):  # a link it cannot read, or a damaged record's
            restored = None
        if restored is None:
            return False
        if entries is not None:
            print(orjson.dumps(_summary(s, entries, time.monotonic() - self.started),
                               option=orjson.OPT_INDENT_2).decode())
            return True
        from rich.markup import escape

        links = f"; {restored} output link(s) put back" if restored else ""
        console.print(f"[green]OK[/]: executed 0, cache hits {s['actions']}, cut off 0, failed 0, "
                      f"wall {time.monotonic() - self.started:.2f}s (up to date: no input changed since the last "
                      f"build{links})", highlight=False)
        for label, link in s["outputs"].items():
            console.print(f"[dim]{escape(label)}:[/] {escape(os.path.relpath(link))}", highlight=False)
        return True

    def reuse(self, cache: Path) -> memo.Reuse | None:
        """What the build may take from the last one (store/memo.py): its per-target memo, where
        only the contents of workspace files read as sources changed."""
        if self.changed is None:
            return None
        if "WORKSPACE.toml" in self.changed:
            return None  # pins, platforms, defaults: what every plan may read
        # A target's definition may have changed: each entry is then checked against its own.
        definitions = any(p.startswith("targets/") and p.endswith(".toml") for p in self.changed)
        generation = uptodate.generation_path(cache / "v1")
        if str(generation) not in self.record.extra:  # the memo belongs to another cache
            return None
        entries = memo.decode(self.rows.memo(self.digest))
        if entries is None:
            return None
        return memo.Reuse(entries, self.changed, generation, self.record.extra[str(generation)], definitions,
                          other_request=not self.own)


def _summary(recorded: dict[str, Any], entries: dict[str, memo.Entry], wall_s: float) -> dict[str, Any]:
    """What `bgraph build --json` prints for this no-op: the full path's summary, every action a hit."""
    actions = [{"label": label, "name": name, "mnemonic": mnemonic, "key": key, "status": "hit",
                "reason": "inputs unchanged", "duration_s": 0.0, "differs": False, "peak_mb": 0, "cpu_s": 0.0}
               for label, e in entries.items() for name, mnemonic, key in e.actions]
    return {"ok": True, "executed": 0, "hits": len(actions), "cut_off": 0, "failed": 0, "would_run": 0,
            "differing": [], "wall_s": round(wall_s, 3), "cpu_s": 0.0, "targets": list(recorded["outputs"]),
            "actions": actions, "errors": [], "up_to_date": True, "outputs": recorded["outputs"]}


def answer_request(args, command: str, parts: dict[str, Any]) -> Request | None:
    """The record of a command whose answer is a function of the workspace alone."""
    root = workspace_root(args.workspace)
    state = state_file(args.cache_dir, root)
    if state is None:
        return None
    return Request(root, uptodate.request_digest({"command": command, "root": str(root), "cwd": os.getcwd(),
                                                  **parts}), state)


def replay(asked: Request) -> tuple[str, int] | None:
    """The recorded answer (its text and exit code), if nothing it was computed from changed."""
    record = uptodate.load(StateFile(asked.state, create=False), asked.digest)
    if record is None or not isinstance(record.summary.get("text"), str) or not isinstance(
            record.summary.get("code"), int) or uptodate.changed_files(record) != set():
        return None
    return record.summary["text"], record.summary["code"]
