"""deb_packages and `bgraph deb lock`, against real .deb files (dpkg-deb, or hand-made ar + tar for
hostile ones) on a real mirror this module serves on 127.0.0.1 (python's http.server), configured
through WORKSPACE.toml [debian]: nothing here reads this machine's apt configuration, except the
one `slow` test that locks real packages from it."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from bgraph_testlib import WORKSPACE_TOML, action
from build_graph.debian import DEB_ARCH
from build_graph.debian.rootfs import RootfsError, assemble, folded
from build_graph.debian.sources import AptSource, configured_sources, read_apt_sources
from build_graph.model import Digester, FileEntry, SymlinkEntry, Tree
from build_graph.workspace import host_platform
from test_archive import make_deb

DPKG_DEB = shutil.which("dpkg-deb")
pytestmark = pytest.mark.skipif(DPKG_DEB is None, reason="dpkg-deb is not installed (apt-get install -y dpkg)")
TRIPLET = {"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}
PLATFORM = host_platform()
ARCH = DEB_ARCH.get(PLATFORM, "amd64")
SUITES = ["bookworm", "bookworm-updates"]


# -- packages and a mirror ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Pkg:
    name: str
    version: str
    arch: str
    files: tuple = ()  # (path, kind, payload): kind file | exec | sym | hard (payload: the linked path)
    fields: tuple = ()  # (("Depends", "..."), ...)
    raw: bytes | None = None  # a hand-made .deb instead of one dpkg-deb builds

    @property
    def pool(self) -> str:
        return f"pool/main/{self.name[0]}/{self.name}/{self.name}_{self.version}_{self.arch}.deb"

    @property
    def control(self) -> str:
        extra = "".join(f"{k}: {v}\n" for k, v in self.fields)
        return (f"Package: {self.name}\nVersion: {self.version}\nArchitecture: {self.arch}\n"
                f"Maintainer: Test <test@invalid>\n{extra}Description: test package {self.name}\n")


_BUILT: dict[Pkg, bytes] = {}


def deb_bytes(pkg: Pkg, work: Path) -> bytes:
    """The package as dpkg-deb builds it (root owner, xz), once per module."""
    if pkg.raw is not None:
        return pkg.raw
    if pkg not in _BUILT:
        root = work / f"{pkg.name}_{pkg.version}_{pkg.arch}"
        (root / "DEBIAN").mkdir(parents=True)
        (root / "DEBIAN/control").write_text(pkg.control)
        doc = root / "usr/share/doc" / pkg.name / "copyright"
        doc.parent.mkdir(parents=True)
        doc.write_text(f"{pkg.name} is free\n")
        for path, kind, payload in pkg.files:
            target = root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            if kind == "sym":
                os.symlink(payload, target)
            elif kind == "hard":
                os.link(root / payload, target)
            else:
                target.write_text(payload)
                target.chmod(0o755 if kind == "exec" else 0o644)
        out = work / f"{root.name}.deb"
        subprocess.run([DPKG_DEB, "--build", "--root-owner-group", "-Zxz", str(root), str(out)], check=True,
                       capture_output=True, env={**os.environ, "SOURCE_DATE_EPOCH": "315532800"})
        _BUILT[pkg] = out.read_bytes()
    return _BUILT[pkg]


class Mirror:
    """A Debian archive on disk, served over HTTP: dists/SUITE/main/binary-ARCH/Packages.xz and pool/."""

    def __init__(self, root: Path, url: str, work: Path):
        self.root, self.url, self.work = root, url, work

    def publish(self, suites: dict[str, list[Pkg]]) -> None:
        if (self.root / "dists").exists():
            shutil.rmtree(self.root / "dists")
        for suite, pkgs in suites.items():
            for arch in TRIPLET:
                paragraphs = []
                for pkg in pkgs:
                    if pkg.arch not in (arch, "all"):
                        continue
                    data = deb_bytes(pkg, self.work)
                    dest = self.root / pkg.pool
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(data)
                    paragraphs.append(pkg.control.replace("Description:", f"Filename: {pkg.pool}\nSize: {len(data)}\n"
                                                          f"SHA256: {hashlib.sha256(data).hexdigest()}\nDescription:"))
                index = self.root / "dists" / suite / "main" / f"binary-{arch}" / "Packages.xz"
                index.parent.mkdir(parents=True, exist_ok=True)
                index.write_bytes(lzma.compress("\n".join(paragraphs).encode()))


def greet(arch: str, version: str) -> Pkg:
    t = TRIPLET[arch]
    return Pkg("libgreet1", version, arch, files=(
        (f"lib/{t}/libgreet.so.1", "file", f"greet {version} {arch}\n"),
        (f"lib/{t}/libgreet.so.1.copy", "hard", f"lib/{t}/libgreet.so.1"),
        (f"usr/lib/{t}/libgreet.so", "sym", f"/lib/{t}/libgreet.so.1")),  # absolute, across the fold
        fields=(("Depends", "base-lib (>= 1.0)"),))


def universe(greet_update: str = "1.1") -> dict[str, list[Pkg]]:
    """bookworm: the packages; bookworm-updates: a newer libgreet1."""
    base = [Pkg("debconf", "1.0", "all"), Pkg("arm-only", "1.0", "arm64")]
    for arch in TRIPLET:
        base += [
            Pkg("hello-tool", "1.0", arch, files=(("bin/hello", "exec", f"#!/bin/sh\necho hello {arch}\n"),),
                fields=(("Pre-Depends", "base-lib"), ("Depends", "libgreet1 (>= 1.1), mawk | awk, debconf"))),
            greet(arch, "1.0"),
            Pkg("base-lib", "1.0", arch, files=(("usr/lib/base.txt", "file", "base\n"),)),
            Pkg("awk-provider", "1.0", arch, files=(("usr/bin/awk-provider", "exec", "#!/bin/sh\n"),),
                fields=(("Provides", "awk"),)),
            Pkg("legacy-user", "1.0", arch, fields=(("Depends", "libold (<< 2.0)"),)),
            Pkg("libold", "1.0", arch, files=(("usr/lib/libold-1", "file", "1\n"),)),
            Pkg("libold", "2.0", arch, files=(("usr/lib/libold-2", "file", "2\n"),)),
            Pkg("broken-top", "1.0", arch, fields=(("Depends", "broken-mid"),)),
            Pkg("broken-mid", "1.0", arch, fields=(("Depends", "libgreet1 (>= 9.0)"),)),
            Pkg("clash-a", "1.0", arch, files=(("usr/share/clash.txt", "file", "a\n"),)),
            Pkg("clash-b", "1.0", arch, files=(("usr/share/clash.txt", "file", "b\n"),)),
        ]
    return {"bookworm": base, "bookworm-updates": [greet(arch, greet_update) for arch in TRIPLET]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(module_tmp):
    """python's http.server on 127.0.0.1 over module_tmp/www; each test's mirror is a folder in it."""
    www = module_tmp / "www"
    www.mkdir()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(www),
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.time() > deadline:
                proc.kill()
                raise RuntimeError("http.server did not start")
            time.sleep(0.05)
    yield www, f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def mirror(server, module_tmp, request):
    www, url = server
    name = request.node.name.replace("[", "-").replace("]", "").replace("/", "-")
    work = module_tmp / "debs"
    work.mkdir(exist_ok=True)
    m = Mirror(www / name, f"{url}/{name}", work)
    m.publish(universe())
    return m


TOOLS = """[tools]
kind = "deb_packages"
lock = "toolchains/tools.lock.json"
packages = ["hello-tool", "legacy-user"]
exclude = ["debconf"]
platforms.aarch64 = { packages = ["arm-only"] }
links = { "usr/bin/awk" = "awk-provider", "usr/sbin/hello" = "/bin/hello" }
"""


def deb_ws(make_ws, mirrors: list[str], targets: str = TOOLS):
    return make_ws({"WORKSPACE.toml": WORKSPACE_TOML + f"\n[debian]\nmirrors = {json.dumps(mirrors)}\n"
                                                      f"suites = {json.dumps(SUITES)}\n",
                    "targets/debs.toml": targets}, toolchains=False)


def target(name: str, packages: list[str], extra: str = "") -> str:
    return f'[{name}]\nkind = "deb_packages"\nlock = "toolchains/{name}.lock.json"\npackages = {json.dumps(packages)}\n{extra}'


def cache_files(ws) -> set[str]:
    """Every blob, directory node and action-cache entry of the workspace's cache."""
    if not ws.store.exists():
        return set()
    return {p.relative_to(ws.store).as_posix() for d in ("cas", "dirs", "ac") for p in (ws.store / d).rglob("*")
            if p.is_file()}


