"""bgraph commands: build, query, why, explain, audit, exec, load, cache, deb. Wires concrete objects; holds no
logic."""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import re
import sys
from pathlib import Path

from typing import TYPE_CHECKING, Callable, NoReturn

from build_graph.errors import BgraphError, UsageError, disk_full
from build_graph.labels import expand, parse_label
from build_graph.roots import cache_root, chosen_cache

if TYPE_CHECKING:  # imported when a command runs, so `bgraph --help` starts fast
    from rich.console import Console

    from build_graph.workspace import Workspace


def cache_dir(ws: Workspace, flag: str | None) -> Path:
    """--cache-dir, else $BGRAPH_CACHE, else WORKSPACE.toml defaults.cache_dir, else ~/.cache/bgraph."""
    return cache_root(flag, ws.root, ws.model.defaults.cache_dir)


def default_max_mem_mb() -> int:
    """80% of physical memory."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.8 / (1 << 20))


def _workspace(args, create: bool = True) -> Workspace:
    """The workspace, parsed or as last kept (store/parsed.py); `create=False`: a reader's, which
    makes no state file in a cache that has none."""
    from build_graph.graph import checked
    from build_graph.roots import state_file, workspace_root
    from build_graph.store import parsed
    from build_graph.workspace import load

    root = workspace_root(args.workspace)
    return parsed.load(root, lambda root: checked(load(root)), state_file(args.cache_dir, root), create)


def cmd_build(args, console: Console) -> int:
    from build_graph import noop

    asked = noop.request(args)
    previous = noop.Previous(asked) if asked is not None else None
    if previous is not None and previous.answer(console, args.json):  # before the heavy imports: a no-op needs none
        return 0
    from build_graph.engine import BuildOptions, Engine
    from build_graph.errors import PlanError
    from build_graph.profile import writable_profile_path
    from build_graph.report import RichReporter, print_summary
    from build_graph.store.uptodate import Recording
    from build_graph.workspace import host_platform, remote_settings

    recording = Recording(asked, _flag_cache(args, asked.root), previous) if asked is not None else None
    overridden = noop.overridden(args)
    if overridden is not None:  # this build relinks bgraph-out/ and records nothing: the old record goes
        noop.drop(overridden)
    ws = _workspace(args, create=not args.check_against)  # a mistyped --check-against makes nothing
    labels = expand(args.targets, ws.targets)
    exec_platform = args.host_platform or host_platform()
    overrides = {k: v for k, v in (("url", args.remote_cache), ("signing_key", args.remote_signing_key))
                 if v is not None}
    if args.remote_upload:
        overrides["upload"] = True
    if args.remote_trusted_key:
        overrides["trusted_keys"] = args.remote_trusted_key
    if args.remote_allow_unsigned:
        overrides["allow_unsigned"] = True
    _check_remote_execution(args)
    overrides.update({k: v for k, v in (("executor", args.remote_executor), ("jobs", args.remote_jobs)) if v})
    if args.remote_local_fallback:
        overrides["local_fallback"] = True
    if args.remote_accept_cached:
        overrides["accept_cached"] = True
    remote = remote_settings(ws, overrides)
    _check_executor(remote.executor)
    if exec_platform != host_platform() and not args.dry_run and not remote.executor:
        raise PlanError(f"cannot run actions for an {exec_platform} host on this {host_platform()} machine",
                        hint=f"plan it with `bgraph build --dry-run --host-platform {exec_platform} …`, or run it on "
                             f"{exec_platform} workers with --remote-executor (`bgraph worker --isa {exec_platform}`); "
                             f"to build for {exec_platform} here, give --platform {exec_platform}")
    options = BuildOptions(
        remote=remote if remote.url else None,
        jobs=args.jobs or ws.model.defaults.jobs or os.cpu_count() or 1,
        max_mem_mb=args.max_mem or ws.model.defaults.max_mem_mb or default_max_mem_mb(),
        keep_going=args.keep_going, check=bool(args.check or args.check_sample),
        check_sample=args.check_sample, dry_run=args.dry_run, platform=args.platform, exec_platform=exec_platform,
        profile=bool(args.profile), remote_executor=remote if remote.executor else None,
        remote_jobs=(remote.jobs or 16) if remote.executor else 0,
        remote_user=remote_settings(None, overrides))  # what the user vouches for, not the workspace
    profile_path = writable_profile_path(args.profile) if args.profile else None
    cache = cache_dir(ws, args.cache_dir)
    if previous is not None:  # only file contents changed: unchanged targets are taken as they were
        options.reuse = previous.reuse(cache)
    other_cache = _other_cache(ws, args.check_against) if args.check_against else None
    log_path = None
    if not args.json:
        import time
        log_dir = cache / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / time.strftime("build-%Y%m%d-%H%M%S.log")
    reporter = RichReporter(console, options.jobs, args.verbose, log_path) if not args.json else None
    engine = Engine(ws, cache, options, reporter,
                    warn=lambda message: console.print("[yellow]warning:[/] " + _escape(message), highlight=False))
    result = engine.build(labels)
    compared = None
    if other_cache is not None:
        compared = engine.compare_with(result, other_cache)
    summary = result.summary(list_reused=args.json)  # --json lists every action
    if options.remote_executor is not None and getattr(engine._sandbox, "stats", None) is not None:
        summary["remote_execution"] = dict(engine._sandbox.stats)  # what went to the executor, what fell back
    if compared is not None:
        summary["compared_with_other_cache"] = compared
    if not options.dry_run and (not result.failures or options.keep_going):
        # With --keep-going the targets that were built are linked too: bgraph-out/ never keeps an
        # earlier build's output of a target this build built (the failed ones keep theirs).
        links = engine.link_outputs(result, ws.root / "bgraph-out")
        summary["outputs"] = {k: str(v) for k, v in links.items()}
        if not result.failures and recording is not None:  # the stored answer the next build's fast path asks (noop.py)
            engine.remember(recording, result, summary, links)
        elif result.failures and links and asked is not None:  # relinked, and nothing recorded
            noop.drop(asked)
    profile_error = None  # reported after the build's own summary, which stays true
    if result.profile is not None:
        try:
            result.profile.write(profile_path)
        except BgraphError as e:
            profile_error = e
            summary.pop("profile", None)
    for err in result.failures:
        console.print("[red]error:[/] " + _escape(err.render()), highlight=False)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        if options.dry_run:  # plain lines, one write: rich's print per line was a tenth of planning 10,000
            sys.stdout.write("".join(f"would run {a['label']} {a['name']} — {a['reason']}\n"
                                     for a in summary["actions"] if a["status"] == "would-run"))
            sys.stdout.flush()
        print_summary(console, summary)
        for label, link in summary.get("outputs", {}).items():  # which platform each is for: its path says
            console.print(f"[dim]{_escape(label)}:[/] {_escape(os.path.relpath(link))}", highlight=False)
        if compared is not None:
            console.print(f"compared {compared} action(s) with {args.check_against}: "
                          f"{len(summary['differing'])} differing", highlight=False)
        if "profile" in summary:
            p = summary["profile"]
            console.print(f"profile: {_escape(args.profile)} — action lanes busy {p['lanes_busy']:.0%} of the wall time; "
                          f"{p['process_s']:.1f}s in processes, {p['sandbox_and_store_s']:.1f}s around them "
                          f"(sandbox, store), {p['planning_thread_s']:.1f}s planning", highlight=False)
        if (summary["executed"] or summary["failed"]) and log_path:
            console.print(f"[dim]executed actions and their reasons: {log_path}[/]", highlight=False)
    if profile_error is not None:
        console.print("[red]error:[/] " + _escape(profile_error.render()), highlight=False)
    if summary["differing"]:
        return 3
    return 2 if profile_error is not None and summary["ok"] else 0 if summary["ok"] else 1


def _flag_cache(args, root: Path) -> tuple[str, ...]:
    """The cache directory chosen without reading WORKSPACE.toml (flag, environment), which the
    workspace scan leaves out; one named in WORKSPACE.toml is left out after loading it."""
    chosen = chosen_cache(args.cache_dir, root)
    return (os.path.realpath(chosen),) if chosen else ()


def _other_cache(ws: Workspace, text: str) -> Path:
    """--check-against's directory, checked before the build: it must hold a bgraph cache of
    this workspace's digest function (a mistyped path is an error, and nothing is made there)."""
    from build_graph.errors import UsageError

    path = Path(os.path.expanduser(text))
    if not (path / "v1" / ws.digest_function / "ac").is_dir():
        raise UsageError(f"--check-against {text}: no bgraph cache there (no v1/{ws.digest_function}/ac)",
                         hint="give the --cache-dir of the build to compare with (for example ~/.cache/bgraph)")
    return path


