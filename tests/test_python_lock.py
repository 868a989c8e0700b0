"""python_lock targets and `bgraph py lock` (issue 35, item 2): the lock file's format, and, with real
uv against a PEP 503 index this module serves on 127.0.0.1 (wheels it writes), a lock per platform,
its refresh and diff, a build that fetches and unpacks the locked wheels, and the refusals."""

from __future__ import annotations

import hashlib
import http.server
import json
import sys
import threading
import zipfile
from functools import partial
from pathlib import Path

import pytest

from bgraph_testlib import WS, WORKSPACE_TOML
from build_graph.python_lock.lockfile import Lock, LockedWheel, LockInput, PyLockError, diff, parse, render

try:
    from build_graph.python_lock.locking import uv_command

    uv_command()
    HAVE_UV = True
except Exception:  # noqa: BLE001 - no uv: the resolver tests are skipped, saying why
    HAVE_UV = False
requires_uv = pytest.mark.skipif(not HAVE_UV, reason="uv is not installed (pip install uv; it is a test extra)")

SHA = "a" * 64


def _lock(**versions: str) -> Lock:
    wheels = tuple(LockedWheel(n, v, f"{n.replace('-', '_')}-{v}-py3-none-any.whl", SHA, 10)
                   for n, v in sorted(versions.items()))
    return Lock(LockInput(("app==1",), "3.11", "2.36", ("x86_64",)), "uv", {"x86_64": wheels})


def test_the_lock_renders_one_line_per_wheel_and_reads_back():
    lock = _lock(core="1.0", app="1")
    text = render(lock)
    assert parse(text, "l.json") == lock and render(parse(text, "l.json")) == text
    lines = text.splitlines()
    assert sum(1 for l in lines if l.strip().startswith('{"name"')) == 2
    assert json.loads(text)["platforms"]["x86_64"][0]["name"] == "app"  # sorted


def test_the_diff_names_added_removed_and_bumped_packages():
    old, new = _lock(core="1.0", gone="2"), _lock(core="1.1", added="3")
    assert diff(old, new) == ["x86_64: + added 3", "x86_64: core 1.0 -> 1.1", "x86_64: - gone 2"]
    assert diff(None, _lock(core="1.0")) == ["x86_64: + core 1.0"]
    assert diff(new, new) == []


@pytest.mark.parametrize("text, message", [
    ("{", "not JSON"),
    ('{"lock_version": 9}', "not a python lock of version 1"),
    ('{"lock_version": 1, "input": {}}', "malformed lock"),
])
def test_a_broken_lock_is_one_error_naming_the_file(text, message):
    with pytest.raises(PyLockError) as e:
        parse(text, "locks/x.lock.json")
    assert e.value.render().startswith(f"locks/x.lock.json: {message}")
    assert "hint: write it again with `bgraph py lock`" in e.value.render()


# -- a real index on 127.0.0.1 and real uv ------------------------------------------------------------
def _wheel(files_dir: Path, name: str, version: str, tag: str = "py3-none-any", requires=(),
           files: dict[str, str] | None = None) -> Path:
    """A minimal valid wheel (METADATA, WHEEL, RECORD) holding `files`."""
    dist = name.replace("-", "_")
    path = files_dir / f"{dist}-{version}-{tag}.whl"
    files = files if files is not None else {f"{dist}/__init__.py": f"VERSION = {version!r}\n"}
    info = f"{dist}-{version}.dist-info"
    meta = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                + "".join(f"Requires-Dist: {r}\n" for r in requires),
            f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: bgraph-test\nRoot-Is-Purelib: "
                             f"{'true' if tag.startswith('py3-none') else 'false'}\nTag: {tag}\n"}
    with zipfile.ZipFile(path, "w") as z:
        for p, text in {**files, **meta}.items():
            z.writestr(p, text)
        z.writestr(f"{info}/RECORD", "".join(f"{p},,\n" for p in [*files, *meta]) + f"{info}/RECORD,,\n")
    return path


