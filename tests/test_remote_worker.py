"""`bgraph worker` against the real engine: PostgreSQL, BuildGrid 0.9.1 with execution, and two
workers, started once for this module on 127.0.0.1. A small Execute client here uploads an
Action, its Command and an input root (the host's /bin/sh, a few tools and their libraries, laid
out merged-/usr as on Debian), calls Execute and reads the Operation stream, as REAPI clients do."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from remote_exec_servers import ExecStack, missing_reason, wait_until

from build_graph.model import Tree
from build_graph.remote_exec.worker import SANDBOX_VERSION

TOOLS = ("/bin/sh", "/bin/cat", "/bin/sleep", "/bin/mkdir", "/bin/grep", "/bin/ls", "/usr/bin/env", "/bin/rmdir",
         "/bin/ln", "/usr/bin/mkfifo", "/usr/bin/truncate")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    s = ExecStack(tmp_path_factory.mktemp("exec"), workers=2)
    try:
        yield s
    finally:
        s.stop()


# -- a small REAPI client ---------------------------------------------------------------------
class Client:
    """Upload, Execute, read the operation stream, cancel: what a REAPI client does."""

    def __init__(self, url: str):
        from google.longrunning import operations_pb2

        from build_graph.store.reapi import reapi_pb2 as pb
        from build_graph.store.reapi_remote import ReapiRemote
        from build_graph.store.remote import CircuitBreaker

        self.pb, self.ops = pb, operations_pb2
        self.cas = ReapiRemote(url, "sha256", timeout_s=30, breaker=CircuitBreaker(limit=1 << 30))
        self.blobs: dict[str, bytes] = {}
        ch = self.cas.channel
        self._execute = ch.unary_stream("/build.bazel.remote.execution.v2.Execution/Execute",
                                        request_serializer=pb.ExecuteRequest.SerializeToString,
                                        response_deserializer=operations_pb2.Operation.FromString)
        self._cancel = ch.unary_unary("/google.longrunning.Operations/CancelOperation",
                                      request_serializer=operations_pb2.CancelOperationRequest.SerializeToString,
                                      response_deserializer=lambda b: b)

    def blob(self, data: bytes):
        """The digest of `data`, kept for upload."""
        h = hashlib.sha256(data).hexdigest()
        self.blobs[h] = data
        return self.pb.Digest(hash=h, size_bytes=len(data))

    def message(self, msg):
        return self.blob(msg.SerializeToString())

    def directory(self, files: dict[str, tuple[bytes, bool]], links: dict[str, str], skip: set[str] = frozenset()):
        """The Merkle tree of `files` (path -> (data, executable)) and `links` (path -> target);
        paths in `skip` are named but their blobs never uploaded (a missing input)."""
        pb = self.pb
        tree: dict = {}
        for path, value in [*files.items(), *links.items()]:
            parts = path.split("/")
            node = tree
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = (path, value)

        def build(node: dict):
            d = pb.Directory()
            for name in sorted(node):
                value = node[name]
                if isinstance(value, dict):
                    d.directories.add(name=name, digest=self.message(build(value)))
                elif isinstance(value[1], str):
                    d.symlinks.add(name=name, target=value[1])
                else:
                    data, executable = value[1]
                    digest = self.blob(data)
                    if value[0] in skip:
                        del self.blobs[digest.hash]
                    d.files.add(name=name, digest=digest, is_executable=executable)
            return d
        return self.message(build(tree))

    def action(self, argv: list[str], outputs: list[str], files=None, links=None, timeout_s: float | None = None,
               env: dict[str, str] | None = None, skip: set[str] = frozenset(), properties=None,
               working_directory: str = ""):
        """Upload an Action running `argv` over the host tools' root plus `files`; its digest."""
        pb = self.pb
        root_files, root_links = host_root()
        root_files.update(files or {})
        root_links.update(links or {})
        command = pb.Command(arguments=argv, output_paths=outputs, working_directory=working_directory)
        for k, v in sorted((env or {"PATH": "/usr/bin:/bin"}).items()):
            command.environment_variables.add(name=k, value=v)
        action = pb.Action(command_digest=self.message(command),
                           input_root_digest=self.directory(root_files, root_links, skip))
        if timeout_s:
            action.timeout.FromNanoseconds(int(timeout_s * 1e9))
        props = properties or {"OSFamily": "Linux", "ISA": "x86-64" if os.uname().machine == "x86_64"
                               else "aarch64", "bgraph-sandbox": SANDBOX_VERSION}
        for k, v in sorted(props.items()):
            action.platform.properties.add(name=k, value=v)
        digest = self.message(action)
        self.cas.put_blobs({h: self.blobs[h] for h in self.cas.find_missing(
            {h: len(b) for h, b in self.blobs.items()})})
        return digest

    def execute(self, digest, skip_cache: bool = True, on_stage=None, timeout_s: float = 120):
        """Execute and follow the stream to `done`: (ExecuteResponse, stages seen, operation name)."""
        pb = self.pb
        stages, name = [], None
        for op in self._execute(pb.ExecuteRequest(action_digest=digest, skip_cache_lookup=skip_cache),
                                timeout=timeout_s):
            name = op.name
            meta = pb.ExecuteOperationMetadata()
            if op.metadata.Unpack(meta):
                stages.append(meta.stage)
                if on_stage is not None:
                    on_stage(op.name, meta.stage)
            if op.done:
                assert not op.HasField("error"), op.error
                response = pb.ExecuteResponse()
                assert op.response.Unpack(response)
                return response, stages, name
        raise AssertionError(f"stream ended without done (stages {stages})")

    def wait_execution(self, name: str, timeout_s: float = 120):
        """WaitExecution(name) to `done`, retried while the server is unavailable: the ExecuteResponse."""
        import grpc

        pb = self.pb
        wait = self.cas.channel.unary_stream("/build.bazel.remote.execution.v2.Execution/WaitExecution",
                                             request_serializer=pb.WaitExecutionRequest.SerializeToString,
                                             response_deserializer=self.ops.Operation.FromString)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                for op in wait(pb.WaitExecutionRequest(name=name), timeout=max(1.0, deadline - time.time())):
                    if op.done:
                        response = pb.ExecuteResponse()
                        assert op.response.Unpack(response), op
                        return response
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                time.sleep(0.5)
        raise AssertionError(f"operation {name} not done after {timeout_s:g} s")

    def cancel(self, name: str) -> None:
        self._cancel(self.ops.CancelOperationRequest(name=name), timeout=10)

    def read(self, digest) -> bytes:
        return self.cas.get_blobs({digest.hash: digest.size_bytes})[digest.hash]


