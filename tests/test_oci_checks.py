"""oci_image's checks at planning and `bgraph load`'s argument and daemon errors (issue 35, the K9
red team's holes): directory modes the bottom layer writes and upper layers keep, a path that is a
file where a directory is, names no file system or tar takes, env keys and order, repositories,
`modes` keys that match nothing, a layout's stream, and `--timeout`."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import tarfile
import tempfile
import threading
from pathlib import Path

import pytest

from build_graph.errors import PlanError
from build_graph.labels import Label
from build_graph.model import Digester, DirEntry, FileEntry, Outcome, SymlinkEntry, TargetOutput, Tree, check_relpath
from build_graph.oci import tarball
from build_graph.rules.base import RuleContext
from build_graph.rules.registry import RULES

EPOCH = 315532800
# base-files ships tmp/ and root/ as empty directories: the tree holds DirEntry there, no mode
SYSTEM = TargetOutput(Tree({"usr/bin/busybox": FileEntry("1" * 64, 10, True), "lib": SymlinkEntry("usr/lib"),
                            "tmp": DirEntry(), "root": DirEntry(), "var/tmp": DirEntry(),
                            "usr/share/doc/x/copyright": FileEntry("2" * 64, 3)}),
                      {"architecture": "amd64", "sysroot": True})
HOST = TargetOutput(Tree(), {"host_paths": ["/usr"], "host_tools": [["/usr/bin/python3", "3", "0" * 64]]})


def _plan(attrs: dict, deps: dict[str, TargetOutput] | None = None, read=lambda e: b""):
    rule = RULES["oci_image"]
    all_deps = {Label("toolchains", "host"): HOST, Label("p", "system"): SYSTEM,
                **{Label("p", name): out for name, out in (deps or {}).items()}}
    ctx = RuleContext(label=Label("p", "img"), attrs=rule.attrs.model_validate(attrs), file="targets/p.toml",
                      table="img", platform="x86_64", digester=Digester("blake3"), deps=all_deps, sources=Tree(),
                      pins=None, arch_sets=lambda v, _w: v, read=read, probe_host=lambda tools: (),
                      rule_version="oci_image/1")
    return rule.plan(ctx)


def _specs(attrs: dict, deps: dict[str, TargetOutput] | None = None) -> dict[str, dict]:
    """layer name -> the spec its writer action is given."""
    return {a.name.removeprefix("layer "): json.loads("".join(a.argv[6:])) for a in next(_plan(attrs, deps))}


def _refusal(attrs: dict, deps: dict[str, TargetOutput] | None = None) -> str:
    with pytest.raises(PlanError) as e:
        next(_plan(attrs, deps))
    return e.value.render()


# -- directory modes ---------------------------------------------------------------------------------
def test_the_bottom_layer_writes_tmp_var_tmp_and_root_modes_over_the_systems_empty_directories(tmp_path):
    """base-python's tmp/ was a DirEntry, skipped: /tmp came out 0755 and a non-root user had none."""
    spec = _specs({"system": ":system"})["system"]
    assert spec["dirs"] == {"tmp": 0o1777, "var/tmp": 0o1777, "root": 0o700}
    (tmp_path / "tmp").mkdir()
    out = io.BytesIO()
    tarball.write_layer(out, str(tmp_path), EPOCH, dirs=spec["dirs"])
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as t:
        assert {m.name: m.mode for m in t} == {"tmp": 0o1777, "var": 0o755, "var/tmp": 0o1777, "root": 0o700}


def test_an_upper_layer_below_tmp_or_root_keeps_their_modes_not_0755():
    specs = _specs({"system": ":system", "layers": [
        {"name": "a", "files": {"tmp/seed": "x", "root/.profile": "y", "var/tmp/z": "z", "etc/app": "w"}},
        {"name": "b", "files": {"tmp/deeper/f": "x"}}]})
    assert specs["a"]["dirs"] == {"tmp": 0o1777, "root": 0o700, "var/tmp": 0o1777}
    assert specs["b"]["dirs"] == {"tmp": 0o1777}
    # a mode the image's `modes` gives a directory of a lower layer is written wherever it is held
    specs = _specs({"system": ":system", "modes": {"usr/share": "0750"},
                    "layers": [{"name": "a", "files": {"usr/share/x": "x"}}]})
    assert specs["system"]["modes"] == specs["a"]["modes"] == {"usr/share": 0o750}


