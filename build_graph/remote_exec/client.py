"""Remote execution: a runner that sends each sandboxed action to a REAPI Execution service
(BuildGrid) instead of running it under the local bubblewrap, with the same surface as
sandbox.BwrapRunner (run_process -> store, stop, close), so the engine files a remote result
exactly like a local one (action cache, state, trace: `why`, `audit`, early cutoff) and no
key changes.

One action: its Command (argv, environment, output paths, working directory) and input root
(input_root.py: the local sandbox's view as one Merkle tree) are uploaded where the server
lacks them (FindMissingBlobs, BatchUpdateBlobs, ByteStream), then `Execute`d, following
REMOTE-EXEC.md's client rules:
- the Operation stream broken with UNAVAILABLE: WaitExecution on the same operation until the
  server is back (its state is in PostgreSQL), for up to `RECONNECT_S`;
- FAILED_PRECONDITION on the call itself (no details: BuildGrid could not read the Action or
  Command): everything is uploaded again, once, then the server's text is the error;
- ExecuteResponse.status FAILED_PRECONDITION with MISSING violations: exactly those blobs are
  uploaded again and the Execute retried;
- RESOURCE_EXHAUSTED: backed off and retried;
- an operation QUEUED for `queue_timeout_s` while no action of its platform started: cancelled,
  and an error naming the platform (no worker matches it; BuildGrid never says so);
- any other non-OK status: the action did not finish; nothing of it is filed; with
  local_fallback it runs locally (one warning line). A non-zero exit is an ordinary failure of
  the action, as it is locally: never a reason to fall back.
Outputs are fetched into the local CAS when the action completes (eagerly: every output), once
the whole result's shape is checked (results.py: only declared outputs, each once, plain names,
bounded Trees); files and logs are streamed (fetch.py). A result of the wrong shape is a
RemoteFailure: nothing of it is filed. Each Execute asks the server not to answer from its action
cache (skip_cache_lookup), which any of its clients may write, unless the user accepts such
results (--remote-accept-cached).

Each Execute carries the action's place in bgraph's own queue (priority.py, through the
scheduler's job thread) as ExecutionPolicy.priority (queue_priority.py: lower = sooner), so that
with more Executes in flight than the fleet has slots the server's queue also starts the longest
path first. It is in the ExecuteRequest only: the Action, and so every key, never holds it.
"""

from __future__ import annotations

import posixpath
import random
import threading
import time
from typing import Callable

from build_graph.errors import ActionFailed, LoadError
from build_graph.model import Action, ActionResult, Tree
from build_graph.remote_exec.address import check_grpc_url, quiet_grpc
from build_graph.remote_exec.fetch import Fetcher, FetchError
from build_graph.remote_exec.input_root import (
    DigestMap,
    Encoded,
    Encoder,
    NotRemotable,
    local_blob_path,
    out_relative,
    output_paths,
    working_directory,
)
from build_graph.remote_exec.queue_priority import reapi_priority, sent
from build_graph.remote_exec.results import (
    MAX_TREE_BYTES,
    BadResult,
    RemoteFile,
    ResultChecker,
    check_digest,
)
from build_graph.remote_exec.worker import (  # bgraph platform -> REAPI ISA property
    ISA,
    SANDBOX_VERSION,
)
from build_graph.scheduler import running_priority
from build_graph.store.origins import EXECUTED, EXECUTOR_CACHE
from build_graph.store.reapi_remote import DIGEST_FUNCTIONS, ReapiRemote
from build_graph.store.remote import CircuitBreaker, RemoteUnavailable

_EXEC = "/build.bazel.remote.execution.v2.Execution/"
_OPS = "/google.longrunning.Operations/"
RECONNECT_S = 120.0  # how long a broken Operation stream is waited on (WaitExecution) before giving up
POLL_S = 5.0  # each Execute/WaitExecution stream is renewed this often, to look at the queue time
MISSING_ROUNDS = 3  # uploads of MISSING blobs before the action's failure is the server's
MAX_BACK_OFFS = 40  # RESOURCE_EXHAUSTED answers absorbed per call (back-off doubling to 10 s: minutes)
FIND_MISSING_BATCH = 10000  # digests per FindMissingBlobs request (about 100 bytes each)
WRITABLE_MARK = ".bgraph-out-writable"  # see RemoteRunner._whole_out
FALLBACK_AFTER = 3  # consecutive failures of the service after which the rest of a build runs locally
CANCEL_S = 5.0  # how long Ctrl-C waits, in all, for the server to take its CancelOperations