_ROOT: tuple[dict, dict] | None = None


def host_root() -> tuple[dict, dict]:
    """The host's TOOLS and their shared libraries as input-root files, with every symlink on the
    way (Debian's merged /usr: bin -> usr/bin, lib64 -> usr/lib64 ...) kept as a symlink."""
    global _ROOT
    if _ROOT is None:
        files: dict[str, tuple[bytes, bool]] = {}
        links: dict[str, str] = {}
        wanted = set(TOOLS)
        for tool in TOOLS:
            out = subprocess.run(["ldd", tool], check=False, capture_output=True, text=True).stdout
            for line in out.splitlines():
                for word in line.split():
                    if word.startswith("/"):
                        wanted.add(word)
        for path in sorted(wanted):
            _add_host_path(path, files, links)
        _ROOT = files, links
    return dict(_ROOT[0]), dict(_ROOT[1])


def _add_host_path(path: str, files: dict, links: dict, depth: int = 0) -> None:
    assert depth < 20, path
    parts = path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        sub = "/" + "/".join(parts[:i])
        if os.path.islink(sub):
            target = os.readlink(sub)
            links[sub[1:]] = target
            resolved = os.path.normpath(os.path.join(os.path.dirname(sub), target))
            rest = "/".join(parts[i:])
            _add_host_path(resolved + ("/" + rest if rest else ""), files, links, depth + 1)
            return
    files[path[1:]] = (Path(path).read_bytes(), os.access(path, os.X_OK))


def marked_pids(marker: str) -> set[int]:
    """Host processes whose command line holds `marker`."""
    found = set()
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmd:
                found.add(int(d))
    return found


def sh(script: str, *extra: str) -> list[str]:
    return ["/bin/sh", "-c", script, "sh", *extra]


# -- tests ------------------------------------------------------------------------------------
def test_runs_a_process_and_returns_its_outputs(stack):
    c = Client(stack.url)
    data = f"input {uuid.uuid4()}\n".encode()
    digest = c.action(sh("cat /bgraph/in/data > bgraph/out/a/copy; mkdir bgraph/out/d; echo inner > bgraph/out/d/f;"
                         " echo to-stdout; echo to-stderr >&2"),
                      ["bgraph/out/a/copy", "bgraph/out/d", "bgraph/out/never"],
                      files={"bgraph/in/data": (data, False)}, links={"bgraph/out/.keep": "x"})
    response, stages, _ = c.execute(digest)
    assert response.status.code == 0, response.status
    result = response.result
    assert result.exit_code == 0
    files = {f.path: f for f in result.output_files}
    assert set(files) == {"bgraph/out/a/copy"}  # bgraph/out/never was not made: absent, no error
    assert c.read(files["bgraph/out/a/copy"].digest) == data
    assert [d.path for d in result.output_directories] == ["bgraph/out/d"]
    tree = c.pb.Tree.FromString(c.read(result.output_directories[0].tree_digest))
    assert [f.name for f in tree.root.files] == ["f"]
    assert c.read(tree.root.files[0].digest) == b"inner\n"
    assert c.read(result.stdout_digest) == b"to-stdout\n"
    assert c.read(result.stderr_digest) == b"to-stderr\n"
    assert result.execution_metadata.worker.split("/")[0] in ("w0", "w1")
    assert c.pb.ExecutionStage.EXECUTING in stages


def test_whole_output_directory_is_writable_itself_and_inputs_keep_the_stores_modes(stack):
    """Output path "" in working directory bgraph/out (bgraph's whole-output action): only
    /bgraph/out is writable, /bgraph takes new entries, an input stays a read-only mount, and
    what the root held in bgraph/out is there as the store lays files out (0444/0555, 1980)."""
    c = Client(stack.url)
    digest = c.action(sh("ls -l --time-style=+%s staged.txt tool > listing; "
                         "if (: >> /bgraph/in/data) 2>/dev/null; then echo in-writable; else echo in-read-only; fi"
                         " >> listing; mkdir /bgraph/new && echo bgraph-takes-entries >> listing; "
                         "ls -ld --time-style=+%s /bgraph/in/data >> listing"),
                      [""], working_directory="bgraph/out",
                      files={"bgraph/in/data": (b"d\n", False), "bgraph/out/staged.txt": (b"s\n", False),
                             "bgraph/out/tool": (b"#!/bin/sh\n", True)})
    response, _stages, _ = c.execute(digest)
    assert response.status.code == 0, response.status
    result = response.result
    assert result.exit_code == 0, c.read(result.stderr_digest)
    assert [d.path for d in result.output_directories] == ["."] and not result.output_files
    tree = c.pb.Tree.FromString(c.read(result.output_directories[0].tree_digest))
    files = {f.name: f for f in tree.root.files}
    assert set(files) == {"listing", "staged.txt", "tool"} and files["tool"].is_executable
    lines = [line.split() for line in c.read(files["listing"].digest).decode().splitlines()]
    assert [(w[0], w[5], w[6]) for w in lines[:2]] == [("-r--r--r--", "315532800", "staged.txt"),
                                                       ("-r-xr-xr-x", "315532800", "tool")], lines
    assert lines[2:4] == [["in-read-only"], ["bgraph-takes-entries"]], lines
    assert (lines[4][0], lines[4][5]) == ("-r--r--r--", "315532800"), lines


