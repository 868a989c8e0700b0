"""oci_image and `bgraph load` (issue 35): deterministic layer tars, the image documents, the
refusals at planning, and, with Debian's dockerd started by this module on a private socket and
data root (OCI.md), an image made by the rule from two workspace directories and two caches,
loaded through the docker SDK (incrementally), run with no network, and the load's errors."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import shutil
import signal
import socketserver
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import pytest

from bgraph_testlib import WS, hermetic_env, requires_bwrap, workspace_copy
from build_graph.errors import PlanError
from build_graph.labels import Label
from build_graph.model import Digester, FileEntry, SymlinkEntry, TargetOutput, Tree
from build_graph.oci import image, tarball
from build_graph.rules.base import RuleContext
from build_graph.rules.registry import RULES
from build_graph.workspace import host_platform

EPOCH = 315532800
DOCKERD = shutil.which("dockerd")
try:
    import docker
except ImportError:  # pragma: no cover - a dependency of bgraph
    docker = None
requires_dockerd = pytest.mark.skipif(
    DOCKERD is None or docker is None,
    reason="dockerd is not installed (apt-get install --no-install-recommends docker.io)")


# -- the tar writer ----------------------------------------------------------------------------------
def _tree_on_disk(root: Path, umask: int, mtime: float, private: bool) -> None:
    old = os.umask(umask)
    try:
        (root / "usr/bin").mkdir(parents=True)
        (root / "usr/lib/deep/er").mkdir(parents=True)
        (root / "empty").mkdir()
        (root / "usr/bin/tool").write_bytes(b"#!/bin/sh\necho tool\n")
        (root / "usr/bin/tool").chmod(0o700 if private else 0o755)
        (root / "usr/lib/deep/er/data.txt").write_bytes(b"x" * 1000)
        (root / "usr/lib/deep/er/data.txt").chmod(0o600 if private else 0o644)
        long_dir = root / "usr/lib" / ("d" * 120)
        long_dir.mkdir()
        (long_dir / ("f" * 150)).write_bytes(b"long name\n")
        (root / "usr/lib/caf\u00e9.txt").write_text("unicode\n")
        os.symlink("usr/bin", root / "bin")
        os.symlink("/" + "t" * 150, root / "usr/lib/far-link")
        for p in sorted(root.rglob("*"), reverse=True):
            os.utime(p, (mtime, mtime), follow_symlinks=False)
    finally:
        os.umask(old)


def _layer(root: Path, **kw) -> tuple[bytes, str, int]:
    out = io.BytesIO()
    digest, size = tarball.write_layer(out, str(root), EPOCH, **kw)
    return out.getvalue(), digest, size


def test_a_layer_is_byte_identical_from_two_directories_umasks_and_mtimes(tmp_path):
    a, b = tmp_path / "one" / "root", tmp_path / "two" / "deeper" / "root"
    _tree_on_disk(a, 0o022, 1_700_000_000, private=False)
    _tree_on_disk(b, 0o077, 1_000_000_000, private=True)
    spec = {"files": {"etc/passwd": {"text": "root:x:0:0::/root:/bin/sh\n", "mode": 0o644}},
            "dirs": {"tmp": 0o1777}, "modes": {"usr/bin/tool": 0o4755}}
    data_a, digest_a, size_a = _layer(a, **spec)
    data_b, digest_b, size_b = _layer(b, **spec)
    assert data_a == data_b and digest_a == digest_b and size_a == size_b == len(data_a)
    assert digest_a == "sha256:" + hashlib.sha256(data_a).hexdigest()  # digest = diff_id: uncompressed
    assert _layer(a, **spec)[0] == data_a  # and from one run to the next
    # an exec bit flipped changes the layer
    (b / "usr/lib/deep/er/data.txt").chmod(0o700)
    assert _layer(b, **spec)[1] != digest_a


def test_layer_entries_sorted_with_parents_fixed_owner_time_and_modes(tmp_path):
    root = tmp_path / "root"
    _tree_on_disk(root, 0o022, 1_700_000_000, private=True)
    data, _digest, _size = _layer(root, files={"etc/passwd": {"text": "root\n", "mode": 0o644}},
                                  dirs={"tmp": 0o1777}, modes={"usr/bin/tool": 0o4755})
    assert data.endswith(b"\0" * 1024) and len(data) % 512 == 0
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        members = t.getmembers()
        names = [m.name for m in members]
        assert [n.encode() for n in names] == sorted(n.encode() for n in names)
        for m in members:
            assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (EPOCH, 0, 0, "", ""), m.name
        by = {m.name: m for m in members}
        assert by["usr/bin/tool"].mode == 0o4755  # declared override (an exec file would be 0755)
        assert by["usr/lib/deep/er/data.txt"].mode == 0o644 and by["usr/lib/deep/er/data.txt"].size == 1000
        assert by["etc"].isdir() and by["etc"].mode == 0o755  # parent added
        assert by["tmp"].isdir() and by["tmp"].mode == 0o1777
        assert by["empty"].isdir()
        assert by["bin"].issym() and by["bin"].linkname == "usr/bin" and by["bin"].mode == 0o777
        assert by["usr/lib/far-link"].linkname == "/" + "t" * 150  # PAX linkpath
        long_name = f"usr/lib/{'d' * 120}/{'f' * 150}"  # no ustar split fits: PAX path
        assert t.extractfile(long_name).read() == b"long name\n"
        assert t.extractfile("usr/lib/caf\u00e9.txt").read() == b"unicode\n"
        assert t.extractfile("etc/passwd").read() == b"root\n"
    # no PAX record where ustar holds the entry (the header of a short name is plain ustar)
    assert data[156:157] == b"2" and data[257:265] == b"ustar\x0000"


def test_ustar_split_and_pax_header_lengths():
    name = b"a" * 150 + b"/" + b"b" * 90
    assert tarball._split(name) == (b"a" * 150, b"b" * 90)
    assert tarball._split(b"c" * 101) is None
    records = tarball._pax_records([(b"path", b"x" * 95)])  # the length field crosses 99 -> 100
    n, _, rest = records.partition(b" ")
    assert int(n) == len(records) and rest.endswith(b"\n")
    head = tarball.header(b"p" * 300, b"0", 5, 0o644, EPOCH)
    assert len(head) % 512 == 0 and head[156:157] == b"x"


def test_image_documents_are_canonical_json_with_both_names():
    layers = [image.Layer("system", "sha256:" + "1" * 64, 2048), image.Layer("app", "sha256:" + "2" * 64, 1024)]
    kw = dict(layers=layers, ref="localhost/bgraph/x:1", created=EPOCH, created_by="bgraph //p:x", env=["PATH=/bin"],
              entrypoint=["/bin/sh"], cmd=[], workdir="/", user="", labels={"org.opencontainers.image.version": "1"})
    amd, arm = image.documents(platform="x86_64", **kw), image.documents(platform="aarch64", **kw)
    assert amd == image.documents(platform="x86_64", **kw)
    config = json.loads(amd.config)
    assert amd.config == json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    assert config["rootfs"]["diff_ids"] == [l.digest for l in layers] and config["created"] == "1980-01-01T00:00:00Z"
    assert (json.loads(arm.config)["architecture"], json.loads(arm.config)["variant"]) == ("arm64", "v8")
    index = json.loads(amd.index)["manifests"][0]
    assert index["digest"] == amd.manifest_digest
    assert index["annotations"] == {"io.containerd.image.name": "localhost/bgraph/x:1",
                                    "org.opencontainers.image.ref.name": "localhost/bgraph/x:1"}
    [docker_manifest] = json.loads(amd.docker_manifest)
    assert docker_manifest["RepoTags"] == ["localhost/bgraph/x:1"]
    assert docker_manifest["Config"] == "blobs/sha256/" + amd.config_digest.split(":")[1]
    chains = image.chain_ids([l.digest for l in layers])
    assert chains[0] == layers[0].digest
    assert chains[1] == "sha256:" + hashlib.sha256(f"{chains[0]} {layers[1].digest}".encode()).hexdigest()


# -- the rule's refusals, planned over made-up trees --------------------------------------------------
SYSTEM = TargetOutput(Tree({"usr/bin/busybox": FileEntry("1" * 64, 10, True), "lib": SymlinkEntry("usr/lib")}),
                      {"architecture": "amd64", "sysroot": True})
HOST = TargetOutput(Tree(), {"host_paths": ["/usr"], "host_tools": [["/usr/bin/python3", "3", "0" * 64]]})


def _plan(attrs: dict, deps: dict[str, TargetOutput], read=lambda e: b""):
    rule = RULES["oci_image"]
    label = Label("p", "img")
    all_deps = {Label("toolchains", "host"): HOST, Label("p", "system"): SYSTEM,
                **{Label("p", name): out for name, out in deps.items()}}
    ctx = RuleContext(label=label, attrs=rule.attrs.model_validate(attrs), file="targets/p.toml", table="img",
                      platform="x86_64", digester=Digester("blake3"), deps=all_deps, sources=Tree(), pins=None,
                      arch_sets=lambda v, _w: v, read=read, probe_host=lambda tools: (),
                      rule_version="oci_image/1")
    return rule.plan(ctx)


def _first_round(attrs: dict, deps: dict[str, TargetOutput]):
    gen = _plan(attrs, deps)
    return next(gen)


def test_a_layer_over_10_gib_is_refused_at_planning_naming_the_target():
    big = TargetOutput(Tree({"weights.bin": FileEntry("2" * 64, 11 << 30)}))
    with pytest.raises(PlanError) as e:
        _first_round({"system": ":system", "layers": [{"name": "model", "from": [{"tree": ":big"}]}]}, {"big": big})
    [line, hint] = e.value.render().splitlines()
    assert line.startswith("//p:img (targets/p.toml [img] key 'layers'): layer model holds 11.0 GiB, over the 10 GiB")
    assert hint.startswith("  hint: split it")
    # 10 GiB exactly is allowed: the first round is the layer actions
    ok = TargetOutput(Tree({"weights.bin": FileEntry("2" * 64, 10 << 30)}))
    actions = _first_round({"system": ":system", "layers": [{"name": "model", "from": [{"tree": ":big"}]}]},
                           {"big": ok})
    assert [a.name for a in actions] == ["layer system", "layer model"]


def test_more_than_127_layers_are_refused_at_planning():
    layers = [{"name": f"l{i}", "files": {f"f{i}": "x"}} for i in range(127)]
    with pytest.raises(PlanError) as e:
        _first_round({"system": ":system", "layers": layers}, {})
    assert e.value.render().splitlines()[0] == ("//p:img (targets/p.toml [img] key 'layers'): 128 layers: an image "
                                                "holds at most 127 (containerd's limit)")
    assert len(_first_round({"layers": layers}, {})) == 127


def test_an_entry_below_a_lower_layers_symlink_and_forbidden_paths_are_refused():
    app = TargetOutput(Tree({"x.so": FileEntry("3" * 64, 5)}))
    with pytest.raises(PlanError, match="puts lib/x.so below lib, a symlink in layer system"):
        _first_round({"system": ":system", "layers": [{"name": "app", "from": [{"tree": ":app", "at": "lib"}]}]},
                     {"app": app})
    driver = TargetOutput(Tree({"usr/lib/libcuda.so.1": FileEntry("4" * 64, 5)}))
    with pytest.raises(PlanError, match=r"layer app holds usr/lib/libcuda.so.1, which forbid \(\*\*/libcuda.so\*\)"):
        _first_round({"system": ":system", "forbid": ["**/libcuda.so*"],
                      "layers": [{"name": "app", "from": [{"tree": ":app"}]}]}, {"app": driver})
    with pytest.raises(PlanError, match="is no amd64 root"):
        _first_round({"system": ":app"}, {"app": app})


def test_a_wheel_part_is_unpacked_into_site_packages_with_its_console_scripts():
    wheel = TargetOutput(Tree({"demo-1.0-py3-none-any.whl": FileEntry("5" * 64, 100)}),
                         {"wheel": "demo-1.0-py3-none-any.whl"})
    gen = _plan({"layers": [{"name": "app", "from": [{"wheel": ":demo"}]}]}, {"demo": wheel},
                read=lambda e: b"[console_scripts]\ndemo-cli = demo.cli:main.run [extra]\n")
    [unpack] = next(gen)
    assert unpack.kind == "extract"
    unpacked = Tree({"demo/__init__.py": FileEntry("6" * 64, 1), "demo-1.0.dist-info/entry_points.txt":
                     FileEntry("7" * 64, 10), "demo-1.0.data/scripts/x": FileEntry("8" * 64, 1)})
    from build_graph.model import Outcome
    [layer] = gen.send([Outcome(unpack, unpacked, "executed")])
    spec = json.loads(layer.argv[-1])
    assert set(layer.input_tree("/bgraph/in/root").entries) == {
        "usr/local/lib/python3.11/dist-packages/demo/__init__.py",
        "usr/local/lib/python3.11/dist-packages/demo-1.0.dist-info/entry_points.txt"}
    assert spec["files"]["usr/local/bin/demo-cli"] == {
        "text": "#!/usr/bin/python3\nimport sys\nfrom demo.cli import main\nsys.exit(main.run())\n", "mode": 0o755}
    assert set(spec["files"]) == {"usr/local/bin/demo-cli", "etc/passwd", "etc/group"}  # the bottom layer


def test_a_wheel_without_entry_points_gets_the_scripts_its_part_declares():
    wheel = TargetOutput(Tree({"demo-1.0-py3-none-any.whl": FileEntry("5" * 64, 100)}),
                         {"wheel": "demo-1.0-py3-none-any.whl"})
    gen = _plan({"layers": [{"name": "app", "from": [{"wheel": ":demo", "scripts": {"demo": "demo.cli:main"}}]}]},
                {"demo": wheel})
    [unpack] = next(gen)
    from build_graph.model import Outcome
    [layer] = gen.send([Outcome(unpack, Tree({"demo/__init__.py": FileEntry("6" * 64, 1)}), "executed")])
    assert json.loads(layer.argv[-1])["files"]["usr/local/bin/demo"] == {
        "text": "#!/usr/bin/python3\nimport sys\nfrom demo.cli import main\nsys.exit(main())\n", "mode": 0o755}
    with pytest.raises(ValueError, match="not a name and module:function"):
        _first_round({"layers": [{"name": "app", "from": [{"wheel": ":demo", "scripts": {"x": "a b"}}]}]},
                     {"demo": wheel})
    with pytest.raises(ValueError, match="scripts are a wheel part"):
        _first_round({"layers": [{"name": "app", "from": [{"tree": ":demo", "scripts": {"x": "a:b"}}]}]},
                     {"demo": wheel})


# -- built for real: two workspaces, two caches ---------------------------------------------------------
APP_TARGETS = """\
package = "//imgtest"

