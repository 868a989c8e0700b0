"""`bgraph build`'s no-op check (store/uptodate.py): an unchanged request is answered from its
record before the workspace is loaded; a successful build writes the record.

Records live in the cache (`<cache>/v1/uptodate/`, like Bazel's output base), not in bgraph-out/:
a user who removes bgraph-out/ (`make clean`) gets the links back from the record at no-op cost
when nothing else changed."""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from build_graph.roots import records_dir, user_config_path, workspace_root
from build_graph.store import memo, uptodate
from build_graph.store.atomic import write_bytes

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
    store: Path  # <cache>/v1/uptodate
    # The request less its targets: builds of other targets in the same workspace, cache and
    # configuration share it, and the last one's memo serves a request that has no record yet.
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
    uptodate.forget(asked.store, asked.digest)
    memo.forget(asked.store, asked.digest)
    try:
        family = _family_path(asked.store, asked.family)
        if family.read_text().strip() == asked.digest:
            family.unlink()
    except (OSError, UnicodeDecodeError):
        pass


def _request(args) -> Request | None:
    root = workspace_root(args.workspace)
    store = records_dir(args.cache_dir, root)
    if store is None:
        return None
    parts = {
        "root": str(root), "cwd": os.getcwd(), "targets": args.targets, "platform": args.platform,
        "host_platform": args.host_platform, "machine": platform.machine(), "cache_dir": args.cache_dir,
        "remote": [args.remote_cache, args.remote_signing_key, args.remote_trusted_key,
                   getattr(args, "remote_allow_unsigned", False)],
        "env": {k: os.environ.get(k) for k in _ENV},
    }
    family = uptodate.request_digest({k: v for k, v in parts.items() if k != "targets"})
    return Request(root, uptodate.request_digest(parts), store, family)


def _family_path(store: Path, family: str) -> Path:
    return store / f"{family}.last"


class Previous:
    """The last successful build of a request, as far as it still holds."""

    def __init__(self, asked: Request):
        self.asked, self.started, self.started_ns = asked, time.monotonic(), time.time_ns()
        self.digest = asked.digest  # whose record this is: the request's own, or its family's last
        self.record = uptodate.load(asked.store, asked.digest)
        if self.record is None and asked.family:
            try:
                last = _family_path(asked.store, asked.family).read_text().strip()
            except (OSError, UnicodeDecodeError):
                last = ""
            if last.isalnum():  # a request digest (a damaged file names none)
                self.digest, self.record = last, uptodate.load(asked.store, last)
        self.own = self.digest == asked.digest
        self.scanned: dict[str, Any] = {}  # the workspace as this check found it (if it got that far)
        # None: more than file contents changed (or no record); empty: nothing in the workspace did
        self.changed = uptodate.changed_files(self.record, self.scanned) if self.record is not None else None

    def answer(self, console: Console, as_json: bool = False) -> bool:
        """If nothing changed and the outputs are in place, say so as a build would (with
        `as_json`, the summary `--json` prints, every action a hit) and return True; else False
        (the caller builds)."""
        if self.changed != set() or not self.own:
            return False
        if as_json and self.record.summary.get("remote"):
            return False  # --json reports the remote's figures: only the full path has them
        entries = memo.load(self.asked.store, self.asked.digest, self.record.memo) if as_json else None
        if as_json and entries is None:
            return False  # the memo lists the actions; without it, the full path does
        try:
            restored = uptodate.restore_links(self.record, self.asked.store.parent)
        except OSError:
            restored = None
        if restored is None:
            return False
        s = self.record.summary
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
        if self.changed is None or not self.record.memo:
            return None
        if "WORKSPACE.toml" in self.changed:
            return None  # pins, platforms, defaults: what every plan may read
        # A target's definition may have changed: each entry is then checked against its own.
        definitions = any(p.startswith("targets/") and p.endswith(".toml") for p in self.changed)
        generation = uptodate.generation_path(cache / "v1")
        if str(generation) not in self.record.extra:  # the memo belongs to another cache
            return None
        entries = memo.load(self.asked.store, self.digest, self.record.memo)
        if entries is None:
            return None
        return memo.Reuse(entries, self.changed, generation, self.record.extra[str(generation)], definitions,
                          other_request=not self.own)