def test_sandbox_has_no_capability_and_no_host(stack):
    c = Client(stack.url)
    probe = ("grep CapEff /proc/self/status > bgraph/out/caps; ls / > bgraph/out/root;"
             " (echo x > /proc/sys/kernel/hostname) 2> /dev/null && echo writable > bgraph/out/proc || true;"
             " (echo x > /usr/bin/cat) 2> /dev/null && echo writable > bgraph/out/usr || true;"
             " env > bgraph/out/env")
    digest = c.action(sh(probe), ["bgraph/out/caps", "bgraph/out/root", "bgraph/out/proc", "bgraph/out/usr",
                                  "bgraph/out/env"], env={"PATH": "/usr/bin:/bin", "ONLY": "this"})
    response, _, _ = c.execute(digest)
    assert response.status.code == 0, response.status
    out = {f.path: c.read(f.digest).decode() for f in response.result.output_files}
    assert out["bgraph/out/caps"].split() == ["CapEff:", "0000000000000000"]
    assert set(out["bgraph/out/root"].split()) == {"bgraph", "bin", "dev", "lib", "lib64", "proc", "tmp", "usr"}
    assert "bgraph/out/proc" not in out and "bgraph/out/usr" not in out  # read-only /proc and inputs
    env = dict(line.split("=", 1) for line in out["bgraph/out/env"].splitlines())
    assert env.get("ONLY") == "this" and "HOME" not in env and "PYTHONPATH" not in env


def test_non_zero_exit_is_an_ordinary_cached_result(stack):
    c = Client(stack.url)
    digest = c.action(sh(f"echo {uuid.uuid4()} > bgraph/out/x; exit 3"), ["bgraph/out/x"])
    response, _, _ = c.execute(digest)
    assert response.status.code == 0 and response.result.exit_code == 3
    assert [f.path for f in response.result.output_files] == ["bgraph/out/x"]
    again, _, _ = c.execute(digest, skip_cache=False)
    assert again.cached_result and again.result.exit_code == 3


def test_missing_input_blob_is_failed_precondition_missing(stack):
    from google.rpc import error_details_pb2

    c = Client(stack.url)
    data = f"never uploaded {uuid.uuid4()}".encode()
    digest = c.action(sh("cat /bgraph/in/gone > bgraph/out/x"), ["bgraph/out/x"],
                      files={"bgraph/in/gone": (data, False)}, skip={"bgraph/in/gone"})
    response, _, _ = c.execute(digest)
    assert response.status.code == 9, response.status  # FAILED_PRECONDITION
    failure = error_details_pb2.PreconditionFailure()
    assert response.status.details[0].Unpack(failure)
    want = f"blobs/{hashlib.sha256(data).hexdigest()}/{len(data)}"
    assert [(v.type, v.subject) for v in failure.violations] == [("MISSING", want)]


def test_timeout_is_deadline_exceeded_and_kills_the_action(stack):
    c = Client(stack.url)
    marker = f"timeout-{uuid.uuid4().hex}"
    digest = c.action(sh("sleep 60; echo late > bgraph/out/x", marker), ["bgraph/out/x"], timeout_s=1.0)
    start = time.time()
    response, _, _ = c.execute(digest)
    assert response.status.code == 4, response.status  # DEADLINE_EXCEEDED
    assert time.time() - start < 30
    wait_until(lambda: not marked_pids(marker), 10, "the timed-out action's processes to end")


def test_cancelled_lease_kills_the_action(stack):
    c = Client(stack.url)
    marker = f"cancel-{uuid.uuid4().hex}"
    digest = c.action(sh("sleep 120", marker), ["bgraph/out/x"])

    def on_stage(name, stage):
        if stage == c.pb.ExecutionStage.EXECUTING:
            wait_until(lambda: marked_pids(marker), 20, "the action to start")
            c.cancel(name)
    with pytest.raises(Exception) as caught:  # the stream ends CANCELLED, or done with CANCELLED
        response, _, _ = c.execute(digest, on_stage=on_stage)
        assert response.status.code == 1, response.status
        raise RuntimeError("cancelled")
    assert "cancel" in str(caught.value).lower() or "CANCELLED" in repr(caught.value)
    # The worker sees the cancellation at its next heartbeat (1 s in these tests) and kills it.
    wait_until(lambda: not marked_pids(marker), 15, "the cancelled action's processes to be killed")


def test_worker_killed_mid_lease_is_requeued_to_the_other_without_orphans(stack):
    c = Client(stack.url)
    marker = f"killed-{uuid.uuid4().hex}"
    digest = c.action(sh("sleep 3; echo done > bgraph/out/x", marker), ["bgraph/out/x"])
    victim: dict = {}

    def on_stage(name, stage):
        if stage == c.pb.ExecutionStage.EXECUTING and not victim:
            pids = wait_until(lambda: marked_pids(marker), 20, "the action to start")
            worker = next(w for w in stack.workers if w.proc.poll() is None and _descends(pids, w.proc.pid))
            victim.update(worker=worker, pids=pids)
            worker.kill()
    response, _, _ = c.execute(digest, on_stage=on_stage, timeout_s=120)
    assert victim, "the action never started"
    assert response.status.code == 0 and response.result.exit_code == 0
    killed_name = victim["worker"].root.name
    assert not response.result.execution_metadata.worker.startswith(killed_name + "/")
    assert not any(_alive(p) for p in victim["pids"]), "the killed worker's action outlived it"
    leases = victim["worker"].root / "leases"
    left = list(leases.glob("slot-*/lease-*"))
    assert left, "the killed worker's lease directory is expected on disk (SIGKILL cleans nothing)"
    # Restarted under the same name (the same bot), it first purges what its killed self left.
    stack.workers.remove(victim["worker"])
    back = stack.add_worker(killed_name)
    wait_until(lambda: not any(leases.glob("slot-*/lease-*")), 30, "the restarted worker to purge old leases")
    assert back.proc.poll() is None


def _run_and_hit_worker(stack, c, marker: str, hit) -> tuple[object, dict, float]:
    """Execute a 3 s action; once it runs, call hit(worker) on the worker running it. The
    response, what was hit, and the seconds from the hit to `done`."""
    digest = c.action(sh("sleep 3; echo done > bgraph/out/x", marker), ["bgraph/out/x"])
    victim: dict = {}

    def on_stage(name, stage):
        if stage == c.pb.ExecutionStage.EXECUTING and not victim:
            pids = wait_until(lambda: marked_pids(marker), 20, "the action to start")
            worker = next(w for w in stack.workers if w.proc.poll() is None and _descends(pids, w.proc.pid))
            victim.update(worker=worker, pids=pids, at=time.time())
            hit(worker)
    response, _, _ = c.execute(digest, on_stage=on_stage, timeout_s=120)
    assert victim, "the action never started"
    return response, victim, time.time() - victim["at"]


