"""The bubblewrap sandbox, through real genrule actions: what an action can and cannot see."""

from __future__ import annotations

import os
import time

import pytest

from bgraph_testlib import TOOLCHAINS_TOML, WORKSPACE_TOML, WS, action, requires_bwrap, write_files
from build_graph.errors import SandboxError

# Each check prints NAME=yes|no (whether the command succeeded); values print NAME=<value>.
PROBE = r"""
check() { if sh -c "$2" >/dev/null 2>&1; then echo "$1=yes"; else echo "$1=no"; fi; }
check read_undeclared        'cat /bgraph/src/secret.txt'
check read_declared          'cat /bgraph/src/in.txt'
check workspace_mounted      'test -e "$WS" || test -e "$WS/secret.txt"'
check cache_mounted          'test -e "$CACHE"'
check host_home              'ls "$HOST_HOME" || ls /root'
check network                'python3 -c "import socket; socket.create_connection((\"1.1.1.1\", 80), timeout=2)"'
check network_dns            'python3 -c "import socket; socket.getaddrinfo(\"example.com\", 443)"'
check tmp_writable           'echo hi > /tmp/f && test "$(cat /tmp/f)" = hi'
check write_usr              'touch /usr/bgraph-probe'
check write_src              'touch /bgraph/src/new'
check src_readonly_mode      'test ! -w /bgraph/src/in.txt || ! echo x >> /bgraph/src/in.txt'
echo "tmp_entries=$(ls -A /tmp | grep -v '^f$' | wc -l)"
echo "src_listing=$(ls -A /bgraph/src | tr '\n' ' ')"
echo "pid=$$"
echo "processes=$(ls /proc | grep -c '^[0-9]')"
echo "hostname=$(hostname)"
echo "interfaces=$(python3 -c 'import socket; print(sorted(n for _, n in socket.if_nameindex()))')"
echo "cwd=$(pwd)"
env | sort | sed 's/^/env:/'
"""


def parse(report: str) -> tuple[dict[str, str], dict[str, str]]:
    values, env = {}, {}
    for line in report.splitlines():
        if line.startswith("env:"):
            k, _, v = line[4:].partition("=")
            env[k] = v
        elif "=" in line:
            k, _, v = line.partition("=")
            values[k] = v
    return values, env


@pytest.fixture(scope="module")
def probe_report(tmp_path_factory):
    """One sandboxed run of PROBE (through the CLI, with a variable set that must not leak)."""
    root = tmp_path_factory.mktemp("probe") / "ws"
    ws = WS(root, root.parent / "cache", env={"BGRAPH_TEST_LEAK": "leaked-value", "HOME": os.path.expanduser("~")})
    write_files(root, {
        "WORKSPACE.toml": WORKSPACE_TOML,
        "targets/toolchains.toml": TOOLCHAINS_TOML,
        "in.txt": "declared\n",
        "secret.txt": "top secret\n",
        "probe.sh": f'WS="{root}"\nCACHE="{ws.cache}"\nHOST_HOME="{os.path.expanduser("~")}"\n' + PROBE,
        "targets/p.toml": '[probe]\nkind = "genrule"\nsrcs = ["in.txt", "probe.sh"]\nouts = ["report.txt", "pid.txt"]\n'
                          'cmd = "echo $$ > $OUT/pid.txt; sh $SRC/probe.sh > $OUT/report.txt 2>&1"\n',
    })
    run = ws.build("//p:probe")
    assert run.rc == 0, run.stderr
    values, env = parse(ws.read_output("//p:probe", "report.txt"))
    values["action_pid"] = ws.read_output("//p:probe", "pid.txt").strip()
    return ws, (values, env)


@requires_bwrap
def test_declared_sources_only(probe_report):
    _ws, (v, _env) = probe_report
    assert v["read_declared"] == "yes"
    assert v["read_undeclared"] == "no"
    assert v["src_listing"].split() == ["in.txt", "probe.sh"]
    assert v["workspace_mounted"] == "no"
    assert v["cache_mounted"] == "no"


@requires_bwrap
def test_no_host_home(probe_report):
    _ws, (v, _env) = probe_report
    assert v["host_home"] == "no"


@requires_bwrap
def test_no_network(probe_report):
    _ws, (v, _env) = probe_report
    assert v["network"] == "no"
    assert v["network_dns"] == "no"
    assert v["interfaces"] == "['lo']"