class Recording:
    """Scans the workspace before a command; after it succeeded, writes the record if the
    workspace did not change while it ran."""

    def __init__(self, asked: Request, skip: tuple[str, ...] = (), previous: Previous | None = None):
        self.asked, self.root, self.skip = asked, asked.root, skip
        if previous is not None and previous.scanned and sorted(previous.record.skip) == sorted(skip):
            # the no-op check scanned with the same directories left out, just now: that is the scan
            self.started_ns, self.before = previous.started_ns, previous.scanned
            return
        self.started_ns = time.time_ns()
        try:
            self.before: dict[str, Any] | None = uptodate.scan(self.root, skip)
        except (OSError, uptodate.Unrecordable):
            self.before = None  # nothing will be recorded: every run takes the full path

    def finish(self, cache: Path, summary: dict[str, Any], links: dict[str, Path], host_tools: list[str],
               entries: dict[str, memo.Entry] | None = None) -> None:
        """Record a successful build (or drop the old record if this one cannot be recorded),
        with its per-target memo where the build made one."""
        if not summary["ok"]:
            uptodate.forget(self.asked.store, self.asked.digest)
            return
        link_targets = {str(link): os.readlink(link) for link in links.values()}
        self._save(cache, [str(uptodate.generation_path(cache / "v1")), *host_tools,
                           *(os.path.realpath(p) for p in host_tools)],
                   link_targets, {"actions": summary["executed"] + summary["hits"] + summary["cut_off"],
                                  "outputs": {label: str(link) for label, link in links.items()},
                                  "remote": "remote" in summary}, entries)

    def remember(self, text: str, code: int, cache: Path) -> None:
        """Record the answer of a command that reads only the workspace (query, why)."""
        self._save(cache, [], {}, {"text": text, "code": code})

    def _save(self, cache: Path, extra_paths: list[str], links: dict[str, str], summary: dict[str, Any],
              entries: dict[str, memo.Entry] | None = None) -> None:
        uptodate.forget(self.asked.store, self.asked.digest)
        if self.before is None:
            return
        cache_path = os.path.realpath(cache)
        skip = sorted({*self.skip, cache_path} if Path(cache_path).is_relative_to(self.root) else set(self.skip))
        inside = tuple(os.path.relpath(d, self.root) + "/" for d in skip if Path(d).is_relative_to(self.root))
        before = {p: s for p, s in self.before.items() if not p.startswith(inside)} if inside else self.before
        try:
            after = uptodate.scan(self.root, tuple(skip))
        except (OSError, uptodate.Unrecordable):
            return
        if after != before:
            return  # edited while it ran: the next run checks everything
        extra_paths = [*uptodate.code_files(), str(user_config_path()), *extra_paths]
        name = ""
        try:
            if entries:  # the memo first, named by its record: a record never names a memo it did not write
                name = f"{time.time_ns()}-{os.getpid()}"
                memo.save(self.asked.store, self.asked.digest, name, _volatile_marked(entries, after))
        except (OSError, TypeError, ValueError, AttributeError):
            name = ""
        record = uptodate.Record(
            root=str(self.root), skip=skip, files=after, racy=uptodate.racy(after, self.started_ns),
            extra={p: uptodate.stamp_of(p) for p in extra_paths},
            links=links, outputs=uptodate.output_stamps(links), summary=summary, memo=name)
        try:
            uptodate.save(self.asked.store, self.asked.digest, record)
            if name and self.asked.family:  # the memo a first build of other targets may take from
                write_bytes(_family_path(self.asked.store, self.asked.family), self.asked.digest.encode())
        except OSError:
            pass  # a read-only cache costs the next run its speed, nothing else


def _summary(recorded: dict[str, Any], entries: dict[str, memo.Entry], wall_s: float) -> dict[str, Any]:
    """What `bgraph build --json` prints for this no-op: the full path's summary, every action a hit."""
    actions = [{"label": label, "name": name, "mnemonic": mnemonic, "key": key, "status": "hit",
                "reason": "inputs unchanged", "duration_s": 0.0, "differs": False, "peak_mb": 0, "cpu_s": 0.0}
               for label, e in entries.items() for name, mnemonic, key in e.actions]
    return {"ok": True, "executed": 0, "hits": len(actions), "cut_off": 0, "failed": 0, "would_run": 0,
            "differing": [], "wall_s": round(wall_s, 3), "cpu_s": 0.0, "targets": list(recorded["outputs"]),
            "actions": actions, "errors": [], "up_to_date": True, "outputs": recorded["outputs"]}


def _volatile_marked(entries: dict[str, memo.Entry], scanned: dict[str, Any]) -> dict[str, memo.Entry]:
    """The entries, each one with a source outside the scan (whose changes no stamp shows) marked
    never to be reused."""
    return {label: e if all(p in scanned for p in e.sources) else dataclasses.replace(e, volatile=True)
            for label, e in entries.items()}


def answer_request(args, command: str, parts: dict[str, Any]) -> Request | None:
    """The record of a command whose answer is a function of the workspace alone."""
    root = workspace_root(args.workspace)
    store = records_dir(args.cache_dir, root)
    if store is None:
        return None
    return Request(root, uptodate.request_digest({"command": command, "root": str(root), "cwd": os.getcwd(),
                                                  **parts}), store)


def replay(asked: Request) -> tuple[str, int] | None:
    """The recorded answer (its text and exit code), if nothing it was computed from changed."""
    record = uptodate.load(asked.store, asked.digest)
    if record is None or "text" not in record.summary or not uptodate.holds(record):
        return None
    return record.summary["text"], record.summary["code"]
