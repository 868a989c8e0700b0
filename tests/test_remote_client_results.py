"""The remote execution client against a hostile REAPI server (issue 36, red team K10): whatever
shape of ActionResult the server sends back, the client refuses it as strictly as the worker
refuses an input root, in one RemoteFailure line naming the action, before anything is filed;
big outputs and logs are streamed, never held whole. The server is a small real gRPC server on
127.0.0.1 speaking the repository's REAPI protos, whose Execute answers what each test says."""

from __future__ import annotations

import hashlib
import os
import resource
from concurrent import futures

import grpc
import pytest
from google.longrunning import operations_pb2
from google.protobuf import any_pb2

from build_graph.errors import ActionFailed, UsageError
from build_graph.model import Action, Digester, FileEntry, SymlinkEntry
from build_graph.remote_exec.address import check_grpc_url
from build_graph.remote_exec.client import RemoteRunner
from build_graph.remote_exec.results import MAX_ENTRIES
from build_graph.store.cas import LocalCas
from build_graph.store.reapi import reapi_pb2 as pb

E = "build.bazel.remote.execution.v2."


class HostileServer:
    """CAS + ByteStream + Execute; `answer(command, put)` makes each Execute's ActionResult
    (`put(bytes)` stores a blob and returns its Digest); `cached` marks it a cache hit."""

    def __init__(self, answer, cached: bool = False, mangle=lambda data: data):
        self.cas: dict[str, bytes] = {}
        self.answer, self.cached, self.mangle = answer, cached, mangle
        self.requests: list = []
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        u, s = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
        handlers = {
            E + "Capabilities": {"GetCapabilities": u(
                lambda r, c: pb.ServerCapabilities(cache_capabilities=pb.CacheCapabilities(
                    digest_functions=[1], max_batch_total_size_bytes=1 << 20)),
                pb.GetCapabilitiesRequest.FromString, pb.ServerCapabilities.SerializeToString)},
            E + "ContentAddressableStorage": {
                "FindMissingBlobs": u(lambda r, c: pb.FindMissingBlobsResponse(
                    missing_blob_digests=[d for d in r.blob_digests if d.hash not in self.cas]),
                    pb.FindMissingBlobsRequest.FromString, pb.FindMissingBlobsResponse.SerializeToString),
                "BatchUpdateBlobs": u(self._update, pb.BatchUpdateBlobsRequest.FromString,
                                      pb.BatchUpdateBlobsResponse.SerializeToString),
                "BatchReadBlobs": u(self._read, pb.BatchReadBlobsRequest.FromString,
                                    pb.BatchReadBlobsResponse.SerializeToString)},
            "google.bytestream.ByteStream": {
                "Read": s(self._bs_read, pb.ReadRequest.FromString, pb.ReadResponse.SerializeToString),
                "Write": grpc.stream_unary_rpc_method_handler(self._bs_write, pb.WriteRequest.FromString,
                                                              pb.WriteResponse.SerializeToString)},
            E + "Execution": {"Execute": s(self._execute, pb.ExecuteRequest.FromString,
                                           operations_pb2.Operation.SerializeToString)},
        }
        for service, methods in handlers.items():
            self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, methods)])
        self.url = f"grpc://127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def put(self, data: bytes) -> pb.Digest:
        h = hashlib.sha256(data).hexdigest()
        self.cas[h] = data
        return pb.Digest(hash=h, size_bytes=len(data))

    def _update(self, request, context):
        for r in request.requests:
            self.cas[r.digest.hash] = r.data
        return pb.BatchUpdateBlobsResponse(responses=[{"digest": r.digest} for r in request.requests])

    def _read(self, request, context):
        out = pb.BatchReadBlobsResponse()
        for d in request.digests:
            if d.hash in self.cas:
                out.responses.add(digest=d, data=self.cas[d.hash])
            else:
                out.responses.add(digest=d, status=pb.Status(code=5))
        return out

    def _bs_read(self, request, context):
        parts = request.resource_name.split("/")
        data = self.cas.get(parts[parts.index("blobs") + 1])
        if data is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no such blob")
        for offset in range(0, len(data), 1 << 20):
            yield pb.ReadResponse(data=data[offset:offset + (1 << 20)])

    def _bs_write(self, requests, context):
        """A large upload (a whole build's input root sends the pinned /usr this way)."""
        data, name = bytearray(), ""
        for r in requests:
            name = name or r.resource_name
            data += r.data
        parts = name.split("/")
        self.cas[parts[parts.index("blobs") + 1]] = bytes(data)
        return pb.WriteResponse(committed_size=len(data))

    def _execute(self, request, context):
        self.requests.append(request)
        action = pb.Action.FromString(self.cas[request.action_digest.hash])
        command = pb.Command.FromString(self.cas[action.command_digest.hash])
        response = pb.ExecuteResponse(result=self.answer(command, self.put), cached_result=self.cached)
        packed = any_pb2.Any()
        packed.Pack(response)
        packed.value = self.mangle(packed.value)  # bytes no message API writes (a name that is not UTF-8)
        yield operations_pb2.Operation(name="op", done=True, response=packed)

    def stop(self) -> None:
        self.server.stop(0)