@requires_bwrap
def test_own_pid_namespace(probe_report):
    _ws, (v, _env) = probe_report
    assert v["action_pid"] in ("1", "2")  # the action's shell, right below bwrap
    assert v["pid"] in ("2", "3")  # the probe's shell, one level down
    assert int(v["processes"]) < 10  # bwrap, the shells, ls: not the host's processes
    assert v["hostname"] == "bgraph"


@requires_bwrap
def test_clean_environment(probe_report):
    _ws, (_v, env) = probe_report
    assert "BGRAPH_TEST_LEAK" not in env
    assert env["HOME"] == "/tmp"
    assert env["PATH"] == "/bgraph/toolchain/bin:/usr/bin:/bin"
    assert env["SRC"] == "/bgraph/src" and env["OUT"] == "/bgraph/out"
    assert env["TZ"] == "UTC" and env["LC_ALL"] == "C" and env["SOURCE_DATE_EPOCH"] == "315532800"
    host_only = set(env) & (set(os.environ) - {"HOME", "PATH", "PWD", "TZ", "LC_ALL", "TMPDIR", "SHLVL", "OLDPWD"})
    assert not host_only, f"host variables leaked into the sandbox: {sorted(host_only)}"
    assert set(env) <= {"HOME", "LC_ALL", "OUT", "PATH", "PWD", "SOURCE_DATE_EPOCH", "SRC", "TMPDIR", "TZ",
                        "SHLVL", "OLDPWD"}


@requires_bwrap
def test_tmp_empty_and_writable(probe_report):
    _ws, (v, _env) = probe_report
    assert v["tmp_entries"] == "0"
    assert v["tmp_writable"] == "yes"


@requires_bwrap
def test_read_only_mounts(probe_report):
    _ws, (v, _env) = probe_report
    assert v["write_usr"] == "no"
    assert v["write_src"] == "no"
    assert v["src_readonly_mode"] == "yes"
    assert v["cwd"] == "/bgraph/out"


# -- failures ----------------------------------------------------------------------------------------
@requires_bwrap
def test_missing_declared_output_fails_showing_stderr(make_ws):
    ws = make_ws({"targets/p.toml": '[a]\nkind = "genrule"\nouts = ["a.txt", "sub/b.txt"]\n'
                                    'cmd = "echo a > a.txt; echo \'warning: forgot b\' >&2"\n'})
    run = ws.build("//p:a")
    assert run.rc == 1
    assert not run.json["ok"] and run.json["failed"] == 1
    assert "declared outputs missing: sub/b.txt" in run.stderr
    assert "warning: forgot b" in run.stderr
    assert any("declared outputs missing: sub/b.txt" in e and "warning: forgot b" in e for e in run.json["errors"])
    assert action(run.json, "//p:a")["status"] == "failed"
    assert ws.ac_entries() == set()


@requires_bwrap
def test_failing_command_shows_status_and_output(make_ws):
    ws = make_ws({"targets/p.toml": '[a]\nkind = "genrule"\nouts = ["a.txt"]\n'
                                    'cmd = "echo to-stdout; echo to-stderr >&2; exit 3"\n'})
    run = ws.build("//p:a")
    assert run.rc == 1
    assert "exited with status 3" in run.stderr
    assert "to-stdout" in run.stderr and "to-stderr" in run.stderr
    assert "//p:a" in run.stderr
    assert "Traceback" not in run.stderr


@requires_bwrap
def test_failed_action_caches_nothing(make_ws):
    ws = make_ws({"flag": "bad\n",
                  "targets/p.toml": '[a]\nkind = "genrule"\nsrcs = ["flag"]\nouts = ["a.txt"]\n'
                                    'cmd = "grep -q ok $SRC/flag && echo built > a.txt"\n'})
    for _ in range(2):  # the same failing action runs again: no failure is cached
        run = ws.build("//p:a")
        assert run.rc == 1
        assert action(run.json, "//p:a")["status"] == "failed"
        assert ws.ac_entries() == set()
        assert not (ws.root / "bgraph-out").exists()
    ws.write({"flag": "ok\n"})
    run = ws.build("//p:a")
    assert run.rc == 0, run.stderr
    assert action(run.json, "//p:a")["status"] == "executed"
    assert ws.read_output("//p:a", "a.txt") == "built\n"
    assert len(ws.ac_entries()) == 1