def _stdout() -> Console:
    """Where query, why and explain print their results (stderr is for progress and errors)."""
    from rich.console import Console

    return Console(emoji=False, soft_wrap=True)


def _escape(text: str) -> str:
    from rich.markup import escape
    return escape(text)


def _answered(command: str, args, parts: dict, compute) -> int:
    """Run `compute` (a command whose answer is a function of the workspace alone, printed on
    stdout), unless its record still holds: then print the recorded answer (see noop.py)."""
    import contextlib
    import io

    from build_graph import noop
    from build_graph.store.uptodate import Recording

    asked = noop.answer_request(args, command, parts)
    replayed = noop.replay(asked) if asked is not None else None
    if replayed is not None:
        sys.stdout.write(replayed[0])
        return replayed[1]
    recording = Recording(asked, skip=_flag_cache(args, asked.root)) if asked is not None else None
    ws = _workspace(args)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = compute(ws)
    sys.stdout.write(buffer.getvalue())
    if recording is not None:
        recording.remember(buffer.getvalue(), code, cache_dir(ws, args.cache_dir))
    return code


def cmd_query(args, console: Console) -> int:
    return _answered("query", args, {"expr": args.expr, "output": args.output}, lambda ws: _query(ws, args))


def _query(ws: Workspace, args) -> int:
    from build_graph.graph import Query, build_graph
    from build_graph.report import render_labels

    g = build_graph(ws)
    labels, edges = Query(ws, g).run(args.expr)
    render_labels(labels, edges, args.output, _stdout(), {l: g.nodes[l]["kind"] for l in labels})
    return 0


def cmd_why(args, console: Console) -> int:
    if args.dest.startswith("/") and not args.dest.startswith("//"):  # a path inside an image?
        ws = _workspace(args, create=False)
        if ws.target(parse_label(args.source)).kind == "oci_image":
            return _why_image_path(ws, parse_label(args.source), args)
    if not args.dest.startswith("//"):  # a patch or a file: down to the actions of the last build that read it
        return _why_file(args, _workspace(args, create=False))
    return _answered("why", args, {"source": args.source, "dest": args.dest}, lambda ws: _why_labels(ws, args))


