"""`bgraph worker`: runs REAPI actions leased from a Remote Workers API server (BuildGrid's Bots
service) in bgraph's bubblewrap sandbox.

THE CONTRACT WITH THE CLIENT (remote_exec/client.py builds input roots to it):

- The input root is the action's whole filesystem view. Each top-level entry of the input root
  is shown read-only at `/<name>`: an input root holding `usr/`, `bgraph/src/...` and
  `bgraph/in/...` gives `/usr`, `/bgraph/src`, `/bgraph/in/...`. A top-level symlink is made as
  that symlink (`bin -> usr/bin`: merged-/usr links work); a top-level file is bound read-only.
  The names `proc`, `dev` and `tmp` are the sandbox's own and refused at the top level
  (INVALID_ARGUMENT). (How it is mounted is the worker's business, the view is the same: a
  directory holding an output directory, e.g. `bgraph`, and `bgraph/in` are made of their
  children's mounts, each input its own read-only tree laid out once and reused by later leases.)
- Besides the input root: a fresh tmpfs `/tmp`, a read-only `/proc` (as sandbox.py's local
  actions), a minimal `/dev`, no network, its own PID (and IPC, UTS) namespace, `--cap-drop ALL`
  (no capability as root either), no nested user namespace where bwrap allows refusing it,
  `--die-with-parent`, `--new-session`, and exactly `Command.environment_variables` as the
  environment (nothing of the worker's).
- The process runs `Command.arguments` in `/<working_directory>`. Output paths are relative to the
  working directory (REAPI); `output_paths` is used, else `output_files` + `output_directories`.
  Each output's parent directory exists before the run and is writable: the worker binds a
  writable per-lease directory at the parent of every output (only the outermost of nested
  parents: outputs `bgraph/out/a` and `bgraph/out/d/b` make `/bgraph/out` writable). An output
  that is a directory of the input root is made writable itself, not its parent: a whole-output
  action (working directory `bgraph/out`, output path "") gets a writable `/bgraph/out` and
  `/bgraph` stays a directory of read-only mounts that takes new entries (bwrap's own tmpfs, as
  sandbox.py's `--dir /bgraph`), exactly the local view. What the input root holds below a
  writable directory (e.g. `bgraph/out`'s staged symlinks and output parents) is laid out there
  first: directories made, symlinks as they are, files as copies (never links into the worker's
  cache) with the store's modes 0444/0555 and mtime FIXED_MTIME, as every input locally has.
  An output directly at the input root's top level that is not a directory of it has no parent
  to bind (INVALID_ARGUMENT). A Directory naming one entry twice (REAPI: names are unique) is
  refused (INVALID_ARGUMENT), so nothing lies below a symlink; the layout never follows a link.
- Outputs are collected after the run: a regular file as an OutputFile (executable bit kept), a
  symlink as an OutputSymlink, a directory as an OutputDirectory whose Tree is uploaded. A
  declared output the action did not make is simply absent (REAPI). An output directory nested
  more than 256 deep (or naming a non-UTF-8 name) fails the action with INVALID_ARGUMENT: its own
  doing, not retried. A stdout or stderr over 16 MiB keeps its last 16 MiB, after a first line
  saying how many bytes were dropped. Sparse outputs stay sparse in the worker's cache.
- Platform properties the worker offers: `OSFamily=Linux`, `ISA=x86-64` or `aarch64` (the
  host's, or with `--isa aarch64 --qemu FILE` the one it emulates: runner.emulating), and
  `bgraph-sandbox=SANDBOX_VERSION`, which the client sends too: a change of this
  contract changes the version, so old clients' actions wait for matching workers instead of
  running in a sandbox they were not built for.
- Statuses: inputs missing from the server's CAS -> FAILED_PRECONDITION with a PreconditionFailure
  of MISSING violations `blobs/<hash>/<size>`; Action.timeout hit -> DEADLINE_EXCEEDED (the process
  tree is killed); a bad Command or input root -> INVALID_ARGUMENT; the worker's own trouble ->
  INTERNAL or UNAVAILABLE (BuildGrid retries those); else OK with an ActionResult (exit_code,
  outputs, stdout/stderr digests, execution_metadata with this bot's id). A non-zero exit is OK.
- Digests are the server's digest function (sha256 by default; `--digest-function blake3` where
  the server offers it).
"""