def only_sources_added(ws, before: set[str], sources: list[str]) -> None:
    """After a failed build, the cache holds nothing new but the workspace sources it read at planning."""
    digests = {Digester("blake3").of((ws.root / s).read_bytes()) for s in sources}
    added = cache_files(ws) - before
    assert all(p.startswith("cas/") and p.split("/")[-1].removesuffix(".x") in {d[2:] for d in digests} | digests
               for p in added), added


def one_error_line(run) -> str:
    assert "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stderr
    return errors[0]


# -- apt's configuration (pure) -------------------------------------------------------------------------
def test_apt_sources_are_read_as_apt_reads_them(tmp_path):
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    (etc / "sources.list").write_text(
        "# a comment\n"
        "deb http://one.invalid/debian bookworm main contrib  # trailing comment\n"
        "deb-src http://one.invalid/debian bookworm main\n"
        "deb [arch=arm64 signed-by=/k.gpg] http://ports.invalid/debian bookworm main\n"
        "deb http://flat.invalid/repo ./\n")
    (etc / "sources.list.d/b.sources").write_text(
        "Types: deb deb-src\nURIs: http://two.invalid/debian http://three.invalid/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n\n"
        "# off\nTypes: deb\nURIs: http://off.invalid/debian\nSuites: bookworm\nComponents: main\nEnabled: no\n\n"
        "Types: deb\nURIs: http://sec.invalid/debian-security\nSuites: bookworm-security\nComponents: main\n"
        "Architectures: amd64\n")
    (etc / "sources.list.d/a.list").write_text("deb http://a.invalid/debian bookworm main\n")
    (etc / "sources.list.d/c.list.disabled").write_text("deb http://disabled.invalid/debian bookworm main\n")
    (etc / "sources.list.d/d.sources.save").write_text("Types: deb\nURIs: http://save.invalid/\nSuites: x\n")
    got = [(s.uri, s.suites, s.components, s.architectures) for s in read_apt_sources(etc)]
    assert got == [
        ("http://one.invalid/debian", ("bookworm",), ("main", "contrib"), ()),
        ("http://ports.invalid/debian", ("bookworm",), ("main",), ("arm64",)),
        ("http://a.invalid/debian", ("bookworm",), ("main",), ()),
        ("http://two.invalid/debian", ("bookworm", "bookworm-updates"), ("main",), ()),
        ("http://three.invalid/debian", ("bookworm", "bookworm-updates"), ("main",), ()),
        ("http://sec.invalid/debian-security", ("bookworm-security",), ("main",), ("amd64",)),
    ]
    # [debian] suites narrow apt's; [debian] mirrors replace them (and apt is not read).
    narrowed = configured_sources([], ["bookworm-security"], ["main"], etc)
    assert [s.uri for s in narrowed] == ["http://sec.invalid/debian-security"]
    mine = configured_sources(["http://m.invalid/d"], SUITES, ["main"], tmp_path / "nowhere")
    assert mine == [AptSource("http://m.invalid/d", tuple(SUITES), ("main",), (), "WORKSPACE.toml [debian]")]