[demo-wheel]
kind = "py_wheel"
distribution = "bgdemo"
version = "1.0"
srcs = ["imgtest/bgdemo/*.py"]
strip_prefix = "imgtest"
pure = true

[py]
kind = "oci_image"
system = "//images:base-python"
layers = [{ name = "demo", from = [{ wheel = ":demo-wheel" }] }]
cmd = ["/usr/bin/python3", "-c", "import bgdemo, sys; print(bgdemo.GREETING, sys.version.split()[0], bgdemo.__file__)"]

# The same image as a layout directory (no image.tar in the store): `bgraph load` writes the tar.
[py-layout]
base = ":py"
archive = false
"""


@pytest.fixture(scope="module")
def built(module_tmp):
    """//images:hello built in two workspace copies (other directories, umasks) with two caches."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    out = {}
    for name, umask in (("a", 0o022), ("b", 0o077)):
        root = workspace_copy(module_tmp / name / ("nested/ws" if name == "b" else "ws"))
        (root / "targets" / "imgtest.toml").write_text(APP_TARGETS)
        (root / "imgtest" / "bgdemo").mkdir(parents=True)
        (root / "imgtest" / "bgdemo" / "__init__.py").write_text('GREETING = "hello from a wheel"\n')
        ws = WS(root, module_tmp / name / "cache")
        old = os.umask(umask)
        try:
            start = time.monotonic()
            run = ws.build("//images:hello", args=("-j2",))
            seconds = time.monotonic() - start
        finally:
            os.umask(old)
        assert run.rc == 0, run.stderr[-3000:]
        link = Path(run.json["outputs"]["//images:hello"])
        out[name] = (ws, link, seconds)
    return out