# -- a file where a directory is -------------------------------------------------------------------------
def test_a_file_where_the_same_layer_has_entries_below_it_is_refused_naming_both():
    tree = TargetOutput(Tree({"d/inner": FileEntry("3" * 64, 6)}))
    text = _refusal({"layers": [{"name": "a", "from": [{"tree": ":tree"}], "files": {"d": "now a file"}}]},
                    {"tree": tree})
    assert "layer a holds d as a file and d/inner below it" in text.splitlines()[0]
    text = _refusal({"layers": [{"name": "a", "files": {"f": "x", "f/g": "y"}}]})
    assert "layer a holds f as a file and f/g below it" in text
    link = TargetOutput(Tree({"d": SymlinkEntry("x"), "e/f": FileEntry("3" * 64, 6)}))
    assert "layer a puts d/x below d, a symlink in layer a" in _refusal(
        {"layers": [{"name": "a", "from": [{"tree": ":link"}], "files": {"d/x": "y"}}]}, {"link": link})


def test_a_file_over_a_lower_layers_directory_or_a_directory_over_its_file_is_refused():
    """An upper file usr/share hid the system's whole /usr/share without a word."""
    text = _refusal({"system": ":system", "layers": [{"name": "app", "files": {"usr/share": "x"}}]})
    assert ("layer app puts a file at usr/share, a directory in layer system: it would hide that directory's "
            "whole tree") in text, text
    text = _refusal({"system": ":system", "layers": [{"name": "app", "files": {"usr/bin/busybox/x": "x"}}]})
    assert "layer app needs usr/bin/busybox as a directory, a file in layer system" in text, text
    # a file over a lower file, and a directory over a lower directory, are fine
    assert set(_specs({"system": ":system", "layers": [{"name": "app", "files": {"usr/bin/busybox": "#!"}}]}))


# -- names ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["..", ".", "a/b", "a\0b", ""])
def test_a_console_script_named_dot_dot_slash_or_nul_is_refused(name):
    wheel = TargetOutput(Tree({"demo-1.0-py3-none-any.whl": FileEntry("5" * 64, 100)}),
                         {"wheel": "demo-1.0-py3-none-any.whl"})
    with pytest.raises(ValueError, match="not a name and module:function"):
        _plan({"layers": [{"name": "app", "from": [{"wheel": ":demo", "scripts": {name: "demo:main"}}]}]},
              {"demo": wheel})
    # and from the wheel's own entry points
    gen = _plan({"layers": [{"name": "app", "from": [{"wheel": ":demo"}]}]}, {"demo": wheel},
                read=lambda e: f"[console_scripts]\n{name or 'x'} = demo:main\n".encode())
    [unpack] = next(gen)
    unpacked = Tree({"demo/__init__.py": FileEntry("6" * 64, 1),
                     "demo-1.0.dist-info/entry_points.txt": FileEntry("7" * 64, 10)})
    if name in ("", ):
        return  # 'x' is a name: the entry-points case needs a bad one
    with pytest.raises(PlanError, match="is not module:function"):
        gen.send([Outcome(unpack, unpacked, "executed")])


def test_check_relpath_refuses_a_nul_byte():
    with pytest.raises(ValueError, match="NUL"):
        check_relpath("etc/a\0b")
    assert check_relpath("etc/./a") == "etc/a"


@pytest.mark.parametrize("attrs", [
    {"layers": [{"name": "a", "files": {"etc/a\0b": "x"}}]},
    {"layers": [{"name": "a", "files": {"etc/x": "y"}}], "modes": {"etc/x\0": "0644"}},
    {"layers": [{"name": "a", "files": {"etc/x": "y"}}], "site_packages": "usr/lib\0x"},
    {"layers": [{"name": "a", "from": [{"tree": ":t", "at": "opt\0x"}]}]},
    {"layers": [{"name": "a", "files": {"etc/x": "y"}}], "workdir": "/a\0b"},
    {"layers": [{"name": "a", "files": {".": "y"}}]},
    {"layers": [{"name": "a", "files": {"a/..": "y"}}]},
])
def test_a_nul_or_dot_path_is_refused_in_every_path_attribute(attrs):
    with pytest.raises(ValueError):
        RULES["oci_image"].attrs.model_validate(attrs)


