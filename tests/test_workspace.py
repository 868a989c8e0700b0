"""Loading WORKSPACE.toml and targets/**/*.toml: every error names file, table, key and line."""

from __future__ import annotations

import re

import pytest

from build_graph.errors import LoadError
from build_graph.labels import Label
from build_graph.rules.genrule import GenruleAttrs
from build_graph.workspace import Pin, PinFile, load

SHA_A = "a" * 64
SHA_B = "b" * 64

GENRULE = '[{name}]\nkind = "genrule"\nouts = ["o"]\ncmd = "true"\n'


def load_error(ws) -> str:
    with pytest.raises(LoadError) as info:
        load(ws.root)
    return str(info.value)


def test_loads_targets_and_derives_packages_from_paths(make_ws):
    ws = make_ws({
        "targets/p.toml": GENRULE.format(name="a") + "\n" + GENRULE.format(name="b"),
        "targets/sub/dir/q.toml": GENRULE.format(name="c"),
    })
    w = load(ws.root)
    assert set(w.targets) == {Label("p", "a"), Label("p", "b"), Label("sub/dir/q", "c"),
                              Label("toolchains", "host")}
    t = w.targets[Label("sub/dir/q", "c")]
    assert (t.kind, t.file, t.table) == ("genrule", "targets/sub/dir/q.toml", "c")
    assert isinstance(t.attrs, GenruleAttrs) and t.attrs.outs == ["o"]
    # Defaults from the rule's model: tools points at //toolchains:host.
    assert t.attrs.tools == "//toolchains:host"
    assert w.digest_function == "blake3"


def test_package_declared_explicitly(make_ws):
    ws = make_ws({"targets/whatever.toml": 'package = "//lib/core"\n\n' + GENRULE.format(name="x")})
    w = load(ws.root)
    assert Label("lib/core", "x") in w.targets
    assert Label("whatever", "x") not in w.targets


def test_package_declared_twice(make_ws):
    ws = make_ws({"targets/a.toml": 'package = "//p"\n' + GENRULE.format(name="x"),
                  "targets/p.toml": GENRULE.format(name="y")})
    msg = load_error(ws)
    assert "package //p is declared twice" in msg and "targets/a.toml" in msg and "targets/p.toml" in msg


def test_bad_package_declaration(make_ws):
    ws = make_ws({"targets/p.toml": '\npackage = "p"\n' + GENRULE.format(name="x")})
    msg = load_error(ws)
    assert msg.startswith("targets/p.toml:2 key 'package': bad package 'p'")


@pytest.mark.parametrize("declared", ["//../victim", "//a/./b", "//.."])
def test_a_package_of_dots_is_refused(make_ws, declared):
    """`package = "//../victim"` linked bgraph-out/../victim/x over a workspace file."""
    ws = make_ws({"targets/p.toml": f'package = "{declared}"\n' + GENRULE.format(name="x")})
    assert load_error(ws).startswith(f"targets/p.toml:1 key 'package': bad package '{declared}'")


def test_a_table_name_ending_in_a_newline_is_no_label(make_ws):
    """["ok\\n"] was the label //p:ok (a regex's `$` matches before a final newline) and silently
    replaced the real [ok]; the error shows the name as its header writes it, on one line."""
    ws = make_ws({"targets/p.toml": GENRULE.format(name="ok") + "\n" + GENRULE.format(name='"ok\\n"')})
    msg = load_error(ws)
    assert "\n" not in msg.split("\n  hint")[0] and 'targets/p.toml:6 ["ok\\n"]: bad label' in msg, msg


def test_two_tables_of_one_label_are_refused(make_ws, monkeypatch):
    """Should two tables ever give one label, the later must not silently replace the earlier."""
    import build_graph.workspace as workspace
    monkeypatch.setattr(workspace, "parse_label", lambda text, **kw: Label("p", "a"))
    ws = make_ws({"targets/p.toml": GENRULE.format(name="a") + "\n" + GENRULE.format(name="b")}, toolchains=False)
    msg = load_error(ws)
    assert msg.startswith("targets/p.toml:6 [b]: target //p:a is declared twice (also by table 'a' in targets/p.toml)"), msg