def _publish(root: Path) -> None:
    """The PEP 503 pages of every wheel under root/files (links carry their sha256)."""
    by_project: dict[str, list[Path]] = {}
    for whl in sorted((root / "files").glob("*.whl")):
        by_project.setdefault(whl.name.split("-")[0].replace("_", "-").lower(), []).append(whl)
    for project, wheels in by_project.items():
        page = root / "simple" / project
        page.mkdir(parents=True, exist_ok=True)
        links = "".join(f'<a href="../../files/{w.name}#sha256={hashlib.sha256(w.read_bytes()).hexdigest()}">'
                        f"{w.name}</a>\n" for w in wheels)
        (page / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def index(tmp_path):
    """An index served on 127.0.0.1: app -> core (1.0, 1.1) and native (a wheel per CPU and a
    pure fallback, which the lock must not take)."""
    root = tmp_path / "index"
    (root / "files").mkdir(parents=True)
    f = root / "files"
    _wheel(f, "bgdemo-app", "1.0", requires=["bgdemo-core>=1.0", "bgdemo-native"])
    _wheel(f, "bgdemo-core", "1.0")
    _wheel(f, "bgdemo-core", "1.1")
    for cpu in ("x86_64", "aarch64"):
        _wheel(f, "bgdemo-native", "2.0", tag=f"cp311-cp311-manylinux_2_17_{cpu}",
               files={"bgdemo_native/__init__.py": f"CPU = {cpu!r}\n"})
    _wheel(f, "bgdemo-native", "2.0", files={"bgdemo_native/__init__.py": "CPU = 'any'\n"})
    _publish(root)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}/simple"
    server.shutdown()
    server.server_close()


TARGETS = """\
package = "//py"

[env]
kind = "python_lock"
lock = "locks/app.lock.json"
requirements = ["bgdemo-app==1.0"]

[core]
base = ":env"
packages = ["bgdemo-core"]

[clash]
base = ":env"
packages = ["bgdemo-core", "bgdemo-clash"]
"""


def _workspace(tmp_path: Path, url: str) -> WS:
    ws = WS(tmp_path / "ws", tmp_path / "cache", env={"PIP_INDEX_URL": url})
    ws.write({"WORKSPACE.toml": WORKSPACE_TOML, "targets/py.toml": TARGETS})
    return ws


@requires_uv
def test_lock_resolves_per_platform_refreshes_with_a_diff_and_builds(tmp_path, index):
    root, url = index
    ws = _workspace(tmp_path, url)
    run = ws.cli("py", "lock")
    assert run.rc == 0, run.output
    assert "locks/app.lock.json (//py:clash, //py:core, //py:env) written: aarch64 3 wheels" in run.stdout
    assert "x86_64: + bgdemo-core 1.1" in run.stdout and "aarch64: + bgdemo-native 2.0" in run.stdout
    lock = parse((ws.root / "locks/app.lock.json").read_text(), "l")
    files = {p: {w.name: w.filename for w in ws_} for p, ws_ in lock.platforms.items()}
    # the platform's own wheel, not the pure fallback
    assert files["x86_64"]["bgdemo-native"] == "bgdemo_native-2.0-cp311-cp311-manylinux_2_17_x86_64.whl"
    assert files["aarch64"]["bgdemo-native"] == "bgdemo_native-2.0-cp311-cp311-manylinux_2_17_aarch64.whl"
    for w in lock.platforms["x86_64"]:
        assert w.sha256 == hashlib.sha256((root / "files" / w.filename).read_bytes()).hexdigest()
        assert w.size == (root / "files" / w.filename).stat().st_size
    assert "http" not in (ws.root / "locks/app.lock.json").read_text()  # no index named: pip's config finds it

    again = ws.cli("py", "lock", "//py:env")
    assert again.rc == 0 and "unchanged" in again.stdout and "+ " not in again.stdout, again.output

    # a new release: the refresh says what moved, per platform
    _wheel(root / "files", "bgdemo-core", "1.2")
    _publish(root)
    bumped = ws.cli("py", "lock")
    assert bumped.rc == 0, bumped.output
    assert "x86_64: bgdemo-core 1.1 -> 1.2" in bumped.stdout and "aarch64: bgdemo-core 1.1 -> 1.2" in bumped.stdout

    # a build fetches the locked wheels (fixed outputs) and unpacks them: the whole closure, or a group
    built = ws.build("//py:env", "//py:core")
    assert built.rc == 0, built.output
    env, core = (Path(built.json["outputs"][l]) for l in ("//py:env", "//py:core"))
    assert (env / "bgdemo_core/__init__.py").read_text() == "VERSION = '1.2'\n"
    import platform as _p
    assert (env / "bgdemo_native/__init__.py").read_text() == f"CPU = {_p.machine()!r}\n"
    assert (env / "bgdemo_core-1.2.dist-info/METADATA").is_file()
    assert sorted(p.name for p in core.iterdir()) == ["bgdemo_core", "bgdemo_core-1.2.dist-info"]