def test_no_mirror_configured(tmp_path):
    with pytest.raises(Exception, match="no Debian mirror is configured"):
        configured_sources([], [], ["main"], tmp_path)


# -- usrmerge and merging (pure) ------------------------------------------------------------------------
def test_usrmerge_folds_paths_and_reaims_links():
    f = FileEntry("d" * 64, 1)
    tree = Tree({
        "bin/tool": f,
        "bin/alias": SymlinkEntry("../usr/bin/real"),  # relative, across the fold: keeps meaning
        "lib64/ld.so": SymlinkEntry("../lib/x86_64-linux-gnu/ld.so.2"),  # from an absolute target
        "usr/lib/x86_64-linux-gnu/libz.so": SymlinkEntry("../../../lib/x86_64-linux-gnu/libz.so.1"),
        "usr/share/doc/p": SymlinkEntry("q"),  # untouched
        "lib": SymlinkEntry("usr/lib"),  # a package shipping the merged-usr link itself: ours wins
    })
    assert folded(tree) == {
        "usr/bin/tool": f,
        "usr/bin/alias": SymlinkEntry("real"),
        "usr/lib64/ld.so": SymlinkEntry("../lib/x86_64-linux-gnu/ld.so.2"),
        "usr/lib/x86_64-linux-gnu/libz.so": SymlinkEntry("libz.so.1"),
        "usr/share/doc/p": SymlinkEntry("q"),
    }


def test_assemble_conflicts_nesting_and_links():
    a, b = FileEntry("a" * 64, 1), FileEntry("b" * 64, 1)
    with pytest.raises(RootfsError, match="packages pa and pb both ship usr/share/x with different content"):
        assemble({"pa": Tree({"usr/share/x": a}), "pb": Tree({"usr/share/x": b})})
    assert assemble({"pa": Tree({"usr/share/x": a}), "pb": Tree({"usr/share/x": b})},
                    prefer={"usr/share/x": "pb"}).entries["usr/share/x"] == b
    # The same bytes from two packages are no conflict.
    assert assemble({"pa": Tree({"bin/x": a}), "pb": Tree({"usr/bin/x": a})}).entries["usr/bin/x"] == a
    with pytest.raises(RootfsError, match="usr/share/d/f of package pb lies below the symlink usr/share/d of package pa"):
        assemble({"pa": Tree({"usr/share/d": SymlinkEntry("e")}), "pb": Tree({"usr/share/d/f": a})})
    with pytest.raises(RootfsError, match="links: usr/bin/cc -> gcc-13: usr/bin/gcc-13 is not in the tree"):
        assemble({"pa": Tree({"usr/bin/gcc-12": a})}, links={"usr/bin/cc": "gcc-13"})
    with pytest.raises(RootfsError, match="links: usr/bin/gcc-12 is already shipped by package pa"):
        assemble({"pa": Tree({"usr/bin/gcc-12": a})}, links={"bin/gcc-12": "x"})
    tree = assemble({"pa": Tree({"usr/bin/gcc-12": a, "lib/x/libc.so.6": b})},
                    links={"usr/bin/cc": "gcc-12", "usr/sbin/cc": "/bin/gcc-12"})
    assert tree.entries["usr/bin/cc"] == SymlinkEntry("gcc-12")
    assert tree.entries["usr/sbin/cc"] == SymlinkEntry("../bin/gcc-12")
    assert {p: e for p, e in tree.entries.items() if "/" not in p} == {
        "bin": SymlinkEntry("usr/bin"), "lib": SymlinkEntry("usr/lib"), "sbin": SymlinkEntry("usr/sbin")}