def runs_on(action: Action) -> str:
    """The platform whose machines run `action` (exec_platform is set only where it differs from
    the target platform; neither: this machine's)."""
    from build_graph.workspace import host_platform
    return action.exec_platform or action.platform or host_platform()


def _foreign(action: Action) -> bool:
    """Whether `action` is for another CPU's machines than this one (--host-platform)."""
    from build_graph.workspace import host_platform
    return runs_on(action) != host_platform()


class RemoteFailure(Exception):
    """The service failed an action for a reason of its own (not the action's)."""


def platform_properties(action: Action) -> list[tuple[str, str]]:
    """The platform an action needs, as REAPI properties (sorted by name)."""
    machine = runs_on(action)
    return sorted([("OSFamily", "Linux"), ("ISA", ISA.get(machine, machine)), ("bgraph-sandbox", SANDBOX_VERSION)])


class RemoteRunner:
    """Runs exec actions on a REAPI remote execution service; `local()` makes the local
    BwrapRunner for fallbacks and for actions that cannot go (a host path)."""

    def __init__(self, cas, url: str, local: Callable[[], object], *, jobs: int = 16, local_jobs: int = 2,
                 local_fallback: bool = False, queue_timeout_s: float = 120.0, timeout_s: float = 60.0,
                 skip_cache_lookup: bool = False, accept_cached: bool = False,
                 warn: Callable[[str], None] | None = None):
        quiet_grpc()  # before grpc's first import: its C-core log lines never reach the user
        import grpc
        from google.longrunning import operations_pb2
        from google.rpc import error_details_pb2

        from build_graph.store.reapi import reapi_pb2 as pb

        self.pb, self.ops_pb, self.details_pb, self.grpc = pb, operations_pb2, error_details_pb2, grpc
        self.cas, self.url = cas, url
        self.local_factory, self._local = local, None
        self.local_fallback, self.queue_timeout_s = local_fallback, queue_timeout_s
        # The executor's action cache is writable by any of its clients (BuildGrid 0.9.1 cannot
        # refuse them while its scheduler writes): a result taken from it is accepted only where
        # the user says no untrusted client can write it (--remote-accept-cached).
        self.accept_cached = accept_cached
        self.skip_cache_lookup = skip_cache_lookup or not accept_cached
        self.warn = warn or (lambda message: None)
        self.slots = Window(max(1, jobs))
        self.local_slots = threading.BoundedSemaphore(max(1, local_jobs))
        self.stopping = False
        self._lock = threading.Lock()
        self._inflight: dict[int, tuple[object, str]] = {}  # id -> (the stream's call, operation name)
        self._ids = iter(range(1 << 62))
        self._present: set[str] = set()  # blobs the server was seen to hold in this build
        self._progress: dict[tuple, float] = {}  # platform -> when an action of it last started or ended
        self._failures = 0
        self._given_up = False
        self.stats = {"executed": 0, "cached": 0, "fell_back": 0, "uploaded_bytes": 0, "downloaded_bytes": 0,
                      "missing_uploaded": 0, "reuploaded": 0, "backed_off": 0}
        check_grpc_url(url, "remote executor", "give --remote-executor grpc://HOST:PORT[/instance]")
        # Transport faults are handled here (retries, WaitExecution, fallback): the shared
        # remote's circuit breaker never opens on its own.
        self.remote = ReapiRemote(url, cas.digester.name, timeout_s, CircuitBreaker(limit=1 << 30))
        self._ready = False
        self._ready_lock = threading.Lock()
        self.digest_map: DigestMap | None = None
        self.encoder: Encoder | None = None
        self.fetcher: Fetcher | None = None

    # -- the service's digest function ----------------------------------------------------
    def _connect(self) -> None:
        """Ask the server once which digest functions it takes: the workspace's where offered,
        else sha256 through a map of local digests (a blake3 workspace on BuildGrid)."""
        with self._ready_lock:
            if self._ready:
                return
            try:
                caps = self.remote.server_capabilities()
            except RemoteUnavailable as e:
                raise RemoteFailure(f"remote executor {self.url} unavailable ({e})") from None
            offered = list(caps.cache_capabilities.digest_functions) or [DIGEST_FUNCTIONS["sha256"]]
            own = self.cas.digester.name
            if DIGEST_FUNCTIONS[own] in offered:
                function, file_digest = own, (lambda e: e.digest)
            elif DIGEST_FUNCTIONS["sha256"] in offered:
                function = "sha256"
                self.digest_map = DigestMap(self.cas, "sha256")
                file_digest = self.digest_map.remote
            else:
                raise LoadError(f"remote executor {self.url} offers none of the digest functions bgraph speaks",
                                hint="use a server that offers sha256 or blake3")
            self.remote.function = DIGEST_FUNCTIONS[function]
            self.remote.digest_function_name = function
            if caps.cache_capabilities.max_batch_total_size_bytes:
                self.remote.max_batch = min(caps.cache_capabilities.max_batch_total_size_bytes, 4 << 20)
            self.encoder = Encoder(self.pb, function, file_digest)
            self.fetcher = Fetcher(self.remote, self.cas, function, self._transient)
            self._ready = True

    # -- the runner's surface ---------------------------------------------------------------
    @property
    def local(self):
        with self._lock:
            if self._local is None:
                self._local = self.local_factory()
            return self._local

    def run(self, action: Action, stamps: dict[str, float] | None = None) -> tuple[Tree, ActionResult]:
        """Run `action` remotely (or locally where it must) and store its outputs."""
        return self.run_process(action, stamps)()

    def run_process(self, action: Action, stamps: dict[str, float] | None = None
                    ) -> Callable[[], tuple[Tree, ActionResult]]:
        """Execute `action` and return `store` (as BwrapRunner.run_process does): the remote
        result's outputs fetched into the local CAS, its tree and result."""
        if self.stopping:
            raise ActionFailed("interrupted", where=action.name)
        if self._given_up:
            return self._run_locally(action, stamps)
        # Read here, on the scheduler's thread for this action (0 elsewhere: the server's default).
        priority = reapi_priority(running_priority()) if sent() else 0
        try:
            self._connect()
            prepared = self._prepare(action)
            prepared["priority"] = priority
        except NotRemotable:
            return self._run_locally(action, stamps)
        except RemoteFailure as e:
            return self._fall_back(action, stamps, e)
        try:
            with self.slots:
                start = time.monotonic()
                response = self._execute(action, prepared)
                end = time.monotonic()
        except RemoteFailure as e:
            if self.stopping:
                raise ActionFailed("interrupted", where=action.name) from None
            return self._fall_back(action, stamps, e)
        with self._lock:
            self._failures = 0
        if stamps is not None:
            stamps.update(process_start=start, process_end=end)
        try:
            return self._fetched(action, response, end - start)
        except RemoteFailure as e:
            return self._fall_back(action, stamps, e)

    def stop(self) -> None:
        """Ctrl-C: cancel every in-flight operation (CancelOperation) and kill local sandboxes."""
        self.stopping = True
        with self._lock:
            inflight = list(self._inflight.values())
            local = self._local
        cancel = self._cancel_method()
        # Every CancelOperation at once, under one deadline: one after another, a server that
        # hangs instead of refusing held a stop of many operations past a CI's grace period.
        sent = [cancel.future(self.ops_pb.CancelOperationRequest(name=name), timeout=CANCEL_S)
                for _call, name in inflight if name]
        deadline = time.monotonic() + CANCEL_S
        for answer in sent:
            try:
                answer.result(timeout=max(0.0, deadline - time.monotonic()))
            except (self.grpc.RpcError, self.grpc.FutureTimeoutError):
                answer.cancel()  # the server is gone or stuck: nothing runs there for us either
        for call, _name in inflight:
            call.cancel()
        if local is not None:
            local.stop()

    def _cancel_method(self):
        from google.protobuf import empty_pb2
        return self.remote._method(_OPS + "CancelOperation", self.ops_pb.CancelOperationRequest, empty_pb2.Empty)

    def close(self) -> None:
        """The end of a build: the local runner's spares go, the digest map is saved."""
        if self._local is not None:
            self._local.close()
        if self.digest_map is not None:
            self.digest_map.save()

    # -- local runs ----------------------------------------------------------------------------
    def _run_locally(self, action: Action, stamps):
        if _foreign(action):
            # An action for workers of another CPU (--host-platform) never runs on this one.
            from build_graph.workspace import host_platform
            machine = runs_on(action)
            raise ActionFailed(f"an action for an {machine} host cannot run on this {host_platform()} machine"
                               + (" (it reads host paths, which are never sent)" if action.host_paths else ""),
                               where=action.name, hint=f"it runs only on {machine} workers "
                                                       f"(`bgraph worker --isa {machine}`)")
        with self.local_slots:
            store = self.local.run_process(action, stamps)
        return store

    def _fall_back(self, action: Action, stamps, error: Exception):
        if not self.local_fallback or _foreign(action):
            raise ActionFailed(f"remote execution failed: {error}", where=action.name,
                               hint=f"it runs only on {runs_on(action)} workers"
                               if _foreign(action) else
                               "--remote-local-fallback runs such an action locally instead") from None
        with self._lock:
            self.stats["fell_back"] += 1
            self._failures += 1
            give_up = not self._given_up and self._failures >= FALLBACK_AFTER
            self._given_up = self._given_up or give_up
        rest = "; the rest of this build runs locally" if give_up else ""
        self.warn(f"remote execution of {action.name} failed ({error}); running it locally{rest}")
        return self._run_locally(action, stamps)

    # -- one action ----------------------------------------------------------------------------
    def _prepare(self, action: Action) -> dict:
        """The action's Command, Action and input root, encoded, with every blob they name."""
        pb = self.pb
        root = self.encoder.input_root(action)
        props = platform_properties(action)
        platform = pb.Platform(properties=[pb.Platform.Property(name=n, value=v) for n, v in props])
        command = pb.Command(arguments=list(action.argv),
                             environment_variables=[pb.Command.EnvironmentVariable(name=k, value=v)
                                                    for k, v in sorted(action.env)],
                             output_paths=sorted(output_paths(action) + self._whole_out(action)), platform=platform,
                             working_directory=working_directory(action))
        command_bytes = command.SerializeToString(deterministic=True)
        command_hash = self.encoder.hash(command_bytes)
        message = pb.Action(command_digest=pb.Digest(hash=command_hash, size_bytes=len(command_bytes)),
                            input_root_digest=pb.Digest(hash=root.root[0], size_bytes=root.root[1]),
                            do_not_cache=not action.cacheable, platform=platform)
        action_bytes = message.SerializeToString(deterministic=True)
        blobs = dict(root.directories)
        blobs[command_hash] = command_bytes
        action_hash = self.encoder.hash(action_bytes)
        blobs[action_hash] = action_bytes
        return {"root": root, "blobs": blobs, "action": (action_hash, len(action_bytes)), "platform": tuple(props)}

    @staticmethod
    def _whole_out(action: Action) -> list[str]:
        """A marker output directly in the output directory, so the worker (which makes each
        output's parent writable) makes the whole of /bgraph/out writable, as the local sandbox
        does: an imported Ninja edge writes beside its staged inputs. Never made, never fetched."""
        if action.outputs == (".",):
            return []
        return output_paths(Action(name="", mnemonic="", outputs=(WRITABLE_MARK,), cwd=action.cwd))

    def _sizes(self, prepared: dict) -> dict[str, int]:
        root: Encoded = prepared["root"]
        sizes = {h: len(b) for h, b in prepared["blobs"].items()}
        sizes.update({h: e.size for h, e in root.files.items()})
        return sizes

    def _upload(self, prepared: dict, only: set[str] | None = None, everything: bool = False) -> None:
        """Upload what the server lacks of this action (or exactly `only`, or, with
        `everything`, all of it again)."""
        sizes = self._sizes(prepared)
        if only is not None:
            unknown = only - sizes.keys()
            if unknown:
                raise RemoteFailure(f"the server asks for blobs this action does not name: {sorted(unknown)[:3]}")
            wanted = only
        elif everything:
            wanted = set(sizes)
        else:
            with self._lock:
                ask = {h: s for h, s in sizes.items() if h not in self._present}
            try:
                wanted, names = set(), list(ask)
                for i in range(0, len(names), FIND_MISSING_BATCH):  # each request well under gRPC's 4 MiB
                    batch = {h: ask[h] for h in names[i:i + FIND_MISSING_BATCH]}
                    wanted |= self._transient(lambda b=batch: self.remote.find_missing(b))
            except RemoteUnavailable as e:
                raise RemoteFailure(f"FindMissingBlobs: {e}") from None
        root: Encoded = prepared["root"]
        small: dict[str, bytes] = {}
        total = 0
        try:
            for h in sorted(wanted):
                if h in prepared["blobs"]:
                    data = prepared["blobs"][h]
                else:
                    data = local_blob_path(self.cas, root.files[h]).read_bytes()
                small[h] = data
                total += len(data)
                if total > 64 << 20:  # bounded memory: send what is gathered
                    self._transient(lambda b=small: self.remote.put_blobs(b))
                    small, total = {}, 0
            self._transient(lambda b=small: self.remote.put_blobs(b))
        except RemoteUnavailable as e:
            raise RemoteFailure(f"uploading inputs: {e}") from None
        except NotRemotable as e:
            raise RemoteFailure(str(e)) from None
        with self._lock:
            self.stats["uploaded_bytes"] += sum(sizes[h] for h in wanted)
            self._present.update(sizes)

    def _execute(self, action: Action, prepared: dict):
        """Upload, Execute and follow the operation to its end; returns the ExecuteResponse
        (status OK). Every retry REMOTE-EXEC.md's client rules name happens here."""
        grpc = self.grpc
        self._upload(prepared)
        reuploaded, missing_rounds, backoff = False, 0, 0.2
        attempts_unavailable, busy = 0, 0
        while True:
            if self.stopping:
                raise RemoteFailure("interrupted")
            try:
                response = self._operation(action, prepared)
            except grpc.RpcError as e:
                code, text = e.code(), e.details() or ""
                if code == grpc.StatusCode.FAILED_PRECONDITION and not reuploaded:
                    # BuildGrid could not read the Action or Command (a bare code): all of it again, once.
                    reuploaded = True
                    with self._lock:
                        self._present.clear()
                        self.stats["reuploaded"] += 1
                    self._upload(prepared, everything=True)
                    continue
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED and busy < MAX_BACK_OFFS:
                    busy += 1
                    backoff = self._back_off(backoff)
                    continue
                if code == grpc.StatusCode.UNAVAILABLE and attempts_unavailable < 3:
                    attempts_unavailable += 1
                    backoff = self._back_off(backoff)
                    continue
                raise RemoteFailure(f"{code.name}: {text}"[:300]) from None
            status = response.status
            if status.code == 0:
                self.slots.done()
                return response
            if status.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]:
                missing = self._missing(status)
                if missing and missing_rounds < MISSING_ROUNDS:
                    missing_rounds += 1
                    with self._lock:
                        self._present.difference_update(missing)
                        self.stats["missing_uploaded"] += len(missing)
                    self._upload(prepared, only=missing)
                    continue
            if status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and busy < MAX_BACK_OFFS:
                busy += 1
                backoff = self._back_off(backoff)
                continue
            name = _code_name(grpc, status.code)
            if status.code == grpc.StatusCode.ABORTED.value[0]:
                # BuildGrid's answer once every attempt failed on the workers' side (a worker
                # lost mid-lease, INTERNAL, UNAVAILABLE): a poison action, not a passing fault.
                raise RemoteFailure(f"the service gave it up after retrying it ({name}: {status.message})"[:300])
            raise RemoteFailure(f"{name}: {status.message}"[:300])

    def _transient(self, call):
        """One CAS call, made again while the server answers RESOURCE_EXHAUSTED (its RPC limit:
        every open Execute stream holds one of its threads) or, a few times, UNAVAILABLE."""
        backoff, unavailable, busy = 0.2, 0, 0
        while True:
            try:
                return call()
            except RemoteUnavailable as e:
                text = str(e)
                if self.stopping:
                    raise
                if (text.startswith("RESOURCE_EXHAUSTED") or "status 8 " in text) and busy < MAX_BACK_OFFS:
                    busy += 1
                    backoff = self._back_off(backoff)
                elif text.startswith("UNAVAILABLE") and unavailable < 3:
                    unavailable += 1
                    backoff = self._back_off(backoff)
                else:
                    raise

    def _back_off(self, backoff: float) -> float:
        """Sleep before a retry the server asked for by being busy (or briefly away), and send
        fewer Executes at once for a while (Window)."""
        self.slots.busy()
        with self._lock:
            self.stats["backed_off"] += 1
        time.sleep(backoff * (0.5 + random.random()))
        return min(backoff * 2, 10.0)

    def _missing(self, status) -> set[str]:
        """The blobs a PreconditionFailure's MISSING violations name."""
        missing = set()
        for detail in status.details:
            if not detail.type_url.endswith("google.rpc.PreconditionFailure"):
                continue
            failure = self.details_pb.PreconditionFailure()
            detail.Unpack(failure)
            for v in failure.violations:
                if v.type == "MISSING" and v.subject.startswith("blobs/"):
                    parts = v.subject.split("/")
                    missing.add(parts[-2])
        return missing

    def _operation(self, action: Action, prepared: dict):
        """One Execute and the WaitExecutions that follow its operation to `done`: the stream is
        renewed every POLL_S (to see how long it has been queued) and after UNAVAILABLE (the
        server restarting) for up to RECONNECT_S. Returns the ExecuteResponse; the Execute's
        own refusal is raised as the RpcError."""
        pb, grpc = self.pb, self.grpc
        execute = self.remote._method(_EXEC + "Execute", pb.ExecuteRequest, self.ops_pb.Operation, "read")
        wait = self.remote._method(_EXEC + "WaitExecution", pb.WaitExecutionRequest, self.ops_pb.Operation, "read")
        h, size = prepared["action"]
        request = pb.ExecuteRequest(instance_name=self.remote.instance, action_digest=pb.Digest(hash=h, size_bytes=size),
                                    skip_cache_lookup=self.skip_cache_lookup, digest_function=self.remote.function,
                                    execution_policy=pb.ExecutionPolicy(priority=prepared.get("priority", 0)))
        platform = prepared["platform"]
        queued_since = time.monotonic()
        name, stage, broken_since = "", 0, None
        key = next(self._ids)
        try:
            while True:
                poll = min(POLL_S, max(1.0, self.queue_timeout_s / 4))
                call = (execute(request, timeout=poll) if not name
                        else wait(pb.WaitExecutionRequest(name=name), timeout=poll))
                with self._lock:
                    self._inflight[key] = (call, name)
                if self.stopping:
                    call.cancel()
                try:
                    for op in call:
                        if op.name and op.name != name:
                            name = op.name
                            with self._lock:
                                self._inflight[key] = (call, name)
                        broken_since = None
                        stage = self._stage(op, stage, platform)
                        if op.done:
                            return self._response(op)
                    # The stream ended without `done`: follow the operation again.
                    if not name:
                        raise RemoteFailure("the Execute stream ended before naming its operation")
                except grpc.RpcError as e:
                    code = e.code()
                    if self.stopping:
                        raise RemoteFailure("interrupted") from None
                    if code == grpc.StatusCode.DEADLINE_EXCEEDED and name:
                        self._check_queue(action, name, stage, queued_since, platform)
                        continue
                    if code == grpc.StatusCode.DEADLINE_EXCEEDED and not name:
                        continue  # no operation yet (a slow server): Execute again, it is deduplicated
                    if code == grpc.StatusCode.UNAVAILABLE and name:
                        broken_since = broken_since or time.monotonic()
                        if time.monotonic() - broken_since > RECONNECT_S:
                            raise RemoteFailure(f"the server stayed unavailable for {RECONNECT_S:.0f} s") from None
                        time.sleep(0.5)
                        continue
                    if code == grpc.StatusCode.NOT_FOUND and name:
                        name, stage = "", 0  # the server lost the operation: Execute anew
                        continue
                    raise
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def _stage(self, op, stage: int, platform: tuple) -> int:
        """The operation's stage from its metadata; an action that starts (or ends) is progress
        for every action of its platform (see _check_queue)."""
        meta = self.pb.ExecuteOperationMetadata()
        try:
            if op.metadata.type_url and op.metadata.Unpack(meta):
                stage = meta.stage
        except Exception:  # noqa: BLE001 - metadata that cannot be read tells no stage
            pass
        if stage >= 3 or op.done:  # EXECUTING, COMPLETED
            with self._lock:
                self._progress[platform] = time.monotonic()
        return stage

    def _check_queue(self, action: Action, name: str, stage: int, queued_since: float, platform: tuple) -> None:
        """An operation still QUEUED `queue_timeout_s` after it was sent and after the last
        action of its platform started: no worker matches it. Cancelled, and said so."""
        if stage >= 3:
            return
        with self._lock:
            last = max(queued_since, self._progress.get(platform, 0.0))
        if time.monotonic() - last < self.queue_timeout_s:
            return
        cancel = self._cancel_method()
        try:
            cancel(self.ops_pb.CancelOperationRequest(name=name), timeout=5)
        except self.grpc.RpcError:
            pass
        props = ", ".join(f"{k}={v}" for k, v in platform)
        raise RemoteFailure(f"queued {self.queue_timeout_s:.0f} s and no worker took it: no worker of "
                            f"{self.url} seems to match the platform {props}")

    def _response(self, op):
        """The ExecuteResponse of a finished operation (an operation error as its status)."""
        response = self.pb.ExecuteResponse()
        if op.HasField("error"):
            response.status.CopyFrom(op.error)
            return response
        try:
            unpacked = op.response.Unpack(response)
        except Exception as e:  # noqa: BLE001 - undecodable (a name that is not UTF-8): the server's fault
            raise RemoteFailure(f"refused the server's result: its ExecuteResponse cannot be read ({e})"[:300]) from None
        if not unpacked:
            raise RemoteFailure(f"refused the server's result: the operation holds a {op.response.type_url[:100]!r}, "
                                "not an ExecuteResponse")
        return response

    # -- outputs ---------------------------------------------------------------------------------
    def _fetched(self, action: Action, response, wall_s: float) -> Callable[[], tuple[Tree, ActionResult]]:
        """The remote result taken into the local CAS: a non-zero exit or a missing output is the
        action's failure (as locally); a result of the wrong shape (results.py) or whose blobs
        do not match it is a RemoteFailure, and nothing of it is stored; otherwise `store`,
        which returns the tree and result."""
        try:
            return self._take(action, response, wall_s)
        except (BadResult, FetchError, ValueError) as e:
            raise RemoteFailure(f"refused the server's result: {e}"[:400]) from None
        finally:
            downloaded = self.fetcher.take_downloaded()
            with self._lock:
                self.stats["downloaded_bytes"] += downloaded

    def _take(self, action: Action, response, wall_s: float) -> Callable[[], tuple[Tree, ActionResult]]:
        result = response.result
        if response.cached_result and not self.accept_cached:
            raise BadResult("the server answered from its action cache, which this client did not ask for "
                            "(--remote-accept-cached)")
        with self._lock:
            self.stats["cached" if response.cached_result else "executed"] += 1
        stdout = self.fetcher.log(result.stdout_raw, self._log_digest(result, "stdout"))
        stderr = self.fetcher.log(result.stderr_raw, self._log_digest(result, "stderr"))
        if result.exit_code != 0:
            from build_graph.sandbox import _tail
            worker = result.execution_metadata.worker or "a remote worker"
            raise ActionFailed(f"exited with status {result.exit_code} (on {worker[:200]})\n"
                               f"{_tail(stdout[-65536:] + stderr[-65536:])}", where=action.name)
        tree = self._output_tree(action, result)
        whole = action.outputs == (".",)
        if not whole:
            missing = [o for o in action.outputs if o not in tree.entries
                       and not any(p.startswith(o + "/") for p in tree.entries)]
            if missing:
                from build_graph.sandbox import _tail
                raise ActionFailed(f"declared outputs missing: {', '.join(missing)}\n{_tail(stderr[-65536:])}",
                                   where=action.name)
        meta = result.execution_metadata
        duration = wall_s
        if meta.HasField("execution_start_timestamp") and meta.HasField("execution_completed_timestamp"):
            duration = (meta.execution_completed_timestamp.ToNanoseconds()
                        - meta.execution_start_timestamp.ToNanoseconds()) / 1e9

        def store() -> tuple[Tree, ActionResult]:
            if self.stopping:
                raise ActionFailed("interrupted", where=action.name)
            return tree, ActionResult(
                output_tree=self.cas.put_tree(tree), exit_code=0, stdout=self.cas.put_bytes(stdout).digest,
                stderr=self.cas.put_bytes(stderr).digest, duration_s=round(max(duration, 0.0), 3),
                output_entries=len(tree))
        # the result's origin, filed with it (store/origins.py): run there, or its cache's answer
        store.made_by = (EXECUTOR_CACHE if response.cached_result else EXECUTED, self.url)
        return store

    @staticmethod
    def _log_digest(result, which: str):
        """stdout's or stderr's digest, checked where the result names one."""
        digest = getattr(result, f"{which}_digest")
        if digest.hash:
            check_digest(digest, which)
        return digest

    def declared(self, action: Action) -> tuple[dict[str, str], set[str]]:
        """The output paths the Command declared, as the server may write each back (as sent, or
        normalised: `.` for the working directory) -> its path in the output directory; and
        those of the client's own marker (dropped)."""
        named, ignored = {}, set()
        for path in [*output_paths(action), *self._whole_out(action)]:
            rel = out_relative(action, path)
            for spelling in {path, posixpath.normpath(path) if path else "."}:
                named[spelling] = rel
                if rel == WRITABLE_MARK:
                    ignored.add(spelling)
        return named, ignored

    def _load_tree(self, output: str, digest: tuple[str, int]):
        """An output directory's Tree message and its Directories by digest (those it does not
        carry read by digest), within MAX_TREE_BYTES in all."""
        pb = self.pb
        h, size = digest
        data = self.fetcher.message_bytes(h, size, MAX_TREE_BYTES)
        try:
            message = pb.Tree.FromString(data)
        except Exception:  # noqa: BLE001 - a blob that is no Tree is the server's fault
            raise BadResult(f"output directory {output!r}: blob {h[:16]}… is not a Tree") from None
        directories = {self.encoder.hash(c.SerializeToString(deterministic=True)): c for c in message.children}
        budget = MAX_TREE_BYTES - size
        seen: set[str] = set()
        frontier = [message.root]
        while frontier:  # each distinct Directory once; those the Tree lacks (encoded otherwise) read by digest
            following, unknown = [], {}
            for directory in frontier:
                for node in directory.directories:
                    dh, dsize = check_digest(node.digest, f"output directory {output!r}", len(h))
                    if dh in seen:
                        continue
                    seen.add(dh)
                    if dh in directories:
                        following.append(directories[dh])
                    else:
                        unknown[dh] = dsize
            if unknown:
                if sum(unknown.values()) > budget:
                    raise BadResult(f"output directory {output!r} names directories of more than "
                                    f"{MAX_TREE_BYTES} bytes")
                budget -= sum(unknown.values())
                for dh, data in self.fetcher.small(unknown).items():
                    try:
                        directories[dh] = pb.Directory.FromString(data)
                    except Exception:  # noqa: BLE001
                        raise BadResult(f"output directory {output!r}: blob {dh[:16]}… is not a Directory") from None
                    following.append(directories[dh])
            frontier = following
        return message, directories

    def _output_tree(self, action: Action, result) -> Tree:
        """The result's outputs as a tree of the output directory, checked whole first
        (results.ResultChecker), then every file fetched into the local CAS: what the local
        runner's ingest of the same directory gives (files, symlinks, empty directories)."""
        named, ignored = self.declared(action)
        checked = ResultChecker(named, ignored, self._load_tree, len(self.encoder.hash(b""))).check(result)
        entries = checked.entries
        entries.pop(WRITABLE_MARK, None)
        files = {p: e for p, e in entries.items() if isinstance(e, RemoteFile)}
        stored = self.fetcher.files({(e.hash, e.executable): e.size for e in files.values()})
        for path, remote in files.items():
            entry = stored[(remote.hash, remote.executable)]
            if self.digest_map is not None:  # this output may be a later remote action's input
                with self.digest_map._lock:
                    self.digest_map.table.set(entry.digest, remote.hash)
            entries[path] = entry
        return Tree(entries)


class Window:
    """The Executes in flight: at most `limit`, which halves when the server says it is busy
    (RESOURCE_EXHAUSTED: BuildGrid serves thread-pool-size RPCs at once, every open Execute
    stream holds one, and its workers need some to fetch inputs) and grows back by one per
    `limit` operations done, up to --remote-jobs (TCP's additive increase, multiplicative
    decrease)."""

    def __init__(self, most: int):
        self.most, self.limit, self.n = most, float(most), 0
        self._cond = threading.Condition()

    def __enter__(self) -> "Window":
        with self._cond:
            while self.n >= max(1, int(self.limit)):
                self._cond.wait()
            self.n += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self.n -= 1
            self._cond.notify_all()

    def busy(self) -> None:
        with self._cond:
            self.limit = max(1.0, min(self.limit, float(self.n)) / 2)

    def done(self) -> None:
        with self._cond:
            self.limit = min(float(self.most), self.limit + 1 / self.limit)
            self._cond.notify_all()


def _code_name(grpc, code: int) -> str:
    for c in grpc.StatusCode:
        if c.value[0] == code:
            return c.name
    return str(code)