@pytest.mark.parametrize("value", ["a" * 64 + "\\n", "\\n" + "a" * 64])
def test_a_sha256_with_a_newline_is_refused(make_ws, value):
    ws = make_ws({"WORKSPACE.toml": f'[workspace]\nname = "t"\n\n[pins.x]\nkind = "url"\nurl = "file:///x"\n'
                                    f'sha256 = "{value}"\n'})
    assert "must be 64 lowercase hex digits" in load_error(ws)


@pytest.mark.parametrize("files, start", [
    ({"targets/p.toml": GENRULE.format(name="a" * 201)}, "targets/p.toml:1 [" + "a" * 60 + "…]: bad label '//p:"),
    ({"targets/p.toml": 'package = "//' + "b" * 201 + '"\n' + GENRULE.format(name="x")},
     "targets/p.toml:1 key 'package': bad package '//" + "b" * 201 + "': the segment 'bbbbbbbbbbbb…' is 201 bytes"),
    ({"targets/" + "c" * 201 + "/p.toml": GENRULE.format(name="x")}, "targets/" + "c" * 201 + "/p.toml: bad package name"),
])
def test_a_label_segment_too_long_for_a_file_name_is_refused(make_ws, files, start):
    """A 300-character target name built, then its bgraph-out link failed with 'File name too
    long: <cache>/trees/…': a segment over 200 bytes is refused at load, naming the table."""
    msg = load_error(make_ws(files))
    assert msg.startswith(start) and "more than 200" in msg, msg


def test_a_label_segment_of_200_characters_loads(make_ws):
    ws = make_ws({"targets/p.toml": GENRULE.format(name="a" * 200)})
    assert Label("p", "a" * 200) in load(ws.root).targets


PIN_HEAD = '[workspace]\nname = "t"\n\n[pins.x]\nkind = "url"\n'


@pytest.mark.parametrize("lines, key", [
    ('url = "file:///tmp/f.txt"\nfilename = "../evil"\n', "filename"),
    ('url = "file:///tmp/f.txt"\nfilename = "a/b"\n', "filename"),
    ('url = "file:///tmp/f.txt"\nfilename = ".."\n', "filename"),
    ('url = "file:///tmp/.."\n', "url"),
    ('url = "file:///tmp/."\n', "url"),
    ('url = "file:///tmp/"\n', "url"),
])
def test_a_pin_file_name_that_is_no_name_is_refused_at_load(make_ws, lines, key):
    """filename = "../evil" (or a url ending in '..') loaded, downloaded, then failed with a raw
    'path escapes the tree root': the load names the pin and key, with a hint."""
    ws = make_ws({"WORKSPACE.toml": PIN_HEAD + lines + f'sha256 = "{SHA_A}"\n'})
    msg = load_error(ws)
    assert msg.startswith(f"WORKSPACE.toml:") and f"[pins.x] key '{key}':" in msg and "\n  hint: " in msg, msg


def test_a_platform_pin_file_and_a_pin_name_that_are_no_names_are_refused(make_ws):
    ws = make_ws({"WORKSPACE.toml": PIN_HEAD + f'[pins.x.platforms.x86_64]\nurl = "https://h/d/.."\nsha256 = "{SHA_A}"\n'})
    assert "[pins.x.platforms.x86_64] key 'url':" in load_error(ws)
    ws = make_ws({"WORKSPACE.toml": PIN_HEAD.replace("pins.x", 'pins.".."') + f'url = "file:///f"\nsha256 = "{SHA_A}"\n'})
    assert "pin name '..' is no file name" in load_error(ws)
    # A url with a name at its end, or a filename of its own, is fine.
    ws = make_ws({"WORKSPACE.toml": PIN_HEAD + f'url = "https://h/d/.."\nfilename = "a.tgz"\nsha256 = "{SHA_A}"\n'})
    assert load(ws.root).model.pins["x"].filename == "a.tgz"


@pytest.mark.parametrize("path", ["targets/aarch64.toml", "targets/x86_64/p.toml"])
def test_a_package_named_after_a_platform_is_refused(make_ws, path):
    """bgraph-out/aarch64/p/x holds //p:x built for aarch64: //aarch64/p:x would share the link."""
    ws = make_ws({path: GENRULE.format(name="x")})
    msg = load_error(ws)
    assert msg.startswith(f"{path}: package //") and "begins with the platform name" in msg, msg