ACTION = Action(name="//t:x", mnemonic="Genrule", argv=("/bin/sh", "-c", "true"), outputs=("a.txt", "d"))


@pytest.fixture
def cas(tmp_path) -> LocalCas:
    return LocalCas(tmp_path / "cache", Digester("sha256"))


def stored_blobs(cas: LocalCas) -> set[bytes]:
    """The contents of every blob in the local cache."""
    return {p.read_bytes() for p in cas.blobs.rglob("*") if p.is_file()}


def run(cas: LocalCas, answer, cached: bool = False, mangle=lambda data: data, **options):
    """The action run through a RemoteRunner against a HostileServer answering `answer`: its tree
    (after `store`), or the ActionFailed it raised; and the server."""
    server = HostileServer(answer, cached, mangle)
    runner = RemoteRunner(cas, server.url, local=lambda: pytest.fail("the action must not run locally"),
                          timeout_s=10, **options)
    try:
        return runner.run(ACTION)[0], server
    except ActionFailed as e:
        return e, server
    finally:
        runner.close()
        server.stop()


def honest(command, put) -> pb.ActionResult:
    r = pb.ActionResult(exit_code=0)
    r.output_files.add(path="a.txt", digest=put(b"hello\n"))
    return r


def complete(command, put) -> pb.ActionResult:
    """The honest result with the declared directory d too (empty)."""
    r = honest(command, put)
    r.output_directories.add(path="d", tree_digest=put(pb.Tree(root=pb.Directory()).SerializeToString()))
    return r


def with_honest(extra):
    """The honest result plus what `extra(result, put)` adds."""
    def answer(command, put):
        r = honest(command, put)
        extra(r, put)
        return r
    return answer


def test_an_honest_result_is_taken(cas):
    def answer(command, put):
        r = honest(command, put)
        r.output_directories.add(path="d", tree_digest=put(pb.Tree(root=_dir(put, [("f", b"f\n")], links=[("l", "f")]),
                                                           ).SerializeToString()))
        return r
    tree, server = run(cas, answer)
    assert not isinstance(tree, ActionFailed), tree
    assert tree.entries == {"a.txt": FileEntry(hashlib.sha256(b"hello\n").hexdigest(), 6),
                            "d/f": FileEntry(hashlib.sha256(b"f\n").hexdigest(), 2), "d/l": SymlinkEntry("f")}
    assert server.requests[0].skip_cache_lookup  # the executor's own action cache is not asked (hole 8)


EVIL = b"evil-bytes-never-filed\n"