@requires_bwrap
def test_output_through_symlink_cannot_take_host_files(make_ws, tmp_path):
    """An action that swaps an output's directory for a symlink to a host directory must not
    make bgraph read (or move into the store) the host's files."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "x").write_text("precious\n")
    ws = make_ws({"targets/p.toml": f'[a]\nkind = "genrule"\nouts = ["sub/x"]\n'
                                    f'cmd = "rmdir sub && ln -s {victim} sub"\n'})
    run = ws.build("//p:a")
    assert run.rc == 1
    assert "lies below symlink sub" in run.stderr
    assert (victim / "x").read_text() == "precious\n"
    assert ws.ac_entries() == set()


@requires_bwrap
@pytest.mark.parametrize("out", ["{abs}/deep/x", "../escape", "a/../../escape"])
def test_outputs_must_be_inside_the_output_dir(make_ws, tmp_path, out):
    out = out.format(abs=tmp_path / "host-dir")
    ws = make_ws({"targets/p.toml": f'[a]\nkind = "genrule"\nouts = ["{out}"]\ncmd = "true"\n'})
    run = ws.build("//p:a")
    assert run.rc == 2  # refused when the target loads, before any action exists
    assert f"output {out!r} must be a relative path inside $OUT" in run.stderr
    assert not (tmp_path / "host-dir").exists()  # no host directory was created for it
    assert not list(ws.cache.rglob("escape"))


@requires_bwrap
def test_symlink_outputs_are_kept_as_links(make_ws):
    ws = make_ws({"targets/p.toml": '[a]\nkind = "genrule"\nouts = ["l", "d"]\n'
                                    'cmd = "ln -s /etc/passwd l; mkdir d; ln -s / d/root"\n'})
    run = ws.build("//p:a")
    assert run.rc == 0, run.stderr
    out = ws.root / "bgraph-out/p/a"
    assert os.readlink(out / "l") == "/etc/passwd"
    assert os.readlink(out / "d/root") == "/"


# -- no bubblewrap -------------------------------------------------------------------------------------
def test_missing_bwrap_is_a_clear_error(monkeypatch):
    import build_graph.sandbox as sandbox
    monkeypatch.setattr(sandbox.shutil, "which", lambda name, *a, **k: None)
    with pytest.raises(SandboxError) as info:
        sandbox.find_bwrap()
    msg = str(info.value)
    assert "bubblewrap (bwrap) is not installed" in msg
    assert "apt-get install" in msg


def test_missing_bwrap_fails_the_build(make_ws, monkeypatch):
    import build_graph.sandbox as sandbox
    ws = make_ws({"targets/p.toml": '[a]\nkind = "genrule"\nouts = ["o"]\ncmd = "echo > o"\n'})
    monkeypatch.setattr(sandbox.shutil, "which", lambda name, *a, **k: None)
    result = ws.engine_build("//p:a")
    assert result.failures
    msg = result.failures[0].render()
    assert "bwrap" in msg and "apt-get install" in msg
    assert ws.ac_entries() == set()


def test_missing_bwrap_via_cli(make_ws, tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    ws = make_ws({"targets/p.toml": '[a]\nkind = "genrule"\nouts = ["o"]\ncmd = "echo > o"\n'})
    run = ws.cli("build", "//p:a", env={"PATH": str(empty)})
    assert run.rc == 1
    assert "bubblewrap (bwrap) is not installed" in run.stderr and "apt-get install" in run.stderr
    assert "Traceback" not in run.stderr


@requires_bwrap
def test_sandbox_command_line_shows_no_host_paths(make_ws):
    """bwrap takes its mounts from a descriptor: /proc/1/cmdline cannot leak the cache or workspace path."""
    ws = make_ws({"targets/p.toml": '[a]\nkind = "genrule"\nouts = ["o"]\n'
                                    'cmd = "cat /proc/1/cmdline /proc/2/cmdline > o 2>/dev/null || true"\n'})
    run = ws.build("//p:a")
    assert run.rc == 0, run.stderr
    seen = ws.read_output("//p:a", "o")
    assert "--args" in seen
    assert str(ws.cache) not in seen and str(ws.root) not in seen


@requires_bwrap
def test_stdin_is_open_and_empty(make_ws):
    """Tools that probe stdin (nvcc's host-compiler check does) need a valid, empty fd 0."""
    ws = make_ws({"targets/p.toml": '[a]\nkind = "genrule"\nouts = ["o"]\ncmd = "cat > o; echo rc=$? >> o"\n'})
    run = ws.build("//p:a")
    assert run.rc == 0, run.stderr
    assert ws.read_output("//p:a", "o") == "rc=0\n"


def test_many_input_mounts_are_merged_into_one():
    from build_graph.model import FileEntry, Tree
    from build_graph.sandbox import MAX_MOUNTS, coalesced_mounts
    f = FileEntry("a" * 64, 1)
    inputs = tuple((f"/bgraph/in/d{i}", Tree({"o.txt": f})) for i in range(MAX_MOUNTS + 1)) + (("/bgraph/src", Tree({"s": f})),)
    mounts = coalesced_mounts(inputs)
    assert [m for m, _ in mounts] == ["/bgraph/src", "/bgraph/in"]
    assert mounts[1][1].entries["d7/o.txt"] == f and len(mounts[1][1]) == MAX_MOUNTS + 1
    assert coalesced_mounts(inputs[:3]) == list(inputs[:3])  # few mounts: unchanged


@requires_bwrap
def test_an_action_with_thousands_of_inputs_and_variables_runs(tmp_path):
    """A target with 4,000 dependencies: 4,000 mounts (merged) and 4,000 $IN_ variables, more
    than bwrap's 9,000 arguments would hold as --setenv options."""
    from build_graph.model import Action, Digester, Tree
    from build_graph.sandbox import BwrapRunner
    from build_graph.store.cas import LocalCas

    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    f = cas.put_bytes(b"x\n")
    n = 4000
    action = Action(name="many", mnemonic="Genrule", argv=("/usr/bin/sh", "-c", 'ls /bgraph/in | wc -l > /bgraph/out/n; '
                                                         'echo "$IN_D3999" > /bgraph/out/v'),
                    env=tuple(sorted({f"IN_D{i}": f"/bgraph/in/d{i}" for i in range(n)}.items())),
                    inputs=tuple((f"/bgraph/in/d{i}", Tree({"o.txt": f})) for i in range(n)),
                    outputs=("n", "v"), host_paths=("/usr",))
    tree, _result = BwrapRunner(cas).run(action)
    assert cas.read_bytes(tree.entries["n"]).strip() == b"4000"
    assert cas.read_bytes(tree.entries["v"]).strip() == b"/bgraph/in/d3999"
    cas.close()


def test_host_tool_probes_are_remembered_until_the_binary_changes(tmp_path):
    """A no-op build neither hashes nor runs the host tools again; a changed binary is re-probed."""
    import shutil

    from build_graph.model import Digester
    from build_graph.sandbox import probe_host_tools
    from build_graph.store.json_table import JsonTable

    import time

    from build_graph.incremental import filestate

    def settle():  # a stamp taken within the racy window is not remembered
        time.sleep(filestate.RACY_NS / 1e9 + 0.05)

    tool = tmp_path / "tool"
    shutil.copy("/usr/bin/true", tool)
    settle()
    table = JsonTable(tmp_path / "host-tools.json", tmp_path)
    [first] = probe_host_tools((str(tool),), Digester("blake3"), table)
    assert "true" in first.version and table.dirty
    table.save()

    again = JsonTable(tmp_path / "host-tools.json", tmp_path)
    shutil.copy("/usr/bin/false", tool)  # a write moves the stamp: the probe runs again
    settle()
    [changed] = probe_host_tools((str(tool),), Digester("blake3"), again)
    assert changed.digest != first.digest and "false" in changed.version
    # Unchanged since: the recorded probe is used (even a wrong recorded version is believed).
    key = f"blake3:{tool}"
    again.table[key][7] = "recorded"
    [kept] = probe_host_tools((str(tool),), Digester("blake3"), again)
    assert kept.version == "recorded" and kept.digest == changed.digest


# -- peak memory: the action's own processes, never bgraph's --------------------------------------
# 300 MiB allocated and written by a grandchild of the sandbox's init, held for a second (so the
# sampling fallback sees it too); and an action that allocates nothing.
MEMORY = {"targets/p.toml": '''[alloc]
kind = "genrule"
outs = ["o.txt"]
cmd = "/usr/bin/python3 -c 'import time; b = b\\"x\\" * (300 << 20); time.sleep(1)' && echo ok > $OUT/o.txt"

[trivial]
kind = "genrule"
outs = ["o.txt"]
cmd = "echo ok > $OUT/o.txt"
'''}


@requires_bwrap
@pytest.mark.parametrize("mechanism", ["cgroup", "sampling"])
def test_peak_memory_is_the_actions_own_even_when_bgraph_is_large(make_ws, monkeypatch, mechanism):
    """Issue 23: a child's ru_maxrss starts from its forking parent's high-water mark, so every
    action of a 1.9 GiB bgraph reported 1.9 GiB. Here the build runs in this test's process
    (the Engine API), made large first: the allocating action reports what it allocated, the
    trivial one next to nothing."""
    import resource

    from build_graph import cgroups
    from build_graph.cgroups import Accounting

    if mechanism == "cgroup" and Accounting.probe().memory is None:
        from test_cgroups import no_cgroup_reason
        pytest.skip(no_cgroup_reason().replace("per-action CPU time", "per-action memory through a cgroup"))
    if mechanism == "sampling":  # a host without memory cgroups: the process tree is sampled
        monkeypatch.setattr(cgroups.MemoryAccounting, "probe", classmethod(lambda cls, *a, **k: None))
    ws = make_ws(MEMORY)
    ballast = b"\1" * (1536 << 20)  # written, so resident: bgraph's process is 1.5 GiB now
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >= 1536 << 10
    try:
        result = ws.engine_build("//p:alloc", "//p:trivial", jobs=1)
    finally:
        del ballast
    assert not result.failures, [f.render() for f in result.failures]
    peaks = {r.label: r.peak_mb for r in result.records}
    assert 250 <= peaks["//p:alloc"] <= 400, peaks
    assert peaks["//p:trivial"] < 50, peaks
    runner = ws.engine()  # which mechanism measured it
    assert (runner.sandbox.accounting.memory is not None) == (mechanism == "cgroup")


# -- no capability, as root too (issue 33) ---------------------------------------------------------
# Run as root (as CI and the README's setup do), an action is uid 0: bwrap kept every capability
# (CapEff 000001fffeffffff) and `mount -o remount,rw` made its read-only inputs writable, a
# dependency's CAS blob among them. Each check prints NAME=yes|no (whether the command
# succeeded). Whatever the sandbox allows, nothing of the host is written: the dependency's blob
# lies in this test's own cache, and /usr and /proc/sys are only remounted or asked (`test -w`).
CAPS_PROBE = r"""
check() { if sh -c "$2" >/dev/null 2>&1; then echo "$1=yes"; else echo "$1=no"; fi; }
for f in CapInh CapPrm CapEff CapBnd CapAmb NoNewPrivs; do
  echo "$f=$(sed -n "s/^$f:[[:space:]]*//p" /proc/self/status)"
done
echo "init_CapEff=$(sed -n 's/^CapEff:[[:space:]]*//p' /proc/1/status)"
echo "uid=$(id -u)"
check mount_tmpfs           'mkdir -p /tmp/m && mount -t tmpfs none /tmp/m'
check bind_mount            'mkdir -p /tmp/b && mount --bind /tmp /tmp/b'
check remount_src           'mount -o remount,rw /bgraph/src'
check remount_src_bind      'mount -o remount,bind,rw /bgraph/src'
check remount_dep           'mount -o remount,rw /bgraph/in/dep'
check remount_dep_bind      'mount -o remount,bind,rw /bgraph/in/dep'
check remount_usr           'mount -o remount,rw /usr'
check remount_usr_bind      'mount -o remount,bind,rw /usr'
check mknod_char            'mknod /tmp/null c 1 3'
check mknod_block           'mknod /tmp/loop b 7 0'
check chown_other           'touch /tmp/f && chown 1:1 /tmp/f'
check chroot                'chroot / /usr/bin/true'
check nested_userns         'unshare -U true'
check proc_sys_writable     'test -w /proc/sys/kernel/core_pattern || test -w /proc/sys/vm/drop_caches'
check write_dep             'echo poisoned >> /bgraph/in/dep/o.txt'
check chmod_dep             'chmod u+w /bgraph/in/dep/o.txt'
check truncate_dep          ': > /bgraph/in/dep/o.txt'
check link_dep              'ln /bgraph/in/dep/o.txt /bgraph/out/hardlink'
check read_dep              'test "$(cat /bgraph/in/dep/o.txt)" = dep-output'
check fifo                  'mkfifo /tmp/fifo'
check umount_dep            'umount -l /bgraph/in/dep'
"""


@pytest.fixture(scope="module")
def caps_report(tmp_path_factory):
    """One sandboxed run of CAPS_PROBE through the CLI, with a dependency mounted at /bgraph/in/dep."""
    root = tmp_path_factory.mktemp("caps") / "ws"
    ws = WS(root, root.parent / "cache")
    write_files(root, {
        "WORKSPACE.toml": WORKSPACE_TOML,
        "targets/toolchains.toml": TOOLCHAINS_TOML,
        "caps.sh": CAPS_PROBE,
        "targets/p.toml": '[dep]\nkind = "genrule"\nouts = ["o.txt"]\ncmd = "echo dep-output > $OUT/o.txt"\n\n'
                          '[probe]\nkind = "genrule"\nsrcs = ["caps.sh"]\ndeps = { dep = ":dep" }\n'
                          'outs = ["report.txt"]\ncmd = "sh $SRC/caps.sh > $OUT/report.txt 2>&1"\n',
    })
    run = ws.build("//p:probe", "//p:dep")
    assert run.rc == 0, run.stderr
    values, _env = parse(ws.read_output("//p:probe", "report.txt"))
    return ws, values


@requires_bwrap
def test_an_action_holds_no_capability_even_as_root(caps_report):
    _ws, v = caps_report
    if os.geteuid() == 0:
        assert v["uid"] == "0"  # the case this is about: bgraph as root, the action uid 0
    for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "init_CapEff"):
        assert v[name] == "0000000000000000", (name, v[name])
    # An empty bounding set and no_new_privs: no setuid binary or file capability gives one back
    # (mount(8), setuid root on Debian, is what failed to mount below).
    assert v["NoNewPrivs"] == "1"