def test_malformed_toml_names_file_and_line(make_ws):
    ws = make_ws({"targets/p.toml": '[a]\nkind = "genrule"\nouts = ["o"\ncmd = "x"\n'})
    msg = load_error(ws)
    assert msg.startswith("targets/p.toml: malformed TOML")
    assert "line 4" in msg


def test_malformed_workspace_toml(make_ws):
    ws = make_ws({"WORKSPACE.toml": '[workspace]\nname = "t\n'})
    msg = load_error(ws)
    assert msg.startswith("WORKSPACE.toml: malformed TOML") and "line 2" in msg


def test_targets_file_that_is_not_utf8_names_file_and_byte(make_ws):
    ws = make_ws({"targets/p.toml": b'[a]\nkind = "genrule"\nouts = ["o"]\ncmd = "caf\xe9"\n'})
    msg = load_error(ws)
    assert msg.startswith("targets/p.toml:4: not valid UTF-8: byte 44 (line 4)"), msg
    run = ws.cli("build", "//p:a")
    assert run.rc == 2 and "not valid UTF-8" in run.stderr and "Traceback" not in run.output


def test_unknown_key_in_target_names_file_table_key_and_line(make_ws):
    ws = make_ws({"targets/p.toml": "# comment\n" + GENRULE.format(name="a") + "\n"
                  + GENRULE.format(name="b") + "srcz = []\n"})
    msg = load_error(ws)
    assert msg.startswith("targets/p.toml:11 [b] key 'srcz': unknown key 'srcz'"), msg


def test_unknown_key_in_quoted_table(make_ws):
    ws = make_ws({"targets/p.toml": '["x-1.0"]\nkind = "genrule"\nouts = ["o"]\ncmd = "true"\nbogus = 1\n'})
    assert load_error(ws).startswith("targets/p.toml:5 [x-1.0] key 'bogus': unknown key 'bogus'")


def test_missing_required_key(make_ws):
    ws = make_ws({"targets/p.toml": '[a]\nkind = "genrule"\ncmd = "true"\n'})
    assert load_error(ws).startswith("targets/p.toml [a] key 'outs': missing required key 'outs'")


def test_wrong_type_names_key(make_ws):
    ws = make_ws({"targets/p.toml": '[a]\nkind = "genrule"\nouts = "o"\ncmd = "true"\n'})
    msg = load_error(ws)
    assert msg.startswith("targets/p.toml:3 [a] key 'outs':") and "list" in msg


def test_unknown_key_in_workspace_toml(make_ws):
    ws = make_ws({"WORKSPACE.toml": '[workspace]\nname = "t"\ncolour = "red"\n'})
    assert load_error(ws) == "WORKSPACE.toml:3 [workspace] key 'colour': unknown key 'colour'"
    ws = make_ws({"WORKSPACE.toml": 'oops = 1\n[workspace]\nname = "t"\n'})
    assert load_error(ws) == "WORKSPACE.toml:1 key 'oops': unknown key 'oops'"


def test_bad_digest_function(make_ws):
    ws = make_ws({"WORKSPACE.toml": '[workspace]\nname = "t"\ndigest_function = "md5"\n'})
    msg = load_error(ws)
    assert msg.startswith("WORKSPACE.toml:3 [workspace] key 'digest_function':")
    assert "blake3" in msg and "sha256" in msg


def test_bad_sha256_in_pin(make_ws):
    ws = make_ws({"WORKSPACE.toml": '[workspace]\nname = "t"\n\n[pins.x]\nkind = "url"\n'
                                    'url = "https://example.invalid/x.tar.gz"\nsha256 = "ABC"\n'})
    msg = load_error(ws)
    assert msg.startswith("WORKSPACE.toml:7 [pins.x] key 'sha256':"), msg
    assert "64 lowercase hex digits" in msg


def test_bad_sha256_in_platform_pin(make_ws):
    ws = make_ws({"WORKSPACE.toml": '[workspace]\nname = "t"\n\n[pins.x]\nkind = "pypi"\nproject = "p"\n'
                                    'version = "1"\nfile = "wheel"\n'
                                    f'platforms.x86_64 = {{ filename = "a.whl", sha256 = "{SHA_A[:-1]}" }}\n'})
    msg = load_error(ws)
    assert "[pins.x.platforms.x86_64] key 'sha256'" in msg and "64 lowercase hex digits" in msg


