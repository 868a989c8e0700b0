"""Atomic writes for the store: write beside, then rename into place (a reader sees the old
file or the new one, never part of one)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json(dest: Path, value: Any, tmp_dir: Path, **dump_options: Any) -> None:
    """Write `value` as JSON to `dest` atomically (the temp file lives in `tmp_dir`, same filesystem)."""
    fd, tmp = tempfile.mkstemp(dir=tmp_dir)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f, **dump_options)
    os.replace(tmp, dest)