def _dir_output(make):
    """A result with a.txt and output directory d whose Tree `make(put)` returns as (root, children)."""
    def extra(r, put):
        root, children = make(put)
        r.output_directories.add(path="d", tree_digest=put(pb.Tree(root=root, children=children).SerializeToString()))
    return with_honest(extra)


def _dir(put, files=(), dirs=(), links=()) -> pb.Directory:
    d = pb.Directory()
    for name, data in files:
        d.files.add(name=name, digest=put(data))
    for name, sub in dirs:
        d.directories.add(name=name, digest=put(sub.SerializeToString(deterministic=True)))
    for name, target in links:
        d.symlinks.add(name=name, target=target)
    return d


HOSTILE = {
    "a name holding NUL": with_honest(lambda r, put: r.output_files.add(path="x\0y", digest=put(EVIL))),
    "a symlink target holding NUL": lambda c, put: pb.ActionResult(
        output_symlinks=[pb.OutputSymlink(path="a.txt", target="a\0b")]),
    "an empty symlink target": lambda c, put: pb.ActionResult(
        output_symlinks=[pb.OutputSymlink(path="a.txt", target="")]),
    "a file and a directory at one path": with_honest(lambda r, put: r.output_directories.add(
        path="a.txt", tree_digest=put(pb.Tree(root=_dir(put, [("inner", EVIL)])).SerializeToString()))),
    "an undeclared output": with_honest(lambda r, put: r.output_files.add(path="extra.txt", digest=put(EVIL))),
    "a path normalised into another": with_honest(lambda r, put: r.output_files.add(path="zz/../stolen.txt",
                                                                                    digest=put(EVIL))),
    "an escaping path": with_honest(lambda r, put: r.output_files.add(path="../../../../evil", digest=put(EVIL))),
    "an absolute path": with_honest(lambda r, put: r.output_files.add(path="/etc/evil", digest=put(EVIL))),
    "an empty path": with_honest(lambda r, put: r.output_files.add(path="", digest=put(EVIL))),
    "one output twice": with_honest(lambda r, put: r.output_files.add(path="a.txt", digest=put(EVIL))),
    "a file and a symlink at one path": with_honest(lambda r, put: r.output_symlinks.add(path="a.txt",
                                                                                          target="/etc/passwd")),
    "a tree child named ..": _dir_output(lambda put: (_dir(put, dirs=[("..", _dir(put, [("evil", EVIL)]))]),
                                                      [_dir(put, [("evil", EVIL)])])),
    "a tree file named ../escape": _dir_output(lambda put: (_dir(put, [("../escape", EVIL)]), [])),
    "a tree file named x/y": _dir_output(lambda put: (_dir(put, [("x/y", EVIL)]), [])),
    "a tree file with no name": _dir_output(lambda put: (_dir(put, [("", EVIL)]), [])),
    "a tree file named .": _dir_output(lambda put: (_dir(put, [(".", EVIL)]), [])),
    "a tree naming one entry twice": _dir_output(lambda put: (_dir(put, [("f", EVIL), ("f", b"other\n")]), [])),
    "a tree file and link at one name": _dir_output(lambda put: (_dir(put, [("f", EVIL)], links=[("f", "x")]),
                                                                 [])),
    "a tree link target holding NUL": _dir_output(lambda put: (_dir(put, links=[("l", "a\0b")]), [])),
    "a malformed digest": with_honest(lambda r, put: r.output_directories.add(
        path="d", tree_digest=pb.Digest(hash="../../x", size_bytes=3))),
    "a negative size": with_honest(lambda r, put: r.output_files.add(
        path="d", digest=pb.Digest(hash=hashlib.sha256(EVIL).hexdigest(), size_bytes=-1))),
}