# -- bgraph deb lock ------------------------------------------------------------------------------------
def packages_of(lock: dict, platform: str) -> dict[str, tuple[str, str, str]]:
    return {e["package"]: (e["version"], e["suite"], e["architecture"])
            for e in lock["platforms"][platform]["packages"]}


def test_lock_resolves_and_is_stable(make_ws, mirror):
    ws = deb_ws(make_ws, [mirror.url])
    run = ws.cli("deb", "lock")
    assert run.rc == 0, run.stderr
    path = ws.root / "toolchains/tools.lock.json"
    text = path.read_text()
    lock = json.loads(text)
    for platform, arch in DEB_ARCH.items():
        expected = {
            "hello-tool": ("1.0", "bookworm", arch),
            "base-lib": ("1.0", "bookworm", arch),  # Pre-Depends
            "libgreet1": ("1.1", "bookworm-updates", arch),  # highest across suites, (>= 1.1)
            "awk-provider": ("1.0", "bookworm", arch),  # mawk | awk: no mawk, awk is provided
            "legacy-user": ("1.0", "bookworm", arch),
            "libold": ("1.0", "bookworm", arch),  # (<< 2.0) passes over the higher 2.0
        }
        if platform == "aarch64":
            expected["arm-only"] = ("1.0", "bookworm", "arm64")  # a per-platform root
        assert packages_of(lock, platform) == expected  # debconf is excluded
        assert lock["platforms"][platform]["roots"] == sorted(["hello-tool", "legacy-user"]
                                                              + (["arm-only"] if platform == "aarch64" else []))
    entry = next(e for e in lock["platforms"]["x86_64"]["packages"] if e["package"] == "libgreet1")
    served = (mirror.root / entry["filename"]).read_bytes()
    assert entry["filename"] == "pool/main/l/libgreet1/libgreet1_1.1_amd64.deb"
    assert (entry["sha256"], entry["size"]) == (hashlib.sha256(served).hexdigest(), len(served))
    assert "127.0.0.1" not in text and "http" not in text  # pool paths only: the lock names no host
    assert "x86_64: + libgreet1 1.1 (for hello-tool)" in run.stdout
    assert "aarch64: + arm-only 1.0 (root)" in run.stdout
    assert "//debs:tools: toolchains/tools.lock.json written" in run.stdout

    # Again: same bytes, not rewritten.
    stamp = path.stat().st_mtime_ns
    again = ws.cli("deb", "lock", "//debs:tools")
    assert again.rc == 0 and "toolchains/tools.lock.json unchanged" in again.stdout
    assert path.read_text() == text and path.stat().st_mtime_ns == stamp

    # A newer libgreet1 on the mirror: its two lines change, every other line stays byte for byte.
    mirror.publish(universe(greet_update="1.2"))
    bumped = ws.cli("deb", "lock")
    assert bumped.rc == 0, bumped.stderr
    changes = [line.strip() for line in bumped.stdout.splitlines() if line.startswith("  ")]
    assert changes == ["aarch64: ~ libgreet1 1.1 -> 1.2", "x86_64: ~ libgreet1 1.1 -> 1.2"]
    old_lines, new_lines = text.splitlines(), path.read_text().splitlines()
    assert len(old_lines) == len(new_lines)
    differ = [(a, b) for a, b in zip(old_lines, new_lines) if a != b]
    assert len(differ) == 2 and all('"libgreet1"' in a and '"1.2"' in b for a, b in differ)


def test_lock_with_split_mirrors(make_ws, mirror, server):
    """Like an archive and its security mirror: each suite from the mirror that carries it."""
    www, url = server
    updates = Mirror(mirror.root.parent / (mirror.root.name + "-updates"), mirror.url + "-updates", mirror.work)
    full = universe()
    mirror.publish({"bookworm": full["bookworm"]})
    updates.publish({"bookworm-updates": full["bookworm-updates"]})
    ws = deb_ws(make_ws, [mirror.url, updates.url], TOOLS)
    run = ws.cli("deb", "lock")
    assert run.rc == 0, run.stderr
    assert packages_of(json.loads((ws.root / "toolchains/tools.lock.json").read_text()), "x86_64")["libgreet1"] == \
        ("1.1", "bookworm-updates", DEB_ARCH["x86_64"])
    built = ws.build("//debs:tools")
    assert built.rc == 0, built.stderr
    assert ws.read_output("//debs:tools", f"usr/lib/{TRIPLET[ARCH]}/libgreet.so") == f"greet 1.1 {ARCH}\n"


