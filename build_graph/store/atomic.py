"""Atomic writes for the store: write beside, then rename into place (a reader sees the old
file or the new one, never part of one)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import orjson


def write_json(dest: Path, value: Any, tmp_dir: Path, sort_keys: bool = False, indent: int | None = None) -> None:
    """Write `value` as JSON to `dest` atomically (the temp file lives in `tmp_dir`, same filesystem).
    orjson, not json: the stamp table of a vLLM cache is 5 MB, and json.dump took a third of a
    second to write it."""
    options = orjson.OPT_NON_STR_KEYS | (orjson.OPT_SORT_KEYS if sort_keys else 0) | (orjson.OPT_INDENT_2 if indent else 0)
    write_bytes(dest, orjson.dumps(value, option=options), tmp_dir)


def write_bytes(dest: Path, data: bytes, tmp_dir: Path | None = None) -> None:
    """Write `data` to `dest` atomically (the temp file in `tmp_dir`, else beside `dest`)."""
    fd, tmp = tempfile.mkstemp(dir=tmp_dir or dest.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        os.unlink(tmp)
        raise
    os.replace(tmp, dest)


def stage(tmp_dir: str, prefix: str, counter, data: bytes) -> str:
    """A new file holding `data` in `tmp_dir`, a staging directory this process leases, named
    `prefix` and the next of `counter` (an itertools.count: one C call, safe from many threads;
    mkstemp's random names were a tenth of storing a small source). O_EXCL: a name found taken
    is skipped, never overwritten."""
    while True:
        path = f"{tmp_dir}/{prefix}{next(counter)}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            break
        except FileExistsError:
            continue
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    return path


def rename_into_shard(tmp_path: str, dest: str) -> None:
    """Rename a staged file to `dest`, making its shard directory the first time one is missing
    (a mkdir per stored file was a fifth of storing a small source)."""
    try:
        os.replace(tmp_path, dest)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.replace(tmp_path, dest)