def test_incomplete_pypi_pin(make_ws):
    ws = make_ws({"WORKSPACE.toml": '[workspace]\nname = "t"\n\n[pins.x]\nkind = "pypi"\nproject = "p"\n'
                                    f'file = "wheel"\nfilename = "a.whl"\nsha256 = "{SHA_A}"\n'})
    msg = load_error(ws)
    assert msg.startswith("WORKSPACE.toml") and "pins" in msg and "pypi pin needs version" in msg


def test_bad_arch_set(make_ws):
    ws = make_ws({"WORKSPACE.toml": '[workspace]\nname = "t"\n[arch_sets]\nx = ["sm_90"]\n'})
    msg = load_error(ws)
    assert msg.startswith("WORKSPACE.toml key 'arch_sets':") and "arch set 'x': 'sm_90' is not an arch" in msg


def test_unknown_kind_suggests(make_ws):
    ws = make_ws({"targets/p.toml": '\n[a]\nkind = "genrul"\n'})
    msg = load_error(ws)
    assert msg.startswith("targets/p.toml:3 [a] key 'kind': unknown kind 'genrul'")
    assert "did you mean genrule?" in msg


def test_missing_kind(make_ws):
    ws = make_ws({"targets/p.toml": '[a]\nouts = ["o"]\n'})
    assert "[a] key 'kind': missing required key 'kind'" in load_error(ws)


def test_dependency_on_unknown_label(make_ws):
    ws = make_ws({"targets/p.toml": GENRULE.format(name="a") + 'deps = { x = "//p:bb" }\n\n'
                  + GENRULE.format(name="b")})
    msg = load_error(ws)
    assert msg.startswith("targets/p.toml [a] key 'deps': no target matches '//p:bb'"), msg
    assert "did you mean //p:b" in msg


def test_dependency_with_relative_label_resolves_in_package(make_ws):
    ws = make_ws({"targets/p.toml": GENRULE.format(name="a") + 'deps = { x = ":b" }\n\n'
                  + GENRULE.format(name="b")})
    load(ws.root)
    ws2 = make_ws({"targets/p.toml": GENRULE.format(name="a") + 'tools = ":host"\n'})
    msg = load_error(ws2)
    assert msg.startswith("targets/p.toml [a] key 'tools': no target matches '//p:host'")


def test_dependency_with_bad_label(make_ws):
    ws = make_ws({"targets/p.toml": GENRULE.format(name="a") + 'deps = { x = "//p:b:c" }\n'})
    assert load_error(ws).startswith("targets/p.toml [a] key 'deps': bad label '//p:b:c'")


def test_target_must_be_a_table(make_ws):
    ws = make_ws({"targets/p.toml": 'pakage = "//x"\n'})
    assert "a target must be a table" in load_error(ws)


def test_cli_load_error_exit_code_2(make_ws):
    ws = make_ws({"targets/p.toml": GENRULE.format(name="a") + "bogus = 1\n"})
    run = ws.cli("query", "//...")
    assert run.rc == 2
    assert "targets/p.toml:5 [a] key 'bogus': unknown key 'bogus'" in run.stderr
    assert "Traceback" not in run.stderr


def test_missing_workspace(tmp_path):
    from build_graph.workspace import find_root
    with pytest.raises(LoadError, match="no WORKSPACE.toml"):
        find_root(tmp_path)


# -- pins -------------------------------------------------------------------------------
def test_pin_for_platform():
    pin = Pin(kind="pypi", project="p", version="1", file="wheel", platforms={
        "x86_64": PinFile(filename="p-1-x86_64.whl", sha256=SHA_A),
        "aarch64": PinFile(filename="p-1-aarch64.whl", sha256=SHA_B),
    })
    assert pin.for_platform("x86_64") == PinFile(filename="p-1-x86_64.whl", sha256=SHA_A)
    assert pin.for_platform("aarch64").sha256 == SHA_B
    with pytest.raises(KeyError):
        pin.for_platform("riscv64")