# -- env, repository, modes --------------------------------------------------------------------------
@pytest.mark.parametrize("env", [{"A=B": "c"}, {"": "x"}, {"A\0": "x"}, {"A": "x\0y"}])
def test_an_env_key_that_is_empty_or_holds_equals_or_nul_is_refused(env):
    with pytest.raises(ValueError, match="env"):
        RULES["oci_image"].attrs.model_validate({"layers": [{"name": "a", "files": {"x": "y"}}], "env": env})


def _config(attrs: dict) -> dict:
    """The image config the plan writes (layers stand-ins: their writer's meta read back)."""
    gen = _plan(attrs, read=lambda e: json.dumps({"digest": "sha256:" + "a" * 64, "size": 10}).encode())
    actions = next(gen)
    done = [Outcome(a, Tree({"layer.tar": FileEntry("9" * 64, 10), "layer.json": FileEntry("8" * 64, 10)}),
                    "executed") for a in actions]
    image_action = next(a for a in gen.send(done) if a.mnemonic == "OciImage")
    members = json.loads("".join(image_action.argv[6:]))["members"]
    [manifest] = json.loads(members["index.json"]["text"])["manifests"]
    digest = json.loads(members[f"blobs/sha256/{manifest['digest'][7:]}"]["text"])["config"]["digest"]
    return json.loads(members[f"blobs/sha256/{digest[7:]}"]["text"])


def test_env_is_written_sorted_so_the_toml_order_does_not_change_the_image():
    base = {"layers": [{"name": "a", "files": {"x": "y"}}]}
    one = _config({**base, "env": {"B": "2", "A": "1", "PATH": "/bin"}})
    two = _config({**base, "env": {"PATH": "/bin", "A": "1", "B": "2"}})
    assert one == two and one["config"]["Env"] == ["A=1", "B=2", "PATH=/bin"]
    assert _config(base)["config"]["Env"] == ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]


@pytest.mark.parametrize("repo", ["localhost:5000", "Localhost/app", "a/" + "b" * 260, "host:5000/", "a//b"])
def test_a_repository_that_is_no_reference_without_a_tag_is_refused(repo):
    with pytest.raises(ValueError, match="is not an image name"):
        RULES["oci_image"].attrs.model_validate({"layers": [{"name": "a", "files": {"x": "y"}}], "repository": repo})


@pytest.mark.parametrize("repo", ["localhost:5000/app", "registry.example.org/team/app", "app", "a__b/c-d"])
def test_a_repository_reference_is_taken(repo):
    RULES["oci_image"].attrs.model_validate({"layers": [{"name": "a", "files": {"x": "y"}}], "repository": repo})


def test_a_modes_key_matching_no_path_is_refused_naming_it():
    text = _refusal({"system": ":system", "modes": {"usr/bin/busybox": "4755", "/usr/bin/busyboks": "4755"}})
    assert "key 'modes'): modes names '/usr/bin/busyboks', a path no layer holds" in text, text
    assert _specs({"system": ":system", "modes": {"/usr/bin/busybox": "4755"}})["system"]["modes"] == {
        "usr/bin/busybox": 0o4755}


# -- load --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "-inf", "x", ""])
def test_load_timeout_is_a_finite_number_above_zero(text):
    from build_graph.cli import timeout_arg

    with pytest.raises(argparse.ArgumentTypeError):
        timeout_arg(text)
    assert timeout_arg("0.5") == 0.5


@pytest.mark.parametrize("value", ["0", "nan", "inf", "-1"])
def test_bgraph_load_with_a_bad_timeout_is_one_usage_line(make_ws, value):
    ws = make_ws({"targets/i.toml": '[img]\nkind = "oci_image"\nlayers = [{name = "a", files = {"x" = "y"}}]\n'})
    run = ws.cli("load", "--timeout", value, "//i:img")
    assert run.rc == 2 and "Traceback" not in run.output and "--timeout" in run.stderr, run.output


def test_a_layout_streams_exactly_the_members_of_image_tar_not_its_sbom(tmp_path):
    """The stream held sbom.cdx.json, which image.tar never does: 2 KiB more, another tar."""
    from build_graph.oci.load import _layout_members, _stream

    members = {"oci-layout": '{"imageLayoutVersion":"1.0.0"}', "index.json": "{}", "manifest.json": "[]",
               "blobs/sha256/" + "a" * 64: "layer bytes"}
    for name, text in members.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "image.json").write_text("{}")
    (tmp_path / "sbom.cdx.json").write_text('{"bomFormat": "CycloneDX"}')
    written = io.BytesIO()
    tarball.write_archive(written, EPOCH, {n: {"text": t} for n, t in members.items()})
    assert b"".join(_stream(tmp_path, _layout_members(tmp_path))) == written.getvalue()