def test_worker_stopped_hands_its_lease_back_at_once(stack):
    """SIGTERM: the worker kills its action and completes the lease UNAVAILABLE, which BuildGrid
    queues again at once (not after the 10 s keepalive); the worker exits 0."""
    c = Client(stack.url)
    marker = f"stopped-{uuid.uuid4().hex}"
    response, victim, _after = _run_and_hit_worker(stack, c, marker, lambda w: w.proc.terminate())
    assert response.status.code == 0 and response.result.exit_code == 0
    assert victim["worker"].proc.wait(timeout=20) == 0
    # When the other worker started it: requeued by expiry instead, no sooner than 9 s after the
    # signal (the session, updated each second, expires 9-10 s after it).
    started = _seconds(response.result.execution_metadata.worker_start_timestamp) - victim["at"]
    assert started < 7, f"run again only {started:.1f} s after the signal: the lease was not handed back"
    assert not any(_alive(p) for p in victim["pids"])
    name = victim["worker"].root.name
    stack.workers.remove(victim["worker"])
    stack.add_worker(name)


def test_worker_restarted_under_its_name_gets_its_job_requeued_at_once(stack):
    """SIGKILL and an immediate restart with the same bot ids: the new CreateBotSession closes the
    old session and BuildGrid queues its job again at once (REMOTE-EXEC.md fault 2)."""
    c = Client(stack.url)
    marker = f"restarted-{uuid.uuid4().hex}"

    def kill_and_restart(worker):
        worker.kill()
        stack.workers.remove(worker)
        stack.add_worker(worker.root.name)
    response, victim, _after = _run_and_hit_worker(stack, c, marker, kill_and_restart)
    assert response.status.code == 0 and response.result.exit_code == 0
    assert not any(_alive(p) for p in victim["pids"])
    # The job runs again right after the restarted worker's first session (its CreateBotSession
    # closed the old one). Expiry would requeue it 9-10 s after the kill: where the restart itself
    # took that long (a loaded machine), the two cannot be told apart.
    back = next(w for w in stack.workers if w.root.name == victim["worker"].root.name)
    session_at = _first_session(back.log)
    if session_at - victim["at"] > 7:
        pytest.skip(f"the restarted worker took {session_at - victim['at']:.1f} s to make its session: "
                    "too close to the 10 s expiry to tell which requeued the job")
    started = _seconds(response.result.execution_metadata.worker_start_timestamp)
    assert started - victim["at"] < 9, (f"run again {started - victim['at']:.1f} s after the kill, "
                                        f"{started - session_at:.1f} s after the restarted session")


def _seconds(ts) -> float:
    return ts.seconds + ts.nanos / 1e9


def _first_session(log: Path) -> float:
    """When the worker logging to `log` (appended to by each start) last asked for a session."""
    import datetime

    lines = [line for line in log.read_text(errors="replace").splitlines() if line.endswith(": CreateBotSession")]
    stamp = lines[-1].split(" bgraph.worker")[0]
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie (dead, not yet reaped by whoever inherited it: this machine's
    PID 1 reaps late) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _descends(pids: set[int], ancestor: int) -> bool:
    """Whether any of `pids` has `ancestor` among its parents."""
    for pid in pids:
        p = pid
        for _ in range(64):
            try:
                stat = Path(f"/proc/{p}/stat").read_text()
            except OSError:
                break
            p = int(stat.rsplit(")", 1)[1].split()[1])
            if p == ancestor:
                return True
            if p <= 1:
                break
    return False


def test_big_input_and_output_go_through_bytestream(stack):
    """Blobs above the 4 MiB batch limit: read by the worker and uploaded by it with ByteStream."""
    c = Client(stack.url)
    big = os.urandom(5 << 20) + uuid.uuid4().bytes
    digest = c.action(sh("cat /bgraph/in/big /bgraph/in/big > bgraph/out/twice"), ["bgraph/out/twice"],
                      files={"bgraph/in/big": (big, False)})
    response, _, _ = c.execute(digest)
    assert response.status.code == 0, response.status
    (out,) = response.result.output_files
    assert out.digest.size_bytes == 2 * len(big)
    assert c.read(out.digest) == big + big


def test_bad_actions_are_refused_with_a_clear_status(stack):
    """An output with no parent directory is INVALID_ARGUMENT; another sandbox version is refused."""
    c = Client(stack.url)
    top = c.action(sh("echo x > x"), ["x"])
    response, _, _ = c.execute(top)
    assert response.status.code == 3 and "top level" in response.status.message
    other = c.action(sh("true"), ["bgraph/out/x"], properties={"OSFamily": "Linux", "ISA": "x86-64"
                                                                if os.uname().machine == "x86_64" else "aarch64",
                                                                "bgraph-sandbox": "bwrap-v0"})
    response, _, _ = c.execute(other)
    assert response.status.code == 9 and "bwrap-v0" in response.status.message


def test_output_below_a_symlink_the_action_made_is_refused(stack):
    """An action that turns an output's parent into a symlink to a host directory gets
    INVALID_ARGUMENT: the worker never reads the host through it."""
    c = Client(stack.url)
    digest = c.action(sh("rmdir bgraph/out/etc && ln -s /etc bgraph/out/etc"),
                      ["bgraph/out/x", "bgraph/out/etc/passwd"])
    response, _, _ = c.execute(digest)
    assert response.status.code == 3 and "symlink" in response.status.message, response.status
    assert not response.result.output_files