@requires_uv
def test_lock_and_build_refusals_are_one_line_with_a_hint(tmp_path, index):
    root, url = index
    ws = _workspace(tmp_path, url)
    assert ws.cli("py", "lock").rc == 0
    # the target asks for other requirements than the lock was made from
    ws.write({"targets/py.toml": TARGETS.replace('["bgdemo-app==1.0"]', '["bgdemo-app==1.0", "bgdemo-core<1.1"]')})
    run = ws.build("//py:env")
    assert run.rc == 1 and "Traceback" not in run.stderr
    assert "locks/app.lock.json is out of date" in run.stderr and "hint: run `bgraph py lock //py:env`" in run.stderr
    # two packages of one target holding one path with other bytes
    _wheel(root / "files", "bgdemo-clash", "1.0", files={"bgdemo_core/__init__.py": "CLASH = 1\n"})
    _publish(root)
    ws.write({"targets/py.toml": TARGETS.replace('["bgdemo-app==1.0"]', '["bgdemo-app==1.0", "bgdemo-clash"]')})
    assert ws.cli("py", "lock").rc == 0
    run = ws.build("//py:clash")
    assert run.rc == 1 and "Traceback" not in run.stderr
    assert "install bgdemo_core/__init__.py with other contents" in run.stderr, run.stderr
    # nothing resolves: uv's reason in one line
    ws.write({"targets/py.toml": TARGETS.replace('["bgdemo-app==1.0"]', '["bgdemo-app==9.9"]')})
    run = ws.cli("py", "lock")
    assert run.rc != 0 and "Traceback" not in run.stderr
    assert "uv found no resolution for" in run.stderr and "bgdemo-app" in run.stderr, run.stderr
    # a target of another kind
    run = ws.cli("py", "lock", "//py:nothing")
    assert run.rc != 0 and "Traceback" not in run.stderr


def test_the_workspace_lock_fits_its_targets_and_pins_torch_as_the_workspace_does():
    """locks/vllm-runtime.lock.json is what //runtime asks for, for both CPUs, and takes the very
    torch wheel WORKSPACE.toml pins for the wheel checks (same file, same sha256)."""
    import tomllib

    from build_graph.python_lock.lockfile import parse as parse_lock

    repo = Path(__file__).resolve().parents[1]
    lock = parse_lock((repo / "locks/vllm-runtime.lock.json").read_text(), "locks/vllm-runtime.lock.json")
    assert set(lock.platforms) == {"x86_64", "aarch64"}
    pins = tomllib.loads((repo / "WORKSPACE.toml").read_text())["pins"]
    for platform in ("x86_64", "aarch64"):
        torch = next(w for w in lock.platforms[platform] if w.name == "torch")
        pin = pins["py-torch"]["platforms"][platform]
        assert (torch.version, torch.filename, torch.sha256) == ("2.14.0", pin["filename"], pin["sha256"])
        names = {w.name for w in lock.platforms[platform]}
        assert {"vllm", "flashinfer-python", "nvidia-cublas", "transformers", "fastapi"} <= names
        assert not any(n in names for n in ("nvidia-driver", "nvidia-ml")), "no driver library in the closure"
    runtime = tomllib.loads((repo / "targets/runtime.toml").read_text())["vllm-cuda"]
    assert lock.input.requirements == tuple(sorted(runtime["requirements"]))


# -- what reaches uv, and where it runs (red-team K15 hole 2) -------------------------------------------
@pytest.mark.parametrize("line, name", [
    ("six", "six"),
    ("Foo.Bar[extra]>=1,<2; python_version >= '3.8'", "foo-bar[extra]<2,>=1; python_version >= \"3.8\""),
    ("requirements.in", "requirements-in"),  # uv is given no dotted name: it may read one as a file
    ("jaraco.zip>=3", "jaraco-zip>=3"),  # a real project: not refused for looking like an archive
    ("evilproj.tar.gz", "evilproj-tar-gz"),
    ("torch==2.14.0", "torch==2.14.0"),
])
def test_a_pep508_requirement_by_name_is_given_to_uv_in_packagings_form(line, name):
    from build_graph.python_lock.requirements import canonical

    assert canonical(line) == name


class _Recording(_Quiet):
    seen: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        self.seen.append(self.path)
        super().do_GET()