# -- building the tree ----------------------------------------------------------------------------------
def test_build_merged_usrmerged_tree_and_bump_one_package(make_ws, mirror):
    ws = deb_ws(make_ws, [mirror.url])
    assert ws.cli("deb", "lock").rc == 0
    run = ws.build("//debs:tools")
    assert run.rc == 0, run.stderr
    names = sorted(a["name"] for a in run.json["actions"] if a["status"] == "executed")
    debs = ["awk-provider_1.0", "base-lib_1.0", "hello-tool_1.0", "legacy-user_1.0", "libgreet1_1.1", "libold_1.0"]
    assert names == sorted([f"fetch {d}_{ARCH}.deb" for d in debs] + [f"extract {d}_{ARCH}.deb" for d in debs])

    out = ws.root / "bgraph-out/debs/tools"
    t = TRIPLET[ARCH]
    assert (out / "usr/bin/hello").read_text() == f"#!/bin/sh\necho hello {ARCH}\n"  # shipped as /bin/hello
    assert os.access(out / "usr/bin/hello", os.X_OK)
    assert not (out / "usr/lib/base.txt").stat().st_mode & 0o111
    for d in ("bin", "lib", "sbin"):
        assert os.readlink(out / d) == f"usr/{d}"
    assert not (out / "lib64").exists()  # no usr/lib64 in this tree: no dangling link
    assert os.readlink(out / f"usr/lib/{t}/libgreet.so") == "libgreet.so.1"  # was /lib/<triplet>/libgreet.so.1
    assert (out / f"usr/lib/{t}/libgreet.so").read_text() == f"greet 1.1 {ARCH}\n"
    assert (out / f"usr/lib/{t}/libgreet.so.1.copy").read_text() == f"greet 1.1 {ARCH}\n"  # hard link
    assert (out / "bin/hello").read_text().startswith("#!/bin/sh")  # through the top-level link
    assert os.readlink(out / "usr/bin/awk") == "awk-provider"
    assert os.readlink(out / "usr/sbin/hello") == "../bin/hello"
    assert (out / "usr/lib/libold-1").exists() and not (out / "usr/lib/libold-2").exists()
    assert not (out / "usr/share/doc/debconf").exists()  # excluded
    assert (out / "usr/share/doc/hello-tool/copyright").exists()

    assert ws.build("//debs:tools").json["executed"] == 0

    # One package bumped: only its fetch and unpack run; the others are cache hits.
    mirror.publish(universe(greet_update="1.2"))
    assert ws.cli("deb", "lock").rc == 0
    bumped = ws.build("//debs:tools")
    assert bumped.rc == 0, bumped.stderr
    assert sorted(a["name"] for a in bumped.json["actions"] if a["status"] == "executed") == \
        [f"extract libgreet1_1.2_{ARCH}.deb", f"fetch libgreet1_1.2_{ARCH}.deb"]
    assert bumped.json["hits"] == 10
    assert (out / f"usr/lib/{t}/libgreet.so").read_text() == f"greet 1.2 {ARCH}\n"


def test_other_platform_plans_its_own_packages(make_ws, mirror):
    """Planned as on another host (--host-platform, dry run): that host's packages."""
    ws = deb_ws(make_ws, [mirror.url])
    assert ws.cli("deb", "lock").rc == 0
    other = "aarch64" if PLATFORM == "x86_64" else "x86_64"
    run = ws.build("//debs:tools", args=("--dry-run", "--host-platform", other))
    assert run.rc == 0, run.stderr
    planned = {a["name"] for a in run.json["actions"]}
    arch = DEB_ARCH[other]
    assert f"fetch hello-tool_1.0_{arch}.deb" in planned
    assert ("fetch arm-only_1.0_arm64.deb" in planned) == (other == "aarch64")
    refused = ws.cli("build", "--host-platform", other, "//debs:tools")
    assert refused.rc == 2 and "--dry-run --host-platform" in refused.stderr, refused.stderr


CROSS = TOOLS + """cross = { aarch64 = ":cross", x86_64 = ":cross" }

[cross]
kind = "deb_packages"
lock = "toolchains/cross.lock.json"
locked_for = ["%s"]
packages = ["hello-tool"]

[root]
kind = "deb_packages"
lock = "toolchains/root.lock.json"
sysroot = true
packages = ["libgreet1"]
""" % PLATFORM


def test_a_system_follows_the_exec_platform_a_sysroot_the_target(make_ws, mirror):
    """For another target platform (a cross build), a system to run actions on is still the exec
    machine's packages (or its `cross` stand-in), and a sysroot is the target's; `locked_for`
    locks only the platforms it names, and planning one it does not name is an error naming it."""
    ws = deb_ws(make_ws, [mirror.url], CROSS)
    assert ws.cli("deb", "lock").rc == 0
    assert set(json.loads((ws.root / "toolchains/cross.lock.json").read_text())["platforms"]) == {PLATFORM}
    other = "aarch64" if PLATFORM == "x86_64" else "x86_64"
    run = ws.build("//debs:tools", "//debs:root", args=("--dry-run", "--platform", other))
    assert run.rc == 0, run.stderr
    planned = {(a["label"], a["name"]) for a in run.json["actions"]}
    # the cross stand-in (exec packages) serves //debs:tools; the sysroot holds the target's packages
    assert (f"//debs:cross", f"fetch hello-tool_1.0_{ARCH}.deb") in planned
    assert not any(label.startswith("//debs:tools") for label, _ in planned), planned  # nothing of its own
    assert (f"//debs:root ({other})", f"fetch libgreet1_1.1_{DEB_ARCH[other]}.deb") in planned
    # natively, the stand-in is not even configured
    native = ws.build("//debs:tools", args=("--dry-run",))
    assert not any(a["label"] == "//debs:cross" for a in native.json["actions"])
    refused = ws.build("//debs:cross", args=("--dry-run", "--host-platform", other))
    assert refused.rc == 1 and f"locked for {PLATFORM} only, not for {other}" in refused.stderr, refused.stderr