@requires_bwrap
def test_an_action_can_neither_mount_nor_remount_nor_make_devices(caps_report):
    _ws, v = caps_report
    for name in ("mount_tmpfs", "bind_mount", "remount_src", "remount_src_bind", "remount_dep",
                 "remount_dep_bind", "remount_usr", "remount_usr_bind", "umount_dep", "mknod_char",
                 "mknod_block", "chown_other", "chroot", "proc_sys_writable"):
        assert v[name] == "no", f"{name}: the action could do it"
    assert v["fifo"] == "yes"  # what needs no privilege still works


@requires_bwrap
def test_an_action_cannot_open_a_nested_user_namespace(caps_report):
    """Where bwrap can forbid it (0.8 or newer, user namespaces on): a nested one would give
    the action every capability again, over that namespace."""
    from build_graph.sandbox import find_bwrap, nesting_options
    if not nesting_options(find_bwrap()):
        pytest.skip("this bubblewrap or host cannot forbid nested user namespaces (bwrap --disable-userns)")
    _ws, v = caps_report
    assert v["nested_userns"] == "no"


@requires_bwrap
def test_a_dependencys_cached_output_cannot_be_written_through_its_mount(caps_report):
    ws, v = caps_report
    assert v["read_dep"] == "yes"
    for name in ("write_dep", "chmod_dep", "truncate_dep", "link_dep"):
        assert v[name] == "no", f"{name}: the action could do it"
    # The blob itself, in the store: its bytes and its read-only mode are as stored.
    blob = (ws.root / "bgraph-out/p/dep/o.txt").resolve()
    assert blob.read_text() == "dep-output\n"
    assert blob.stat().st_mode & 0o777 == 0o444
    run = ws.cli("cache", "verify")
    assert run.rc == 0, run.output