@pytest.mark.parametrize("what", sorted(HOSTILE))
def test_a_hostile_result_is_refused_in_one_line_and_nothing_is_filed(cas, what):
    """Each shape is a RemoteFailure naming the action (ActionFailed without fallback), never a
    traceback or an action failure of its own, and no byte of the result reaches the cache."""
    before = stored_blobs(cas)
    failed, _server = run(cas, HOSTILE[what])
    assert isinstance(failed, ActionFailed), f"{what}: accepted as {failed}"
    text = str(failed.message)
    assert text.startswith("remote execution failed: refused the server's result: ") and failed.where == "//t:x", text
    assert "\n" not in text and "Traceback" not in text
    assert "--remote-local-fallback" in (failed.hint or "")
    assert not [b for b in stored_blobs(cas) - before if b in (EVIL, b"other\n", b"hello\n")]


def test_a_result_that_is_not_utf8_is_refused_in_one_line(cas):
    """An output path that is not UTF-8 makes the ExecuteResponse undecodable: the service's
    failure in one line, never a traceback."""
    def answer(command, put):
        r = complete(command, put)
        r.output_files.add(path="PLACEHOLDER", digest=put(EVIL))
        return r
    failed, _server = run(cas, answer, mangle=lambda data: data.replace(b"PLACEHOLDER", b"\xff\xfeLACEHOLD"))
    assert isinstance(failed, ActionFailed), failed
    assert failed.message.startswith("remote execution failed: refused the server's result: its ExecuteResponse "
                                     "cannot be read"), failed.message
    assert EVIL not in stored_blobs(cas)


def test_a_tree_bomb_is_refused_at_once(cas):
    """31 small Directories each naming the next 8 times (8^30 paths): measured per distinct
    digest, refused over MAX_ENTRIES within a second, never walked path by path."""
    import time

    def bomb(put):
        sub, levels = _dir(put, [("f", b"f\n")]), []
        for _ in range(30):
            levels.append(sub)
            sub = _dir(put, dirs=[(f"d{j}", sub) for j in range(8)])
        return _dir(put, dirs=[("bomb", sub)]), levels + [sub]
    start = time.monotonic()
    failed, _server = run(cas, _dir_output(bomb))
    assert isinstance(failed, ActionFailed) and f"more than {MAX_ENTRIES} entries" in failed.message
    assert time.monotonic() - start < 5


def test_a_deep_tree_is_refused(cas):
    def deep(put):
        sub, levels = _dir(put, [("f", b"f\n")]), []
        for _ in range(300):
            levels.append(sub)
            sub = _dir(put, dirs=[("d", sub)])
        return sub, levels
    failed, _server = run(cas, _dir_output(deep))
    assert isinstance(failed, ActionFailed) and "directories deep" in failed.message


def test_a_cached_result_is_refused_unless_the_user_accepts_them(cas):
    """Hole 8: any client may have written the executor's action cache; a result it answers
    from there is taken only with accept_cached (--remote-accept-cached)."""
    failed, server = run(cas, honest, cached=True)
    assert isinstance(failed, ActionFailed) and "from its action cache" in failed.message
    assert server.requests[0].skip_cache_lookup
    tree, server = run(cas, complete, cached=True, accept_cached=True)
    assert not isinstance(tree, ActionFailed), tree.message
    assert "a.txt" in tree.entries and not server.requests[0].skip_cache_lookup


def test_nested_declared_outputs_may_repeat_one_entry(cas):
    """An output declared inside a declared directory (d and d/f) is given twice with the same
    contents, as the local ingest takes it; that is no conflict."""
    action = Action(name="//t:y", mnemonic="Genrule", argv=("/bin/sh",), outputs=("d", "d/f"))

    def answer(command, put):
        r = pb.ActionResult()
        r.output_directories.add(path="d", tree_digest=put(pb.Tree(root=_dir(put, [("f", b"same\n")]))
                                                           .SerializeToString()))
        r.output_files.add(path="d/f", digest=put(b"same\n"))
        return r
    server = HostileServer(answer)
    try:
        runner = RemoteRunner(cas, server.url, local=lambda: None, timeout_s=10)
        tree, _result = runner.run(action)
    finally:
        server.stop()
    assert set(tree.entries) == {"d/f"}