def test_conflicting_packages_and_prefer(make_ws, mirror):
    ws = deb_ws(make_ws, [mirror.url], target("clash", ["clash-a", "clash-b"]))
    assert ws.cli("deb", "lock").rc == 0
    run = ws.build("//debs:clash")
    assert run.rc == 1
    line = one_error_line(run)
    assert "packages clash-a and clash-b both ship usr/share/clash.txt with different content" in line
    assert 'prefer = { "usr/share/clash.txt" = "clash-a" }' in run.stderr  # the hint
    ws.write({"targets/debs.toml": target("clash", ["clash-a", "clash-b"],
                                          'prefer = { "usr/share/clash.txt" = "clash-b" }\n')})
    run = ws.build("//debs:clash")
    assert run.rc == 0, run.stderr
    assert run.json["executed"] == 0  # the unpacked packages were cached; only the merge changed
    assert ws.read_output("//debs:clash", "usr/share/clash.txt") == "b\n"


def test_stale_and_missing_lock(make_ws, mirror):
    ws = deb_ws(make_ws, [mirror.url])
    run = ws.build("//debs:tools")
    assert run.rc == 2 and "source file 'toolchains/tools.lock.json' does not exist" in one_error_line(run)
    assert ws.cli("deb", "lock").rc == 0
    ws.write({"targets/debs.toml": TOOLS.replace('"legacy-user"]', '"legacy-user", "libold"]')})
    run = ws.build("//debs:tools")
    assert run.rc == 1
    line = one_error_line(run)
    assert "toolchains/tools.lock.json is out of date" in line and "'libold'" in line
    assert "run `bgraph deb lock //debs:tools`" in run.stderr


# -- bad inputs: one line naming the package and the file; the cache as it was ------------------------------
def test_lock_unknown_package(make_ws, mirror):
    ws = deb_ws(make_ws, [mirror.url], target("tools", ["hello-tol"]))
    run = ws.cli("deb", "lock")
    assert run.rc == 2
    line = one_error_line(run)
    assert "targets/debs.toml [tools] key 'packages'" in line
    assert "package 'hello-tol' is not in the" in line and "index of bookworm, bookworm-updates" in line
    assert "did you mean hello-tool?" in run.stderr
    assert not (ws.root / "toolchains").exists() and not ws.cache.exists()


def test_lock_unsatisfiable_dependency_names_the_chain(make_ws, mirror):
    ws = deb_ws(make_ws, [mirror.url], TOOLS + "\n" + target("broken", ["broken-top"]))
    run = ws.cli("deb", "lock")
    assert run.rc == 2
    line = one_error_line(run)
    assert "targets/debs.toml [broken] key 'packages'" in line
    assert "unsatisfiable dependency broken-top -> broken-mid -> libgreet1 (>= 9.0)" in line
    assert "has libgreet1 1.1, 1.0 only" in line
    # One target failed: no lock is written, not even the good target's.
    assert not (ws.root / "toolchains").exists() and not ws.cache.exists()


def test_lock_mirror_does_not_answer(make_ws):
    dead = f"http://127.0.0.1:{free_port()}/debian"
    ws = deb_ws(make_ws, [dead])
    run = ws.cli("deb", "lock")
    assert run.rc == 2
    line = one_error_line(run)
    assert f"{dead}/dists/bookworm/main/binary-" in line and "does not answer" in line
    assert "Connection refused" in line
    assert "hint: check the network and the mirror" in run.stderr
    assert not (ws.root / "toolchains").exists() and not ws.cache.exists()


BAD_FIELDS = [("Version: 1.0\nSize: abc", "Size 'abc' is not a number of bytes"),
              ("Version: 1:\nSize: 5", "Version '1:' is not a Debian version"),
              ("Version: 1.0\nSize: 5\nX-Filename: ../../../etc/x.deb", "Filename '../../../etc/x.deb' is not a .deb's path"),
              ("Version: 1.0\nSize: 5\nX-SHA256: abc", "SHA256 'abc' is not 64 hex digits")]


def _bad_index(field: str) -> bytes:
    """One stanza of package hello with `field` (X-Filename / X-SHA256 replace the good ones)."""
    filename = field.split("X-Filename: ")[1].split("\n")[0] if "X-Filename: " in field else "pool/h/hello.deb"
    sha = field.split("X-SHA256: ")[1] if "X-SHA256: " in field else "0" * 64
    head = "\n".join(line for line in field.split("\n") if not line.startswith("X-"))
    return f"Package: hello\n{head}\nArchitecture: amd64\nFilename: {filename}\nSHA256: {sha}\n".encode()


