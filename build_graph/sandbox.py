"""The bubblewrap runner: one sandboxed process per action.

Inside, an action sees only its declared input trees, read-only at their fixed mount points
(/bgraph/src, /bgraph/in/<name>, /bgraph/toolchain, and /usr when it runs on a pinned system
root), a writable /bgraph/out, a tmpfs /tmp, and the host directories its host_tools target
declares (an opt-in), read-only. No network (own empty net
namespace), its own PID namespace (nvcc names temp files after its PID), a clean environment.
No capability, as root too (bwrap keeps root's unless told), and a read-only /proc. No keyring
and no tracing: bwrap installs build_graph/seccomp/'s program on every path that starts a sandbox.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import shutil
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from build_graph import seccomp
from build_graph.cgroups import Accounting
from build_graph.errors import ActionFailed, SandboxError
from build_graph.incremental import filestate
from build_graph.model import (
    Action,
    ActionResult,
    DirEntry,
    FileEntry,
    HostTool,
    SymlinkEntry,
    Tree,
    check_relpath,
)
from build_graph.sandbox_env import (
    HOST_ENV,
    SHELL,
    EnvironmentRefused,
    handover,
    host_lookup,
    resolves,
    stdin_fd,
)
from build_graph.spares import Outputs, Spares, memfd
from build_graph.store.cas import FIXED_MTIME, LocalCas, hash_file, rmtree
from build_graph.store.json_table import JsonTable

LOW_SPACE = 16 << 20  # below this much free space, a failed action is reported as a full disk
INSTALL_HINT = "install bubblewrap: `apt-get install -y bubblewrap` (Debian/Ubuntu) or `dnf install bubblewrap`"


def find_bwrap() -> str:
    """The bwrap binary, or a SandboxError that says how to install it (never a silent fallback)."""
    path = shutil.which("bwrap")
    if not path:
        raise SandboxError("bubblewrap (bwrap) is not installed; bgraph runs every action inside it",
                           hint=INSTALL_HINT)
    return path


def probe_host_tools(paths: tuple[str, ...], digester, known: JsonTable | None = None) -> tuple[HostTool, ...]:
    """Identify host binaries by resolved path, first line of `--version` and content digest.
    `known` (path -> what an earlier probe found, with the binary's stat stamp) is used while
    the stamp holds, and updated: a no-op build then hashes and runs nothing. The `--version`
    run is sandboxed (_sandboxed_version): bgraph never runs a tool on the host."""
    # Imported here: the rules import this module's callers.
    from build_graph.rules.host_tools import refused_tool

    tools = []
    for p in paths:
        # Judged again here, not only at load: a kept parse skips the validators, and a link on
        # the way may have moved since.
        refused = refused_tool(p)
        if refused is not None:
            raise SandboxError(f"host tool {refused}", hint="list host binaries (such as /usr/bin/gcc) in "
                               "host_tools.tools; a script the workspace ships is a source")
        real = os.path.realpath(p)
        try:
            st = filestate.settle(real, os.stat(real))  # a recent binary's mapped pages written back first
        except FileNotFoundError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            raise SandboxError(f"host tool {p} does not exist", hint="install it or fix host_tools.tools")
        stamp = [real, *filestate.of(st)]
        seen = known.table.get(f"{digester.name}:{p}") if known is not None else None
        if seen and seen[:7] == stamp:
            version, digest = seen[7], seen[8]
        else:
            version, digest = _probe_host_tool(p, real, digester)
            if known is not None and not filestate.racy(stamp[1:], time.time_ns()):
                known.set(f"{digester.name}:{p}", [*stamp, version, digest])
        tools.append(HostTool(p if real == p else f"{p}={real}", version, digest))
    return tuple(tools)


def _probe_host_tool(p: str, real: str, digester) -> tuple[str, str]:
    return _sandboxed_version(p), hash_file(real, digester)


PROBE_TIMEOUT_S = 20
PROBE_OUTPUT_CAP = 64 << 10  # bytes read of each stream; only the first line is kept
PROBE_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}  # as the host probe had: version lines unchanged
# What the probe mounts: every directory a host_tools target may mount (rules/host_tools.py), so a
# tool sees its libraries and /etc/alternatives links as an action would, and nothing else.
PROBE_DIRS = ("/usr", "/etc", "/opt")
PROBE_TOP = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def probe_command(bwrap: str, p: str, seccomp_fd: int) -> list[str]:
    """The bwrap command that runs `p --version` as an action runs: no capability, no network,
    own namespaces, read-only /proc, the system directories read-only, and `p` itself; the
    actions' seccomp program read from descriptor `seccomp_fd`."""
    args = [bwrap, "--unshare-all", *NO_CAPABILITIES, *nesting_options(bwrap), *seccomp.options(seccomp_fd),
            "--die-with-parent",
            "--new-session", "--hostname", "bgraph", *READ_ONLY_PROC, "--dev", "/dev", "--tmpfs", "/tmp"]
    for d in PROBE_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            args += ["--ro-bind", d, d]
    for top in PROBE_TOP:
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    from build_graph.rules.host_tools import system_dir
    if not system_dir(os.path.dirname(os.path.normpath(p))):
        args += ["--ro-bind", p, p]  # a tool elsewhere: by itself, as plan_host_tools mounts it
    return args + ["--chdir", "/", "--", p, "--version"]


def _sandboxed_version(p: str) -> str:
    """The first line `p --version` prints (stdout, else stderr) inside the probe's sandbox, or ""
    where it fails, hangs past PROBE_TIMEOUT_S or cannot start. Each stream is read up to
    PROBE_OUTPUT_CAP bytes; a tool that writes more is killed."""
    import selectors

    program = seccomp.open_program()
    try:
        proc = subprocess.Popen(probe_command(find_bwrap(), p, program), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(PROBE_ENV),
                                pass_fds=(program,))
    except OSError:
        return ""
    finally:
        os.close(program)
    got = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    try:
        with selectors.DefaultSelector() as sel:
            for f in got:
                sel.register(f, selectors.EVENT_READ)
            while sel.get_map() and time.monotonic() < deadline:
                for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                    got[key.fileobj] += chunk
                if any(len(buf) > PROBE_OUTPUT_CAP for buf in got.values()):
                    break  # endless output: no version line needs this much
        proc.wait(timeout=0.5 if time.monotonic() < deadline else 0)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:  # killing bwrap ends the sandbox (--die-with-parent, own PID namespace)
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    for buf in got.values():  # stdout first
        text = bytes(buf[:PROBE_OUTPUT_CAP]).decode("utf-8", "replace").strip()
        if text:
            return text.splitlines()[0]
    return ""


# An action holds no capability, as root too: bwrap keeps root's unless told, and with them an
# action could remount a read-only input (a dependency's CAS blob, the pinned /usr every action
# shares) writable, mount, or make a device. bwrap also sets no_new_privs, and the bounding set is
# empty: no setuid binary or file capability brings one back.
NO_CAPABILITIES = ("--cap-drop", "ALL")
# Nor a nested user namespace, where it would hold every capability again (over that namespace
# only: the kernel keeps bwrap's read-only mounts read-only there, but mounts and devices open up).
NO_USER_NAMESPACES = ("--unshare-user", "--disable-userns")
# /proc read-only: bgraph run as root makes the action host uid 0 (no capability needed), which
# the kernel lets write most of /proc/sys (kernel.core_pattern runs a program as root on the
# host); bwrap leaves /proc/sys writable. Reading /proc is unchanged.
READ_ONLY_PROC = ("--proc", "/proc", "--remount-ro", "/proc")

_NESTING_BLOCKED: dict[str, bool] = {}  # bwrap path -> whether NO_USER_NAMESPACES works here


def nesting_options(bwrap: str) -> tuple[str, ...]:
    """NO_USER_NAMESPACES where this bwrap (0.8 or newer) and host allow it (asked once per
    process); elsewhere none: older bubblewrap, or a host that gives bwrap no user namespace,
    where an action can make none either (the mounts stay locked read-only in any case)."""
    works = _NESTING_BLOCKED.get(bwrap)
    if works is None:
        try:
            probe = subprocess.run([bwrap, *NO_USER_NAMESPACES, *NO_CAPABILITIES, "--ro-bind", "/", "/",
                                    "--", bwrap, "--version"], capture_output=True, timeout=30,
                                   stdin=subprocess.DEVNULL, env={})
            works = probe.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            works = False
        _NESTING_BLOCKED[bwrap] = works
    return NO_USER_NAMESPACES if works else ()


MAX_MOUNTS = 256  # bwrap takes at most 9,000 arguments; one input mount costs three


def coalesced_mounts(inputs: tuple[tuple[str, Tree], ...]) -> list[tuple[str, Tree]]:
    """The input mounts, with the /bgraph/in/<name> ones merged into one tree at /bgraph/in when
    there are too many for bwrap (a target with thousands of dependencies). The sandbox shows
    the same paths either way."""
    if len(inputs) <= MAX_MOUNTS:
        return list(inputs)
    under = [(m, t) for m, t in inputs if m.startswith("/bgraph/in/")]
    merged = Tree().merged(*(t.prefixed(m[len("/bgraph/in/"):]) for m, t in under))
    return [(m, t) for m, t in inputs if not m.startswith("/bgraph/in/")] + [("/bgraph/in", merged)]


OUT_MOUNT = "/bgraph/out"  # the action's writable output directory
MERGED_USR_LINKS = ("bin", "lib", "lib64", "sbin")


def sandbox_layout(action: Action) -> list[tuple]:
    """The read-only part of an action's filesystem view, in the order it is mounted: ("host",
    path) binds a host path at the same path, ("symlink", target, path) makes a link, ("tree",
    mount, tree) shows an input tree at `mount`. Pure (bar reading the host's merged-/usr links
    for a host /usr): the local runner turns it into bwrap options, and remote execution into
    the REAPI input root, so both give an action the same view."""
    ops: list[tuple] = [("host", host_path) for host_path in action.host_paths]
    if "/usr" in action.host_paths:
        # Debian's merged /usr: the usual top-level links.
        for link in MERGED_USR_LINKS:
            if os.path.islink(f"/{link}"):
                ops.append(("symlink", os.readlink(f"/{link}"), f"/{link}"))
    for mount, tree in coalesced_mounts(action.inputs):
        ops.append(("tree", mount, tree))
        if mount == "/usr":  # a pinned system root (deb_packages): the merged-/usr links, from no host path
            ops += [("symlink", f"usr/{link}", f"/{link}") for link in MERGED_USR_LINKS]
    return ops


class BwrapRunner:
    """Runs exec actions under bubblewrap, storing declared outputs into the CAS."""

    def __init__(self, cas: LocalCas, jobs: int = 1):
        self.cas = cas
        self.bwrap = find_bwrap()
        self.isolation = (*NO_CAPABILITIES, *nesting_options(self.bwrap))
        seccomp.memory_file()  # the seccomp program every action's bwrap installs (a SandboxError here if none)
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self.stopping = False
        self._free_dirs: list[Path] = []  # emptied output directories, for the next actions
        # Output directories emptied of all but a staged layout, exactly as staged: the next action
        # that stages the same tree at the same mount takes one as it is (issue 34: a ninja edge
        # stages a build directory of ~1,100 entries, 0.1-0.3 s of inodes per action here).
        self._staged_dirs: dict[tuple[str, str], list[tuple[Path, _Layout]]] = {}
        self._jobs = max(1, jobs)
        self._dir_names = itertools.count()  # names in this build's own staging directory
        self._dir_made: tuple | None = None  # how a new one looks (_as_made)
        # Per-action cgroups where this host allows them: CPU time (else 0) and peak memory
        # (else sampled from the process tree).
        self.accounting = Accounting.probe()
        # Processes that join the next actions' groups ahead of them (spares.py): one per lane.
        used = self.accounting.cpu is not None or self.accounting.memory is not None
        self.spares = Spares(self.accounting, jobs) if used else None

    def command(self, action: Action, out_dir: Path) -> list[str]:
        args = [self.bwrap, "--unshare-all", *self.isolation, "--die-with-parent", "--new-session",
                "--hostname", "bgraph", *READ_ONLY_PROC, "--dev", "/dev",
                "--tmpfs", "/tmp", "--dir", "/bgraph"]
        for op in sandbox_layout(action):
            if op[0] == "host":
                args += ["--ro-bind", op[1], op[1]]
            elif op[0] == "symlink":
                args += ["--symlink", op[1], op[2]]
            else:
                args += ["--ro-bind", str(self.cas.materialize(op[2])), op[1]]
        args += ["--bind", str(out_dir), OUT_MOUNT, "--chdir", action.cwd]
        return args + ["--", *action.argv]

    @staticmethod
    def environment(action: Action) -> dict[str, str]:
        """The action's whole environment, which bwrap gives it inside the sandbox (never a host
        process's: sandbox_env.py)."""
        return dict(action.env)

    def handover(self, action: Action):
        """How bwrap hands `action` its environment (sandbox_env.handover); a SandboxError of one
        line where it cannot."""
        try:
            return handover(self.environment(action), lambda: has_shell(action))
        except EnvironmentRefused as e:
            raise SandboxError(str(e), where=action.name,
                               hint=e.hint or "use fewer variables (fewer dependencies) or give the action a /bin/sh "
                                    "(host_tools with /usr, or a system root)") from None

    def interactive(self, action: Action, out_dir: Path) -> tuple[list[str], dict[str, str], int | None]:
        """argv, host environment and stdin (a descriptor, or None for the caller's) that run
        `action` in the foreground (`bgraph exec`): its environment reaches only the sandbox. A
        shell opens the seccomp program's file for bwrap (the caller passes no descriptor on)."""
        bwrap, *options = self.command(action, out_dir)
        split = options.index("--")
        env = self.handover(action)
        stdin = stdin_fd(env.script) if env.script is not None else None
        argv = ["/bin/sh", "-c", 'f=$1; shift; exec "$@" 3<"$f"', "bgraph-exec", str(seccomp.program_path()),
                bwrap, *seccomp.options(3), *options[:split], *env.options, "--", *env.prefix, *options[split + 1:]]
        return argv, dict(HOST_ENV), stdin

    def run(self, action: Action, stamps: dict[str, float] | None = None) -> tuple[Tree, ActionResult]:
        """Run `action` in a fresh sandbox; its outputs go into the store. `stamps`, when given,
        receives when the process started and ended (for --profile)."""
        return self.run_process(action, stamps)()

    def run_process(self, action: Action, stamps: dict[str, float] | None = None
                    ) -> Callable[[], tuple[Tree, ActionResult]]:
        """Run `action`'s process in a fresh sandbox and check how it ended (its status, its
        declared outputs present and below no symlink): a failure is raised here, with its
        stdout and stderr. Returns `store`, to be called once, on any thread: it takes the
        outputs into the store (hashed, moved in, the tree's node written) and returns the tree
        and result. Between the two, nothing of the action runs: the scheduler gives its slot to
        the next action while this one's outputs are stored (issue 34, item 1)."""
        if self.stopping:
            raise ActionFailed("interrupted", where=action.name)
        whole = action.outputs == (".",)  # the action's whole output directory
        for o in () if whole else action.outputs:
            try:
                check_relpath(o)
            except ValueError:
                raise SandboxError(f"declared output {o!r} is not a relative path inside the output directory",
                                   where=action.name) from None
        groups: dict[str, Path] = {}  # the action's cgroups, where its CPU time and memory are accounted
        staged = action.input_tree(action.staged) if action.staged else None
        key = (action.staged, staged.digest(self.cas.digester)) if staged is not None else None
        out_dir, layout = self._out_dir(key)
        outputs: Outputs | None = None
        watched: int | None = None  # the action's token of the cache disk's watch
        try:
            if staged is not None and layout is None:
                layout = _stage(out_dir, staged, action.staged)
            for o in () if whole else action.outputs:
                if "/" in o:
                    _make_parents(out_dir, o, action.name)
            start = time.monotonic()
            # The cache's disk is watched while the action runs (cgroups.SpaceWatch): one that ran
            # while it was full may have lost writes and still exit 0.
            space = self.accounting.space_watch(self.cas.tmp, LOW_SPACE)
            watched = space.begin(action.name, out_dir, action.outputs)
            proc, groups, outputs = self._start(action, out_dir)
            try:
                # Without a memory cgroup, the process tree is sampled. Never wait4's ru_maxrss:
                # it starts from bgraph's own high-water mark (see cgroups.py).
                sampler = PeakSampler(proc.pid) if "memory" not in groups else None
                if sampler is not None:
                    sampler.start()
                try:
                    _pid, status = os.waitpid(proc.pid, 0)
                    proc.returncode = code = os.waitstatus_to_exitcode(status)
                finally:
                    if sampler is not None:
                        sampler.stop()
            finally:
                with self._lock:
                    self._procs.discard(proc)
            end = time.monotonic()
            duration = end - start
            full, watched = space.end(watched), None
            hit = self.accounting.limit_hit(groups)  # a fork refused or a process killed for memory
            # bwrap has ended; its PID namespace's teardown kills every process in it (its init
            # may still be listed, dying). One still alive in the action's groups got out of that
            # teardown (ptrace of bwrap's init): every process left is killed now, and waited for
            # off the slot before anything of the action is read (store, or the output directory
            # emptied), and the action fails (one alive might write).
            left = self.accounting.kill_left(groups, wait=False)
            if left and not self.stopping:  # stop() kills by the groups too: "interrupted" below
                raise ActionFailed(f"{left} process{'es' if left > 1 else ''} of the action outlived its sandbox "
                                   "(still running after bwrap ended); killed, its outputs not kept",
                                   where=action.name)
            if hit is not None:
                raise ActionFailed(hit.message, where=action.name, hint=hit.hint)
            cpu_s = self.accounting.cpu_s(groups)
            peak_mb = self.accounting.peak_mb(groups) if sampler is None else sampler.peak_kb // 1024
            if stamps is not None:
                stamps.update(process_start=start, process_end=end)
            stdout, stderr = outputs.read()
            if self.stopping:
                raise ActionFailed("interrupted", where=action.name)
            if code != 0 and shutil.disk_usage(out_dir).free < LOW_SPACE:
                # The action wrote its outputs on the cache's disk, which is full: its own error
                # text is lost or misleading; say what happened.
                raise OSError(errno.ENOSPC, "no space left in the cache directory")
            if full is not None:  # freed again since: what it wrote may be truncated, exit 0 or not
                raise ActionFailed(full, where=action.name,
                                   hint="free space on the cache's disk (or find what filled it) and build again")
            if code != 0:
                raise ActionFailed(f"exited with status {code}\n{_tail(stdout + stderr)}", where=action.name)
            for o in action.outputs:
                # The action may have replaced a directory by a symlink: never read (and move
                # into the store) host files through it.
                link = _symlinked_parent(out_dir, o)
                if link:
                    raise ActionFailed(f"declared output {o} lies below symlink {link}; refused", where=action.name)
            missing = [o for o in action.outputs if not os.path.lexists(out_dir / o)]
            if missing:
                raise ActionFailed(f"declared outputs missing: {', '.join(missing)}\n{_tail(stderr)}",
                                   where=action.name)
        except BaseException:
            if watched is not None:
                space.end(watched)
            self.accounting.wait_left(groups)
            self._end(outputs, groups)
            self._done_with(out_dir, reuse=not self.stopping, key=key, layout=layout)
            raise
        self._end(outputs, groups)

        def store() -> tuple[Tree, ActionResult]:
            try:
                if self.stopping:  # Ctrl-C: nothing of it reaches the store
                    raise ActionFailed("interrupted", where=action.name)
                self.accounting.wait_left(groups)  # what kill_left killed is out before a file is read
                tree = self.cas.ingest_dir(out_dir, None if whole else list(action.outputs), move=True)
                result = ActionResult(
                    output_tree=self.cas.put_tree(tree), exit_code=0,
                    stdout=self.cas.put_bytes(stdout).digest, stderr=self.cas.put_bytes(stderr).digest,
                    duration_s=round(duration, 3), output_entries=len(tree), peak_mb=peak_mb or 0,
                    cpu_s=round(cpu_s or 0.0, 3))
                return tree, result
            finally:
                self._done_with(out_dir, reuse=not self.stopping, key=key, layout=layout)
        return store

    def _end(self, outputs: Outputs | None, groups: dict[str, Path]) -> None:
        """The process has ended and its figures are read: its memory files and cgroups go."""
        if outputs is not None:
            outputs.close()
        if self.spares is not None:
            self.spares.retire(groups)
        else:
            self.accounting.remove(groups)

    def _out_dir(self, key: tuple[str, str] | None = None) -> tuple[Path, _Layout | None]:
        """An output directory for the next action: one that already holds the staged layout
        `key` (mount, tree digest) exactly as staged, with its layout; else an empty one an
        earlier action of this runner left (emptied, and checked to be as made), else a new one
        in this build's staging. A directory made and removed per action was two of the files
        each action cost (issue 34)."""
        with self._lock:
            ready = self._staged_dirs.get(key) if key is not None else None
            if ready:
                return ready.pop()
            if self._free_dirs:
                return self._free_dirs.pop(), None
        while True:
            path = Path(f"{self.cas.tmp}/act-{next(self._dir_names)}")
            try:
                path.mkdir()
            except FileExistsError:  # never, in a staging directory of our own
                continue
            _reset_times(path)
            self._dir_made = _as_made(path)
            return path, None

    def _done_with(self, out_dir: Path, reuse: bool, key: tuple[str, str] | None = None,
                   layout: _Layout | None = None) -> None:
        """Empty `out_dir` for the next action, or remove it. It is reused only if what the
        action left in it is gone and the directory itself is as a new one is made (its mode,
        owner, size, extended attributes such as an ACL, and inode flags): no action sees
        anything an earlier one left. Its times are put back to FIXED_MTIME, which a new one is
        given too (an action sets its atime to any value; the next one would read it).
        A staged layout (`key`, `layout`) is kept for the next action that stages the same
        tree where all that is left once the action's own files are gone is that layout,
        exactly as staged (`_unstage`); else the directory is emptied as any other."""
        if reuse and layout is not None and key is not None:
            try:
                kept = _unstage(out_dir, layout)
            except OSError:
                kept = False
            if kept:
                with self._lock:
                    pooled = sum(map(len, self._staged_dirs.values()))
                    if not self.stopping and pooled < 2 * self._jobs:
                        self._staged_dirs.setdefault(key, []).append((out_dir, layout))
                        return
        if reuse:
            try:
                with os.scandir(out_dir) as entries:
                    for e in entries:
                        rmtree(Path(e.path))
                reuse = self._dir_made is not None and _as_made(out_dir) == self._dir_made
                if reuse:
                    _reset_times(out_dir)
            except OSError:
                reuse = False
        if reuse:
            with self._lock:
                if not self.stopping:
                    self._free_dirs.append(out_dir)
                    return
        rmtree(out_dir)

    def _start(self, action: Action, out_dir: Path) -> tuple[subprocess.Popen, dict[str, Path], Outputs]:
        """The action's process, started in its cgroups (through a spare where one is ready),
        its stdout and stderr going to memory files; registered for stop()."""
        # bwrap reads its options from a descriptor (it closes it after reading), so the
        # sandbox's /proc/1/cmdline shows no host path (the cache directory) an action could copy.
        # The action's environment goes to bwrap in its options (or, where too large, on the
        # stdin of the sandbox's shell): no host process started here (the cgroup-joining sh,
        # bwrap) ever runs with it, where LD_PRELOAD and the like would run the action's code
        # on the host (sandbox_env.py).
        bwrap, *options = self.command(action, out_dir)
        split = options.index("--")
        env = self.handover(action)
        argv_in = [*env.prefix, *options[split + 1:]]
        spare = self.spares.take() if self.spares is not None and env.script is None else None
        if spare is not None:
            with self._lock:  # registered before it runs the action, so stop() cannot miss it
                self._procs.add(spare.proc)
            if spare.launch(bwrap, _nul_separated([*options[:split], *env.options]), argv_in):
                return spare.proc, spare.groups, spare.outputs
            with self._lock:
                self._procs.discard(spare.proc)
            spare.outputs.close()
            self.accounting.remove(spare.groups)
        groups = self.accounting.new_groups()
        outputs = args = stdin = program = None
        try:
            outputs, args, program = Outputs.new(), memfd("options"), seccomp.open_program()
            os.write(args, _nul_separated([*options[:split], *env.options]))
            os.lseek(args, 0, os.SEEK_SET)
            stdin = stdin_fd(env.script)
            argv = self.accounting.wrap(groups, [bwrap, *seccomp.options(program), "--args", str(args), "--",
                                                 *argv_in])
            proc = subprocess.Popen(argv, stdout=outputs.stdout, stderr=outputs.stderr, stdin=stdin,
                                    pass_fds=(args, program), start_new_session=True, env=dict(HOST_ENV))
        except BaseException:
            if outputs is not None:
                outputs.close()
            self.accounting.remove(groups)
            raise
        finally:
            for fd in (args, stdin, program):
                if fd is not None:
                    os.close(fd)
        with self._lock:
            self._procs.add(proc)
        return proc, groups, outputs

    def close(self) -> None:
        """End the idle spares and remove the idle output directories (the end of a build); the
        next action starts new ones."""
        if self.spares is not None:
            self.spares.close()
        with self._lock:
            free, self._free_dirs = self._free_dirs, []
            staged, self._staged_dirs = self._staged_dirs, {}
        for d in [*free, *(d for dirs in staged.values() for d, _layout in dirs)]:
            rmtree(d)

    def stop(self) -> None:
        """Kill every running sandbox (Ctrl-C); nothing partial reaches the store."""
        self.stopping = True
        with self._lock:
            procs = list(self._procs)
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # And by their cgroups: a process that got out of its PID namespace's teardown (ptrace of
        # bwrap's init) is in none of these process groups. Without cgroups (a host that has none)
        # only the above holds, with the seccomp filter that refuses an action ptrace.
        self.accounting.kill_all()


def _nul_separated(args: list[str]) -> bytes:
    """Arguments as bwrap's --args reads them."""
    return b"".join(a.encode() + b"\0" for a in args)


def has_shell(action: Action) -> bool:
    """Whether /bin/sh is a file in `action`'s sandbox (sandbox_layout, its links followed)."""
    binds: list[tuple[str, object]] = []
    links: dict[str, str] = {}
    for op in sandbox_layout(action):
        if op[0] == "host":
            binds.append((op[1], ("host", op[1])))
        elif op[0] == "symlink":
            links[op[2]] = op[1]
        else:
            binds.append((op[1], ("tree", op[2], op[1])))

    def lookup(what, rel: str):
        if what[0] == "host":
            return host_lookup(what[1], rel)
        parts = rel.split("/")
        for i in range(1, len(parts) + 1):  # a link on the way (bin -> usr/bin in a system root)
            entry = what[1].entries.get("/".join(parts[:i]))
            if isinstance(entry, SymlinkEntry):
                here = os.path.join(what[2], *parts[:i - 1])
                return ("link", os.path.normpath(os.path.join(here, entry.target, *parts[i:])))
        return ("file",) if isinstance(entry, FileEntry) else None
    return resolves(SHELL, binds, links, lookup)


class PeakSampler(threading.Thread):
    """The peak memory of a process tree, where no memory cgroup can be made (cgroups.py): the
    tree below `pid` is sampled, each process's high-water mark (VmHWM, which sampling cannot
    miss for a process alive at one sample) and the sum of current RSS (parallel processes).
    VmHWM belongs to the address space a process exec'd, so bgraph's own size never shows;
    wait4's ru_maxrss is not used: it starts from the forking parent's high-water mark, and it
    stops at bwrap's PID namespace anyway. A process that lives less than one interval can be
    missed (the first samples come quickly, then every `interval_s`): short steps are cheap,
    the long compiles are the ones the budget is for."""

    FIRST = (0.02, 0.05, 0.1, 0.2)  # seconds after the start: short actions get a sample too

    def __init__(self, pid: int, interval_s: float = 0.25):
        super().__init__(daemon=True)
        self.pid, self.interval_s = pid, interval_s
        self.peak_kb = 0
        self._done = threading.Event()

    def run(self) -> None:
        waits = [b - a for a, b in zip((0.0, *self.FIRST), self.FIRST)]
        while not self._done.wait(waits.pop(0) if waits else self.interval_s):
            self.peak_kb = max(self.peak_kb, _tree_memory_kb(self.pid))

    def stop(self) -> None:
        self._done.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=5)