def _why_image_path(ws: Workspace, label, args) -> int:
    """`bgraph why //images:X /path`: the layer, target and package of a path in the built image."""
    import dataclasses

    from build_graph.oci.why import ImageWhyError, origin
    from build_graph.workspace import host_platform

    platform = args.platform or ws.target(label).attrs.platform or host_platform()
    rel = f"{label.package}/{label.name}"
    image_dir = ws.root / "bgraph-out" / (rel if platform == host_platform() else f"{platform}/{rel}")
    if not (image_dir / "image.json").is_file():
        flag = f" --platform {platform}" if platform != host_platform() else ""
        raise ImageWhyError(f"{label} has no built image for {platform} ({image_dir} is missing)",
                            hint=f"build it first: bgraph build{flag} {label}")
    found = origin(image_dir, args.dest)
    if args.json:
        print(json.dumps(dataclasses.asdict(found), indent=1))
    else:
        for line in found.lines():
            _stdout().print(_escape(line), highlight=False)
    return 0


def _why_labels(ws: Workspace, args) -> int:
    from build_graph.graph import allpaths, build_graph
    from build_graph.report import paths_tree

    g = build_graph(ws)
    a, b = (parse_label(x) for x in (args.source, args.dest))
    for lab in (a, b):
        ws.target(lab)
    paths = allpaths(g, a, b)
    out = _stdout()
    if not paths:
        out.print(f"{a} does not depend on {b}", highlight=False)
        return 1
    edges = sorted({(p[i], p[i + 1]) for p in paths for i in range(len(p) - 1)})
    out.print(f"{a} depends on {b} through {len(paths)} path(s):", highlight=False)
    out.print(paths_tree([n for p in paths for n in p], edges, root=a))
    return 0


def _workspace_path(ws: Workspace, text: str) -> str:
    """A path given on the command line as the workspace names it: relative to the workspace
    root (or, when it exists there, to the current directory); else as written (a path inside
    a tree that no workspace file holds, e.g. csrc/x.cuh of a patched source tree)."""
    import posixpath

    path = Path(text)
    for candidate in ([path] if path.is_absolute() else [ws.root / path, Path.cwd() / path]):
        try:
            if candidate.exists():
                return candidate.resolve().relative_to(ws.root).as_posix()
        except ValueError:
            pass
    return posixpath.normpath(text)


def _why_file(args, ws: Workspace) -> int:
    """`bgraph why LABEL FILE`: the path from LABEL (in the configuration of its last build)
    through its targets, TUs and archs to the recorded actions that read FILE (or the files
    the patch FILE changes): provenance.py finds them, audit_render.py writes them."""
    from build_graph.audit_render import why_lines
    from build_graph.model import Digester
    from build_graph.provenance import Finder

    label = parse_label(args.source)
    ws.target(label)
    subject = _workspace_path(ws, args.dest)
    base = cache_dir(ws, args.cache_dir) / "v1" / Digester(ws.digest_function).name
    prov = Finder(ws, base).find(label, subject, args.platform)
    if args.json:
        print(json.dumps(prov.to_json(), indent=1))
        return 0 if prov.reads else 1
    out = _stdout()
    if not out.is_terminal:
        out.width = 100_000  # piped: whole paths on each line (rich would cut them at 80 columns)
    for line in why_lines(prov):
        out.print(line, highlight=False)
    return 0 if prov.reads else 1


def cmd_explain(args, console: Console) -> int:
    from build_graph import configs
    from build_graph.model import Digester
    from build_graph.provenance import configured, trace_workspace
    from build_graph.report import render_explain
    from build_graph.store.trace import Trace

    ws = _workspace(args, create=False)
    asked = parse_label(args.label)
    ws.target(asked)
    base = cache_dir(ws, args.cache_dir) / "v1" / Digester(ws.digest_function).name
    trace = Trace(base, base.parent / "tmp", create=False)
    # The label in the configuration of its last build: --platform's, else its own platform's;
    # else the one other configuration it was built in (under an aarch64 wheel), said so.
    label, forced, note, others = configured(ws, trace, asked, args.platform)
    data = trace.load(str(label))
    notes = [note] if note else []
    if not data and others:
        notes.append(f"{label} has no recorded build; its recorded builds: {', '.join(others)} "
                     "(--platform chooses)")
    foreign = trace_workspace(data, ws)
    if foreign:
        notes.append(f"the last build of {label} recorded in this cache ran in another workspace, {foreign} "
                     "(the cache is shared): shown is that build, not this workspace's")
    if args.json:
        for n in notes:
            console.print("note: " + _escape(n), highlight=False)
        print(json.dumps(data.get("last_build", []), indent=1))
        return 0
    out = _stdout()
    for n in notes:
        out.print("note: " + _escape(n), highlight=False)
    render_explain(str(label), data, out, args.all)
    # Then each dependency whose last build ran something: the causes usually live there
    # (a patched header recompiles TUs of the imported CMake project under a wheel).
    quiet = 0
    for dep in reversed(configs.configure(ws, [label], forced).order):
        if dep == label:
            continue
        dep_data = trace.load(str(dep))
        if any(r.get("status") == "executed" for r in dep_data.get("last_build", [])):
            render_explain(str(dep), dep_data, out, args.all)
            other = trace_workspace(dep_data, ws)
            if other:
                out.print(f"  note: recorded by a build in another workspace, {_escape(other)}", highlight=False)
        else:
            quiet += 1
    if quiet:
        out.print(f"[dim]{quiet} dependencies ran nothing in their last build[/]", highlight=False)
    return 0