def test_pin_for_all_platforms():
    pin = Pin(kind="url", url="https://example.invalid/a.tgz", sha256=SHA_A)
    for platform in ("x86_64", "aarch64"):
        assert pin.for_platform(platform) == PinFile(url="https://example.invalid/a.tgz", sha256=SHA_A)


def test_pin_needs_exactly_one_of_sha256_and_platforms():
    with pytest.raises(ValueError):
        Pin(kind="url", url="https://example.invalid/a.tgz")
    with pytest.raises(ValueError):
        Pin(kind="url", url="u", sha256=SHA_A, platforms={"x86_64": PinFile(url="u", sha256=SHA_A)})


def test_per_platform_pins_from_toml(make_ws):
    ws = make_ws({"WORKSPACE.toml": f'''[workspace]
name = "t"

[pins.w]
kind = "pypi"
project = "p"
version = "1"
file = "wheel"
platforms.x86_64 = {{ filename = "p-x.whl", sha256 = "{SHA_A}" }}
platforms.aarch64 = {{ filename = "p-a.whl", sha256 = "{SHA_B}" }}
'''})
    w = load(ws.root)
    assert w.pin("w").for_platform("x86_64").filename == "p-x.whl"
    assert w.pin("w").for_platform("aarch64").sha256 == SHA_B
    with pytest.raises(LoadError, match="did you mean w"):
        w.pin("ww")


def test_repository_workspace_loads():
    """The repository's own WORKSPACE.toml and targets/ are valid."""
    from pathlib import Path
    w = load(Path(__file__).resolve().parents[1])
    assert Label("toolchains", "host") in w.targets
    assert Label("sources", "vllm") in w.targets
    for pin in w.model.pins.values():
        assert pin.for_platform("x86_64").sha256


@pytest.mark.parametrize("outs, deps, message", [
    ('["/etc/passwd"]', "{}", "must be a relative path inside $OUT"),
    ('["../up"]', "{}", "must be a relative path inside $OUT"),
    ('["o"]', '{ "../../usr" = "//p:x" }', "must be letters, digits and '_'"),
    ('["o"]', '{ a_b = "//p:x", A_B = "//p:x" }', "both give $IN_A_B"),
])
def test_genrule_outs_and_dep_names_are_checked_at_load(make_ws, outs, deps, message):
    ws = make_ws({"targets/p.toml": GENRULE.format(name="x") +
                  f'\n[y]\nkind = "genrule"\ncmd = "true"\nouts = {outs}\ndeps = {deps}\n'})
    with pytest.raises(LoadError, match=re.escape(message)) as err:
        load(ws.root)
    assert "targets/p.toml" in str(err.value) and "[y]" in str(err.value)


def test_the_user_config_is_checked_whole_and_names_the_table(tmp_path, monkeypatch):
    """R6 toml_nested: a typo under [fetch] passed every build that fetched no file: URL, and an
    unknown top-level table was reported as a key of [remote]."""
    from build_graph.workspace import remote_settings, user_settings

    config = tmp_path / "config.toml"
    monkeypatch.setenv("BGRAPH_CONFIG", str(config))
    config.write_text('[remote]\njobs = 3\n\n[fetch]\nfile_url_dir = ["/x"]\n')
    with pytest.raises(LoadError) as e:
        remote_settings(None, {})  # a build reads [remote] only: [fetch] is checked all the same
    line = e.value.render()
    assert "unknown key 'file_url_dir'" in line and "[fetch]" in line and "config.toml:5 " in line, line
    config.write_text('[fetchh]\nfile_url_dirs = ["/x"]\n')
    with pytest.raises(LoadError) as e:
        remote_settings(None, {})
    line = e.value.render()
    assert "unknown key 'fetchh'" in line and "[remote]" not in line, line
    config.write_text('[remote]\njobs = 3\n\n[fetch]\nfile_url_dirs = ["/x"]\n')
    assert remote_settings(None, {}).jobs == 3 and user_settings().fetch == {"file_url_dirs": ["/x"]}
    config.write_text('[remote]\njobs = 5\n')  # an edit is read again (the kept copy is per stamp)
    assert remote_settings(None, {}).jobs == 5 and user_settings().fetch == {"file_url_dirs": []}