@requires_bwrap
def test_the_image_digest_is_the_same_from_two_workspaces_and_two_caches(built):
    (ws_a, a, secs_a), (ws_b, b, secs_b) = built["a"], built["b"]
    assert a != b
    meta_a, meta_b = (json.loads((p / "image.json").read_text()) for p in (a, b))
    assert meta_a == meta_b
    assert (a / "image.tar").read_bytes() == (b / "image.tar").read_bytes()
    assert (a / "sbom.cdx.json").read_bytes() == (b / "sbom.cdx.json").read_bytes()
    print(f"\n//images:hello cold builds {secs_a:.1f}s / {secs_b:.1f}s; config {meta_a['config']}, "
          f"manifest {meta_a['manifest']}, layers {[(l['name'], l['size']) for l in meta_a['layers']]}")
    with tarfile.open(a / "image.tar") as t:
        names = t.getnames()
        assert {"oci-layout", "index.json", "manifest.json"} <= set(names)
        for digest in [meta_a["config"], meta_a["manifest"]] + [l["digest"] for l in meta_a["layers"]]:
            blob = t.extractfile(image.blob_path(digest)).read()
            assert "sha256:" + hashlib.sha256(blob).hexdigest() == digest
        index = json.loads(t.extractfile("index.json").read())
        assert index["manifests"][0]["annotations"]["io.containerd.image.name"] == "localhost/bgraph/hello:0.1"
        config = json.loads(t.extractfile(image.blob_path(meta_a["config"])).read())
        assert config["config"]["Labels"]["bgraph.target"] == "//images:hello"
        assert config["config"]["User"] == "nobody" and config["config"]["WorkingDir"] == "/app"


