"""py_wheel's pieces that need no sandbox: its RECORD (PEP 376 CSV) and reading a PKG-INFO."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
import zipfile
from types import SimpleNamespace

import pytest

from build_graph.errors import PlanError
from build_graph.model import FileEntry, Tree
from build_graph.rules.py_wheel import WHEEL_SCRIPT, _metadata


def test_record_quotes_names_with_commas_and_quotes(tmp_path):
    pkg = tmp_path / "pkg" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / 'odd, name "q".txt').write_text("data\n")
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    subprocess.run([sys.executable, "-I", "-S", "-c", WHEEL_SCRIPT, str(tmp_path / "pkg"), str(wheel), "demo", "1.0",
                    "py3-none-any", "Requires-Dist: numpy"], check=True)
    with zipfile.ZipFile(wheel) as zf:
        rows = list(csv.reader(io.StringIO(zf.read("demo-1.0.dist-info/RECORD").decode())))
        names = set(zf.namelist())
    assert all(len(r) == 3 for r in rows), rows
    recorded = {r[0] for r in rows}
    assert 'demo/odd, name "q".txt' in recorded and recorded == names
    assert rows[-1] == ["demo-1.0.dist-info/RECORD", "", ""]


def _ctx(text: str):
    blob = FileEntry("d" * 64, len(text))
    fail = lambda message, key=None, hint=None: PlanError(message, where=key)  # noqa: E731
    return SimpleNamespace(read=lambda entry: text.encode(), fail=fail, attrs=SimpleNamespace(tree="//s:sdist")), \
        Tree({"PKG-INFO": blob})


PKG_INFO = """Metadata-Version: 2.4
Name: demo
Version: 1.2.3
Requires-Python: >=3.10
Requires-Dist: numpy>=1.26
Requires-Dist: torch==2.14.0;
 platform_machine == "x86_64"
Description-Content-Type: text/markdown

Version: 9.9.9 (a line of the description, not a header)
Requires-Dist: not-a-dependency
"""


def test_pkg_info_headers_are_read_by_the_email_parser():
    ctx, tree = _ctx(PKG_INFO)
    assert _metadata(ctx, tree, "PKG-INFO", "1.2.3") == [
        "Requires-Python: >=3.10", "Requires-Dist: numpy>=1.26",
        'Requires-Dist: torch==2.14.0; platform_machine == "x86_64"']


def test_pkg_info_version_must_match():
    ctx, tree = _ctx(PKG_INFO)
    with pytest.raises(PlanError, match="says version 1.2.3, the target says 2.0"):
        _metadata(ctx, tree, "PKG-INFO", "2.0")
