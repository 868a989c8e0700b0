"""Remote execution's client (issue 36, item 1): an action as REAPI Action + Command + input
root, and builds through BuildGrid with `bgraph worker`s (tests/remote_exec_servers.py).

The translation tests need no server: the input root of an action, decoded back from its
Directory messages, is compared with what the local bubblewrap sandbox shows the same action
(listed from inside it by a real run), so the two views cannot drift apart."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from pathlib import Path

import pytest

from bgraph_testlib import requires_bwrap
from build_graph.model import Action, Digester, DirEntry, FileEntry, SymlinkEntry, Tree
from build_graph.remote_exec.client import SANDBOX_VERSION, platform_properties
from build_graph.remote_exec.input_root import (Encoder, NotRemotable, out_relative, output_paths,
                                                working_directory)
from build_graph.store.cas import LocalCas
from build_graph.store.reapi import reapi_pb2 as pb

# Lists the sandbox's filesystem from inside it with dash built-ins and readlink: one line per
# entry, "<kind> <path>[ -> <target>]" (f: file, x: executable file, d: directory, l: link).
LISTER = r"""
walk() {
  for e in "$1"/* "$1"/.[!.]*; do
    [ -e "$e" ] || [ -L "$e" ] || continue
    if [ -L "$e" ]; then echo "l $e -> $(readlink "$e")"
    elif [ -d "$e" ]; then echo "d $e"; walk "$e"
    elif [ -x "$e" ]; then echo "x $e"
    else echo "f $e"; fi
  done
}
top=$(for t in /*; do case "$t" in /proc|/dev|/tmp) ;; *) echo "$t";; esac; done)
listing=$(for t in $top; do
  if [ -L "$t" ]; then echo "l $t -> $(readlink "$t")"; else echo "d $t"; walk "$t"; fi
done)
mkdir -p "$OUT/d"
echo "$listing" > "$OUT/listing"
echo made > "$OUT/d/x"
"""


def host_usr(cas: LocalCas) -> Tree:
    """A tiny pinned /usr made of the host's dash, readlink, libc and loader (real binaries)."""
    files = {"bin/sh": "/usr/bin/dash", "bin/readlink": "/usr/bin/readlink",
             "lib/x86_64-linux-gnu/libc.so.6": "/lib/x86_64-linux-gnu/libc.so.6",
             "lib64/ld-linux-x86-64.so.2": "/lib64/ld-linux-x86-64.so.2"}
    return Tree({p: cas.put_file(os.path.realpath(src), executable=True) for p, src in files.items()})


def sample_action(cas: LocalCas, staged: bool = True) -> Action:
    """An action with every kind of mount: a pinned /usr, sources with an empty directory and a
    link, a dependency (staged into the output directory), declared outputs with a parent."""
    src = Tree({"a.txt": cas.put_bytes(b"a\n"), "sub/b.sh": cas.put_bytes(b"#!/bin/sh\n", True),
                "empty": DirEntry(), "link": SymlinkEntry("a.txt")})
    dep = Tree({"gen/h.h": cas.put_bytes(b"int x;\n"), "top": cas.put_bytes(b"t\n")})
    return Action(name="list", mnemonic="Genrule", argv=("/bin/sh", "-c", LISTER),
                  env=(("OUT", "/bgraph/out"), ("PATH", "/usr/bin"), ("LC_ALL", "C")),
                  inputs=(("/bgraph/in/dep", dep), ("/bgraph/src", src), ("/usr", host_usr(cas))),
                  outputs=("listing", "d/x"), platform="x86_64", staged="/bgraph/in/dep" if staged else None)


def decoded(encoded, root_hash: str | None = None, prefix: str = "") -> set[str]:
    """The input root's entries in the lister's notation, read back from the Directory messages."""
    lines = set()
    directory = pb.Directory.FromString(encoded.directories[root_hash or encoded.root[0]])
    for f in directory.files:
        lines.add(f"{'x' if f.is_executable else 'f'} {prefix}/{f.name}")
    for s in directory.symlinks:
        lines.add(f"l {prefix}/{s.name} -> {s.target}")
    for d in directory.directories:
        lines.add(f"d {prefix}/{d.name}")
        lines |= decoded(encoded, d.digest.hash, f"{prefix}/{d.name}")
    return lines


@pytest.fixture
def cas(tmp_path) -> LocalCas:
    return LocalCas(tmp_path / "cache", Digester("blake3"))


def sha256_encoder(cas: LocalCas) -> Encoder:
    from build_graph.remote_exec.input_root import DigestMap
    return Encoder(pb, "sha256", DigestMap(cas, "sha256").remote)


@requires_bwrap
@pytest.mark.skipif(not os.path.exists("/lib/x86_64-linux-gnu/libc.so.6"), reason="an x86_64 Debian host's libc")
def test_input_root_is_the_local_sandboxes_view(cas):
    """Run the action in the local sandbox, which lists what it sees before writing; the input
    root decoded from its REAPI messages holds exactly those entries (links with their targets,
    executable bits), plus the outputs the action then made."""
    from build_graph.sandbox import BwrapRunner
    action = sample_action(cas)
    runner = BwrapRunner(cas)
    try:
        tree, _result = runner.run(action)
    finally:
        runner.close()
    seen = set(cas.read_bytes(tree.entries["listing"]).decode().split("\n")) - {""}
    encoded = sha256_encoder(cas).input_root(action)
    # The lister made d/ (an output's parent, which both views already hold) before listing.
    assert seen == decoded(encoded)
    assert "l /bin -> usr/bin" in seen and "l /bgraph/out/gen/h.h -> /bgraph/in/dep/gen/h.h" in seen
    assert "d /bgraph/src/empty" in seen and "x /bgraph/src/sub/b.sh" in seen and "d /bgraph/out/d" in seen


def test_input_root_digests_are_the_servers_function(cas):
    """A blake3 workspace on a sha256 server: every file and Directory is named by its sha256,
    and a Directory's digest is that of its serialized bytes."""
    action = sample_action(cas)
    encoded = sha256_encoder(cas).input_root(action)
    for h, entry in encoded.files.items():
        assert hashlib.sha256(cas.read_bytes(entry)).hexdigest() == h
    for h, data in encoded.directories.items():
        assert hashlib.sha256(data).hexdigest() == h
    assert encoded.root[1] == len(encoded.directories[encoded.root[0]])
    # Same action, same root: the encoding is deterministic (and memoized per tree).
    assert sha256_encoder(cas).input_root(sample_action(cas)).root == encoded.root
    # One changed byte of one input changes the root.
    other = sample_action(cas)
    src = other.input_tree("/bgraph/src").overlaid(Tree({"a.txt": cas.put_bytes(b"b\n")}))
    changed = dataclasses.replace(other, inputs=tuple((m, src if m == "/bgraph/src" else t) for m, t in other.inputs))
    assert sha256_encoder(cas).input_root(changed).root != encoded.root


def test_command_and_platform():
    """Argv as is, environment and output paths as the Command lists them, the working
    directory relative to the root, and the platform: OSFamily, ISA of where it runs, sandbox."""
    action = Action(name="a", mnemonic="M", argv=("/bin/sh", "-c", "x"), env=(("B", "2"), ("A", "1")),
                    outputs=("o", "d/p"), platform="aarch64", exec_platform="x86_64")
    assert working_directory(action) == "bgraph/out"
    assert output_paths(action) == ["o", "d/p"]
    assert platform_properties(action) == [("ISA", "x86-64"), ("OSFamily", "Linux"),
                                           ("bgraph-sandbox", SANDBOX_VERSION)]
    native = Action(name="a", mnemonic="M", platform="aarch64", outputs=(".",))
    assert dict(platform_properties(native))["ISA"] == "aarch64"
    assert output_paths(native) == [""] and out_relative(native, "") == "."
    elsewhere = Action(name="a", mnemonic="M", outputs=("o",), cwd="/bgraph/out/build")
    assert working_directory(elsewhere) == "bgraph/out/build"
    with pytest.raises(NotRemotable):
        output_paths(elsewhere)


def test_host_paths_are_not_sent(cas):
    """An action that mounts host paths (host_tools) has no content view to send: it runs locally."""
    action = Action(name="a", mnemonic="M", argv=("/bin/true",), host_paths=("/usr",), outputs=("o",))
    with pytest.raises(NotRemotable, match="host path /usr"):
        sha256_encoder(cas).input_root(action)


# -- builds through BuildGrid and two `bgraph worker`s --------------------------------------------

import contextlib  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from bgraph_testlib import WS, copy_toolchains, hermetic_env  # noqa: E402
from remote_exec_servers import ExecStack, missing_reason  # noqa: E402
from remote_servers import free_port  # noqa: E402


def _sigint_as_at_a_terminal() -> None:
    """In the build's child before exec: SIGINT back to its default disposition. A test run
    started as a background job (`nohup pytest ... &`, CI scripts) inherits SIGINT *ignored*
    (POSIX shells do that to asynchronous commands), exec keeps it ignored, and Python then
    never raises KeyboardInterrupt: the Ctrl-C test's build would sleep on (its cause of
    not exiting within 60 s in suite runs). A user's Ctrl-C reaches a foreground build whose
    SIGINT is at its default; so must the test's."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def build_once_started(root: Path, ws, url: str, label: str, started, *more: str):
    """A remote `bgraph build --json` of `label` (with `more` options) in the background, handed
    over once `started()` (the action is seen running on a worker) answers something: (the
    process, that answer). A build still running when the test ends is killed."""
    proc = subprocess.Popen([sys.executable, "-m", "build_graph", "-C", str(root), "--cache-dir", str(ws.cache),
                             "build", "--json", "--remote-executor", url, *more, label],
                            env=hermetic_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint_as_at_a_terminal)
    try:
        deadline = time.monotonic() + 120
        while not (seen := started()):
            assert proc.poll() is None and time.monotonic() < deadline, "the action never started on a worker"
            time.sleep(0.1)
        yield proc, seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

needs_stack = pytest.mark.skipif(missing_reason() is not None, reason=missing_reason() or "")

# Real actions on the pinned Debian /usr (//toolchains:host): files, an executable bit, a
# directory output holding an empty directory, a symlink, a dependency read remotely.
REMOTE_TARGETS = """\
[a]
kind = "genrule"
outs = ["a.txt", "d", "link"]
cmd = "python3 -c 'print(sum(range(10**6)))' > $OUT/a.txt; mkdir -p $OUT/d/e; echo x > $OUT/d/f; chmod +x $OUT/d/f; ln -s a.txt $OUT/link"

[b]
kind = "genrule"
deps = { a = ":a" }
outs = ["b.txt"]
cmd = "cat $IN_A/a.txt $IN_A/d/f > $OUT/b.txt; readlink $IN_A/link >> $OUT/b.txt; ls -a $IN_A/d >> $OUT/b.txt"

[fail]
kind = "genrule"
outs = ["never"]
cmd = "echo oops-remote >&2; exit 3"

[local-too]
kind = "genrule"
outs = ["c.txt"]
cmd = "echo fallback > $OUT/c.txt"

[restart]
kind = "genrule"
outs = ["r"]
cmd = "sleep 6.4242; echo survived > $OUT/r"

[victim]
kind = "genrule"
outs = ["v"]
cmd = "sleep 3.4242; echo requeued > $OUT/v"

[slow]
kind = "genrule"
outs = ["s"]
cmd = "sleep 4242; touch $OUT/s"

[poison]
kind = "genrule"
outs = ["p"]
cmd = "sleep 8.4242; echo ran > $OUT/p"
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if missing_reason() is not None:
        pytest.skip(missing_reason())
    s = ExecStack(tmp_path_factory.mktemp("exec"), workers=2)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def root(module_tmp) -> Path:
    """A workspace with this repository's pinned systems and REMOTE_TARGETS as //remote."""
    ws = module_tmp / "ws"
    copy_toolchains(ws)
    (ws / "targets" / "remote.toml").write_text(REMOTE_TARGETS)
    return ws


@pytest.fixture(scope="module")
def local(root, module_tmp) -> WS:
    """//remote:b built locally, in a cache of its own: what the remote build must equal."""
    ws = WS(root, module_tmp / "local-cache")
    run = ws.build("//remote:a", "//remote:b", args=("-j2",))
    assert run.rc == 0, run.stderr[-3000:]
    return ws


def server_blob(stack, digest: str) -> Path:
    """Where BuildGrid's disk storage holds blob `digest`; raises where it holds none."""
    return stack.grid.cas_path(digest)


def remote_args(stack, *more: str) -> tuple[str, ...]:
    return ("--remote-executor", stack.url, *more)


@needs_stack
def test_remote_build_is_byte_identical_to_the_local_one(stack, local, root, module_tmp):
    """The genrules run on the workers (their outputs are in BuildGrid's CAS, which the local
    build never wrote to); every action's output tree equals the local build's under the same
    key (--check-against: same keys, same bytes); `explain` reads the trace a remote run left."""
    ws = WS(root, module_tmp / "remote-cache")
    run = ws.build("//remote:a", "//remote:b", args=remote_args(stack, "-j2"))
    assert run.rc == 0, run.stderr[-3000:]
    ran = {a["label"]: a["status"] for a in run.json["actions"] if a["label"].startswith("//remote:")}
    assert ran == {"//remote:a": "executed", "//remote:b": "executed"}
    assert run.json["remote_execution"]["executed"] >= 2 and run.json["remote_execution"]["fell_back"] == 0
    b_txt = (root / "bgraph-out" / "remote" / "b" / "b.txt").read_bytes()
    assert b_txt == b"499999500000\nx\na.txt\n.\n..\ne\nf\n"
    assert server_blob(stack, hashlib.sha256(b_txt).hexdigest()).read_bytes() == b_txt  # made by a worker
    a_dir = root / "bgraph-out" / "remote" / "a"
    assert os.access(a_dir / "d" / "f", os.X_OK) and (a_dir / "d" / "e").is_dir()
    assert os.readlink(a_dir / "link") == "a.txt"
    explain = ws.cli("explain", "//remote:b")
    assert explain.rc == 0 and "ran genrule" in explain.stdout, explain.output
    check = ws.build("//remote:a", "//remote:b", args=("--check-against", str(local.cache)))
    assert check.rc == 0, check.stderr[-2000:]
    assert check.json["compared_with_other_cache"] >= 2 and check.json["differing"] == []
    assert {a["status"] for a in check.json["actions"]} == {"hit"}  # filed locally like a local run


@needs_stack
def test_non_zero_exit_is_the_actions_failure_not_a_fallback(stack, root, module_tmp):
    ws = WS(root, module_tmp / "remote-cache")
    for _ in range(2):  # the second time BuildGrid answers from its cache: the same failure
        run = ws.build("//remote:fail", args=remote_args(stack, "--remote-local-fallback"))
        assert run.rc == 1
        assert "exited with status 3" in run.output and "oops-remote" in run.output, run.output[-2000:]
        assert "running it locally" not in run.output and "Traceback" not in run.output
        assert run.json["failed"] == 1


@needs_stack
def test_server_down_falls_back_locally_with_one_warning(root, module_tmp):
    ws = WS(root, module_tmp / "remote-cache")
    dead = f"grpc://127.0.0.1:{free_port()}"
    run = ws.build("//remote:local-too", args=("--remote-executor", dead, "--remote-local-fallback"))
    assert run.rc == 0, run.stderr[-2000:]
    warnings = [line for line in run.stderr.splitlines() if "remote execution of" in line]
    assert len(warnings) == 1 and "running it locally" in warnings[0], run.stderr[-2000:]
    assert "//remote:local-too" in warnings[0], warnings  # the target, not only the action's name
    assert (root / "bgraph-out" / "remote" / "local-too" / "c.txt").read_text() == "fallback\n"
    assert run.json["remote_execution"]["fell_back"] == 1
    # Without the fallback: one error line naming the remote and the flag, no traceback.
    ws.write({"targets/remote.toml": REMOTE_TARGETS.replace("echo fallback", "echo fallback2")})
    try:
        run = ws.build("//remote:local-too", args=("--remote-executor", dead))
        assert run.rc == 1 and "unavailable" in run.stderr and "--remote-local-fallback" in run.stderr
        assert "Traceback" not in run.stderr
    finally:
        ws.write({"targets/remote.toml": REMOTE_TARGETS})


def _runner(cas, url: str, **kw):
    from build_graph.remote_exec.client import RemoteRunner
    from build_graph.sandbox import BwrapRunner
    return RemoteRunner(cas, url, lambda: BwrapRunner(cas), **kw)


@needs_stack
def test_unmatched_platform_is_a_clear_error_after_the_queue_timeout(stack, cas):
    """No worker offers ISA=aarch64: BuildGrid keeps the job queued without a word; the client
    cancels it after its queue timeout and names the platform."""
    from build_graph.errors import ActionFailed
    action = Action(name="arm", mnemonic="Genrule", argv=("/bin/true",), outputs=("o",), platform="aarch64",
                    inputs=(("/bgraph/src", Tree({"x": cas.put_bytes(os.urandom(16))})),))
    runner = _runner(cas, stack.url, queue_timeout_s=3)
    start = time.monotonic()
    with pytest.raises(ActionFailed, match=r"no worker .* platform ISA=aarch64, OSFamily=Linux") as err:
        runner.run(action)
    assert time.monotonic() - start < 30
    # An aarch64 action never falls back to this x86_64 machine: the hint names the workers it needs.
    assert "it runs only on aarch64 workers" in err.value.render()


@needs_stack
def test_input_blob_removed_from_the_server_after_upload_is_uploaded_again(stack, cas):
    """An input uploaded, then deleted from BuildGrid's CAS: the worker reports it MISSING, the
    client uploads exactly that blob again and the Execute is retried to success."""
    data = os.urandom(64)
    action = sample_action(cas, staged=False)
    src = Tree({**action.input_tree("/bgraph/src").entries, "rand": cas.put_bytes(data)})
    action = dataclasses.replace(action, inputs=tuple((m, src if m == "/bgraph/src" else t) for m, t in action.inputs))
    runner = _runner(cas, stack.url)
    runner._connect()
    runner._upload(runner._prepare(action))
    blob = server_blob(stack, hashlib.sha256(data).hexdigest())
    assert blob.read_bytes() == data
    blob.unlink()
    tree, result = runner.run(action)
    assert runner.stats["missing_uploaded"] >= 1
    assert "l /bgraph/src/link -> a.txt" in cas.read_bytes(tree.entries["listing"]).decode()
    assert cas.read_bytes(tree.entries["d/x"]) == b"made\n" and result.exit_code == 0


# Run whole-output (outputs ["."], as cmake_project's configure and ninja_generator): how it sees
# its inputs, with the tools the configure uses. Every input file and directory with its mode and
# mtime; whether an input, /bgraph and the output directory take writes; the configure's own
# "generated sources" test (cp -a the read-only source into a new /bgraph/src, then find -newermt).
WHOLE_OUTPUT = r"""
set -e
walk() {
  for e in "$1"/* "$1"/.[!.]*; do
    [ -e "$e" ] || [ -L "$e" ] || continue
    if [ -L "$e" ]; then echo "l $e -> $(readlink "$e")"; else stat -c '%F %a %Y %n' "$e"; fi
    if [ -d "$e" ] && [ ! -L "$e" ]; then walk "$e"; fi
  done
}
mkdir -p .bgraph
{ walk /bgraph/in; walk /bgraph/toolchain; } > .bgraph/inputs
find /bgraph/in/src /bgraph/toolchain -newermt 1980-01-02 ! -type l > .bgraph/newer
for d in /bgraph/in/src /bgraph/in/src/sub /bgraph/toolchain; do
  if (: > "$d/probe") 2>/dev/null; then echo "$d writable"; else echo "$d read-only"; fi
done > .bgraph/writes
stat -c '%a %n' /bgraph >> .bgraph/writes
mkdir /bgraph/src
cp -a /bgraph/in/src/. /bgraph/src/
find /bgraph/src -type f -newermt 1980-01-02 > .bgraph/generated
echo built > result
"""


def tools_usr(cas: LocalCas, tools: tuple[str, ...]) -> Tree:
    """A pinned /usr of the host's `tools` (real binaries) and every library ldd names for them."""
    files = {f"bin/{os.path.basename(t)}": t for t in tools}
    for tool in tools:
        out = subprocess.run(["ldd", tool], check=True, capture_output=True, text=True).stdout
        for word in out.split():
            if word.startswith("/") and os.path.exists(word):
                files[word.lstrip("/").removeprefix("usr/")] = word
    return Tree({p: cas.put_file(os.path.realpath(src), executable=True) for p, src in files.items()})


@needs_stack
@pytest.mark.skipif(not os.path.exists("/lib/x86_64-linux-gnu/libc.so.6"), reason="an x86_64 Debian host's libc")
def test_whole_output_action_sees_the_local_sandboxes_inputs(stack, cas):
    """An action whose output is its whole output directory (the CMake configure's shape) gives the
    same tree on a worker as in the local sandbox: its inputs read-only, dated FIXED_MTIME with the
    store's modes, /bgraph taking new entries, and none of the sources taken for generated ones."""
    from build_graph.sandbox import BwrapRunner
    src = Tree({"a.c": cas.put_bytes(b"int a;\n"), "sub/b.sh": cas.put_bytes(b"#!/bin/sh\n", True),
                "empty": DirEntry(), "link": SymlinkEntry("a.c")})
    toolchain = Tree({"bin/nvcc": cas.put_bytes(b"#!/bin/sh\necho nvcc\n", True)})
    usr = tools_usr(cas, ("/usr/bin/dash", "/usr/bin/readlink", "/usr/bin/stat", "/usr/bin/find", "/usr/bin/cp",
                          "/usr/bin/mkdir"))
    action = Action(name="configure", mnemonic="CmakeConfigure", argv=("/usr/bin/dash", "-c", WHOLE_OUTPUT),
                    env=(("PATH", "/usr/bin"), ("LC_ALL", "C")), platform="x86_64", outputs=(".",),
                    inputs=(("/bgraph/in/src", src), ("/bgraph/toolchain", toolchain), ("/usr", usr)))
    local_runner = BwrapRunner(cas)
    try:
        local_tree, _ = local_runner.run(action)
    finally:
        local_runner.close()
    runner = _runner(cas, stack.url)
    remote_tree, result = runner.run(action)
    assert runner.stats["executed"] == 1 and result.exit_code == 0

    def text(tree: Tree, path: str) -> str:
        return cas.read_bytes(tree.entries[path]).decode()
    # The local view is what the configure relies on (so this test cannot pass on two wrong views).
    assert text(local_tree, ".bgraph/generated") == "" and text(local_tree, ".bgraph/newer") == ""
    assert "regular file 444 315532800 /bgraph/in/src/a.c" in text(local_tree, ".bgraph/inputs")
    assert "regular file 555 315532800 /bgraph/in/src/sub/b.sh" in text(local_tree, ".bgraph/inputs")
    assert text(local_tree, ".bgraph/writes") == ("/bgraph/in/src read-only\n/bgraph/in/src/sub read-only\n"
                                                  "/bgraph/toolchain read-only\n755 /bgraph\n")
    for path in sorted(local_tree.entries):
        if isinstance(local_tree.entries[path], FileEntry):
            assert text(remote_tree, path) == text(local_tree, path), path
    assert remote_tree.entries == local_tree.entries


@needs_stack
@pytest.mark.slow
def test_cmake_demo_built_remotely_equals_the_local_build(stack, module_tmp):
    """//examples:cmake-demo from fresh caches, locally and through BuildGrid: CMake's configure
    (a whole-output action: what a bwrap-v1 worker got wrong) and the edges it imports run on the
    workers, and every action's output tree equals the local build's under the same key."""
    from bgraph_testlib import workspace_copy
    ws_root = workspace_copy(module_tmp / "cmake-ws")
    local = WS(ws_root, module_tmp / "cmake-local")
    run = local.cli("build", "--json", "-j2", "//examples:cmake-demo", timeout=1500)
    assert run.rc == 0, run.stderr[-3000:]
    remote = WS(ws_root, module_tmp / "cmake-remote")
    run = remote.cli("build", "--json", "-j2", *remote_args(stack, "--remote-jobs", "4"), "//examples:cmake-demo",
                     timeout=1500)
    assert run.rc == 0, run.stderr[-3000:]
    assert run.json["remote_execution"]["executed"] > 0 and run.json["remote_execution"]["fell_back"] == 0
    configure = [a for a in run.json["actions"] if a["label"] == "//examples:cmake-demo" and a["name"] == "configure"]
    assert [a["status"] for a in configure] == ["executed"], configure
    check = local.cli("build", "--json", "--check-against", str(remote.cache), "//examples:cmake-demo", timeout=600)
    assert check.rc == 0, check.stderr[-2000:]
    assert check.json["compared_with_other_cache"] >= 300 and check.json["differing"] == []


@needs_stack
def test_ctrl_c_cancels_the_remote_operation_and_the_worker_kills_the_action(stack, root, module_tmp):
    """SIGINT to a build whose action sleeps on a worker: the build stops (130, "interrupted"),
    the operation is cancelled, the worker sees its lease cancelled and kills the sleeping
    process (no orphan left)."""
    def sleeping() -> list[str]:
        out = subprocess.run(["pgrep", "-f", "sleep 4242"], capture_output=True, text=True).stdout
        return out.split()

    def cancelled_leases() -> int:
        return sum(w.log.read_text(errors="replace").count("cancelled: action killed")
                   for w in stack.workers if w.log.exists())
    assert not sleeping()
    before = cancelled_leases()
    ws = WS(root, module_tmp / "remote-cache")
    with build_once_started(root, ws, stack.url, "//remote:slow", sleeping) as (proc, _):
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err[-2000:]
        deadline = time.monotonic() + 30
        while sleeping() or cancelled_leases() == before:
            assert time.monotonic() < deadline, "the worker left the cancelled action running (or kept its lease)"
            time.sleep(0.2)


@needs_stack
def test_buildgrid_restarted_mid_action_the_build_follows_the_same_operation(stack, root, module_tmp):
    """bgd SIGTERMed while the action runs on a worker and started again on the same database:
    the client's stream breaks with UNAVAILABLE, WaitExecution follows the operation once the
    server is back, and the build finishes with the action's output."""
    def running() -> bool:
        return bool(subprocess.run(["pgrep", "-f", "sleep 6.4242"], capture_output=True).stdout)
    ws = WS(root, module_tmp / "remote-cache")
    with build_once_started(root, ws, stack.url, "//remote:restart", running) as (proc, _):
        stack.grid.stop()
        stack.grid.start()
        out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    assert (root / "bgraph-out" / "remote" / "restart" / "r").read_text() == "survived\n"


@pytest.fixture(scope="module")
def small_grid(tmp_path_factory):
    """A second stack whose bgd takes 6 concurrent RPCs (thread-pool-size), one worker of 2 slots."""
    if missing_reason() is not None:
        pytest.skip(missing_reason())
    from remote_exec_servers import ExecBuildGrid, Postgres, WorkerProcess
    root = tmp_path_factory.mktemp("small")
    pg = Postgres()
    grid = worker = None
    try:
        grid = ExecBuildGrid(root / "bgd", pg.url, threads=6)
        worker = WorkerProcess(grid.url, root, "busy", slots=2)
        yield grid
    finally:
        for part in (worker, grid, pg):
            if part is not None:
                part.stop()


@needs_stack
def test_more_executes_than_the_servers_threads_are_absorbed(small_grid, root, module_tmp):
    """12 Executes in flight against a server that serves 6 RPCs at once: the client backs off
    on RESOURCE_EXHAUSTED (Execute and CAS calls alike) and every action completes."""
    ws = WS(root, module_tmp / "remote-cache")
    ws.write({"targets/busy.toml": "".join(f'[b{i}]\nkind = "genrule"\nouts = ["o"]\ncmd = "echo busy-{i} > $OUT/o"\n\n'
                                           for i in range(12))})
    run = ws.cli("build", "--json", "--remote-executor", small_grid.url, "--remote-jobs", "12", "//busy:all",
                 timeout=600)
    assert run.rc == 0, run.stderr[-3000:]
    assert run.json["remote_execution"]["executed"] + run.json["remote_execution"]["cached"] == 12
    assert run.json["remote_execution"]["backed_off"] > 0 and run.json["remote_execution"]["fell_back"] == 0
    assert (root / "bgraph-out" / "busy" / "b7" / "o").read_text() == "busy-7\n"


def test_bad_remote_execution_settings_are_one_line_each(root, module_tmp):
    """A non-grpc address (flag or [remote] executor), a port outside 1-65535 or a broken host, and
    a --remote-jobs below 1: one error line with a hint, before anything is planned, never a
    traceback."""
    ws = WS(root, module_tmp / "bad-cache")
    run = ws.cli("build", "--remote-executor", "http://127.0.0.1:1", "//remote:a")
    assert run.rc != 0 and "is not a grpc:// or grpcs:// address" in run.stderr and "hint:" in run.stderr
    assert "Traceback" not in run.stderr
    for url, why in (("grpc://127.0.0.1:65537", "port '65537' is not a number from 1 to 65535"),
                     ("grpc://[::1", "is not a host name or address"), ("grpc://", "has no HOST:PORT")):
        run = ws.cli("build", "--remote-executor", url, "//remote:a")  # gRPC took 65537 as port 1
        assert run.rc != 0 and why in run.stderr and "hint:" in run.stderr and "Traceback" not in run.stderr
    run = ws.cli("build", "--remote-executor", "grpc://127.0.0.1:1", "--remote-jobs", "0", "//remote:a")
    assert run.rc != 0 and "--remote-jobs 0: give at least 1" in run.stderr and "Traceback" not in run.stderr
    config = module_tmp / "user-config.toml"
    config.write_text('[remote]\nexecutor = "127.0.0.1:8980"\n')
    run = ws.cli("build", "//remote:a", env={"BGRAPH_CONFIG": str(config)})
    assert run.rc != 0 and "'127.0.0.1:8980'" in run.stderr and "[remote] executor" in run.stderr
    assert "Traceback" not in run.stderr


@needs_stack
def test_early_cutoff_and_no_op_after_remote_runs(stack, root, module_tmp):
    """A dependency run again remotely to identical bytes cuts its dependent off (the remote
    result is filed under bgraph's key like a local one); the next build is a no-op."""
    ws = WS(root, module_tmp / "remote-cache")
    assert ws.build("//remote:b", args=remote_args(stack)).rc == 0
    ws.write({"targets/remote.toml": REMOTE_TARGETS.replace("cmd = \"python3 -c", "cmd = \"true; python3 -c")})
    try:
        run = ws.build("//remote:b", args=remote_args(stack))
        assert run.rc == 0, run.stderr[-2000:]
        ran = {a["label"]: a["status"] for a in run.json["actions"] if a["label"].startswith("//remote:")}
        # b is not run again: cut off by action, or (the edit path's early cutoff by target,
        # when only a target file changed) taken whole as a hit.
        assert ran["//remote:a"] == "executed" and ran["//remote:b"] in ("cutoff", "hit"), ran
        assert run.json["remote_execution"]["executed"] + run.json["remote_execution"]["cached"] == 1
        again = ws.build("//remote:b", args=remote_args(stack))
        assert again.rc == 0 and again.json["executed"] == 0 and "remote_execution" not in again.json
    finally:
        ws.write({"targets/remote.toml": REMOTE_TARGETS})


def _ancestors(pid: int) -> set[int]:
    """The process's parents up to init, read from /proc."""
    found = set()
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        found.add(pid)
    return found


@needs_stack
def test_worker_killed_mid_action_the_build_still_finishes(stack, root, module_tmp):
    """The worker running the action is SIGKILLed and started again under its name (the same
    bot): BuildGrid queues the job again, a worker runs it, and the build, still following the
    same operation, finishes with the right output; the killed run left no process."""
    def sleeping() -> list[int]:
        out = subprocess.run(["pgrep", "-f", "sleep 3.4242"], capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]
    ws = WS(root, module_tmp / "remote-cache")
    with build_once_started(root, ws, stack.url, "//remote:victim", sleeping) as (proc, pids):
        worker = next(w for w in stack.workers if w.proc.poll() is None and w.proc.pid in _ancestors(pids[0]))
        worker.kill()
        stack.workers.remove(worker)
        stack.add_worker(worker.root.name)
        out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    assert (root / "bgraph-out" / "remote" / "victim" / "v").read_text() == "requeued\n"
    assert all(not Path(f"/proc/{p}").exists() for p in pids), "the killed worker's action outlived it"


@needs_stack
def test_poison_action_is_aborted_never_cached_reported_once_and_not_run_locally(stack, root, module_tmp):
    """An action whose every run takes its worker down (here the worker running it is SIGKILLed
    and started again under its name each time, as a machine dying under it would): BuildGrid
    gives the job up after its attempts (ABORTED). The build fails with one line naming the
    action, no local run happens, and nothing is filed: the next build Executes it again (no
    local hit, no answer from BuildGrid's action cache). With --remote-local-fallback it runs
    locally after the ABORTED, with one warning line, as Bazel's --remote_local_fallback does
    for any failed remote execution but a timeout."""
    def poisoned() -> list[int]:
        out = subprocess.run(["pgrep", "-f", "sleep 8.4242"], capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]

    def build_killing_its_workers(*more: str) -> tuple[int, str, dict, int]:
        """The build, each worker that runs the action killed and started again: (its exit
        status, stderr, its --json summary, how many workers were killed)."""
        kills = 0
        with build_once_started(root, ws, stack.url, "//remote:poison", poisoned, *more) as (proc, _):
            deadline = time.monotonic() + 400
            while proc.poll() is None:
                assert time.monotonic() < deadline, "BuildGrid never gave the poison action up"
                for pid in poisoned():
                    worker = next((w for w in stack.workers if w.proc.poll() is None
                                   and w.proc.pid in _ancestors(pid)), None)
                    if worker is not None:  # not the local run of the fallback
                        worker.kill()
                        stack.workers.remove(worker)
                        stack.add_worker(worker.root.name)
                        kills += 1
                time.sleep(0.1)
            out, err = proc.communicate()
        return proc.returncode, err, json.loads(out), kills

    assert not poisoned()
    ws = WS(root, module_tmp / "remote-cache")
    rc, err, summary, kills = build_killing_its_workers()
    assert rc == 1 and "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "ABORTED" in line]
    assert len(lines) == 1 and "//remote:poison" in lines[0], err[-3000:]  # reported once, naming it
    assert kills == 5, (kills, err[-2000:])  # BuildGrid 0.9.1 tries a job 5 times (REMOTE-EXEC.md)
    assert "running it locally" not in err and summary["remote_execution"]["fell_back"] == 0
    assert summary["failed"] == 1 and not (root / "bgraph-out" / "remote" / "poison" / "p").exists()
    # Nothing filed: the same action is Executed (and killed) again, then, with the fallback, run here.
    rc, err, summary, kills = build_killing_its_workers("--remote-local-fallback")
    assert rc == 0 and kills == 5, (kills, err[-3000:])
    warnings = [line for line in err.splitlines() if "remote execution of" in line]
    assert len(warnings) == 1 and "ABORTED" in warnings[0] and "running it locally" in warnings[0], err[-3000:]
    assert "//remote:poison" in warnings[0], warnings
    assert summary["remote_execution"]["fell_back"] == 1
    assert [a["status"] for a in summary["actions"] if a["label"] == "//remote:poison"] == ["executed"]
    assert (root / "bgraph-out" / "remote" / "poison" / "p").read_text() == "ran\n"
    assert not poisoned(), "a killed worker's action outlived it"