from __future__ import annotations

import fcntl
import logging
import os
import platform
import shutil
import signal
import socket
import threading
import time
import traceback
import uuid
from pathlib import Path

from build_graph.errors import LoadError
from build_graph.model import Digester, FileEntry, Tree
from build_graph.remote_exec import outputs as outs
from build_graph.remote_exec.patient import PatientRemote
from build_graph.remote_exec.bots import BotsClient, SessionGone, Stopped
from build_graph.remote_exec.cache_bound import Uses, parse_size, tree_bytes
from build_graph.remote_exec.fsops import Layout, Refused, remove_tree
from build_graph.remote_exec.runner import Process, bwrap_options, emulating, emulation_problem
from build_graph.remote_exec.staging import (
    BadInput,
    CorruptInput,
    MissingInputs,
    Stager,
    output_paths,
    writable_dirs,
)
from build_graph.remote_exec.trees import TreeCache
from build_graph.store.cas import FIXED_MTIME, LocalCas, rmtree
from build_graph.store.reapi import remoteworkers_pb2 as rw
from build_graph.store.remote import CircuitBreaker, RemoteUnavailable

# The `bgraph-sandbox` platform property: this contract's version. v2: an output that is a
# directory of the input root is made writable itself (v1 made its parent writable, copying the
# whole-output action's inputs there with the current mtime); being in the Action, it also keeps
# BuildGrid's cache from answering with a result made under v1.
SANDBOX_VERSION = "bwrap-v2"
ISA = {"x86_64": "x86-64", "aarch64": "aarch64", "arm64": "aarch64"}
log = logging.getLogger("bgraph.worker")

# google.rpc.Code values
OK, CANCELLED, INVALID_ARGUMENT, DEADLINE_EXCEEDED, FAILED_PRECONDITION, INTERNAL, UNAVAILABLE = 0, 1, 3, 4, 9, 13, 14


def host_properties(isa: str | None = None) -> dict[str, str]:
    """The platform this worker offers: OSFamily, ISA (the host's, or `isa` where it emulates
    one) and the sandbox version."""
    machine = isa or platform.machine()
    return {"OSFamily": "Linux", "ISA": ISA.get(machine, machine), "bgraph-sandbox": SANDBOX_VERSION}


def emulation(isa: str | None, qemu: str | None) -> tuple[str | None, list[str]]:
    """The ISA a worker offers where it is not the host's, and the launcher its actions start
    through (runner.emulating); a worker that cannot emulate it is refused with one line."""
    host = ISA.get(platform.machine(), platform.machine())
    if isa is None or ISA.get(isa, isa) == host:
        if qemu:
            raise LoadError("--qemu is for a worker of another CPU", hint="give --isa too, e.g. --isa aarch64")
        return None, []
    if not qemu:
        raise LoadError(f"a worker for {isa} on this {platform.machine()} host runs its programs under qemu-user: "
                        "--qemu is missing",
                        hint="give the pinned one: --qemu $(bgraph build --json //toolchains:qemu-user …)"
                             f"/usr/libexec/qemu-binfmt/{isa}-binfmt-P")
    problem = emulation_problem(isa, qemu)
    if problem:
        raise LoadError(f"cannot emulate {isa} with --qemu {qemu}: {problem}")
    return isa, emulating(isa, qemu)


def _status(code: int, message: str, missing: list[tuple[str, int]] | None = None):
    from google.rpc import error_details_pb2, status_pb2

    status = status_pb2.Status(code=code, message=message[:4000])
    if missing:
        failure = error_details_pb2.PreconditionFailure()
        for h, size in missing:
            failure.violations.add(type="MISSING", subject=f"blobs/{h}/{size}")
        status.details.add().Pack(failure)
    return status