def cmd_audit(args, console: Console) -> int:
    """`bgraph audit LABEL`: build LABEL with and without each patch hunk in its closure and say
    what each one changes (audit.py)."""
    from build_graph.audit import Audit, AuditOptions
    from build_graph.audit_render import audit_lines
    from build_graph.engine import NullReporter
    from build_graph.report import RichReporter

    ws = _workspace(args)
    label = parse_label(args.label)
    ws.target(label)
    options = AuditOptions(jobs=args.jobs or ws.model.defaults.jobs or os.cpu_count() or 1,
                           max_mem_mb=args.max_mem or ws.model.defaults.max_mem_mb or default_max_mem_mb(),
                           only=args.only or [])
    live = console.is_terminal and not console.is_dumb_terminal
    report = Audit(ws, cache_dir(ws, args.cache_dir), label, options,
                   progress=lambda line: console.print(f"[dim]{_escape(line)}[/]", highlight=False),
                   reporter=(lambda: RichReporter(console, options.jobs)) if live else NullReporter).run()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        out = _stdout()
        for line in audit_lines(report):
            out.print(line, highlight=False, markup=False)
    return 0 if report["baseline"]["ok"] else 1


def cmd_exec(args, console: Console) -> int:
    """Build LABEL, then run a command in the sandbox with its output at /bgraph/target."""
    from build_graph.engine import BuildOptions, Engine
    from build_graph.model import Action
    from build_graph.rules.base import BASE_ENV

    if not args.argv:  # bwrap given no command printed its whole usage text
        raise UsageError("exec needs a command to run in the sandbox",
                         hint=f"bgraph exec {args.label} -- ls -l (the target's output is the working "
                              "directory, /bgraph/target)")
    ws = _workspace(args)
    label = parse_label(args.label)
    ws.target(label)
    engine = Engine(ws, cache_dir(ws, args.cache_dir), BuildOptions(jobs=os.cpu_count() or 1,
                                                                    max_mem_mb=default_max_mem_mb()))
    result = engine.build([label])
    if result.failures:
        for err in result.failures:
            console.print("[red]error:[/] " + _escape(err.render()), highlight=False)
        return 1
    out = result.outputs[label]
    env = dict(BASE_ENV, PATH="/bgraph/target/bin:/usr/bin:/bin")
    action = Action(name="exec", mnemonic="Exec", argv=tuple(args.argv), env=tuple(sorted(env.items())),
                    inputs=(("/bgraph/target", out.tree),), host_paths=("/usr",), cwd="/bgraph/target",
                    cacheable=False)
    import subprocess
    import tempfile
    work = Path(tempfile.mkdtemp(dir=engine.cas.tmp))
    try:
        # The action's environment reaches only the sandbox, never bwrap on the host (sandbox_env.py).
        argv, host_env, stdin = engine.sandbox.interactive(action, work)
        return subprocess.call(argv, env=host_env, stdin=stdin)
    finally:
        from build_graph.store.cas import rmtree
        rmtree(work)


def cmd_worker(args, console: Console) -> int:
    """Serve remote execution leases from a Remote Workers API server (BuildGrid's Bots service)."""
    from build_graph.remote_exec.worker import main as worker_main

    return worker_main(args.server, args.slots, args.work_dir, args.cache, args.digest_function, args.heartbeat,
                       args.name, args.max_cache, args.isa, args.qemu)


def cmd_load(args, console: Console) -> int:
    """`bgraph load LABEL`: build the oci_image LABEL (or find it in the cache), then load it into
    the Docker daemon at DOCKER_HOST, sending only the layers it lacks (oci/load.py)."""
    from build_graph.engine import BuildOptions, Engine
    from build_graph.oci.load import ImageLoadError, load
    from build_graph.report import RichReporter

    ws = _workspace(args)
    label = parse_label(args.label)
    if ws.target(label).kind != "oci_image":
        raise ImageLoadError(f"{label} is a {ws.target(label).kind} target; `bgraph load` loads oci_image targets")
    jobs = ws.model.defaults.jobs or os.cpu_count() or 1
    engine = Engine(ws, cache_dir(ws, args.cache_dir),
                    BuildOptions(jobs=jobs, max_mem_mb=ws.model.defaults.max_mem_mb or default_max_mem_mb(),
                                 platform=args.platform),
                    None if args.json else RichReporter(console, jobs))
    result = engine.build([label])
    if result.failures:
        for err in result.failures:
            console.print("[red]error:[/] " + _escape(err.render()), highlight=False)
        return 1
    links = engine.link_outputs(result, ws.root / "bgraph-out")
    out = result.outputs[result.requested[0]]
    image_dir = engine.cas.materialize(out.tree)
    meta = json.loads((image_dir / "image.json").read_text())
    report = load(image_dir, meta, timeout=args.timeout, full=args.full,
                  progress=lambda line: console.print(f"[dim]{_escape(line)}[/]", highlight=False))
    if args.json:
        print(json.dumps({**report.to_json(), "output": str(links.get(str(result.requested[0]), ""))}, indent=1))
    else:
        _stdout().print(report.line(), highlight=False)
    return 0