class _Daemon:
    """A daemon speaking API 1.41 that refuses every image name with 400 (as Docker does a bad one)."""

    def __init__(self, handler):
        import socketserver

        class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

        self.dir = Path(tempfile.mkdtemp(prefix="bgo-", dir="/tmp"))
        self.server = Server(str(self.dir / "d.sock"), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.host = f"unix://{self.dir}/d.sock"

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _handler(listing: int = 400):
    """/version as Docker 20.10; an image looked up: 400 (a bad name), or 404 where the listing of
    all images is answered `listing` (500: a daemon failing later in the load)."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.endswith("/version"):
                code, body = 200, {"Version": "20.10.24", "ApiVersion": "1.41", "MinAPIVersion": "1.12"}
            elif listing == 400:
                code, body = 400, {"message": "invalid reference format"}
            elif "/images/json" in self.path:
                code, body = listing, {"message": "layer store is broken"}
            else:
                code, body = 404, {"message": "no such image"}
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def address_string(self):
            return "unix"

        def log_message(self, *args):
            pass

    return Handler


def test_a_daemon_refusing_the_name_is_one_error_line_not_a_raw_400(monkeypatch, tmp_path):
    pytest.importorskip("docker")
    from build_graph.oci.load import ImageLoadError, load

    daemon = _Daemon(_handler())
    try:
        monkeypatch.setenv("DOCKER_HOST", daemon.host)
        with pytest.raises(ImageLoadError) as e:
            load(tmp_path, {"ref": "localhost:5000:latest", "config": "sha256:" + "c" * 64, "layers": []}, timeout=10)
        [line, hint] = e.value.render().splitlines()
        assert line.endswith(f"the daemon at {daemon.host} refused localhost:5000:latest: invalid reference format")
        assert hint.startswith("  hint: rebuild the image with a valid repository")
    finally:
        daemon.close()


# -- why ---------------------------------------------------------------------------------------------
def _image_dir(root: Path, layers: list[tuple[str, dict]]) -> Path:
    """An image layout of made-up layers (name, {path: text | ("link", target)}), bottom first."""
    described = []
    for name, entries in layers:
        tree = root / f"tree-{name}"
        tree.mkdir()
        files = {p: {"text": v} for p, v in entries.items() if isinstance(v, str)}
        for p, v in entries.items():
            if not isinstance(v, str):
                (tree / p).parent.mkdir(parents=True, exist_ok=True)
                (tree / p).symlink_to(v[1])
        out = io.BytesIO()
        digest, size = tarball.write_layer(out, str(tree), EPOCH, files=files)
        blob = root / "img" / "blobs" / "sha256" / digest[7:]
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(out.getvalue())
        described.append({"name": name, "digest": digest, "size": size, "placed": {f"//p:{name}": [""]}})
    (root / "img" / "image.json").write_text(json.dumps({"ref": "localhost/bgraph/t:latest", "layers": described}))
    return root / "img"


def test_why_follows_directory_symlinks_and_answers_the_top_layer_a_container_sees(tmp_path):
    """`why /bin/sh` said 'in no layer' (bin -> usr/bin); a path below an upper file was 'layer system'."""
    from build_graph.oci.why import ImageWhyError, origin

    img = _image_dir(tmp_path, [
        ("system", {"bin": ("link", "usr/bin"), "usr/bin/sh": "#!", "usr/share/doc/x": "c", "usr/lib/y": "y",
                    "lib": ("link", "/usr/lib"), "opt/a/keep": "k"}),
        ("app", {"usr/bin/sh": "#! newer", "usr/share": "a file now", "usr/.wh.lib": "", "opt/a/.wh..wh..opq": "",
                 "opt/a/new": "n"})])
    found = origin(img, "/bin/sh")
    assert (found.path, found.layer, found.shadowed, found.targets) == ("usr/bin/sh", "app", ["system"], ["//p:app"])
    assert origin(img, "/bin/../bin/sh").layer == "app"
    with pytest.raises(ImageWhyError, match="/usr/share/doc/x is hidden: layer app holds /usr/share as a file"):
        origin(img, "/usr/share/doc/x")
    with pytest.raises(ImageWhyError, match="/usr/lib is in no layer of localhost/bgraph/t:latest"):
        origin(img, "/lib/y")  # lib -> /usr/lib, which the app layer's whiteout removed
    with pytest.raises(ImageWhyError, match="/opt/a/keep is in no layer"):
        origin(img, "/opt/a/keep")  # below an opaque directory
    assert origin(img, "/opt/a/new").layer == "app"
    assert origin(img, "/usr/share").layer == "app"


# -- big inline values --------------------------------------------------------------------------------
def test_a_big_inline_file_or_label_goes_in_argv_chunks_and_the_writer_joins_them(tmp_path):
    """A 140 KB inline file was one argument: "Argument list too long: '/bin/sh'" when it ran."""
    big = "x" * 140_000 + "\u00e9"
    [system, layer] = next(_plan({"system": ":system", "layers": [{"name": "a", "files": {"etc/big": big}}]}))
    assert len(layer.argv) == 6 + 3 and all(len(a.encode()) <= 64 << 10 for a in layer.argv)
    assert len(system.argv) == 7  # a small spec is one argument, as before (the same action key)
    root = tmp_path / "root"
    root.mkdir()
    spec = json.loads("".join(layer.argv[6:]))
    spec.update(root=str(root), out=str(tmp_path / "layer.tar"), meta=str(tmp_path / "layer.json"))
    text = json.dumps(spec)
    tarball.main(["layer", text[:1000], text[1000:]])
    with tarfile.open(tmp_path / "layer.tar") as t:
        assert t.extractfile("etc/big").read().decode() == big
    config = _config({"layers": [{"name": "a", "files": {"x": "y"}}],
                      "labels": {"org.opencontainers.image.description": big}})
    assert config["config"]["Labels"]["org.opencontainers.image.description"] == big


def test_inline_values_past_the_command_line_budget_are_refused_at_planning():
    text = _refusal({"layers": [{"name": "a", "files": {"etc/big": "x" * (1 << 20)}}]})
    assert text.splitlines()[0].endswith("key 'layers'): layer a's inline files take 1024 KiB, more than the "
                                         "1024 KiB an action's command line may carry"), text
    assert "hint: put big files in a tree" in text


def test_a_system_whose_var_is_a_link_gets_no_var_tmp_below_it():
    system = TargetOutput(Tree({"bin/sh": FileEntry("1" * 64, 10, True), "var": SymlinkEntry("private/var")}),
                          {"architecture": "amd64", "sysroot": True})
    [layer] = next(_plan({"system": ":sys"}, {"sys": system}))
    assert json.loads("".join(layer.argv[6:]))["dirs"] == {"tmp": 0o1777, "root": 0o700}


def test_a_daemon_error_later_in_the_load_is_one_error_line(monkeypatch, tmp_path):
    pytest.importorskip("docker")
    from build_graph.oci.load import ImageLoadError, load

    with open(tmp_path / "image.tar", "wb") as f:
        tarball.write_archive(f, EPOCH, {"oci-layout": {"text": "{}"}})
    daemon = _Daemon(_handler(listing=500))
    try:
        monkeypatch.setenv("DOCKER_HOST", daemon.host)
        with pytest.raises(ImageLoadError) as e:
            load(tmp_path, {"ref": "localhost/bgraph/x:latest", "config": "sha256:" + "c" * 64,
                            "layers": [{"digest": "sha256:" + "d" * 64, "size": 1}]}, timeout=10)
        [line, hint] = e.value.render().splitlines()
        assert line.endswith("answered an error while loading localhost/bgraph/x:latest: layer store is broken")
        assert hint.startswith("  hint: check the daemon")
    finally:
        daemon.close()


@pytest.mark.parametrize("extra", [{"python": "/usr/bin/python3\nimport os"}, {"python": "python3"},
                                   {"entrypoint": ["/bin/sh\0"]}, {"cmd": ["a", "b\0c"]}])
def test_a_launcher_interpreter_or_command_that_no_process_can_take_is_refused(extra):
    with pytest.raises(ValueError, match="python|NUL"):
        RULES["oci_image"].attrs.model_validate({"layers": [{"name": "a", "files": {"x": "y"}}], **extra})