def _tree_memory_kb(root: int) -> int:
    hwm, rss, todo = 0, 0, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        hwm = max(hwm, int(line.split()[1]))
                    elif line.startswith("VmRSS:"):
                        rss += int(line.split()[1])
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue  # the process ended meanwhile
    return max(hwm, rss)


class _Layout:
    """A staged layout as made: each symlink's target, and how each directory looked (`_as_made`,
    the output directory itself as "")."""

    def __init__(self, links: dict[str, str], dirs: dict[str, tuple | None]):
        self.links, self.dirs = links, dirs


def _make_parents(out_dir: Path, output: str, where: str) -> None:
    """Make the directories a declared output lies in, never through a link: a staged layout's
    links lead into the sandbox's mounts, which on the host are other paths (mkdir through one
    would make a host directory, or fail with a traceback)."""
    here = out_dir
    for part in output.split("/")[:-1]:
        here = here / part
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            here.mkdir()
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise SandboxError(f"declared output {output!r} lies below {here.relative_to(out_dir)}, which the "
                               "staged build directory holds as an input, not a directory", where=where,
                               hint="declare outputs at paths the build directory leaves free")


def _stage(out_dir: Path, tree: Tree, mount: str) -> _Layout:
    """Lay `tree` out in the writable output directory as symlinks into its read-only mount:
    the action reads its inputs where its command expects them, and cannot write through them
    (the mount is read-only), while new files it writes land beside them."""
    links: dict[str, str] = {}
    dirs: set[str] = {""}
    for path, entry in tree.entries.items():
        target = out_dir / path
        if isinstance(entry, DirEntry):
            target.mkdir(parents=True, exist_ok=True)
            dirs.add(path)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(f"{mount}/{path}", target)
            _reset_times(target)  # as a reused layout's links are (_unstage)
            links[path] = f"{mount}/{path}"
        parent = path.rpartition("/")[0]
        while parent and parent not in dirs:  # the directories mkdir(parents=True) made
            dirs.add(parent)
            parent = parent.rpartition("/")[0]
    for d in dirs:
        _reset_times(out_dir / d if d else out_dir)
    return _Layout(links, {d: _as_made(out_dir / d if d else out_dir) for d in dirs})