def cmd_deb(args, console: Console) -> int:
    """`bgraph deb lock [LABEL...]`: resolve deb_packages targets against the mirrors, write their locks."""
    import time

    from build_graph.debian.locking import deb_targets, lock

    ws = _workspace(args, create=False)  # a failed lock makes nothing in the cache
    labels = deb_targets(ws, expand(args.targets, ws.targets) if args.targets else [])
    if not labels:
        console.print("no deb_packages targets in this workspace", highlight=False)
        return 0
    start = time.monotonic()
    results = lock(ws, labels, progress=lambda m: console.print(f"[dim]{_escape(m)}[/]", highlight=False))
    out = _stdout()
    for r in results:
        sizes = ", ".join(f"{p} {n} packages ({size / 2**20:.1f} MiB)" for p, (n, size) in sorted(r.totals.items()))
        out.print(f"{r.label}: {r.lock} {'written' if r.written else 'unchanged'}: {sizes}", highlight=False)
        for line in r.changes + ([r.note] if r.note else []):
            out.print(f"  {_escape(line)}", highlight=False)
    console.print(f"locked {len(results)} target(s) in {time.monotonic() - start:.1f}s", highlight=False)
    return 0


def cmd_py(args, console: Console) -> int:
    """`bgraph py lock [LABEL...]`: resolve python_lock targets with uv, write their locks, print the changes."""
    import time

    from build_graph.python_lock.locking import lock, lock_targets

    ws = _workspace(args, create=False)  # a failed lock makes nothing in the cache
    labels = expand(args.targets, ws.targets) if args.targets else []
    if not lock_targets(ws, labels):
        console.print("no python_lock targets in this workspace", highlight=False)
        return 0
    start = time.monotonic()
    results = lock(ws, labels, progress=lambda m: console.print(f"[dim]{_escape(m)}[/]", highlight=False))
    out = _stdout()
    for r in results:
        sizes = ", ".join(f"{p} {n} wheels ({size / 2**20:.1f} MiB)" for p, (n, size) in sorted(r.totals.items()))
        out.print(f"{r.lock} ({', '.join(r.labels)}) {'written' if r.written else 'unchanged'}: {sizes}",
                  highlight=False)
        for line in r.changes + r.notes:
            out.print(f"  {_escape(line)}", highlight=False)
    console.print(f"locked {len(results)} file(s) in {time.monotonic() - start:.1f}s", highlight=False)
    return 0


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def count(text: str) -> int:
    """A whole number of at least 1 (-j, --max-mem, --check-sample, --slots): 0 or a negative is a
    usage error, not a silent default."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: give at least 1")
    return n


def parse_size(text: str) -> int:
    """'500M', '20G', '1.5T' or plain bytes -> bytes (powers of 1024: 20G is 20 GiB), through
    pydantic's ByteSize; 'inf', negative and unitless-garbage sizes are usage errors."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    m = _SIZE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 500M, 20G)")
    number, unit = m.groups()
    try:
        return int(TypeAdapter(ByteSize).validate_python(f"{number}{unit.upper()}iB" if unit else number))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 500M, 20G)") from None


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_cache(args, console: Console) -> int:
    from build_graph.model import Digester
    from build_graph.store import upkeep

    if args.action == "keygen":
        from build_graph.store.signing import generate_key
        try:
            public = generate_key(Path(args.file))
        except FileExistsError:
            raise BgraphError(f"{args.file} exists; not overwriting a key", hint="choose another file name") from None
        except OSError as e:
            raise BgraphError(f"cannot write the key to {args.file}: {e.strerror}",
                              hint="give a path in an existing, writable directory") from None
        _stdout().print(public, highlight=False)
        console.print(f"private key written to {args.file} (mode 0600; keep it in CI's secrets); "
                      "the public key above goes in [remote] trusted_keys", highlight=False)
        return 0
    ws = _workspace(args)
    layout = cache_dir(ws, args.cache_dir) / "v1"
    digester = Digester(ws.digest_function)
    if not (layout / digester.name).exists():
        console.print(f"no cache at {layout.parent}", highlight=False)
        return 0
    out = _stdout()
    if args.action == "gc":
        r = upkeep.collect(layout, digester, args.max_size)  # bumps the cache's generation if it removed anything
        out.print(f"removed {r.entries_removed} action-cache entries, {r.blobs_removed} blobs, "
                  f"{r.nodes_removed} directory nodes and {r.trees_removed} materialized trees; "
                  f"blobs {_human(r.bytes_before)} -> {_human(r.bytes_after)}; kept {r.entries_kept} entries"
                  + (f" ({r.held_by_builds} held by {r.running_builds} running build(s))"
                     if r.running_builds else ""), highlight=False)
        return 0
    r = upkeep.verify(layout, digester, repair=args.repair)  # and so does a repair
    out.print(f"checked {r.blobs_checked} blobs, {r.nodes_checked} directory nodes, "
              f"{r.entries_checked} action-cache entries, {r.trees_checked} materialized trees", highlight=False)
    for what, items in (("corrupt blob", r.corrupt_blobs), ("corrupt directory node", r.corrupt_nodes),
                        ("dangling action-cache entry", r.dangling_entries), ("broken tree", r.bad_trees),
                        ("damaged state file", r.bad_state), ("stray entry", r.stray)):
        for d in items:
            out.print(f"{what} {d}" + (" (removed)" if r.repaired else ""), highlight=False)
    if r.clean:
        out.print("the cache is clean", highlight=False)
        return 0
    if not r.repaired:
        console.print("hint: `bgraph cache verify --repair` removes them; builds re-create what they need",
                      highlight=False)
    return 0 if r.repaired else 1