@requires_bwrap
def test_the_sbom_beside_the_image_is_valid_cyclonedx_naming_layer_target_and_sha256(built):
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    ws, link, _secs = built["a"]
    text = (link / "sbom.cdx.json").read_text()
    assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(text) is None
    bom = json.loads(text)
    meta = json.loads((link / "image.json").read_text())
    props = {p["name"]: p["value"] for p in bom["metadata"]["component"]["properties"]}
    assert props == {"bgraph:config": meta["config"], "bgraph:manifest": meta["manifest"]}
    assert bom["metadata"]["timestamp"].startswith("1980-01-01T00:00:00")
    by = {c["name"]: c for c in bom["components"]}
    busybox = by["busybox-static"]
    assert busybox["purl"].startswith("pkg:deb/debian/busybox-static@") and busybox["purl"].endswith("?arch=amd64") \
        or busybox["purl"].endswith("?arch=arm64")
    assert {p["name"]: p["value"] for p in busybox["properties"]} == {"bgraph:layer": "system",
                                                                      "bgraph:target": "//images:busybox"}
    assert {p["name"]: p["value"] for p in by["//images:hello-app"]["properties"]}["bgraph:layer"] == "app"
    # a wheel bgraph built: its sha256
    run = ws.build("//imgtest:py")
    out = Path(run.json["outputs"]["//imgtest:py"])
    wheel = next(c for c in json.loads((out / "sbom.cdx.json").read_text())["components"] if c["name"] == "bgdemo")
    props = {p["name"]: p["value"] for p in wheel["properties"]}
    assert props["bgraph:target"] == "//imgtest:demo-wheel" and props["bgraph:layer"] == "demo"
    built_wheel = next(Path(ws.build("//imgtest:demo-wheel").json["outputs"]["//imgtest:demo-wheel"]).glob("*.whl"))
    assert wheel["hashes"] == [{"alg": "SHA-256", "content": hashlib.sha256(built_wheel.read_bytes()).hexdigest()}]


@requires_bwrap
def test_why_names_the_layer_target_and_package_of_a_path_in_the_image(built):
    ws, _link, _secs = built["a"]
    assert ws.build("//imgtest:py", "//imgtest:py-layout").rc == 0
    wheel = next(Path(ws.build("//imgtest:demo-wheel").json["outputs"]["//imgtest:demo-wheel"]).glob("*.whl"))
    for label in ("//imgtest:py", "//imgtest:py-layout"):  # read out of image.tar, and from the layout's blobs
        run = ws.cli("why", label, "/usr/local/lib/python3.11/dist-packages/bgdemo/__init__.py")
        assert run.rc == 0, run.output
        lines = run.stdout.splitlines()
        assert lines[0].startswith("/usr/local/lib/python3.11/dist-packages/bgdemo/__init__.py: layer demo (2 of 2, "
                                   "sha256:"), lines
        assert lines[0].endswith("placed by //imgtest:demo-wheel"), lines
        assert lines[1] == (f"  package bgdemo 1.0 ({wheel.name}, sha256 "
                            f"{hashlib.sha256(wheel.read_bytes()).hexdigest()})"), lines
    run = ws.cli("why", "--json", "//imgtest:py", "/usr/bin/python3.11")
    assert run.rc == 0, run.output
    assert (run.json["layer"], run.json["index"], run.json["targets"]) == ("system", 1, ["//images:base-python"])
    # through the system's merged /usr (bin -> usr/bin), as the container sees it
    run = ws.cli("why", "--json", "//imgtest:py", "/bin/python3.11")
    assert run.rc == 0 and (run.json["path"], run.json["layer"]) == ("usr/bin/python3.11", "system"), run.output
    run = ws.cli("why", "//imgtest:py", "/etc/ssl/certs/ca-certificates.crt")
    assert run.rc == 0 and run.stdout.startswith("/etc/ssl/certs/ca-certificates.crt: layer system"), run.output
    # /etc/passwd is the rule's own file (no maintainer script ran to write it), not the system target's.
    run = ws.cli("why", "--json", "//imgtest:py", "/etc/passwd")
    assert run.rc == 0 and (run.json["layer"], run.json["targets"]) == ("system", []), run.output
    run = ws.cli("why", "//imgtest:py", "/usr/bin/no-such-tool")
    assert run.rc != 0 and "Traceback" not in run.stderr
    assert "/usr/bin/no-such-tool is in no layer of localhost/bgraph/py:latest" in run.stderr, run.stderr
    run = ws.cli("why", "--platform", "aarch64", "//imgtest:py", "/usr/bin/python3.11")
    assert run.rc != 0 and "hint: build it first: bgraph build --platform aarch64 //imgtest:py" in run.stderr, run.stderr


