"""The build loop's errors: whatever goes wrong while planning is one line naming the target,
never a traceback, and the build stops cleanly."""

from __future__ import annotations

import dataclasses

from bgraph_testlib import requires_bwrap
from build_graph.rules.registry import RULES

GENRULE = {"in.txt": "alpha\n",
           "targets/p.toml": '[a]\nkind = "genrule"\nsrcs = ["in.txt"]\nouts = ["a.txt"]\n'
                             'cmd = "cp $SRC/in.txt $OUT/a.txt"\n'}


def test_a_rule_that_raises_fails_its_target_with_one_line(make_ws, monkeypatch):
    def broken_plan(ctx):
        raise KeyError("surprise")
        yield  # pragma: no cover - a generator, like every plan

    monkeypatch.setitem(RULES, "genrule", dataclasses.replace(RULES["genrule"], plan=broken_plan))
    ws = make_ws(GENRULE)
    result = ws.engine_build("//p:a")
    assert len(result.failures) == 1
    text = result.failures[0].render()
    assert text.startswith("//p:a: the genrule rule failed: KeyError: 'surprise'"), text
    assert "hint:" in text


@requires_bwrap
def test_a_continuation_that_raises_fails_its_target_with_one_line(make_ws, monkeypatch):
    real = RULES["genrule"].plan

    def breaks_after_first_round(ctx):
        gen = real(ctx)
        yield next(gen)  # the real action runs; the plan breaks when it resumes
        raise ValueError("cannot use that output")

    monkeypatch.setitem(RULES, "genrule", dataclasses.replace(RULES["genrule"], plan=breaks_after_first_round))
    ws = make_ws(GENRULE)
    result = ws.engine_build("//p:a")
    assert [e.render().splitlines()[0] for e in result.failures] == [
        "//p:a: the genrule rule failed: ValueError: cannot use that output"]


def test_an_unreadable_source_is_one_line_naming_the_file(make_ws):
    ws = make_ws(GENRULE)
    (ws.root / "in.txt").unlink()
    (ws.root / "in.txt").symlink_to("/proc/self/mem")  # a regular file whose read fails (EIO), even as root
    run = ws.cli("build", "//p:a")
    assert run.rc == 1, run.output
    assert "//p:a: cannot read" in run.stderr and "in.txt" in run.stderr, run.stderr
    assert "Traceback" not in run.output
