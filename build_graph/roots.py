"""Where a workspace and the user's config live: found without loading either (no pydantic), so
that the no-op check can run before anything heavy is imported."""

from __future__ import annotations

import os
from pathlib import Path

from build_graph.errors import LoadError


def find_root(start: Path) -> Path:
    """The nearest directory at or above `start` holding WORKSPACE.toml."""
    for d in [start, *start.parents]:
        if (d / "WORKSPACE.toml").is_file():
            return d
    raise LoadError("no WORKSPACE.toml here or in any parent directory", where=str(start))


def workspace_root(flag: str | None) -> Path:
    """-C/--workspace if given, else the nearest workspace at or above the current directory."""
    return Path(flag).resolve() if flag else find_root(Path.cwd())


def user_config_path() -> Path:
    """$BGRAPH_CONFIG, else $XDG_CONFIG_HOME/bgraph/config.toml, else ~/.config/bgraph/config.toml."""
    explicit = os.environ.get("BGRAPH_CONFIG")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(base) / "bgraph" / "config.toml"