@requires_bwrap
def test_the_aarch64_image_holds_aarch64_programs(built):
    ws, _link, _secs = built["a"]
    run = ws.build("//images:hello", args=("--platform", "aarch64"))
    assert run.rc == 0, run.stderr[-3000:]
    link = Path(run.json["outputs"]["//images:hello (aarch64)"])
    meta = json.loads((link / "image.json").read_text())
    host_meta = json.loads((built["a"][1] / "image.json").read_text())
    assert meta["platform"] == "aarch64"
    assert meta["layers"][1] == host_meta["layers"][1]  # the app layer is one blob for both
    with tarfile.open(link / "image.tar") as t:
        config = json.loads(t.extractfile(image.blob_path(meta["config"])).read())
        assert (config["architecture"], config["variant"]) == ("arm64", "v8")
        with tarfile.open(fileobj=t.extractfile(image.blob_path(meta["layers"][0]["digest"]))) as layer:
            elf = layer.extractfile("usr/bin/busybox").read(20)
    assert elf[:4] == b"\x7fELF" and int.from_bytes(elf[18:20], "little") == 183  # EM_AARCH64


@requires_bwrap
def test_the_vllm_images_load_and_plan(built):
    ws, _link, _secs = built["a"]
    start = time.monotonic()
    run = ws.build("//images:vllm-sm121", "//images:vllm-sm120", args=("--dry-run",))
    assert run.rc == 0, run.stderr[-3000:]
    assert run.json["ok"], run.stderr[-3000:]
    query = ws.cli("query", "deps(//images:vllm-sm121)")
    assert query.rc == 0, query.stderr
    deps = set(query.stdout.split())
    assert {"//wheels:vllm-sm121", "//wheels:flashinfer-sm121", "//runtime:vllm-cuda", "//runtime:vllm-torch",
            "//runtime:vllm-deps", "//images:base-python", "//toolchains:host"} <= deps
    print(f"\ndry run of both vLLM images: {time.monotonic() - start:.1f}s")


@requires_bwrap
def test_refusals_are_one_line_naming_the_target_before_anything_runs(built):
    ws, _link, _secs = built["a"]
    layers = ", ".join(f'{{ name = "l{i}", files = {{ "f{i}" = "x" }} }}' for i in range(127))
    ws.write({"targets/refused.toml": f'[many]\nkind = "oci_image"\nsystem = "//images:busybox"\nlayers = [{layers}]\n'})
    try:
        run = ws.cli("build", "--dry-run", "//refused:many")
    finally:
        (ws.root / "targets" / "refused.toml").unlink()
    assert run.rc == 1
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: //refused:many (targets/refused.toml [many] key 'layers'): 128 layers: an image holds "
                      "at most 127 (containerd's limit)"], run.stderr


@pytest.mark.parametrize("extra, key", [('modes = {"../../x" = "4755"}', "modes"),
                                        ('site_packages = "/../../x"', "site_packages")])
def test_a_path_attribute_leaving_the_image_is_refused_at_load_naming_the_key(make_ws, extra, key):
    """They failed at plan time as 'ValueError: path escapes the tree root / hint: this is a bug
    in bgraph's rule', naming neither key nor line."""
    ws = make_ws({"targets/i.toml": f'[img]\nkind = "oci_image"\nlayers = [{{name = "a", files = {{"etc/x" = "y"}}}}]\n'
                                    f'{extra}\n'})
    run = ws.cli("build", "//i:img")
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert run.rc != 0 and "Traceback" not in run.output and "bug in bgraph" not in run.output, run.output
    assert len(errors) == 1 and f"[img] key '{key}'" in errors[0] and "not a" in errors[0], run.output