def _unstage(out_dir: Path, layout: _Layout) -> bool:
    """Remove everything in `out_dir` that is not part of `layout`; True where what is left is
    the layout exactly as staged: every symlink there with its target (its times put back to
    FIXED_MTIME, as _stage gives them), every directory as it was
    made (mode, owner, link count, size, extended attributes, inode flags: an action that
    changed one, or left a directory larger, gives False, and the caller empties it whole)."""
    seen = 0
    todo = [""]
    while todo:
        rel = todo.pop()
        with os.scandir(out_dir / rel if rel else out_dir) as entries:
            for e in entries:
                path = f"{rel}/{e.name}" if rel else e.name
                if path in layout.dirs:
                    if not e.is_dir(follow_symlinks=False):
                        return False
                    todo.append(path)
                elif path in layout.links:
                    if not e.is_symlink() or os.readlink(e.path) != layout.links[path]:
                        return False
                    # An action may re-time a link it owns (touch -h): the next one sees it as staged.
                    _reset_times(Path(e.path))
                else:  # the action's own: an output it left, a temporary file
                    rmtree(Path(e.path))
                    continue
                seen += 1
    if seen != len(layout.links) + len(layout.dirs) - 1:  # something staged is gone
        return False
    if not all(_as_made(out_dir / d if d else out_dir) == made for d, made in layout.dirs.items()):
        return False
    for d in layout.dirs:
        _reset_times(out_dir / d if d else out_dir)
    return True