def _disk_full(args, e: OSError) -> BgraphError:
    """ENOSPC outside the build loop: name the file being written where it is known and lies
    outside the cache, else the cache directory as the workspace resolves it."""
    try:
        cache = cache_dir(_workspace(args), getattr(args, "cache_dir", None))
    except BgraphError:
        cache = Path(os.path.expanduser(getattr(args, "cache_dir", None) or os.environ.get("BGRAPH_CACHE")
                                        or "~/.cache/bgraph"))
    written = Path(os.path.abspath(e.filename)) if isinstance(e.filename, str) else None
    if written is not None and not written.is_relative_to(cache.absolute()):
        return BgraphError(f"no space left on the disk holding {written}",
                           hint="free disk space there (or write that file elsewhere); the cache was not changed")
    return disk_full(cache)


def _check_remote_execution(args) -> None:
    """--remote-jobs below 1: one clear line before anything runs (not pydantic's traceback)."""
    from build_graph.errors import UsageError
    if args.remote_jobs is not None and args.remote_jobs < 1:
        raise UsageError(f"--remote-jobs {args.remote_jobs}: give at least 1", hint="e.g. --remote-jobs 16")


def _check_executor(url: str | None) -> None:
    """The remote executor's address, from the flag or a config file: grpc:// or grpcs:// with a
    host and a port from 1 to 65535 (remote_exec/address.py)."""
    from build_graph.remote_exec.address import check_grpc_url, quiet_grpc
    quiet_grpc()  # before grpc is first imported: bgraph's one-line errors, not C-core log lines
    if url:
        check_grpc_url(url, "remote executor", "give --remote-executor (or [remote] executor) "
                                               "grpc://HOST:PORT[/instance] (a REAPI Execution service)")