@requires_uv
def test_a_requirement_line_uv_would_obey_as_an_option_or_a_path_is_refused_at_load(tmp_path, index):
    """`-e DIR` built the workspace's setup.py on the host, `-r FILE` read a host file into the error,
    `--extra-index-url` asked a server the workspace named: each is refused, naming target, key and line."""
    _, url = index
    ws = _workspace(tmp_path, url)
    ran = tmp_path / "setup-py-ran"
    ws.write({"proj/setup.py": f"open({str(ran)!r}, 'w').write('ran')\n"
                               "from setuptools import setup\nsetup(name='evilproj', version='1.0')\n"})
    secret = tmp_path / "secret.txt"
    secret.write_text("secret-token-xyzzy\n")
    attacker = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_Recording, directory=str(tmp_path)))
    threading.Thread(target=attacker.serve_forever, daemon=True).start()
    other = f"http://127.0.0.1:{attacker.server_address[1]}"
    proj = ws.root / "proj"
    try:
        for line in ["-e ${PWD}/proj", f"-e {proj}", f"-r {secret}", f"--extra-index-url {other}/simple",
                     f"--index-url {other}/simple", f"--find-links {other}/", f"evilproj @ file://{proj}",
                     str(proj), "./proj", 'six; os_name == "$HOME"',
                     f'bgdemo-core; os_name == "x --extra-index-url {other}/simple"', f"six # -e {proj}"]:
            requirements = f'["bgdemo-app==1.0", {json.dumps(line)}]'
            ws.write({"targets/py.toml": TARGETS.replace('["bgdemo-app==1.0"]', requirements)})
            run = ws.cli("py", "lock")
            assert run.rc != 0 and "Traceback" not in run.stderr, (line, run.output)
            errors = [l for l in run.stderr.splitlines() if l.startswith("error:")]
            assert len(errors) == 1 and "[env] key 'requirements'" in errors[0] and repr(line) in errors[0], \
                (line, run.stderr)
            assert not ran.exists(), f"{line!r} ran the workspace's setup.py"
            assert "xyzzy" not in run.output and not _Recording.seen, (line, run.output, _Recording.seen)
            assert not (ws.root / "locks").exists()
    finally:
        attacker.shutdown()
        attacker.server_close()


@requires_uv
def test_uv_runs_in_a_directory_of_its_own_not_the_workspace(tmp_path, index):
    """uv looks for an interpreter in its working directory: a workspace's `.venv/bin/python` ran on
    the host while uv ran in the workspace."""
    _, url = index
    ws = _workspace(tmp_path, url)
    ran = tmp_path / "venv-python-ran"
    ws.write({".venv/pyvenv.cfg": f"home = {Path(sys.executable).parent}\nversion = 3.11.7\n",
              ".venv/bin/python": f"#!/bin/sh\necho ran > {ran}\nexec {sys.executable} \"$@\"\n"})
    (ws.root / ".venv/bin/python").chmod(0o755)
    run = ws.cli("py", "lock")
    assert run.rc == 0, run.output
    assert not ran.exists(), "uv ran the workspace's .venv/bin/python"
    assert "bgdemo-core" in (ws.root / "locks/app.lock.json").read_text()


# -- the lock file is never read or written through a symlink (red-team K15 hole 3) ---------------------
@requires_uv
def test_py_lock_refuses_a_lock_path_through_a_symlink(tmp_path, index):
    _, url = index
    ws = _workspace(tmp_path, url)
    outside = tmp_path / "outside"
    outside.mkdir()
    (ws.root / "locks").symlink_to(outside)
    run = ws.cli("py", "lock")
    assert run.rc != 0 and "Traceback" not in run.stderr, run.output
    assert "lock path locks/app.lock.json: locks is a symlink" in run.stderr and "hint:" in run.stderr, run.stderr
    assert list(outside.iterdir()) == []
    # the lock itself a link to a host file: neither read nor replaced (nor the link)
    (ws.root / "locks").unlink()
    (ws.root / "locks").mkdir()
    host = outside / "config.json"
    host.write_text('{"auths": {}}\n')
    (ws.root / "locks/app.lock.json").symlink_to(host)
    run = ws.cli("py", "lock")
    assert run.rc != 0 and "lock path locks/app.lock.json is a symlink" in run.stderr, run.output
    assert host.read_text() == '{"auths": {}}\n' and (ws.root / "locks/app.lock.json").is_symlink()