FS_IOC_GETFLAGS = 0x80086601  # _IOR('f', 1, long): chattr's inode flags


def _reset_times(path: Path) -> None:
    """Give an output directory (or a staged link) the times every input has (FIXED_MTIME),
    never through a link: a new one, and one reused, look the same to the action."""
    os.utime(path, (FIXED_MTIME, FIXED_MTIME), follow_symlinks=False)


def _as_made(path: Path) -> tuple | None:
    """What an action could see of an empty output directory besides its times: its type,
    mode, owner, link count, size (a directory that held many names stays larger), extended
    attributes (an ACL the owner set) and inode flags (chattr's: an owner may set several
    without a capability). None where it is not a plain directory."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        try:
            flags = fcntl.ioctl(fd, FS_IOC_GETFLAGS, b"\0" * 8)
        except OSError:  # a file system without inode flags: none can be set either
            flags = b""
        xattrs = os.listxattr(fd)
    finally:
        os.close(fd)
    return (st.st_mode, st.st_uid, st.st_gid, st.st_nlink, st.st_size, flags, sorted(xattrs))


def _symlinked_parent(out_dir: Path, output: str) -> str | None:
    """The first directory on the way from out_dir to `output` that is a symlink, if any."""
    p = out_dir
    for part in output.split("/")[:-1]:
        p = p / part
        if p.is_symlink():
            return p.relative_to(out_dir).as_posix()
    return None


def _tail(data: bytes, lines: int = 40) -> str:
    text = data.decode(errors="replace").rstrip()
    parts = text.splitlines()
    if len(parts) > lines:
        parts = ["…", *parts[-lines:]]
    return "\n".join("  | " + p for p in parts) if parts else "  | (no output)"