def test_big_outputs_and_logs_are_streamed_sparse_and_capped(cas):
    """A 40 MiB output that is mostly zeros is stored sparse (its holes cost no disk), a 40 MiB
    stderr keeps its last 16 MiB after a line saying so, and neither is ever held whole: the
    client's peak memory grows by much less than the 80 MiB received."""
    from build_graph.remote_exec.outputs import LOG_CAP
    big = bytes(40 << 20) + b"tail\n"
    log = b"E" * (40 << 20) + b"last line\n"

    def answer(command, put):
        r = pb.ActionResult(exit_code=0, stderr_digest=put(log))
        r.output_files.add(path="a.txt", digest=put(big))
        r.output_directories.add(path="d", tree_digest=put(pb.Tree(root=pb.Directory()).SerializeToString()))
        return r
    server = HostileServer(answer)
    runner = RemoteRunner(cas, server.url, local=lambda: None, timeout_s=30)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        tree, result = runner.run(ACTION)
    finally:
        server.stop()
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak  # KiB; the server's copies came before
    entry = tree.entries["a.txt"]
    assert entry.size == len(big) and cas.blob_path(entry.digest).read_bytes()[-5:] == b"tail\n"
    assert os.stat(cas.blob_path(entry.digest)).st_blocks * 512 < 1 << 20
    stderr = cas.blob_path(result.stderr).read_bytes()
    assert stderr.endswith(b"last line\n") and len(stderr) < LOG_CAP + 200 and b"were dropped" in stderr
    assert grown < 60 << 10, f"peak memory grew by {grown} KiB"


@pytest.mark.parametrize("url", ["grpc://127.0.0.1:73000", "grpc://", "grpc://[::1", "grpc://h:0", "grpc://h",
                                 "grpcs://h:-1", "http://h:1"])
def test_bad_addresses_are_refused_up_front(url):
    """Hole 12: gRPC would take a port modulo 65536 and fail a broken IPv6 literal late."""
    with pytest.raises(UsageError) as e:
        check_grpc_url(url, "remote executor", "give grpc://HOST:PORT")
    assert url in e.value.message


def test_a_symlink_climbing_out_is_kept_as_the_action_made_it(cas):
    """A symlink whose target climbs out (as an action may make locally) is kept as given."""
    def answer(command, put):
        r = pb.ActionResult()
        r.output_symlinks.add(path="a.txt", target="../../etc/passwd")
        r.output_directories.add(path="d", tree_digest=put(pb.Tree(root=pb.Directory()).SerializeToString()))
        return r
    tree, _server = run(cas, answer)
    assert tree.entries["a.txt"] == SymlinkEntry("../../etc/passwd")



def test_grpc_core_logs_stay_quiet(tmp_path):
    """Hole 13: a TLS handshake with a plaintext server printed gRPC C-core's own log line before
    bgraph's error; GRPC_VERBOSITY is NONE unless the user set it, so only bgraph's line is left."""
    import subprocess
    import sys
    server = HostileServer(honest)
    script = ("import sys; from build_graph.model import Digester; from build_graph.store.cas import LocalCas\n"
              "from build_graph.remote_exec.client import RemoteRunner, RemoteFailure\n"
              f"r = RemoteRunner(LocalCas(sys.argv[1], Digester('sha256')), {server.url.replace('grpc:', 'grpcs:')!r},"
              " local=None, timeout_s=5)\n"
              "try:\n    r._connect()\nexcept RemoteFailure as e:\n    print('refused:', str(e)[:40])\n")
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    try:
        run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "c")], capture_output=True, text=True,
                             env=env, timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    finally:
        server.stop()
    assert run.stdout.startswith("refused: remote executor grpcs://"), run.stdout + run.stderr
    assert run.stderr == "", run.stderr