def timeout_arg(text: str) -> float:
    """`load --timeout`'s type: seconds, a finite number above 0 (argparse turns the error into one line)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number of seconds above 0 (e.g. 600)")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bgraph", description="A reproducible build graph for GPU inference stacks.")
    p.add_argument("-C", "--workspace", help="workspace root (default: nearest WORKSPACE.toml)")
    p.add_argument("--cache-dir", help="cache directory (default: $BGRAPH_CACHE or ~/.cache/bgraph)")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build targets")
    b.add_argument("targets", nargs="+", help="labels or patterns (//pkg:name, //pkg:all, //...)")
    b.add_argument("-j", "--jobs", type=count, help="parallel actions (default: cores)")
    b.add_argument("--max-mem", type=count, help="memory budget in MiB for running actions (default: 80%% of RAM)")
    b.add_argument("-k", "--keep-going", action="store_true", help="build what can be built after a failure")
    b.add_argument("--check", action="store_true", help="re-execute cached actions and report differing outputs")
    b.add_argument("--check-sample", type=count, metavar="N", help="like --check, for N sampled actions")
    b.add_argument("--check-against", metavar="CACHE_DIR",
                   help="compare every action's output with the result another cache holds for the same key")
    b.add_argument("-n", "--dry-run", action="store_true",
                   help="plan and look up the cache, run nothing: list the actions that would run "
                        "(those that wait on their outputs cannot be planned yet)")
    b.add_argument("--platform", choices=["x86_64", "aarch64"],
                   help="the platform to build for (default: each target's own `platform`, else the host's); "
                        "another CPU than the host's is a cross build; outputs go to bgraph-out/<platform>/…")
    b.add_argument("--host-platform", choices=["x86_64", "aarch64"],
                   help="the machine actions run on (default: this one); another one only with --dry-run, "
                        "to plan what that machine would run")
    b.add_argument("--remote-cache", metavar="URL",
                   help="shared cache behind the local one: http(s)://host:port/prefix ('' turns it off)")
    b.add_argument("--remote-upload", action="store_true", help="write results to the remote cache (meant for CI)")
    b.add_argument("--remote-signing-key", metavar="FILE", help="ed25519 private key that signs uploaded results")
    b.add_argument("--remote-trusted-key", metavar="HEX", action="append",
                   help="accept only remote results signed by this ed25519 public key (repeatable)")
    b.add_argument("--remote-allow-unsigned", action="store_true",
                   help="use a remote cache that has no trusted keys: its results are taken whoever wrote them")
    b.add_argument("--remote-executor", metavar="URL",
                   help="run actions on this REAPI remote execution service: grpc://HOST:PORT[/instance] (BuildGrid)")
    b.add_argument("--remote-jobs", type=int, metavar="N",
                   help="remote actions in flight at once (default 16), beside --jobs local ones")
    b.add_argument("--remote-local-fallback", action="store_true",
                   help="run an action locally when the remote executor fails it for a reason of its own")
    b.add_argument("--remote-accept-cached", action="store_true",
                   help="take results the remote executor answers from its own action cache: only for a server "
                        "whose action cache no untrusted client can write")
    b.add_argument("--json", action="store_true", help="print the summary as JSON")
    b.add_argument("--profile", metavar="FILE",
                   help="write the build's timeline to FILE (Chrome trace format: open it in Perfetto or chrome://tracing)")
    b.add_argument("-v", "--verbose", action="store_true", help="print every executed action and its reason")
    b.set_defaults(fn=cmd_build)

    q = sub.add_parser("query", help="deps(X), rdeps(U, X), somepath(A, B), allpaths(A, B), kind(K, X)")
    q.add_argument("expr")
    q.add_argument("--output", choices=["label", "tree", "json"], default="label")
    q.set_defaults(fn=cmd_query)

    w = sub.add_parser("why", help="the dependency paths from A to B, as a tree; with a patch or a file as B, "
                                   "down to the TUs, archs and actions of A's last build that read it")
    w.add_argument("source")
    w.add_argument("dest", help="a label, or a patch or file path; for an oci_image A, an absolute path in the "
                                "image (its layer, target and package)")
    w.add_argument("--json", action="store_true", help="(patch or file) the reading actions as JSON")
    w.add_argument("--platform", choices=["x86_64", "aarch64"],
                   help="(patch or file) the last build of A for this platform (as build's; default: A's own)")
    w.set_defaults(fn=cmd_why)

    e = sub.add_parser("explain", help="what ran in the last build of LABEL, and why")
    e.add_argument("label")
    e.add_argument("--json", action="store_true", help="this target's records only, as JSON")
    e.add_argument("--all", action="store_true", help="list every cut-off and cached action too")
    e.add_argument("--platform", choices=["x86_64", "aarch64"], help="the build for this platform (as build's)")
    e.set_defaults(fn=cmd_explain)

    a = sub.add_parser("audit", help="build LABEL with and without each patch hunk in its closure: which hunks "
                                     "are dead, live (which TUs, archs, outputs) or break the build")
    a.add_argument("label")
    a.add_argument("--json", action="store_true", help="the whole report as JSON")
    a.add_argument("--only", action="append", metavar="PATTERN",
                   help="audit only hunks whose id (PATCH#N) or patch path matches (fnmatch; repeatable)")
    a.add_argument("-j", "--jobs", type=count, help="parallel actions (default: cores)")
    a.add_argument("--max-mem", type=count, help="memory budget in MiB for running actions (default: 80%% of RAM)")
    a.set_defaults(fn=cmd_audit)

    c = sub.add_parser("cache", help="gc: collect the cache; verify: re-hash it; keygen: a signing key")
    csub = c.add_subparsers(dest="action", required=True)
    g = csub.add_parser("gc", help="remove what nothing needs; least recently used first with --max-size")
    g.add_argument("--max-size", type=parse_size, metavar="SIZE",
                   help="keep at most this much (e.g. 20G); what running builds hold is always kept")
    v = csub.add_parser("verify", help="re-hash every blob; find corrupt blobs, dangling entries, broken trees")
    v.add_argument("--repair", action="store_true", help="remove what is corrupt or dangling")
    k = csub.add_parser("keygen", help="make an ed25519 key pair for signing remote-cache uploads")
    k.add_argument("file", help="where to write the private key (must not exist)")
    c.set_defaults(fn=cmd_cache)

    x = sub.add_parser("exec", help="run a command in the sandbox over a target's output")
    x.add_argument("label")
    x.add_argument("argv", nargs=argparse.REMAINDER)
    x.set_defaults(fn=cmd_exec)

    ld = sub.add_parser("load", help="build an oci_image and load it into the Docker daemon at DOCKER_HOST, "
                                     "sending only the layers it lacks")
    ld.add_argument("label")
    ld.add_argument("--platform", choices=["x86_64", "aarch64"], help="the image for this platform (as build's)")
    ld.add_argument("--timeout", type=timeout_arg, default=600,
                    help="seconds the load may wait for the daemon's answer (default 600)")
    ld.add_argument("--full", action="store_true", help="send every layer, even those the daemon has")
    ld.add_argument("--json", action="store_true", help="print the load's figures as JSON")
    ld.set_defaults(fn=cmd_load)

    d = sub.add_parser("deb", help="Debian package sets (deb_packages): lock them against the mirrors")
    dsub = d.add_subparsers(dest="action", required=True)
    dl = dsub.add_parser("lock", help="resolve each target's packages for every platform; write its lock file")
    dl.add_argument("targets", nargs="*", help="labels or patterns (default: every deb_packages target)")
    d.set_defaults(fn=cmd_deb)
    py = sub.add_parser("py", help="Python runtime closures (python_lock): lock them with uv")
    pysub = py.add_subparsers(dest="action", required=True)
    pl = pysub.add_parser("lock", help="resolve each lock's requirements for every platform; write the lock file")
    pl.add_argument("targets", nargs="*", help="labels or patterns (default: every python_lock target)")
    py.set_defaults(fn=cmd_py)
    wk = sub.add_parser("worker", help="run remote execution leases from a REAPI server's Bots service "
                                       "(BuildGrid) in bgraph's sandbox, one per slot")
    wk.add_argument("--server", required=True, metavar="grpc://HOST:PORT[/INSTANCE]")
    wk.add_argument("--slots", type=count, default=1, help="actions run at once (one bot each; default 1)")
    wk.add_argument("--work-dir", help="where leases are staged (default: CACHE/leases)")
    wk.add_argument("--cache", help="the worker's own CAS (default: $BGRAPH_CACHE or ~/.cache/bgraph, /worker)")
    wk.add_argument("--digest-function", choices=["sha256", "blake3"],
                    help="default: the server's (sha256 where it offers it)")
    wk.add_argument("--heartbeat", type=float, help="seconds between session updates while an action runs "
                                                    "(default: a third of the server's keepalive, at most 10)")
    wk.add_argument("--name", help="bot ids are NAME/0, NAME/1, ... (default: the host name); keep it across "
                                   "restarts: the server then requeues a restarted worker's jobs at once")
    wk.add_argument("--max-cache", metavar="SIZE", help="empty the worker's cache between leases when it holds "
                                                        "more than SIZE (e.g. 50G; default: no bound)")
    wk.add_argument("--isa", choices=["x86_64", "aarch64"],
                    help="the CPU this worker offers (default: the host's); another one needs --qemu")
    wk.add_argument("--qemu", metavar="FILE", help="a static qemu-user binary (//toolchains:qemu-user's "
                                                   "usr/libexec/qemu-binfmt/aarch64-binfmt-P) that runs --isa's "
                                                   "programs, registered in the actions' own user namespace only")
    wk.set_defaults(fn=cmd_worker)
    return p


def _utf8_mode() -> None:
    """Run in Python's UTF-8 mode where the locale's encoding is another (a Latin-1 or ASCII
    locale with PYTHONUTF8=0): names, commands and logs are UTF-8 whatever the locale, or an
    action's argv bytes, a source name's key and the log's text would follow it. Re-executes
    this command once, with the same argument bytes."""
    if sys.flags.utf8_mode or sys.getfilesystemencoding().lower().replace("-", "") == "utf8":
        return
    if os.environ.get("BGRAPH_UTF8_REEXEC"):  # it did not take: go on as we are
        return
    os.environ["BGRAPH_UTF8_REEXEC"] = "1"
    argv = [os.fsencode(a) for a in sys.argv[1:]]  # the bytes the caller passed
    os.execv(sys.executable, [sys.executable, "-X", "utf8", "-m", "build_graph", *argv])


def run() -> NoReturn:
    """The `bgraph` command: main(), then exit without the interpreter's teardown. Freeing a
    build's objects one by one took 0.03 s after a no-op and 0.1 s after an edit of the arch
    bench; the exit handlers (the store's staging lease) still run, and every thread left is a
    daemon with nothing to finish."""
    import atexit

    _utf8_mode()
    # Actions and the cache are written as under umask 022, whatever the caller's: an output's
    # modes (and a sandbox's staging directory, which umask 0277 made unwritable) never depend on it.
    os.umask(0o022)
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a reader that went away (`bgraph query | head`)
    atexit._run_exitfuncs()
    os._exit(code or 0)


class Terminated(KeyboardInterrupt):
    """SIGTERM, taken the way Ctrl-C is (a CI timeout, `kill`, a container stopping)."""


def _terminate_as_interrupt() -> Callable[[], None]:
    """Make SIGTERM stop a command as Ctrl-C does: sandboxes killed, remote operations cancelled,
    the store left consistent (it killed the process at once, and a remote action ran on). An
    inherited ignore is kept, as for SIGINT; only the main thread can install it (tests call main
    from others)."""
    import signal
    import threading

    def stop(_sig, _frame):
        raise Terminated()

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return lambda: None
    signal.signal(signal.SIGTERM, stop)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)  # for a caller of main() that goes on


def main(argv: list[str] | None = None) -> int:
    import gc

    # A build allocates millions of small objects that live to its end (targets, keys, trees):
    # the default young-generation threshold (700) ran the collector over them again and again,
    # a third of planning 100,000 targets; peak memory is the same with this one. The middle
    # generation is collected after 100 young ones (5 million allocations), not 20: each of its
    # collections walked every survivor since the last (0.2 s apiece, 0.5 s of planning 100,000
    # targets, which now needs none) to free few cycles (40,000 objects there, against 660,000
    # freed young; peak memory unchanged).
    gc.set_threshold(50_000, 100, 100)
    args = parser().parse_args(argv)
    if args.command == "exec" and args.argv[:1] == ["--"]:
        args.argv = args.argv[1:]
    from rich.console import Console

    # No emoji codes: "//p:a: ..." would print as "//p🅰 ...".
    console = Console(stderr=True, emoji=False, soft_wrap=True)
    restore = _terminate_as_interrupt()
    try:
        return args.fn(args, console)
    except BgraphError as e:
        console.print("[red]error:[/] " + _escape(e.render()), highlight=False)
        return 2
    except BrokenPipeError:
        # The reader went away (`bgraph query ... | head`): stop quietly, as cat does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:
        if e.errno == errno.ENOSPC:
            console.print("[red]error:[/] " + _escape(_disk_full(args, e).render()), highlight=False)
            return 2
        # One line, never a traceback: what failed and on which path.
        where_ = f": {e.filename}" if e.filename else ""
        console.print(f"[red]error:[/] {_escape(e.strerror or str(e))}{_escape(str(where_))}\n"
                      "  hint: check that path (permissions, a file where a directory is expected, free space)",
                      highlight=False)
        return 2
    except Terminated:
        console.print("[yellow]terminated[/]: the store is consistent; finished actions are cached")
        return 143
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: the store is consistent; finished actions are cached")
        return 130
    finally:
        restore()