class Worker:
    """`slots` bots on one server, each running one lease at a time in the sandbox."""

    def __init__(self, server: str, slots: int, work_dir: Path, cache_dir: Path,
                 digest_function: str | None = None, heartbeat_s: float | None = None, name: str | None = None,
                 max_cache: int | None = None, isa: str | None = None, launcher: list[str] = ()):
        """`isa` and `launcher` (emulation()): the CPU this worker offers, where not the host's."""
        from build_graph.store.reapi_remote import ReapiRemote

        if not server.startswith("grpc://"):
            raise LoadError(f"--server {server!r} is not a grpc:// URL", hint="e.g. --server grpc://127.0.0.1:50051")
        if slots < 1:
            raise LoadError(f"--slots {slots}: a worker needs at least one slot", hint="e.g. --slots 2")
        self.server, self.slots = server, slots
        self.isa, self.launcher = isa, list(launcher)
        self.work_dir, self.cache_dir = Path(work_dir), Path(cache_dir)
        self.heartbeat_s = heartbeat_s
        self.stopping = threading.Event()
        self.host = name or socket.gethostname()  # bot ids are <host>/<slot>
        # The breaker never opens: a worker outlives server restarts and waits them out.
        probe = ReapiRemote(server, "sha256", timeout_s=60.0, breaker=CircuitBreaker(limit=1 << 62))
        fn = digest_function or self._server_digest_function(probe)
        self.remote = probe if fn == "sha256" else ReapiRemote(server, fn, timeout_s=60.0,
                                                              breaker=CircuitBreaker(limit=1 << 62))
        self.cas = LocalCas(self.cache_dir, Digester(fn))
        self.cas_calls = PatientRemote(self.remote, self.stopping)  # a busy server is waited for
        self.stager = Stager(self.cas_calls, self.cas)
        self.trees = TreeCache(self.cas)
        self.max_cache = max_cache
        self.uses = Uses()
        self._base_bytes = tree_bytes(self.cas.base) if max_cache else 0  # what earlier runs left
        self._stored_bytes = 0  # outputs and logs stored by this run
        self.instance = self.remote.instance
        self._processes: dict[int, Process] = {}
        self._lock = threading.Lock()

    def _server_digest_function(self, remote) -> str:
        """sha256 where the server offers it (REAPI's default), else blake3; the server is waited
        for while it does not answer (a worker may start before it)."""
        backoff = 0.2
        while True:
            try:
                offered = list(remote.server_capabilities().cache_capabilities.digest_functions)
                break
            except RemoteUnavailable as e:
                if self.stopping.wait(backoff):
                    raise LoadError("stopped before the server answered") from None
                log.info("server not answering (%s), again in %.1f s", e, backoff)
                backoff = min(backoff * 2, 5.0)
        if not offered or 1 in offered:
            return "sha256"
        if 9 in offered:
            return "blake3"
        raise LoadError(f"the server {self.server} offers neither sha256 nor blake3 digests",
                        hint="bgraph workers hash with sha256 or blake3")

    def run(self) -> int:
        """Serve leases until SIGTERM/SIGINT; the running actions are killed then."""
        self._purge_old()
        threads = [threading.Thread(target=self._slot, args=(i,), name=f"slot-{i}", daemon=True)
                   for i in range(self.slots)]
        for t in threads:
            t.start()
        try:
            while any(t.is_alive() for t in threads) and not self.stopping.wait(0.5):
                pass
        finally:
            self.stop()
            for t in threads:
                t.join(timeout=15)
            self.cas.close()
        return 0

    def stop(self) -> None:
        """Stop taking leases and kill every running action."""
        self.stopping.set()
        with self._lock:
            procs = list(self._processes.values())
        for p in procs:
            p.kill("cancelled")

    def _purge_old(self) -> None:
        """Lease directories an earlier worker left (killed mid-lease) go before any new one.
        The work directory is this worker's alone (a lock held while it runs): another one's
        purge would remove leases that are running."""
        self._lock_fd = os.open(self.work_dir / ".worker.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise LoadError(f"another bgraph worker uses the work directory {self.work_dir}",
                            hint="give each worker its own --work-dir (and --name)") from None
        for slot in self.work_dir.glob("slot-*"):
            remove_tree(slot)

    # -- one bot -------------------------------------------------------------------------------
    def _session_template(self, index: int) -> rw.BotSession:
        bot_id = f"{self.host}/{index}"  # stable: a restarted worker's jobs are requeued at once
        session = rw.BotSession(bot_id=bot_id, status=rw.OK)
        device = session.worker.devices.add(handle=bot_id)
        for key, value in sorted(host_properties(self.isa).items()):
            device.properties.add(key=key, value=value)
        return session

    def _heartbeat(self, session: rw.BotSession) -> float:
        """Seconds between updates while a lease runs: a third of what the server gives the
        session before it expires (BuildGrid's keepalive), at most 10."""
        if self.heartbeat_s:
            return self.heartbeat_s
        if session.HasField("expire_time"):
            left = session.expire_time.ToSeconds() - time.time()
            if left > 0:
                return max(0.3, min(10.0, left / 3))
        return 2.0

    def _slot(self, index: int) -> None:
        template = self._session_template(index)
        bots = BotsClient(self.remote.channel, self.instance, self.stopping)
        while not self.stopping.is_set():
            try:
                self._bot(index, bots, template)
            except Stopped:
                return
            except Exception:  # noqa: BLE001 - logged; the bot starts a new session a moment later
                # An unexpected server answer must not leave the slot dead while the worker runs.
                log.error("bot %s failed, starting again:\n%s", template.bot_id, traceback.format_exc())
                self.stopping.wait(1.0)

    def _bot(self, index: int, bots: BotsClient, template) -> None:
        """One session's life: long polls, leases served, a new session where the server drops it."""
        session = bots.create(template)
        log.info("bot %s: session %s", template.bot_id, session.name)
        while not self.stopping.is_set():
            lease = next((le for le in session.leases if le.state in (rw.PENDING, rw.ACTIVE)), None)
            if lease is None:
                try:
                    session = bots.update(session, interruptible=True) or session
                except SessionGone as e:
                    log.info("bot %s: session gone (%s): a new one", template.bot_id, e)
                    session = bots.create(template)
                continue
            session = self._serve(index, bots, template, session, lease.id)

    def _serve(self, index: int, bots: BotsClient, template, session, lease_id: str):
        """Run one lease while heartbeating; complete it; the session to go on with."""
        lease = next(le for le in session.leases if le.id == lease_id)
        lease.state = rw.ACTIVE
        cancelled = threading.Event()
        result: dict = {}
        run = threading.Thread(target=lambda: result.update(done=self._execute(index, lease, cancelled)),
                               name=f"lease-{index}", daemon=True)
        run.start()
        wait = 0.0  # the first update at once: the server marks the job EXECUTING
        while run.is_alive():
            run.join(wait)
            if not run.is_alive():
                break
            wait = self._heartbeat(session)
            try:
                got = bots.update(session, timeout_s=max(wait, 5.0))
            except SessionGone as e:
                log.info("bot %s: session gone mid-lease (%s): action killed", template.bot_id, e)
                cancelled.set()
                run.join()
                return bots.create(template)
            if got is None:
                continue
            session = got
            mine = next((le for le in session.leases if le.id == lease_id), None)
            if mine is None or mine.state == rw.CANCELLED:
                log.info("bot %s: lease %s cancelled: action killed", template.bot_id, lease_id)
                cancelled.set()
                run.join()
                return session
        status, action_result = result.get("done") or (_status(INTERNAL, "the lease's thread failed"), None)
        mine = next((le for le in session.leases if le.id == lease_id), None)
        if mine is None or mine.state == rw.CANCELLED:
            return session
        if self.stopping.is_set() and status.code != OK:
            # Killed by our own stop: UNAVAILABLE has the server run it again elsewhere at once.
            status, action_result = _status(UNAVAILABLE, "the worker stopped during the action"), None
        mine.state = rw.COMPLETED
        mine.status.CopyFrom(status)
        if action_result is not None:
            mine.result.Pack(action_result)
        try:
            got = bots.update_until_sent(session)
        except SessionGone:
            return bots.create(template)
        if got is None:
            if self.stopping.is_set():
                raise Stopped()
            # The server never took the completion (down for 10 minutes): it will have expired
            # the session and queued the job again; a new session goes on.
            return bots.create(template)
        return got

    # -- one lease -----------------------------------------------------------------------------
    def _execute(self, index: int, lease, cancelled: threading.Event):
        """Run `lease`'s action: (google.rpc.Status, ActionResult or None); then keep the cache
        within --max-cache."""
        with self.uses.lease():
            done = self._execute_lease(index, lease, cancelled)
        if self.max_cache and self._held_bytes() > self.max_cache:
            self._empty_cache()
        return done

    def _held_bytes(self) -> int:
        return self._base_bytes + self.stager.fetched_bytes + self._stored_bytes

    def _empty_cache(self) -> None:
        """Empty the worker's CAS and laid-out trees (between leases: none runs meanwhile)."""
        with self.uses.alone():
            if self._held_bytes() <= self.max_cache:
                return  # another slot emptied it meanwhile
            log.info("cache over %d bytes: emptied", self.max_cache)
            digester = self.cas.digester
            self.cas.close()
            rmtree(self.cas.base)
            self.cas = LocalCas(self.cache_dir, digester)
            self.stager = Stager(self.cas_calls, self.cas)
            self.trees = TreeCache(self.cas)
            self._base_bytes, self._stored_bytes = 0, 0

    def _execute_lease(self, index: int, lease, cancelled: threading.Event):
        pb = self.remote.pb
        lease_dir = self.work_dir / f"slot-{index}" / f"lease-{uuid.uuid4().hex[:12]}"
        meta = pb.ExecutedActionMetadata(worker=f"{self.host}/{index}")
        meta.worker_start_timestamp.GetCurrentTime()
        try:
            action = pb.Action()
            if lease.payload.Is(pb.Action.DESCRIPTOR):
                lease.payload.Unpack(action)
            elif lease.payload.Is(pb.Digest.DESCRIPTOR):
                digest = pb.Digest()
                lease.payload.Unpack(digest)
                action = self.stager.message(digest, pb.Action)
            else:
                raise BadInput(f"lease payload {lease.payload.type_url!r} is neither an Action nor a Digest")
            wanted = {p.name: p.value for p in action.platform.properties}
            if wanted.get("bgraph-sandbox", SANDBOX_VERSION) != SANDBOX_VERSION:
                return _status(FAILED_PRECONDITION, f"this worker runs sandbox {SANDBOX_VERSION}, the action was "
                               f"made for {wanted['bgraph-sandbox']}"), None
            meta.input_fetch_start_timestamp.GetCurrentTime()
            command = self.stager.message(action.command_digest, pb.Command)
            if not command.arguments:
                raise BadInput("the Command has no arguments")
            wd = command.working_directory.strip("/")
            if wd:
                wd = os.path.normpath(wd)
                if wd == ".." or wd.startswith("../"):
                    raise BadInput(f"working directory {command.working_directory!r} is outside the input root")
            outputs = output_paths(command, wd)
            writable = writable_dirs(outputs, self.stager.directories(action.input_root_digest, outputs)) \
                if outputs else []
            mounts = self.stager.mounts(action.input_root_digest, writable)
            if wd and not _is_dir(wd, mounts):
                raise BadInput(f"working directory {wd!r} is not a directory of the input root")
            meta.input_fetch_completed_timestamp.GetCurrentTime()
            return self._run(action, command, wd, outputs, mounts, lease_dir, cancelled, meta)
        except MissingInputs as e:
            return _status(FAILED_PRECONDITION, str(e), e.blobs), None
        except BadInput as e:
            return _status(INVALID_ARGUMENT, str(e)), None
        except outs.BadOutput as e:
            # The action's own making (a tree nested too deep): failing it again elsewhere
            # would end the same, so no retry (INTERNAL would have BuildGrid run it again).
            return _status(INVALID_ARGUMENT, f"the action's outputs are refused: {e}"), None
        except (CorruptInput, RemoteUnavailable) as e:
            return _status(UNAVAILABLE, f"worker {meta.worker}: {e}"), None
        except Exception as e:  # noqa: BLE001 - our own failure: the server retries it elsewhere
            log.error("lease %s failed in the worker:\n%s", lease.id, traceback.format_exc())
            return _status(INTERNAL, f"worker {meta.worker}: {type(e).__name__}: {e}"), None
        finally:
            self._remove_lease(lease_dir)

    def _remove_lease(self, lease_dir: Path) -> None:
        """Remove a lease's directory, whatever the action left there (fd-based and iterative:
        FIFOs and sockets unlinked, never opened; any depth); a failure is logged, never raised
        (the lease's status is already decided, and _purge_old takes what is left)."""
        try:
            remove_tree(lease_dir)
        except OSError as e:
            log.error("could not remove lease directory %s: %s", lease_dir, e)

    def _run(self, action, command, wd: str, outputs: list[str], mounts, lease_dir: Path,
             cancelled: threading.Event, meta):
        """Lay out the read-only trees (held while the lease runs), then run it."""
        lease_dir.mkdir(parents=True)
        ops: list[tuple] = []
        held: list[str] = []
        try:
            for op in mounts.ops:
                if op[0] == "tree":
                    path = self.trees.take(op[2])
                    held.append(path.name)
                    ops.append(("ro", path, op[1]))
                elif op[0] == "file":
                    name = op[1].rpartition("/")[2]
                    path = self.trees.take(Tree.from_checked({name: op[2]}))
                    held.append(path.name)
                    ops.append(("ro", path / name, op[1]))
                else:
                    ops.append(op)
            return self._sandboxed(action, command, outputs, mounts.writable, ops, wd, lease_dir, cancelled, meta)
        finally:
            self.trees.give_back(held)

    def _sandboxed(self, action, command, outputs, writable: dict, mounts, wd, lease_dir, cancelled, meta):
        """Stage the writable directories, run the process, collect and upload its outputs."""
        pb = self.remote.pb
        binds: list[tuple[Path, str]] = []
        for i, w in enumerate(writable):
            host = lease_dir / f"w{i}"
            host.mkdir()
            with Layout(host) as layout:
                try:
                    self._stage_writable(layout, writable[w])
                    for o in outputs:
                        if o.startswith(w + "/") and "/" in o[len(w) + 1:]:
                            layout.directory(os.path.dirname(o[len(w) + 1:]))
                except Refused as e:
                    raise BadInput(f"cannot lay out /{w}: {e.strerror}") from None
            binds.append((host, w))
        options = bwrap_options(shutil.which("bwrap") or "bwrap", mounts, binds, wd)
        env = {e.name: e.value for e in command.environment_variables}
        stdout, stderr = lease_dir / "stdout", lease_dir / "stderr"
        timeout = action.timeout.ToTimedelta().total_seconds() if action.HasField("timeout") else None
        if cancelled.is_set() or self.stopping.is_set():
            return _status(CANCELLED, "lease cancelled (or the worker stopping) before the action started"), None
        meta.execution_start_timestamp.GetCurrentTime()
        proc = Process(options, list(command.arguments), env, stdout, stderr, self.launcher)
        key = id(proc)
        with self._lock:
            self._processes[key] = proc
        try:
            ended = proc.wait(timeout, cancelled)
        finally:
            with self._lock:
                self._processes.pop(key, None)
        meta.execution_completed_timestamp.GetCurrentTime()
        if ended.killed == "timeout":
            return _status(DEADLINE_EXCEEDED, f"the action ran past its timeout of {timeout:g} s and was killed"), None
        if ended.killed:
            return _status(CANCELLED, "the action was killed: its lease was cancelled"), None
        if not ended.started:
            text = stderr.read_bytes().decode(errors="replace")[-2000:]
            return _status(INTERNAL, f"worker {meta.worker}: the sandbox did not start: {text.strip()}"), None
        meta.output_upload_start_timestamp.GetCurrentTime()

        def host_of(path: str) -> str:
            for (host, w) in binds:
                if path == w:  # a writable directory that is itself an output (the whole output)
                    return str(host)
                if path.startswith(w + "/"):
                    rel = path[len(w) + 1:]
                    # The action may have replaced a directory on the way by a symlink (to /etc,
                    # say): never read host files through it, as local builds refuse it too.
                    p = host
                    for part in rel.split("/")[:-1]:
                        p = p / part
                        if p.is_symlink():
                            raise BadInput(f"output {path} lies below a symlink the action made "
                                           f"({p.relative_to(host).as_posix()}); refused")
                    return str(host / rel)
            return str(lease_dir / "absent" / path)  # not below a writable directory: never made
        got = outs.collect(pb, self.cas, host_of, outputs, wd)
        result = pb.ActionResult(exit_code=ended.exit_code, output_files=got.files,
                                 output_directories=got.directories, output_symlinks=got.symlinks)
        for name, path in (("stdout", stdout), ("stderr", stderr)):
            # Capped (the action may ftruncate its stdout to a terabyte for free) and stored as
            # outputs are: a hole stays a hole, nothing is read whole.
            log_file = outs.cap_log(path)
            entry = outs.store_file(self.cas, log_file)
            got.blob(entry, self.cas.blob_path(entry.digest))
            getattr(result, f"{name}_digest").CopyFrom(pb.Digest(hash=entry.digest, size_bytes=entry.size))
        self._stored_bytes += sum(size for size, _source in got.blobs.values())
        outs.upload(self.cas_calls, got.blobs)
        meta.output_upload_completed_timestamp.GetCurrentTime()
        meta.worker_completed_timestamp.GetCurrentTime()
        result.execution_metadata.CopyFrom(meta)
        return _status(OK, ""), result

    def _stage_writable(self, layout: Layout, entries: dict) -> None:
        """What the input root holds below a writable directory, laid out there: directories,
        symlinks, and files as copies (the action may change them; the cache's blobs stay intact).
        A copy is as the store lays a file out (LocalCas.materialize): mode 0444 or 0555, mtime
        FIXED_MTIME, so an action that tells inputs by their date (a configure's `find -newermt`)
        sees one here as it would locally. Every step goes through `layout`, which never follows
        a symlink (staging refuses entries below one; this holds whatever the entries say)."""
        for path, entry in entries.items():
            if isinstance(entry, FileEntry):
                layout.copy(self.cas.blob_path(entry.digest), path, 0o555 if entry.executable else 0o444,
                            FIXED_MTIME)
            elif hasattr(entry, "target"):
                layout.symlink(entry.target, path)
            else:
                layout.directory(path)