@requires_bwrap
def test_actions_started_through_spares_hold_no_capability_either(tmp_path):
    """The two ways an action starts (directly, and through a spare waiting in its cgroups)
    give bwrap the same options: capabilities are dropped on both."""
    from build_graph.model import Action, Digester
    from build_graph.sandbox import BwrapRunner
    from build_graph.store.cas import LocalCas

    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    runner = BwrapRunner(cas, jobs=1)
    try:
        seen = []
        for i in range(4):
            action = Action(name=f"caps{i}", mnemonic="Genrule", env=(("N", str(i)), ("PATH", "/usr/bin")),
                            argv=("/usr/bin/sh", "-c", "grep -E '^(Cap|NoNewPrivs)' /proc/self/status > /bgraph/out/s"),
                            inputs=(), outputs=("s",), host_paths=("/usr",))
            tree, _result = runner.run(action)
            seen.append(dict(line.split(":\t") for line in cas.read_bytes(tree.entries["s"]).decode().splitlines()))
            deadline = time.monotonic() + 10  # let the starter thread have the next spare ready
            while runner.spares is not None and runner.spares._open and not runner.spares._ready \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
        for status in seen:
            assert {k: v for k, v in status.items() if k.startswith("Cap")} == dict.fromkeys(
                ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"), "0000000000000000"), status
            assert status["NoNewPrivs"] == "1"
        if runner.spares is not None:
            assert runner.spares.taken >= 1  # the later ones came through a spare
    finally:
        runner.close()
        cas.close()


def _next_spare_ready(runner, timeout: float = 10) -> None:
    """Let the starter thread have the next spare ready, as a build's planning does."""
    deadline = time.monotonic() + timeout
    while runner.spares is not None and runner.spares._open and not runner.spares._ready \
            and time.monotonic() < deadline:
        time.sleep(0.01)


@requires_bwrap
def test_a_failing_action_reports_its_stdout_and_stderr_however_it_started(tmp_path):
    """stdout and stderr are memory files now (no file per action): a failing action's error
    still carries both, whether it started directly or through a spare; a successful one's are
    stored."""
    from build_graph.errors import ActionFailed
    from build_graph.model import Action, Digester
    from build_graph.sandbox import BwrapRunner
    from build_graph.store.cas import LocalCas

    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    runner = BwrapRunner(cas, jobs=1)
    try:
        for i in range(4):  # the first `jobs` start directly, the later ones through spares where cgroups allow
            fail = Action(name=f"fail{i}", mnemonic="Genrule", env=(("N", str(i)),),
                          argv=("/usr/bin/sh", "-c", f"echo out-{i}; echo err-{i} >&2; exit 3"),
                          inputs=(), outputs=("x",), host_paths=("/usr",))
            with pytest.raises(ActionFailed) as e:
                runner.run(fail)
            assert "exited with status 3" in str(e.value) and f"out-{i}" in str(e.value) and f"err-{i}" in str(e.value)
            _next_spare_ready(runner)
            ok = Action(name=f"ok{i}", mnemonic="Genrule", env=(("N", str(i)),),
                        argv=("/usr/bin/sh", "-c", f"echo so-{i}; echo se-{i} >&2; echo {i} > /bgraph/out/x"),
                        inputs=(), outputs=("x",), host_paths=("/usr",))
            tree, result = runner.run(ok)
            assert cas.read_bytes(tree.entries["x"]) == f"{i}\n".encode()
            assert cas.blob_path(result.stdout).read_bytes() == f"so-{i}\n".encode()
            assert cas.blob_path(result.stderr).read_bytes() == f"se-{i}\n".encode()
            _next_spare_ready(runner)
        if runner.spares is not None:
            assert runner.spares.taken >= 2
        # No file of the action's own (options, launch script, stdout, stderr) is left or made
        # beside its output directory: the staging holds at most the one idle output directory.
        assert [p.name for p in cas.tmp.iterdir() if p.name.startswith("act-")] == ["act-0"]
    finally:
        runner.close()
        cas.close()


@requires_bwrap
def test_an_output_directory_is_reused_only_when_nothing_of_the_last_action_is_left(tmp_path):
    """An action's output directory serves the next action once emptied, unless the action
    changed the directory itself (its mode, an extended attribute): then a new one is made. No
    action sees anything an earlier one left in or on /bgraph/out."""
    from build_graph.model import Digester
    from build_graph.sandbox import BwrapRunner
    from build_graph.store.cas import LocalCas

    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    runner = BwrapRunner(cas, jobs=1)
    look = ("ls -A /bgraph/out > /tmp/l; stat -c '%a %s %h' /bgraph/out >> /tmp/l; "
            "python3 -c \"import os; print(os.listxattr('/bgraph/out'))\" >> /tmp/l; mv /tmp/l /bgraph/out/l")

    def run(name: str, cmd: str) -> str:
        return _shell_output(runner, cas, name, cmd)

    try:
        fresh = run("first", look)
        assert fresh.splitlines()[0] != "l" and fresh.splitlines()[-1] == "[]", fresh
        # Leaves an undeclared file, a directory and a dangling link: emptied, and reused.
        run("litter", "mkdir -p d/e; echo x > d/e/f; echo y > stray; ln -s /nowhere link; chmod 500 d; echo > l")
        assert run("after-litter", look) == fresh
        reused = {p.name for p in cas.tmp.iterdir() if p.name.startswith("act-")}
        # Changes the directory itself: never reused.
        run("chmod", "echo > l; chmod 700 /bgraph/out")
        assert run("after-chmod", look) == fresh
        run("xattr", "echo > l; python3 -c \"import os; os.setxattr('/bgraph/out', 'user.left', b'1')\"")
        assert run("after-xattr", look) == fresh
        now = {p.name for p in cas.tmp.iterdir() if p.name.startswith("act-")}
        assert len(now) == 1 and now != reused  # the changed ones were removed, a new one made
    finally:
        runner.close()
        cas.close()
    assert not any(p.name.startswith("act-") for p in cas.tmp.iterdir()) if cas.tmp.exists() else True


def _shell_output(runner, cas, name: str, cmd: str) -> str:
    """Run `cmd` under sh as action `name` (the host's /usr) and return the file `l` it writes."""
    from build_graph.model import Action

    action = Action(name=name, mnemonic="Genrule", env=(("PATH", "/usr/bin"),), argv=("/usr/bin/sh", "-c", cmd),
                    inputs=(), outputs=("l",), host_paths=("/usr",))
    tree, _result = runner.run(action)
    return cas.read_bytes(tree.entries["l"]).decode()


@requires_bwrap
def test_what_an_action_leaves_in_or_on_its_output_directory_reaches_no_later_action(tmp_path):
    """An action leaves a FIFO (emptying the directory opened it: bgraph hung), a unix socket
    (a TypeError), a directory 2,100 deep (a RecursionError, and the staging left behind), and
    sets /bgraph/out's atime and mtime far ahead (the next action read them): the build goes on,
    the directory is emptied and reused, and the next action sees the times every new one has."""
    import threading

    from build_graph.model import Digester
    from build_graph.sandbox import BwrapRunner
    from build_graph.store.cas import FIXED_MTIME, LocalCas

    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    runner = BwrapRunner(cas, jobs=1)
    litter = ("echo > l; mkfifo stray; python3 -c \"import os, socket; socket.socket(socket.AF_UNIX).bind('sock')\n"
              "for _ in range(2100): os.mkdir('d'); os.chdir('d')\"; "
              "touch -d @4000000000.123456789 /bgraph/out")
    look = "stat -c '%X %Y' /bgraph/out > /tmp/l; ls -A /bgraph/out >> /tmp/l; mv /tmp/l /bgraph/out/l"

    def run(name: str, cmd: str) -> str:
        return _shell_output(runner, cas, name, cmd)

    try:
        fresh = run("first", look)
        assert fresh == f"{FIXED_MTIME} {FIXED_MTIME}\n", fresh
        first_dir = {p.name for p in cas.tmp.iterdir() if p.name.startswith("act-")}
        done, failed = threading.Event(), []

        def litter_run():
            try:
                run("litter", litter)
            except BaseException as e:  # reported below
                failed.append(e)
            done.set()

        threading.Thread(target=litter_run, daemon=True).start()
        assert done.wait(300), "emptying the output directory hung"
        assert failed == []
        assert run("after", look) == fresh
        assert {p.name for p in cas.tmp.iterdir() if p.name.startswith("act-")} == first_dir  # reused
    finally:
        runner.close()
        cas.close()
    assert not any(p.name.startswith("act-") for p in cas.tmp.iterdir()) if cas.tmp.exists() else True


UMASK_AND_LOCALE = ('[a]\nkind = "genrule"\nouts = ["u", "d", "o"]\n'
                    'cmd = "umask > $OUT/u && mkdir $OUT/d && echo x > $OUT/d/f && echo café > $OUT/o"\n')


def test_outputs_do_not_depend_on_the_callers_umask_or_locale(make_ws, tmp_path):
    """The caller's umask (077, or 0277, which left the staging directory unwritable) and a
    non-UTF-8 locale (whose encoding turned the command's bytes into Latin-1) reach no output:
    two caches, one key, one content (red-team read)."""
    import subprocess

    runs = {}
    locale = tmp_path / "loc"
    made = subprocess.run(["localedef", "-i", "en_US", "-f", "ISO-8859-1", str(locale / "en_US.ISO-8859-1")],
                          capture_output=True)
    latin1 = {"LOCPATH": str(locale), "LC_ALL": "en_US.ISO-8859-1", "PYTHONUTF8": "0"} if made.returncode in (0, 1) \
        and (locale / "en_US.ISO-8859-1").is_dir() else {"LC_ALL": "POSIX", "PYTHONUTF8": "0"}
    for name, mask, env in (("plain", 0o022, {}), ("private", 0o077, {}), ("odd", 0o277, latin1)):
        ws = make_ws({"targets/p.toml": UMASK_AND_LOCALE}, name=name)
        old = os.umask(mask)
        try:
            run = ws.build("//p:a", env=env)
        finally:
            os.umask(old)
        assert run.rc == 0, run.output
        out = ws.root / "bgraph-out/p/a"
        runs[name] = ([a["key"] for a in run.json["actions"] if a["name"] == "genrule"],
                      (out / "u").read_text(), oct((out / "d").stat().st_mode & 0o777),
                      oct((out / "d/f").stat().st_mode & 0o777), (out / "o").read_bytes())
    assert runs["plain"][1:] == ("0022\n", "0o555", "0o444", "café\n".encode()), runs["plain"]
    assert runs["private"] == runs["plain"] and runs["odd"] == runs["plain"], runs