def test_second_worker_on_one_work_dir_is_one_clear_error(stack):
    """Its purge would remove the first one's running leases: refused, one line and a hint."""
    import sys

    first = stack.workers[0]
    out = subprocess.run([sys.executable, "-m", "build_graph", "worker", "--server", stack.url, "--work-dir",
                          str(first.root / "leases"), "--cache", str(first.root / "other-cache")],
                         check=False, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 2, out.stderr
    assert "another bgraph worker uses the work directory" in out.stderr and "Traceback" not in out.stderr
    assert first.proc.poll() is None


def test_writable_dirs_and_mounts(tmp_path):
    """Outputs' parents: the outermost ones only. The mounts: a top-level directory whole, one
    holding the outputs' directory and bgraph/in split, what lies below the outputs' directory
    given to be copied, a top-level /proc refused. (Every blob is in the worker's own CAS here:
    the server is never asked, so none is given.)"""
    from types import SimpleNamespace

    from build_graph.model import Digester, DirEntry, FileEntry, SymlinkEntry
    from build_graph.remote_exec.staging import BadInput, Stager, writable_dirs
    from build_graph.store.cas import LocalCas
    from build_graph.store.reapi import reapi_pb2 as pb

    assert writable_dirs(["bgraph/out/a", "bgraph/out/d/b", "other/x/y"]) == ["other/x", "bgraph/out"]
    # An output that is a directory of the root (a whole-output action's working directory) is
    # writable itself, not its parent: /bgraph keeps its read-only mounts, as locally.
    assert writable_dirs(["bgraph/out"], {"bgraph/out"}) == ["bgraph/out"]
    assert writable_dirs(["bgraph/out", "bgraph/out/a/b"], {"bgraph/out"}) == ["bgraph/out"]
    assert writable_dirs(["bgraph/out"]) == ["bgraph"]
    with pytest.raises(BadInput):
        writable_dirs(["x"])
    cas = LocalCas(tmp_path / "cache", Digester("sha256"))

    def blob(data: bytes):
        e = cas.put_bytes(data)
        return pb.Digest(hash=e.digest, size_bytes=e.size)

    def directory(files=(), dirs=(), links=()):
        d = pb.Directory()
        for name, data, x in sorted(files):  # REAPI: each list sorted by name
            d.files.add(name=name, digest=blob(data), is_executable=x)
        for name, sub in sorted(dirs, key=lambda x: x[0]):
            d.directories.add(name=name, digest=blob(sub.SerializeToString()))
        for name, target in sorted(links):
            d.symlinks.add(name=name, target=target)
        return d
    usr = directory(dirs=[("bin", directory(files=[("sh", b"elf", True)]))])
    bgraph = directory(dirs=[("src", directory(files=[("a.c", b"int a;", False)])),
                             ("in", directory(dirs=[("dep1", directory(files=[("o", b"1", False)])),
                                                    ("dep2", directory(files=[("o", b"2", False)]))])),
                             ("out", directory(dirs=[("sub", directory())], links=[("l", "/bgraph/src/a.c")]))])
    root = blob(directory(dirs=[("usr", usr), ("bgraph", bgraph)], links=[("bin", "usr/bin")]).SerializeToString())
    stager = Stager(SimpleNamespace(pb=pb), cas)
    got = stager.mounts(root, ["bgraph/out"])
    kinds = [(op[0], op[2] if op[0] == "symlink" else op[1]) for op in got.ops]
    assert kinds == [("symlink", "bin"), ("dir", "bgraph"), ("dir", "bgraph/in"), ("tree", "bgraph/in/dep1"),
                     ("tree", "bgraph/in/dep2"), ("tree", "bgraph/src"), ("tree", "usr")]
    usr_tree = next(op[2] for op in got.ops if op[1] == "usr")
    assert usr_tree.entries == {"bin/sh": FileEntry(usr_tree.entries["bin/sh"].digest, 3, True)}
    assert got.writable == {"bgraph/out": {"l": SymlinkEntry("/bgraph/src/a.c"), "sub": DirEntry()}}
    assert stager.directories(root, ["bgraph/out", "bgraph/out/l", "bgraph/src/a.c", "usr/bin", "nope/x"]) \
        == {"bgraph/out", "usr/bin"}
    # The same subtree in another lease is the same Tree object: laid out and hashed once.
    assert next(op[2] for op in stager.mounts(root, ["bgraph/out"]).ops if op[1] == "usr") is usr_tree
    with pytest.raises(BadInput):
        stager.mounts(blob(directory(dirs=[("proc", directory())]).SerializeToString()), [])
    cas.close()


def test_materialized_trees_are_bounded_and_made_again(tmp_path):
    """Trees no lease uses go beyond KEEP, least recently used first; one in use stays; a removed
    one is laid out again when asked for (LocalCas must not hand out the removed path)."""
    from build_graph.model import Digester
    from build_graph.remote_exec.trees import TreeCache
    from build_graph.store.cas import LocalCas

    cas = LocalCas(tmp_path / "cache", Digester("sha256"))
    trees = [Tree({f"f{i}": cas.put_bytes(f"blob {i}".encode())}) for i in range(3)]
    cache = TreeCache(cas, keep=2)
    held = cache.take(trees[0])
    first = cache.take(trees[1])
    cache.give_back([first.name])
    assert held.exists() and first.exists()  # two trees: not over KEEP
    second = cache.take(trees[2])
    cache.give_back([second.name])
    assert not first.exists() and held.exists()  # the idle, least recently used one went
    cache.give_back([held.name])
    again = cache.take(trees[1])
    assert again == first and (again / "f1").read_bytes() == b"blob 1"
    cas.close()


def test_idle_worker_stops_at_once(stack):
    """SIGTERM to a worker waiting in its long polls: it leaves them and exits 0 within a second
    or two, not after the server's poll time (8 s here)."""
    w = stack.add_worker("idle", slots=2)
    try:
        wait_until(lambda: w.log.read_text(errors="replace").count(": session ") >= 2, 60,
                   "both bots of the idle worker to have sessions")
        time.sleep(1.0)  # inside a long poll now
        start = time.time()
        w.proc.terminate()
        assert w.proc.wait(timeout=30) == 0
        assert time.time() - start < 4, f"took {time.time() - start:.1f} s to stop"
    finally:
        w.stop()
        stack.workers.remove(w)


def test_bounded_cache_is_emptied_between_leases(stack):
    """--max-cache 1M: a lease that brings 5 MiB into the worker's cache leaves it emptied, and the
    next lease needing the same input fetches it again and runs. The module's two workers are
    stopped meanwhile so that the bounded one takes the jobs, and started again after."""
    from build_graph.remote_exec.cache_bound import parse_size, tree_bytes

    assert parse_size("1M") == 1 << 20 and parse_size("2.5G") == int(2.5 * (1 << 30))
    names = [w.root.name for w in stack.workers]
    for w in list(stack.workers):
        w.stop()
        stack.workers.remove(w)
    bounded = stack.add_worker("bounded", extra=("--max-cache", "1M"))
    try:
        c = Client(stack.url)
        big = os.urandom(5 << 20)
        for i in range(2):
            digest = c.action(sh(f"cat /bgraph/in/big > bgraph/out/copy; echo {i} {uuid.uuid4()}"),
                              ["bgraph/out/copy"], files={"bgraph/in/big": (big, False)})
            response, _, _ = c.execute(digest)
            assert response.status.code == 0 and response.result.exit_code == 0, response.status
            assert response.result.execution_metadata.worker == "bounded/0"
            assert response.result.output_files[0].digest.size_bytes == len(big)
            assert tree_bytes(bounded.root / "cache") < 1 << 20  # emptied before the lease was completed
    finally:
        bounded.stop()
        stack.workers.remove(bounded)
        for name in names:
            stack.add_worker(name)


def _input_root_with_out(c, out):
    """An Action running `echo hi > /out/x` over the host tools' root plus top-level `out` (a
    Directory message, given as it is: the Client's own builder could not name an entry twice)."""
    pb = c.pb
    files, links = host_root()
    root = pb.Directory.FromString(c.blobs[c.directory(files, links).hash])
    root.directories.add(name="out", digest=c.message(out))
    dirs = sorted(root.directories, key=lambda d: d.name)
    del root.directories[:]
    for d in dirs:
        root.directories.add().CopyFrom(d)
    command = pb.Command(arguments=["/bin/sh", "-c", "echo hi > /out/x"], output_paths=["out/x"])
    command.environment_variables.add(name="PATH", value="/usr/bin:/bin")
    action = pb.Action(command_digest=c.message(command), input_root_digest=c.message(root))
    for k, v in sorted({"OSFamily": "Linux", "ISA": "x86-64" if os.uname().machine == "x86_64" else "aarch64",
                        "bgraph-sandbox": SANDBOX_VERSION}.items()):
        action.platform.properties.add(name=k, value=v)
    digest = c.message(action)
    c.cas.put_blobs({h: c.blobs[h] for h in c.cas.find_missing({h: len(b) for h, b in c.blobs.items()})})
    return digest


def test_a_name_given_twice_in_the_input_root_never_writes_the_workers_host(stack, tmp_path):
    """Red-team K6 hole 1: `out` holds a symlink `a` -> a host directory and also a directory `a`
    holding `b`. Laid out, `b` was copied through the link (any host file written, as the
    worker's user). The input root is refused (INVALID_ARGUMENT) and the host file is untouched."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "b").write_text("original\n")
    c = Client(stack.url)
    pb = c.pb
    inner = pb.Directory()
    inner.files.add(name="b", digest=c.blob(f"written-by-remote-action {uuid.uuid4()}\n".encode()))
    out = pb.Directory()
    out.symlinks.add(name="a", target=str(victim))
    out.directories.add(name="a", digest=c.message(inner))
    response, _, _ = c.execute(_input_root_with_out(c, out))
    assert response.status.code == 3 and "out/a twice" in response.status.message, response.status
    assert (victim / "b").read_text() == "original\n" and os.listdir(victim) == ["b"]


def test_layout_never_follows_a_symlink(tmp_path):
    """Whatever the entries say, the writable directory's layout makes nothing through a link:
    a file, a directory or a symlink below one is refused (Refused), the host stays as it was."""
    from build_graph.remote_exec.fsops import Layout, Refused
    from build_graph.store.cas import FIXED_MTIME

    victim, host = tmp_path / "victim", tmp_path / "w0"
    victim.mkdir()
    (victim / "b").write_text("original\n")
    host.mkdir()
    source = tmp_path / "source"
    source.write_bytes(b"attacker\n")
    with Layout(host) as layout:
        layout.symlink(str(victim), "a")
        layout.copy(source, "ok/f", 0o444, FIXED_MTIME)
        for step in (lambda: layout.copy(source, "a/b", 0o444, FIXED_MTIME),
                     lambda: layout.copy(source, "a/new", 0o444, FIXED_MTIME),
                     lambda: layout.directory("a/sub"),
                     lambda: layout.symlink("/x", "a/l"),
                     lambda: layout.copy(source, "a", 0o444, FIXED_MTIME)):
            with pytest.raises(Refused):
                step()
    assert (victim / "b").read_text() == "original\n" and os.listdir(victim) == ["b"]
    st = (host / "ok" / "f").stat()
    assert (st.st_mode & 0o777, st.st_mtime) == (0o444, FIXED_MTIME)
    assert (host / "ok" / "f").read_bytes() == b"attacker\n"


def test_duplicate_names_and_entries_below_a_link_are_refused_by_staging(tmp_path):
    """Stager.mounts refuses a Directory naming one entry twice (symlink and directory, file and
    directory, two files), below an output directory or not; REAPI names are unique."""
    from types import SimpleNamespace

    from build_graph.model import Digester
    from build_graph.remote_exec.staging import BadInput, Stager
    from build_graph.store.cas import LocalCas
    from build_graph.store.reapi import reapi_pb2 as pb

    cas = LocalCas(tmp_path / "cache", Digester("sha256"))

    def digest(msg):
        e = cas.put_bytes(msg.SerializeToString() if hasattr(msg, "SerializeToString") else msg)
        return pb.Digest(hash=e.digest, size_bytes=e.size)
    inner = pb.Directory()
    inner.files.add(name="b", digest=digest(b"x"))
    stager = Stager(SimpleNamespace(pb=pb), cas)
    for where in ("bgraph/out", "bgraph/src"):
        for dup in ("symlink", "file"):
            d = pb.Directory()
            d.directories.add(name="a", digest=digest(inner))
            if dup == "symlink":
                d.symlinks.add(name="a", target="/etc")
            else:
                d.files.add(name="a", digest=digest(b"y"))
            bgraph = pb.Directory()
            bgraph.directories.add(name=where.split("/")[1], digest=digest(d))
            if where != "bgraph/out":
                bgraph.directories.add(name="out", digest=digest(pb.Directory()))
            root = pb.Directory()
            root.directories.add(name="bgraph", digest=digest(bgraph))
            with pytest.raises(BadInput, match=f"{where}/a twice"):
                stager.mounts(digest(root), ["bgraph/out"])
    cas.close()


def test_remove_tree_takes_any_depth_and_never_opens_a_fifo(tmp_path):
    """A lease directory as an action may leave it: 3000 directories deep (past PATH_MAX and
    Python's recursion limit), a FIFO, a listening unix socket, a 0000 and a 0555 directory, a
    symlink to a host directory. All of it goes; the FIFO is not opened (that would hang), the
    host directory behind the link keeps its file."""
    import socket

    from build_graph.remote_exec.fsops import remove_tree

    lease = tmp_path / "lease"
    lease.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("k")
    fd = os.open(lease, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(3000):
        os.mkdir("d", dir_fd=fd)
        sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub
    os.mkfifo("fifo", dir_fd=fd)
    os.close(fd)
    os.mkfifo(lease / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(lease / "sock"))
    sock.listen()
    (lease / "locked" / "in").mkdir(parents=True)
    (lease / "locked" / "in" / "f").write_text("f")
    os.chmod(lease / "locked" / "in", 0o555)
    os.chmod(lease / "locked", 0)
    os.symlink(outside, lease / "link")
    for i in range(2000):  # wide too: each directory is read once, not once per subdirectory
        (lease / "wide" / f"d{i}").mkdir(parents=True)
        (lease / "wide" / f"f{i}").write_text("f")
    start = time.time()
    remove_tree(lease)
    sock.close()
    assert not lease.exists() and (outside / "keep").read_text() == "k"
    assert time.time() - start < 60
    remove_tree(lease)  # gone already: nothing to do


def test_outputs_nested_too_deep_are_refused_and_sparse_files_stay_sparse(tmp_path):
    """outputs: a directory nested past MAX_DEPTH is BadOutput (the action's fault, one line); a
    1 GiB sparse output costs the worker's cache no disk; a 20 MiB log keeps its last 16 MiB
    behind a line saying what was dropped."""
    from build_graph.model import Digester
    from build_graph.remote_exec import outputs as outs
    from build_graph.store.cas import LocalCas
    from build_graph.store.reapi import reapi_pb2 as pb

    cas = LocalCas(tmp_path / "cache", Digester("sha256"))
    deep = tmp_path / "w" / "deep"
    p = deep
    for _ in range(outs.MAX_DEPTH + 5):
        p = p / "d"
    p.mkdir(parents=True)
    with pytest.raises(outs.BadOutput, match="nests more than 256"):
        outs.collect(pb, cas, lambda path: str(tmp_path / "w" / path), ["deep"], "")
    sparse = tmp_path / "w" / "sparse"
    with open(sparse, "wb") as f:
        f.write(b"head")
        f.truncate(1 << 30)
        f.seek((1 << 30) - 4)
        f.write(b"tail")
    got = outs.collect(pb, cas, lambda path: str(tmp_path / "w" / path), ["sparse"], "")
    (out,) = got.files
    blob = cas.blob_path(out.digest.hash)
    assert out.digest.size_bytes == 1 << 30 and blob.stat().st_size == 1 << 30
    assert blob.stat().st_blocks * 512 < 1 << 20, "the hole was filled"
    h = hashlib.sha256(b"head")
    zeros = bytes(8 << 20)
    left = (1 << 30) - 8
    while left:
        h.update(zeros[:min(left, len(zeros))])
        left -= min(left, len(zeros))
    h.update(b"tail")
    assert out.digest.hash == h.hexdigest()
    log = tmp_path / "stdout"
    log.write_bytes(b"a" * (4 << 20) + b"b" * (16 << 20))
    capped = outs.cap_log(log)
    data = capped.read_bytes()
    first, _, rest = data.partition(b"\n")
    assert b"first 4194304 of 20971520 bytes were dropped" in first and rest == b"b" * (16 << 20)
    small = tmp_path / "small"
    small.write_bytes(b"x")
    assert outs.cap_log(small) == small
    sparse_log = tmp_path / "stderr"
    with open(sparse_log, "wb") as f:
        f.write(b"start\n")
        f.truncate(64 << 20)
    capped = outs.cap_log(sparse_log)
    assert capped.stat().st_size < (16 << 20) + 200 and capped.stat().st_blocks * 512 < 1 << 20
    cas.close()


def test_deep_output_fails_the_action_once_and_leaves_no_lease_directory(stack):
    """Red-team K6 hole 4 (worker): a declared output directory nested 1100 deep (the old walk and
    removal recursed: RecursionError killed the lease thread, INTERNAL, retried, a lease
    directory left per try) fails as INVALID_ARGUMENT, once, with a FIFO in it unopened; an
    undeclared deep directory beside a good output is removed and the action is OK."""
    c = Client(stack.url)
    nest = "i=0; while [ $i -lt 1100 ]; do mkdir d && cd d || exit 1; i=$((i+1)); done; mkfifo p"
    bad = c.action(sh(f"mkdir bgraph/out/deep && cd bgraph/out/deep && {nest}; echo {uuid.uuid4()}"),
                   ["bgraph/out/deep"], timeout_s=120)
    response, _, _ = c.execute(bad, timeout_s=300)
    assert response.status.code == 3 and "nests more than 256" in response.status.message, response.status
    good = c.action(sh(f"echo ok > bgraph/out/ok; cd bgraph/out && {nest}; echo {uuid.uuid4()}"),
                    ["bgraph/out/ok"], timeout_s=120)
    response, _, _ = c.execute(good, timeout_s=300)
    assert response.status.code == 0 and response.result.exit_code == 0, response.status
    for w in stack.workers:
        wait_until(lambda w=w: not list((w.root / "leases").glob("slot-*/lease-*")), 30,
                   f"{w.root.name}'s lease directories to be removed")
        text = w.log.read_text(errors="replace")
        assert "RecursionError" not in text and "failed in the worker" not in text


def test_sparse_output_and_huge_stdout_cost_the_worker_no_disk(stack):
    """Red-team K6 hole 8: a 128 MiB sparse output stays sparse in the worker's cache and is
    streamed to the server (ByteStream, never read whole); a 64 MiB sparse stdout is kept as its
    last 16 MiB behind a line saying what was dropped."""
    c = Client(stack.url)
    size = 128 << 20
    digest = c.action(sh(f"echo head; truncate -s {64 << 20} /proc/self/fd/1; truncate -s {size} bgraph/out/x; "
                         f": {uuid.uuid4()}"), ["bgraph/out/x"], timeout_s=120)
    before = {w.root.name: _disk_bytes(w.root / "cache") for w in stack.workers}
    response, _, _ = c.execute(digest, timeout_s=300)
    assert response.status.code == 0 and response.result.exit_code == 0, response.status
    (out,) = response.result.output_files
    h = hashlib.sha256()
    zeros = bytes(8 << 20)
    for _ in range(size // len(zeros)):
        h.update(zeros)
    assert (out.digest.size_bytes, out.digest.hash) == (size, h.hexdigest())
    worker = response.result.execution_metadata.worker.split("/")[0]
    w = next(w for w in stack.workers if w.root.name == worker)
    assert _disk_bytes(w.root / "cache") - before[worker] < 8 << 20, "the worker's cache filled the holes"
    stdout = response.result.stdout_digest
    assert stdout.size_bytes < (16 << 20) + 200
    head = c.cas.get_blob(stdout.hash, stdout.size_bytes)[:200]
    assert head.startswith(b"[bgraph worker: the first ") and b"of 67108864 bytes were dropped" in head


def _disk_bytes(root: Path) -> int:
    """The disk a tree uses (allocated blocks, not sizes)."""
    total = 0
    for d, _dirs, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def test_workers_carry_on_across_a_buildgrid_restart(stack):
    """bgd stopped mid-lease and started again on the same database: the operation still ends
    done and OK (WaitExecution), and both workers serve new actions afterwards, with sessions
    made again where the server dropped theirs. Last in this module: it restarts the server."""
    import grpc

    c = Client(stack.url)
    marker = f"restart-{uuid.uuid4().hex}"
    digest = c.action(sh("sleep 3; echo done > bgraph/out/x", marker), ["bgraph/out/x"])
    name = None
    try:
        def on_stage(op_name, stage):
            nonlocal name
            name = op_name
            if stage == c.pb.ExecutionStage.EXECUTING:
                wait_until(lambda: marked_pids(marker), 20, "the action to start")
                stack.grid.stop()
        c.execute(digest, on_stage=on_stage)
    except grpc.RpcError as e:  # the stream breaks as the server goes
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
    except AssertionError as e:  # or ends without `done`
        assert "without done" in str(e), e
    assert name is not None
    stack.grid.start()
    response = Client(stack.url).wait_execution(name, timeout_s=120)
    assert response.status.code == 0 and response.result.exit_code == 0, response.status
    # Two at once: both bots must be back in service for both to start before either ends.
    again = Client(stack.url)
    slow = [again.action(sh(f"sleep 2; echo {uuid.uuid4()} > bgraph/out/x"), ["bgraph/out/x"]) for _ in range(2)]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda d: Client(stack.url).execute(d)[0], slow))
    assert [r.status.code for r in results] == [0, 0]
    assert len({r.result.execution_metadata.worker for r in results}) == 2
    assert all(w.proc.poll() is None for w in stack.workers)


def test_a_busy_server_is_waited_for_and_other_errors_are_not():
    """RESOURCE_EXHAUSTED on a worker's CAS call is backed off and the call made again (it is
    the server's RPC limit, not the action's failure); any other error is raised at once."""
    import threading

    from build_graph.remote_exec.patient import PatientRemote
    from build_graph.store.remote import RemoteUnavailable

    class Flaky:
        def __init__(self, errors):
            self.errors, self.calls = list(errors), 0

        def find_missing(self, sizes):
            self.calls += 1
            if self.errors:
                raise self.errors.pop(0)
            return set(sizes)

    busy = Flaky([RemoteUnavailable("RESOURCE_EXHAUSTED: Concurrent RPC limit exceeded!")] * 2)
    assert PatientRemote(busy, threading.Event()).find_missing({"a": 1}) == {"a"} and busy.calls == 3
    gone = Flaky([RemoteUnavailable("UNAVAILABLE: connection refused")])
    with pytest.raises(RemoteUnavailable):
        PatientRemote(gone, threading.Event()).find_missing({"a": 1})
    assert gone.calls == 1


def test_a_commands_environment_reaches_only_the_sandbox(stack, tmp_path):
    """A Command's LD_PRELOAD names a host library that writes a marker when loaded: no process
    the worker starts on its host loads it (red-team K14); the action sees exactly the Command's
    variables (and bwrap's PWD), few or more than bwrap's arguments hold; more of them with a
    name no shell can set is INVALID_ARGUMENT."""
    from test_sandbox_env import many, parsed, preload_library

    from build_graph.sandbox_env import MAX_SETENV_ARGS

    lib, mark = preload_library(tmp_path)
    c = Client(stack.url)
    for extra in ({}, many(MAX_SETENV_ARGS // 3 + 1)):
        env = {"PATH": "/usr/bin:/bin", "LD_PRELOAD": str(lib), **extra}
        response, _, _ = c.execute(c.action(["/usr/bin/env", "-0"], [], env=env))
        assert response.status.code == 0 and response.result.exit_code == 0, response
        assert parsed(c.read(response.result.stdout_digest)) == {**env, "PWD": "/"}
        assert not mark.exists(), f"the library ran on the worker's host: {mark.read_text()}"
    bad = {**many(MAX_SETENV_ARGS // 3 + 1), "NOT-A-NAME": "x"}
    response, _, _ = c.execute(c.action(["/usr/bin/env", "-0"], [], env=bad))
    assert response.status.code == 3 and "'NOT-A-NAME' is not a shell variable name" in response.status.message