def _is_dir(path: str, mounts) -> bool:
    """Whether `path` is a directory of the sandbox the mounts make."""
    if any(path == w or path.startswith(w + "/") for w in mounts.writable):
        return True
    for op in mounts.ops:
        if op[0] == "dir" and op[1] == path:
            return True
        if op[0] == "tree" and (op[1] == path or path.startswith(op[1] + "/")):
            rel = path[len(op[1]) + 1:]
            if not rel:
                return True
            entry = op[2].entries.get(rel)
            return entry is not None and not hasattr(entry, "digest") and not hasattr(entry, "target") \
                or any(p.startswith(rel + "/") for p in op[2].entries)
    return False


def main(server: str, slots: int, work_dir: str | None, cache_dir: str | None,
         digest_function: str | None = None, heartbeat_s: float | None = None, name: str | None = None,
         max_cache: str | None = None, isa: str | None = None, qemu: str | None = None) -> int:
    """`bgraph worker`: serve until SIGTERM or Ctrl-C."""
    from build_graph import seccomp
    from build_graph.sandbox import find_bwrap

    find_bwrap()
    seccomp.memory_file()  # every lease's bwrap installs it: a machine bgraph has none for fails here
    isa, launcher = emulation(isa, qemu)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cache = Path(cache_dir) if cache_dir else Path(os.environ.get("BGRAPH_CACHE") or
                                                     Path.home() / ".cache" / "bgraph") / "worker"
    work = Path(work_dir) if work_dir else cache / "leases"
    work.mkdir(parents=True, exist_ok=True)
    bound = parse_size(max_cache) if max_cache else None
    worker = Worker(server, slots, work, cache, digest_function, heartbeat_s, name, bound, isa, launcher)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    print(f"bgraph worker: {slots} slot(s) as {worker.host}/0..{slots - 1} on {server} "
          f"({', '.join(f'{k}={v}' for k, v in sorted(host_properties(isa).items()))}"
          f"{f', under {qemu}' if isa else ''})", flush=True)
    return worker.run()