@pytest.mark.parametrize("field, said", BAD_FIELDS)
def test_an_index_entry_a_lock_could_not_hold_is_an_error_naming_index_and_entry(field, said):
    from build_graph.debian.index import parse_packages
    from build_graph.errors import FetchError

    with pytest.raises(FetchError) as e:
        list(parse_packages(_bad_index(field), "bookworm", "http://m/debian/dists/bookworm/main/binary-amd64/Packages.xz"))
    text = e.value.render()
    assert text.startswith("http://m/debian/dists/bookworm/main/binary-amd64/Packages.xz: index entry hello ") and \
        said in text and "\n  hint: the mirror's index is damaged" in text, text


@pytest.mark.parametrize("field, said", BAD_FIELDS[:2])
def test_deb_lock_against_a_damaged_index_is_one_line(make_ws, mirror, field, said):
    """'Size: abc' and 'Version: 1:' ended `bgraph deb lock` in a traceback (ValueError)."""
    for arch in TRIPLET:
        index = mirror.root / "dists" / "bookworm" / "main" / f"binary-{arch}" / "Packages.xz"
        index.write_bytes(lzma.compress(_bad_index(field).replace(b"amd64", arch.encode())))
    ws = deb_ws(make_ws, [mirror.url], target("base", ["hello"]))
    run = ws.cli("deb", "lock")
    assert run.rc != 0
    line = one_error_line(run)
    assert "/dists/bookworm/main/binary-" in line and "index entry hello" in line and said in line, line
    assert "hint: the mirror's index is damaged" in run.stderr
    assert not (ws.root / "toolchains" / "base.lock.json").exists()


def test_fetch_mirror_does_not_answer(make_ws, mirror):
    ws = deb_ws(make_ws, [mirror.url], target("base", ["base-lib"]))
    assert ws.cli("deb", "lock").rc == 0
    dead = f"http://127.0.0.1:{free_port()}/debian"
    ws.write({"WORKSPACE.toml": (ws.root / "WORKSPACE.toml").read_text().replace(mirror.url, dead)})
    before = cache_files(ws)
    run = ws.build("//debs:base")
    assert run.rc == 1
    line = one_error_line(run)
    pool = f"pool/main/b/base-lib/base-lib_1.0_{ARCH}.deb"
    assert f"package base-lib ({pool})" in line
    assert f"{dead}/{pool} does not answer" in line and "Connection refused" in line
    assert "hint: check the network and the mirror" in run.stderr
    only_sources_added(ws, before, ["WORKSPACE.toml", "toolchains/base.lock.json"])
    assert ws.ac_entries() == set()


def test_deb_gone_from_the_mirror(make_ws, mirror):
    ws = deb_ws(make_ws, [mirror.url], target("base", ["base-lib"]))
    assert ws.cli("deb", "lock").rc == 0
    pool = f"pool/main/b/base-lib/base-lib_1.0_{ARCH}.deb"
    (mirror.root / pool).unlink()
    run = ws.build("//debs:base")
    assert run.rc == 1
    line = one_error_line(run)
    assert f"package base-lib ({pool}): no mirror could give it: {mirror.url}/{pool}: HTTP 404" in line
    assert "re-lock with `bgraph deb lock`" in run.stderr
    assert ws.ac_entries() == set()


def test_deb_not_matching_its_pin(make_ws, mirror):
    ws = deb_ws(make_ws, [mirror.url], target("base", ["base-lib"]))
    assert ws.cli("deb", "lock").rc == 0
    pool = f"pool/main/b/base-lib/base-lib_1.0_{ARCH}.deb"
    tampered = make_deb([("./usr/lib/base.txt", "file", b"TAMPERED\n", 0o644)])
    (mirror.root / pool).write_bytes(tampered)
    before = cache_files(ws)
    run = ws.build("//debs:base")
    assert run.rc == 1
    line = one_error_line(run)
    assert f"package base-lib ({pool})" in line and "does not match its pin" in line
    assert f"got {hashlib.sha256(tampered).hexdigest()}" in line and "nothing was stored" in line
    only_sources_added(ws, before, ["WORKSPACE.toml", "toolchains/base.lock.json"])
    assert ws.ac_entries() == set()