# -- a real daemon ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dockerd():
    """Debian's dockerd on a private socket and data root: no iptables, no bridge (OCI.md)."""
    if DOCKERD is None or docker is None:
        pytest.skip("dockerd is not installed (apt-get install --no-install-recommends docker.io)")
    d = Path(tempfile.mkdtemp(prefix="bgd-", dir="/tmp"))  # short: a socket path holds 107 bytes
    (d / "daemon.json").write_text("{}")
    log = open(d / "dockerd.log", "wb")
    proc = subprocess.Popen(
        [DOCKERD, "--host", f"unix://{d}/docker.sock", "--data-root", str(d / "data"), "--exec-root", str(d / "exec"),
         "--pidfile", str(d / "dockerd.pid"), "--config-file", str(d / "daemon.json"), "--iptables=false",
         "--ip-forward=false", "--ip-masq=false", "--bridge=none", "--storage-driver", "overlay2"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    host = f"unix://{d}/docker.sock"
    client = None
    start = time.monotonic()
    try:
        while time.monotonic() - start < 30:
            if proc.poll() is not None:
                pytest.fail(f"dockerd exited: {(d / 'dockerd.log').read_text()[-2000:]}")
            try:
                client = docker.DockerClient(base_url=host, timeout=30)
                client.ping()
                break
            except Exception:
                client = None
                time.sleep(0.2)
        if client is None:
            pytest.fail(f"dockerd did not answer within 30 s: {(d / 'dockerd.log').read_text()[-2000:]}")
        print(f"\ndockerd ready in {time.monotonic() - start:.2f}s")
        yield host, client
    finally:
        if client is not None:
            client.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for group in Path("/sys/fs/cgroup").glob(f"*/{CGROUP}"):  # containers' groups outlive the daemon
            for sub in sorted(group.rglob("*"), reverse=True):
                if sub.is_dir():
                    try:
                        sub.rmdir()
                    except OSError:
                        pass
            try:
                group.rmdir()
            except OSError:
                pass
        shutil.rmtree(d, ignore_errors=True)


CGROUP = f"bgraph-oci-test-{os.getpid()}"


def _run(client, ref: str, command=None) -> str:
    """Run the image with no network; its output."""
    container = client.containers.run(ref, command, network_mode="none", detach=True, cgroup_parent=f"/{CGROUP}",
                                      mem_limit="256m")
    try:
        status = container.wait(timeout=60)
        logs = container.logs().decode()
        assert status["StatusCode"] == 0, logs
        return logs
    finally:
        container.remove(force=True)


def _load(ws: WS, host: str, *args: str) -> dict:
    run = ws.cli("load", "--json", *args, env={"DOCKER_HOST": host}, timeout=300)
    assert run.rc == 0, run.output[-3000:]
    return run.json


@requires_bwrap
@requires_dockerd
def test_load_runs_and_reloads_only_the_layers_the_daemon_lacks(built, dockerd):
    host, client = dockerd
    ws, link, _secs = built["b"]
    meta = json.loads((link / "image.json").read_text())
    first = _load(ws, host, "//images:hello")
    assert (first["status"], first["layers"], first["layers_sent"]) == ("loaded", 2, 2)
    assert first["image_id"] == meta["config"] and first["ref"] == "localhost/bgraph/hello:0.1"
    assert client.images.get("localhost/bgraph/hello:0.1").id == meta["config"]
    assert _run(client, "localhost/bgraph/hello:0.1") == f"hello from bgraph on {os.uname().machine}\n"
    again = _load(ws, host, "//images:hello")
    assert (again["status"], again["bytes_sent"]) == ("present", 0)

    # an edit of the app: one layer rebuilt, the system layer's digest unchanged, one layer sent
    toml = ws.root / "targets" / "images.toml"
    toml.write_text(toml.read_text().replace('"app/greeting" = "bgraph"', '"app/greeting" = "bgraph v2"'))
    second = _load(ws, host, "//images:hello")
    meta2 = json.loads((Path(second["output"]) / "image.json").read_text())
    assert meta2["layers"][0] == meta["layers"][0] and meta2["layers"][1] != meta["layers"][1]
    assert (second["status"], second["layers_sent"]) == ("loaded", 1), second
    assert second["bytes_sent"] < 64 << 10 < meta["layers"][0]["size"], second
    assert _run(client, "localhost/bgraph/hello:0.1") == f"hello from bgraph v2 on {os.uname().machine}\n"
    full = _load(ws, host, "--full", "//images:hello")
    assert (full["layers_sent"], full["status"]) == (2, "loaded")
    print(f"\nload: cold {first['bytes_sent']} B in {first['seconds']}s; app edit {second['bytes_sent']} B "
          f"({second['layers_sent']}/{second['layers']} layers) in {second['seconds']}s; the same whole "
          f"{full['bytes_sent']} B in {full['seconds']}s")


@requires_bwrap
@requires_dockerd
def test_a_python_image_with_a_wheel_runs(built, dockerd):
    host, client = dockerd
    ws, _link, _secs = built["a"]
    loaded = _load(ws, host, "//imgtest:py")
    assert loaded["layers_sent"] == 2
    out = _run(client, "localhost/bgraph/py:latest")
    assert out == "hello from a wheel 3.11.2 /usr/local/lib/python3.11/dist-packages/bgdemo/__init__.py\n", out


@requires_bwrap
@requires_dockerd
def test_the_system_layer_carries_the_ca_bundle_that_python_trusts(built, dockerd):
    """ca-certificates' postinst never runs: the rule's action writes its bundle, which Python's
    default TLS context (OpenSSL's /usr/lib/ssl/cert.pem -> the bundle) then loads."""
    host, client = dockerd
    ws, _link, _secs = built["a"]
    assert _load(ws, host, "//imgtest:py")["status"] in ("loaded", "present")
    check = ("import ssl; c = ssl.create_default_context(); s = c.cert_store_stats(); "
             "b = open('/etc/ssl/certs/ca-certificates.crt').read(); "
             "print(s['x509_ca'] > 100, b.count('BEGIN CERTIFICATE') == s['x509_ca'], b.endswith('\\n'))")
    out = _run(client, "localhost/bgraph/py:latest", ["/usr/bin/python3", "-c", check])
    assert out == "True True True\n", out


@requires_bwrap
@requires_dockerd
def test_a_layout_image_streams_the_archive_bytes_and_loads(built, dockerd):
    """archive = false: the output is the OCI layout (its blobs the layer actions' own files); the tar
    `bgraph load` streams from it is, byte for byte, what the archive action writes."""
    from build_graph.oci.load import _layout_members, _stream

    host, client = dockerd
    ws, _link, _secs = built["a"]
    run = ws.build("//imgtest:py-layout")
    assert run.rc == 0, run.stderr[-3000:]
    layout = Path(run.json["outputs"]["//imgtest:py-layout"])
    assert not (layout / "image.tar").exists() and (layout / "oci-layout").is_file()
    meta = json.loads((layout / "image.json").read_text())
    streamed = b"".join(_stream(layout, _layout_members(layout)))
    # what the archive action would write: the documents and blobs the image names, read from
    # image.json and index.json (not the directory listing, which also holds sbom.cdx.json)
    index = json.loads((layout / "index.json").read_text())
    names = {"oci-layout", "index.json", "manifest.json", image.blob_path(meta["config"]),
             *(image.blob_path(m["digest"]) for m in index["manifests"]),
             *(image.blob_path(layer["digest"]) for layer in meta["layers"])}
    members = {name: {"file": str(layout / name)} for name in sorted(names)}
    assert (layout / "sbom.cdx.json").is_file()
    written = io.BytesIO()
    tarball.write_archive(written, EPOCH, members)
    assert streamed == written.getvalue()
    with tarfile.open(fileobj=io.BytesIO(streamed)) as t:
        for layer in meta["layers"]:
            blob = t.extractfile(image.blob_path(layer["digest"])).read()
            assert "sha256:" + hashlib.sha256(blob).hexdigest() == layer["digest"]
    loaded = _load(ws, host, "//imgtest:py-layout")
    assert loaded["image_id"] == meta["config"] and loaded["status"] == "loaded", loaded
    out = _run(client, "localhost/bgraph/py-layout:latest")
    assert out.startswith("hello from a wheel 3.11.2 "), out


@requires_bwrap
@requires_dockerd
def test_load_errors_are_one_line_with_a_hint(built, dockerd, tmp_path):
    host, _client = dockerd
    ws, _link, _secs = built["a"]
    run = ws.cli("load", "//images:hello", env={"DOCKER_HOST": f"unix://{tmp_path}/none.sock"})
    assert run.rc == 2
    assert f"error: cannot reach a Docker daemon at unix://{tmp_path}/none.sock: no socket there" in run.stderr
    assert "hint: start a Docker daemon" in run.stderr and "Traceback" not in run.stderr
    run = ws.cli("load", "--full", "--timeout", "0.001", "//images:hello", env={"DOCKER_HOST": host})
    assert run.rc == 2 and "timed out after 0.001 s" in run.stderr and "Traceback" not in run.stderr, run.output
    run = ws.cli("load", "//toolchains:host", env={"DOCKER_HOST": host})
    assert run.rc == 2 and "is a deb_packages target; `bgraph load` loads oci_image targets" in run.stderr


class _OldDaemon(http.server.BaseHTTPRequestHandler):
    """Answers /version as Docker 19.03 (API 1.40) does."""

    def do_GET(self):
        body = json.dumps({"Version": "19.03.15", "ApiVersion": "1.40", "MinAPIVersion": "1.12",
                           "Components": [{"Name": "Engine", "Version": "19.03.15"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def address_string(self):
        return "unix"

    def log_message(self, *args):
        pass


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@pytest.mark.skipif(docker is None, reason="the docker SDK is not installed")
def test_a_daemon_too_old_is_refused_before_anything_is_sent(monkeypatch):
    from build_graph.oci.load import ImageLoadError, connect

    d = Path(tempfile.mkdtemp(prefix="bgo-", dir="/tmp"))
    server = _UnixServer(str(d / "old.sock"), _OldDaemon)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("DOCKER_HOST", f"unix://{d}/old.sock")
        with pytest.raises(ImageLoadError) as e:
            connect(timeout=10)
        text = e.value.render()
        assert "is too old: Docker 19.03.15 (API 1.40); loading needs API 1.41 (Docker 20.10) or newer" in text
        assert "hint: upgrade Docker" in text
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(docker is None, reason="the docker SDK is not installed")
@pytest.mark.parametrize("value", ["http://[::1", "tcp://host:notaport"])
def test_a_malformed_docker_host_is_one_error_naming_it(monkeypatch, value):
    """'http://[::1' (a typo'd IPv6 address) ended in a traceback: ValueError: Invalid IPv6 URL."""
    from build_graph.oci.load import ImageLoadError, connect

    monkeypatch.setenv("DOCKER_HOST", value)
    with pytest.raises(ImageLoadError) as e:
        connect(timeout=5)
    text = e.value.render()
    assert text.startswith(f"DOCKER_HOST={value!r} is not a Docker daemon address: ") and "\n  hint: fix" in text, text


# -- the vLLM runtime image, for real (slow: 8 GB of layers) ---------------------------------------------
VLLM_BASE_DISK_GB = 45  # the wheels (4 GB), their unpacked trees (8.5), the layers (8.5), the daemon's copy and its load staging (17)


@pytest.mark.slow
@requires_bwrap
@requires_dockerd
def test_the_vllm_runtime_image_imports_torch_with_no_network_and_an_edit_reloads_one_layer(dockerd, tmp_path):
    """//images:vllm-base from the pinned closure (locks/vllm-runtime.lock.json): loaded through the
    SDK, run with no network, `import torch, flashinfer` and TLS's CA bundle work; an edit of the top
    layer rebuilds that layer alone and `bgraph load` sends it alone."""
    free_gb = shutil.disk_usage(tmp_path).free / 1e9
    if free_gb < VLLM_BASE_DISK_GB:
        pytest.skip(f"needs {VLLM_BASE_DISK_GB} GB of free disk for the 8 GB image and its copies, {free_gb:.1f} GB free")
    host, client = dockerd
    ws = WS(workspace_copy(tmp_path / "ws"), tmp_path / "cache")
    start = time.monotonic()
    run = ws.build("//images:vllm-base", args=("-j2",))
    assert run.rc == 0, run.stderr[-3000:]
    cold = time.monotonic() - start
    layout = Path(run.json["outputs"]["//images:vllm-base"])
    meta = json.loads((layout / "image.json").read_text())
    assert [l["name"] for l in meta["layers"]] == ["system", "cuda", "torch", "deps", "flashinfer"]
    loaded = _load(ws, host, "//images:vllm-base")
    assert (loaded["status"], loaded["layers_sent"]) == ("loaded", 5), loaded
    check = ("import sys, ssl, torch, flashinfer, transformers, fastapi; "
             "print(sys.version.split()[0], torch.__version__, torch.cuda.is_available(), flashinfer.__version__, "
             "ssl.create_default_context().cert_store_stats()['x509_ca'] > 100)")
    container = client.containers.run("localhost/bgraph/vllm-base:0.33.0", ["/usr/bin/python3", "-c", check],
                                      network_mode="none", detach=True, cgroup_parent=f"/{CGROUP}", mem_limit="4g")
    try:
        status = container.wait(timeout=600)
        logs = container.logs().decode()
    finally:
        container.remove(force=True)
    assert status["StatusCode"] == 0, logs
    assert logs == "3.11.2 2.14.0+cu130 False 0.7.2.post1 True\n", logs
    # Triton is pointed at CUDA 13.0's ptxas (its bundled one rejects sm_121a): it runs in the image
    ptxas = client.containers.run("localhost/bgraph/vllm-base:0.33.0", ["/usr/local/cuda/bin/ptxas", "--version"],
                                  network_mode="none", remove=False, detach=True, cgroup_parent=f"/{CGROUP}")
    try:
        assert ptxas.wait(timeout=120)["StatusCode"] == 0
        assert "release 13.0" in ptxas.logs().decode()
    finally:
        ptxas.remove(force=True)
    config = client.images.get("localhost/bgraph/vllm-base:0.33.0").attrs["Config"]
    assert {"NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
            "TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas"} <= set(config["Env"])

    toml = ws.root / "targets" / "images.toml"
    text = toml.read_text()
    top = '{ name = "flashinfer", from = [{ tree = "//runtime:flashinfer-pypi", at = "usr/local/lib/python3.11/dist-packages" }] }'
    assert top in text
    toml.write_text(text.replace(top, top[:-2] + ', files = { "etc/bgraph-edit" = "one edit" } }'))
    edited = ws.build("//images:vllm-base", args=("-j2",))
    assert edited.rc == 0, edited.stderr[-3000:]
    ran = [a["name"] for a in edited.json["actions"] if a.get("status") == "executed"]
    assert sorted(ran) == ["image layout localhost/bgraph/vllm-base:0.33.0", "image sbom", "layer flashinfer"], ran
    meta2 = json.loads((Path(edited.json["outputs"]["//images:vllm-base"]) / "image.json").read_text())
    assert meta2["layers"][:4] == meta["layers"][:4] and meta2["layers"][4] != meta["layers"][4]
    thin = _load(ws, host, "//images:vllm-base")
    assert (thin["status"], thin["layers_sent"]) == ("loaded", 1), thin
    print(f"\n//images:vllm-base cold build {cold:.0f}s; layers {[(l['name'], l['size']) for l in meta['layers']]}; "
          f"load {loaded['bytes_sent']} B in {loaded['seconds']}s; after the edit {thin['bytes_sent']} B in "
          f"{thin['seconds']}s")


# -- the Spark's image (aarch64), checked on this x86_64 machine (slow: 8.5 GB of layers, an hour cold) --
SPARK_CACHE_ENV = "SPARK_IMAGE_TEST_BGRAPH_CACHE"  # not BGRAPH_*: conftest drops those
SPARK_DISK_GB = 3  # the root: the files bgraph's store holds are hard-linked, not written (--link-store)


@pytest.mark.slow
@requires_bwrap
def test_the_spark_image_is_all_aarch64_and_imports_vllm_under_qemu(tmp_path):
    """//images:vllm-sm121 as built in a warm cache (named by $SPARK_IMAGE_TEST_BGRAPH_CACHE: its vLLM and
    FlashInfer wheels take about an hour of both cores cold): every ELF in its layers is AArch64, and
    on its root filesystem the image's CPython under the pinned qemu-user imports vllm, flashinfer and
    torch, loads their extension libraries, and `vllm --version` prints 0.33.0 or, with no GPU, stops
    with vLLM's "Failed to infer device type" (bench/image_aarch64_check.py)."""
    cache = os.environ.get(SPARK_CACHE_ENV)
    if not cache or not Path(cache).is_dir():
        pytest.skip(f"no warm cache: set {SPARK_CACHE_ENV} to a cache where `bgraph build //images:vllm-sm121` ran")
    ws = WS(workspace_copy(tmp_path / "ws"), Path(cache))
    plan = ws.cli("build", "--dry-run", "--platform", "aarch64", "//images:vllm-sm121", "//vllm:cuda-driver-stub")
    if plan.rc != 0 or "would run" in plan.stderr:
        pytest.skip(f"//images:vllm-sm121 is not built in {cache} (its dry run would run actions: an hour cold); "
                    f"build it there first")
    free_gb = shutil.disk_usage(cache).free / 1e9
    if free_gb < SPARK_DISK_GB:
        pytest.skip(f"needs {SPARK_DISK_GB} GB free beside {cache} to unpack the layers, {free_gb:.1f} GB free")
    root = Path(tempfile.mkdtemp(prefix="spark-root-", dir=Path(cache).parent))  # hard links: the cache's filesystem
    check = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "bench" / "image_aarch64_check.py"),
                            "-C", str(ws.root), "--cache-dir", cache, "--label", "//images:vllm-sm121",
                            "--link-store", cache, "--root", str(root / "root")],
                           capture_output=True, text=True, timeout=3600, env=hermetic_env(), check=False)
    shutil.rmtree(root, ignore_errors=True)
    report = json.loads(check.stdout) if check.stdout.strip().startswith("{") else {}
    assert check.returncode == 0, (check.stdout[-4000:], check.stderr[-3000:])
    assert report["all_elf_aarch64"] and report["elf_files"] > 100, report
    assert [l["name"] for l in report["layers"]] == ["system", "cuda", "torch", "deps", "flashinfer", "vllm"]
    assert all(l["digest_ok"] for l in report["layers"]), report["layers"]
    probe = report["probe"]
    assert (probe["machine"], probe["vllm"], probe["flashinfer"]) == ("aarch64", "0.33.0", "0.7.2.post1"), probe
    assert probe["scaled_fp4_quant"] and probe["flashinfer_aot_modules"] > 0, probe
    # With no GPU, `vllm` stops before --version (its parsers' defaults need a device): vLLM's own error.
    assert report["vllm_version"] == "0.33.0" or report["vllm_version_no_gpu"], report.get("vllm_version_error")