HOSTILE = {
    "dotdot": ("./../../escaped", "file", b"EVIL-PAYLOAD\n", 0o644),
    "absolute": ("/etc/escaped", "file", b"EVIL-PAYLOAD\n", 0o644),
    "symlink": ("./usr/lib/out", "sym", "../../../../etc/shadow", 0o777),
    "hardlink": ("./usr/lib/hard", "lnk", "../../etc/shadow", 0o644),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_deb_with_an_escaping_entry(make_ws, mirror, kind):
    raw = make_deb([("./usr/share/doc/evil/copyright", "file", b"GOOD-PAYLOAD\n", 0o644), HOSTILE[kind]])
    suites = universe()
    suites["bookworm"] += [Pkg("evil", "1.0", arch, raw=raw) for arch in TRIPLET]
    mirror.publish(suites)
    ws = deb_ws(make_ws, [mirror.url], target("evil", ["evil"]))
    locked = ws.cli("deb", "lock")
    assert locked.rc == 0, locked.stderr
    before = cache_files(ws)
    run = ws.build("//debs:evil")
    assert run.rc == 1
    line = one_error_line(run)
    assert f"evil_1.0_{ARCH}.deb: " in line and "refused" in line
    assert action(run.json, "//debs:evil", f"extract evil_1.0_{ARCH}.deb")["status"] == "failed"
    # The fetch (the pinned bytes) is kept; the unpack stored nothing: no entry, no blob of the package's files.
    fetch = action(run.json, "//debs:evil", f"fetch evil_1.0_{ARCH}.deb")
    assert fetch["status"] == "executed"
    assert {e.replace("/", "") for e in ws.ac_entries()} == {f"{fetch['key']}.json"}
    contents = {p.read_bytes() for p in (ws.store / "cas").rglob("*") if p.is_file()}
    assert b"GOOD-PAYLOAD\n" not in contents and b"EVIL-PAYLOAD\n" not in contents
    assert not list(ws.root.parent.rglob("escaped"))
    assert len(cache_files(ws) - before) < 10


# -- the real thing (network, this machine's apt configuration, bubblewrap) ----------------------------------
@pytest.mark.slow
def test_real_packages_run_without_the_hosts_usr(make_ws):
    """Lock sed and grep from the mirror apt is configured with, build, and run them under bubblewrap
    with the tree as /usr and nothing of the host's /usr."""
    if not read_apt_sources():
        pytest.skip("apt has no deb source configured on this machine")
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    ws = make_ws({"targets/debs.toml": target("shell", ["sed", "grep"], 'exclude = ["dpkg", "install-info"]\n')},
                 toolchains=False)
    start = time.monotonic()
    locked = ws.cli("deb", "lock", timeout=600)
    assert locked.rc == 0, locked.stderr
    lock_s = time.monotonic() - start
    built = ws.build("//debs:shell")
    assert built.rc == 0, built.stderr
    tree = (ws.root / "bgraph-out/debs/shell").resolve()
    assert not (tree / "etc/ld.so.cache").exists()  # no ldconfig ran: the loader's default paths suffice
    bwrap = ["bwrap", "--unshare-all", "--die-with-parent", "--clearenv", "--setenv", "PATH", "/usr/bin",
             "--ro-bind", str(tree / "usr"), "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
             "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    sed = subprocess.run(bwrap + ["/usr/bin/sed", "--version"], capture_output=True, text=True)
    assert sed.returncode == 0, sed.stderr
    assert sed.stdout.startswith("/usr/bin/sed (GNU sed)") or "GNU sed" in sed.stdout
    grep = subprocess.run(bwrap + ["/usr/bin/grep", "-c", "needle"], input="hay\nneedle\n", capture_output=True,
                          text=True)
    assert grep.returncode == 0 and grep.stdout == "1\n", grep.stderr
    print(f"lock {lock_s:.1f}s, build {built.json['wall_s']:.1f}s, {built.json['executed']} actions")


def test_deb_lock_is_never_written_or_read_through_a_symlink(make_ws, mirror, tmp_path):
    """Red-team K15 hole 3: a workspace shipping `toolchains -> /outside` had the lock written there."""
    ws = deb_ws(make_ws, [mirror.url])
    outside = tmp_path / "outside"
    outside.mkdir()
    (ws.root / "toolchains").symlink_to(outside)
    run = ws.cli("deb", "lock")
    assert run.rc != 0
    assert "lock path toolchains/tools.lock.json: toolchains is a symlink" in one_error_line(run)
    assert list(outside.iterdir()) == []
    # the lock itself a link to a host file: neither read nor replaced
    (ws.root / "toolchains").unlink()
    (ws.root / "toolchains").mkdir()
    host = outside / "config.json"
    host.write_text('{"auths": {}}\n')
    (ws.root / "toolchains/tools.lock.json").symlink_to(host)
    run = ws.cli("deb", "lock")
    assert run.rc != 0 and "toolchains/tools.lock.json is a symlink" in one_error_line(run)
    assert host.read_text() == '{"auths": {}}\n'


def test_a_file_mirror_the_workspace_names_is_held_to_what_a_file_url_may_read(make_ws, mirror, tmp_path):
    """`bgraph deb lock` read a [debian] file: mirror with a plain open(): any host directory, and
    a FIFO where an index is hung it (red-team K15, left by the fetcher's fix)."""
    ws = deb_ws(make_ws, [f"file://{mirror.root}"])
    run = ws.cli("deb", "lock")
    assert run.rc != 0 and "Traceback" not in run.output, run.output
    assert "outside the workspace and the directories the user allows" in run.output, run.output
    ws.env["BGRAPH_FILE_URL_DIRS"] = str(mirror.root)  # the user's word: then it reads
    run = ws.cli("deb", "lock")
    assert run.rc == 0, run.output
    fifo = tmp_path / "fifo-mirror"
    first = fifo / "dists" / SUITES[0] / "main" / f"binary-{ARCH}" / "Packages.xz"
    first.parent.mkdir(parents=True)
    os.mkfifo(first)
    ws2 = deb_ws(make_ws, [f"file://{fifo}"])
    ws2.env["BGRAPH_FILE_URL_DIRS"] = str(fifo)
    run = ws2.cli("deb", "lock", timeout=60)
    assert run.rc != 0 and "is a FIFO, not a regular file" in run.output, run.output
