"""Load WORKSPACE.toml and targets/**/*.toml into validated pydantic models.

Every error names the file, the table and the key, and the line where one can be found.
"""

from __future__ import annotations

import json
import platform as _platform
import re
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
import os
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from build_graph.errors import LoadError, where
from build_graph.labels import MAX_SEGMENT, Label, parse_label, too_long, unknown_label, valid_package
from build_graph.roots import NotRegular, regular_bytes
from build_graph.roots import find_root, target_files, user_config_path  # noqa: F401  (re-exported)

PLATFORMS = ("x86_64", "aarch64")
# Matched whole (fullmatch): `$` also matches before a final newline.
SHA256_RE = re.compile(r"[0-9a-f]{64}")
ARCH_RE = re.compile(r"\d+\.\d+[af]?")


def host_platform() -> str:
    """The platform name pins and action keys carry for this machine."""
    machine = _platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


def _sha256(value: str) -> str:
    if not SHA256_RE.fullmatch(value):
        raise ValueError("must be 64 lowercase hex digits (a sha256)")
    return value


class WorkspaceSection(Strict):
    name: str = Field(description="the workspace's name")
    digest_function: Literal["blake3", "sha256"] = Field("blake3", description="CAS digest function")


class Defaults(Strict):
    cache_dir: str | None = Field(None, description="cache directory; $BGRAPH_CACHE wins, else ~/.cache/bgraph")
    jobs: int | None = Field(None, ge=1, description="parallel actions (default: cores)")
    max_mem_mb: int | None = Field(None, ge=64, description="memory budget for running actions")


class RemoteSection(Strict):
    """The shared cache (WORKSPACE.toml [remote], or the user's ~/.config/bgraph/config.toml)."""

    url: str | None = Field(None, description="http(s)://host[:port]/prefix (Bazel's HTTP cache protocol)")
    upload: bool = Field(False, description="write results to the remote (meant for CI; or --remote-upload)")
    trusted_keys: list[str] = Field(default_factory=list,
                                    description="ed25519 public keys (hex): when set, only results one of them signed are used")
    allow_unsigned: bool = Field(False, description="use a remote without trusted_keys, whoever wrote its results "
                                                    "(or --remote-allow-unsigned); without either, such a remote "
                                                    "is an error")
    signing_key: str | None = Field(None, description="file with the ed25519 private key that signs uploads "
                                                      "(user config only: never commit it)")
    timeout_s: float = Field(10.0, gt=0, description="seconds per request")
    executor: str | None = Field(None, description="grpc://host:port[/instance]: run actions on this REAPI "
                                                   "remote execution service (BuildGrid), or --remote-executor")
    jobs: int | None = Field(None, ge=1, description="remote Executes in flight at once (or --remote-jobs; "
                                                     "default 16), apart from --jobs' local ones")
    local_fallback: bool = Field(False, description="run an action locally when the remote executor fails it "
                                                    "for a reason of its own (or --remote-local-fallback)")
    accept_cached: bool = Field(False, description="take results the remote executor answers from its own action "
                                                   "cache (or --remote-accept-cached): only for a server whose "
                                                   "action cache no untrusted client can write")
    queue_timeout_s: float = Field(120.0, gt=0, description="fail an action queued this long while no action of "
                                                           "its platform started (no worker matches it)")


class DebianSection(Strict):
    """Where Debian packages come from (deb_packages, `bgraph deb lock`); empty: apt's own sources."""

    mirrors: list[str] = Field(default_factory=list,
                               description="base URLs of Debian archives, tried in order for each suite and each "
                                           "pool file (default: the sources apt is configured with)")
    suites: list[str] = Field(default_factory=list,
                              description="suites to lock from, highest version wins (e.g. bookworm, bookworm-updates)")
    components: list[str] = Field(default_factory=lambda: ["main"], description="archive components")

    @model_validator(mode="after")
    def _suites_with_mirrors(self) -> "DebianSection":
        if self.mirrors and not self.suites:
            raise ValueError("mirrors need suites (e.g. suites = [\"bookworm\", \"bookworm-updates\"])")
        return self


HINT = " -- hint: "  # a validator's ValueError text: message, HINT, the hint _validation_error shows


def _file_name(value: str | None) -> str | None:
    """A pin's filename: one name, which the download is filed under in its tree."""
    if value is not None and (value in ("", ".", "..") or "/" in value or "\0" in value):
        raise ValueError(f"{value!r} is not a file name" + HINT + "give the downloaded file's name alone "
                         "(no '/', not '.' or '..'), e.g. filename = \"src.tar.gz\"")
    return value


def _url_file_name(url: str | None, info: ValidationInfo) -> str | None:
    """A url whose last segment names the file (no filename given) must end in a file name."""
    if url is not None and info.data.get("filename", "invalid") is None:
        last = url.rsplit("/", 1)[-1]
        if last in ("", ".", "..") or "\0" in last:
            raise ValueError(f"the file's name is taken from the url's last segment, {last!r}, which is no "
                             "file name" + HINT + "add filename = \"NAME\" (the downloaded file's name)")
    return url


class PinFile(Strict):
    """One downloadable file of a pin, for one platform or for all."""

    filename: str | None = Field(None, description="the file's name on the index")
    url: str | None = Field(None, description="for url pins: where to download")
    sha256: str = Field(description="sha256 of the file's bytes")

    @field_validator("sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        return _sha256(v)

    _filename = field_validator("filename")(_file_name)
    _url = field_validator("url")(_url_file_name)


class Pin(Strict):
    """A pinned external input: a PyPI sdist or wheel (name, version, file kind) or a URL archive."""

    kind: Literal["pypi", "url"] = Field(description="pypi: through pip's index; url: a plain archive")
    project: str | None = Field(None, description="PyPI project name (pypi pins)")
    version: str | None = Field(None, description="version (pypi pins)")
    file: Literal["sdist", "wheel"] | None = Field(None, description="file kind (pypi pins)")
    filename: str | None = None
    url: str | None = None
    sha256: str | None = None
    platforms: dict[Literal["x86_64", "aarch64"], PinFile] = Field(
        default_factory=dict, description="per-platform files (wheels differ by CPU)")

    @field_validator("sha256")
    @classmethod
    def _sha(cls, v: str | None) -> str | None:
        return None if v is None else _sha256(v)

    _filename = field_validator("filename")(_file_name)
    _url = field_validator("url")(_url_file_name)

    @model_validator(mode="after")
    def _complete(self) -> "Pin":
        if self.kind == "pypi":
            missing = [k for k in ("project", "version", "file") if getattr(self, k) is None]
            if missing:
                raise ValueError(f"pypi pin needs {', '.join(missing)}")
        has_top = self.sha256 is not None
        if has_top == bool(self.platforms):
            raise ValueError("give either sha256 (+ filename/url) for all platforms, or a [platforms] table")
        if has_top and self.kind == "pypi" and not self.filename:
            raise ValueError("pypi pin needs filename")
        if has_top and self.kind == "url" and not self.url:
            raise ValueError("url pin needs url")
        return self

    def for_platform(self, platform: str) -> PinFile:
        """The file this pin means on `platform`."""
        if self.sha256 is not None:
            return PinFile(filename=self.filename, url=self.url, sha256=self.sha256)
        if platform not in self.platforms:
            raise KeyError(platform)
        return self.platforms[platform]


class WorkspaceModel(Strict):
    workspace: WorkspaceSection
    defaults: Defaults = Field(default_factory=Defaults)
    remote: RemoteSection = Field(default_factory=RemoteSection)
    arch_sets: dict[str, list[str]] = Field(default_factory=dict, description="named arch lists")
    pins: dict[str, Pin] = Field(default_factory=dict, description="pinned external inputs")
    debian: DebianSection = Field(default_factory=DebianSection)

    @field_validator("pins")
    @classmethod
    def _pin_names(cls, v: dict[str, Pin]) -> dict[str, Pin]:
        for name in v:  # a platform's file without filename or url is filed under the pin's name
            if name in ("", ".", "..") or "/" in name or "\0" in name:
                raise ValueError(f"pin name {name!r} is no file name" + HINT + "name the pin with letters, "
                                 "digits and '_.+-' (no '/', not '.' or '..')")
        return v

    @field_validator("arch_sets")
    @classmethod
    def _archs(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, archs in v.items():
            if not archs:
                raise ValueError(f"arch set {name!r} is empty; name at least one arch, e.g. ['12.1a']")
            for a in archs:
                if not ARCH_RE.fullmatch(a):
                    raise ValueError(f"arch set {name!r}: {a!r} is not an arch like '12.1a', '12.0f' or '9.0'")
        return v


@dataclass(frozen=True)
class Target:
    label: Label
    kind: str
    attrs: BaseModel
    file: str
    table: str


@dataclass(frozen=True)
class Workspace:
    root: Path
    model: WorkspaceModel
    targets: dict[Label, Target]
    # The static dependency graph was found free of cycles (graph.checked), with the parse: a
    # build from a kept parse (store/parsed.py) then skips the check.
    acyclic: bool = False

    @property
    def digest_function(self) -> str:
        return self.model.workspace.digest_function

    def target(self, label: Label, where_: str | None = None) -> Target:
        if label not in self.targets:
            raise unknown_label(str(label), self.targets, where=where_)
        return self.targets[label]

    def pin(self, name: str, where_: str | None = None) -> Pin:
        if name not in self.model.pins:
            import difflib
            close = difflib.get_close_matches(name, list(self.model.pins), n=3)
            raise LoadError(f"unknown pin {name!r}", where=where_,
                            hint=f"did you mean {', '.join(close)}?" if close else "declare it under [pins] in WORKSPACE.toml")
        return self.model.pins[name]

    def archs(self, spec: str | list[str], where_: str | None = None) -> list[str]:
        """Resolve an arch set name or an explicit arch list."""
        if isinstance(spec, str):
            if spec not in self.model.arch_sets:
                raise LoadError(f"unknown arch set {spec!r}", where=where_,
                                hint=f"known: {', '.join(sorted(self.model.arch_sets)) or 'none'}")
            return list(self.model.arch_sets[spec])
        if not spec:  # nvcc would quietly build its default arch
            raise LoadError("an empty arch list", where=where_, hint="name at least one arch, e.g. archs = [\"12.1a\"]")
        for a in spec:
            if not ARCH_RE.fullmatch(a):
                raise LoadError(f"{a!r} is not an arch like '12.1a'", where=where_)
        return list(spec)


_HEADER = re.compile(r'^\s*\[\s*(?:"([^"]+)"|([^\]\[]+?))\s*\]\s*(?:#.*)?$')


def table_lines(text: str) -> dict[str, int]:
    """[table] -> the line it starts on, for the whole file in one pass (loading stays linear)."""
    lines: dict[str, int] = {}
    for i, line in enumerate(text.splitlines()):
        m = _HEADER.match(line)
        if m:
            name = m.group(1) if m.group(1) is not None else re.sub(r"\s*\.\s*", ".", m.group(2))
            if m.group(1) is not None and "\\" in name:  # ["ok\n"]: the key the escapes spell
                try:
                    name = tomllib.loads(f'k = "{name}"')["k"]
                except tomllib.TOMLDecodeError:
                    pass
            lines.setdefault(name, i + 1)
    return lines


def _line_of(text: str, table: str | None, key: str | None) -> int | None:
    """Best-effort line of `key` inside `[table]` (tomllib reports lines only for syntax errors)."""
    lines = text.splitlines()
    start = 0
    if table:
        header = re.compile(r"^\s*\[\s*" + re.escape(table).replace(r"\.", r"\s*\.\s*") + r"\s*\]")
        quoted = re.compile(r'^\s*\[\s*"' + re.escape(table) + r'"\s*\]')
        for i, line in enumerate(lines):
            if header.match(line) or quoted.match(line):
                start = i
                if not key:
                    return i + 1
                break
        else:
            return None
    if key:
        pat = re.compile(r"^\s*\"?" + re.escape(key) + r"\"?\s*=")
        for i in range(start, len(lines)):
            if i > start and table and lines[i].lstrip().startswith("["):
                break
            if pat.match(lines[i]):
                return i + 1
    return None


def _validation_error(exc: ValidationError, file: str, text: str, table_prefix: list[str]) -> LoadError:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    # The table is everything but the last element (for nested tables), the key is the last.
    key = loc[-1] if loc else None
    table_parts = table_prefix + loc[:-1]
    table = ".".join(table_parts) if table_parts else None
    line = _line_of(text, table, key)
    msg, _, hint = err["msg"].partition(HINT)
    if err["type"] == "extra_forbidden":
        msg = f"unknown key {key!r}"
    elif err["type"] == "missing":
        msg = f"missing required key {key!r}"
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return LoadError(msg + more, where=where(file, table, key, line), hint=hint or None)


def _read_toml(path: Path, rel: str) -> tuple[dict[str, Any], str]:
    try:
        data = regular_bytes(path)
    except OSError as e:
        raise LoadError(f"cannot read: {e.strerror}", where=rel) from None
    except NotRegular as e:
        raise LoadError(f"not a regular file: it is {e}", where=rel,
                        hint="bgraph reads its TOML files only from regular files (or links to them): "
                             "replace or remove it") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise LoadError(f"not valid UTF-8: byte {e.start} (line {line}) is {data[e.start:e.start + 1]!r}",
                        where=f"{rel}:{line}", hint="TOML files must be UTF-8; re-save the file as UTF-8") from None
    try:
        parsed = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise LoadError(f"malformed TOML: {e}", where=rel) from None
    except RecursionError:  # tomllib parses arrays and inline tables recursively
        parsed = None
    if parsed is None or _too_deep(parsed):
        raise LoadError(f"malformed TOML: values nested more than {MAX_NESTING} deep", where=rel,
                        hint="no bgraph setting nests arrays or inline tables that deep; flatten the value") from None
    return parsed, text


MAX_NESTING = 32  # far beyond any setting, far below what the recursive code after the parse allows


def _too_deep(value: Any) -> bool:
    """Whether `value` nests tables or arrays more than MAX_NESTING deep (checked without recursion)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_NESTING:
            return True
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
    return False


def package_of(rel: Path) -> str:
    """targets/toolchains.toml -> toolchains; targets/a/b.toml -> a/b."""
    return rel.relative_to("targets").with_suffix("").as_posix()


def load(root: Path) -> Workspace:
    """Load and validate the whole workspace: WORKSPACE.toml and every targets/**/*.toml."""
    from build_graph.rules.registry import RULES

    root = root.resolve()
    data, text = _read_toml(root / "WORKSPACE.toml", "WORKSPACE.toml")
    try:
        model = WorkspaceModel.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e, "WORKSPACE.toml", text, []) from None

    targets: dict[Label, Target] = {}
    packages: dict[str, str] = {}
    raw: dict[Label, tuple[dict[str, Any], str, str, str, int | None]] = {}  # label -> table, file, name, text, line
    for path in target_files(root):
        rel = path.relative_to(root)
        data, text = _read_toml(path, rel.as_posix())
        declared = data.pop("package", None)
        if declared is not None:
            if not isinstance(declared, str) or not declared.startswith("//") or not valid_package(declared[2:]):
                long = isinstance(declared, str) and too_long(declared)
                raise LoadError(f"bad package {declared!r}" + (f": {long}" if long else ""),
                                where=where(rel.as_posix(), None, "package", _line_of(text, None, "package")),
                                hint="write package = \"//name\" (letters, digits, '_.+-', not '.' or '..' alone, "
                                     f"at most {MAX_SEGMENT} characters between '/')")
            package = declared[2:]
        else:
            package = package_of(rel)
            if not valid_package(package):
                long = too_long(package)
                raise LoadError(f"bad package name {package!r} (from the file's path)" + (f": {long}" if long else ""),
                                where=rel.as_posix(), hint="rename the file or directory: letters, digits, '_.+-', "
                                f"not '.' or '..' alone, at most {MAX_SEGMENT} characters")
        if package.split("/")[0] in PLATFORMS:
            # bgraph-out/<platform>/<package>/<name> holds another platform's builds: //aarch64/p:x
            # and //p:x built for aarch64 would share one link.
            raise LoadError(f"package //{package} begins with the platform name {package.split('/')[0]!r}",
                            where=rel.as_posix(), hint="bgraph-out/<platform>/ holds the builds for another "
                            "platform: rename the package (or its directory under targets/)")
        if package in packages:
            raise LoadError(f"package //{package} is declared twice (also in {packages[package]})", where=rel.as_posix())
        packages[package] = rel.as_posix()
        starts = table_lines(text)
        for name, table in data.items():
            # A name with a newline or other control character is shown as its TOML header
            # writes it (quoted, escaped), so the error stays one line; a long one is cut.
            shown = name if name.isprintable() else json.dumps(name)
            shown = shown if len(shown) <= 60 else shown[:60] + "…"
            loc = where(rel.as_posix(), shown, None, starts.get(name))
            if not isinstance(table, dict):
                raise LoadError("a target must be a table ([name] with kind = ...)", where=loc)
            label = parse_label(f"//{package}:{name}", where=loc)
            if label in raw:  # one label, two tables: the later would silently replace the earlier
                raise LoadError(f"target {label} is declared twice (also by table {raw[label][2]!r} in {raw[label][1]})",
                                where=loc, hint="rename one of the two tables")
            raw[label] = (table, rel.as_posix(), name, text, starts.get(name))
    for label, (table, file, name, text, _line) in raw.items():
        table = _with_base(label, raw)
        kind = table.get("kind")
        if kind not in RULES:
            import difflib
            close = difflib.get_close_matches(str(kind), list(RULES), n=2)
            raise LoadError(f"unknown kind {kind!r}" if kind else "missing required key 'kind'",
                            where=where(file, name, "kind", _line_of(text, name, "kind")),
                            hint=f"did you mean {', '.join(close)}?" if close else f"known kinds: {', '.join(sorted(RULES))}")
        attrs_data = {k: v for k, v in table.items() if k != "kind"}
        try:
            attrs = RULES[kind].attrs.model_validate(attrs_data)
        except ValidationError as e:
            raise _validation_error(e, file, text, [name]) from None
        targets[label] = Target(label, kind, attrs, file, name)
    workspace = Workspace(root, model, targets)
    # Labels inside attributes must parse and exist; check now so errors name the file and key.
    for target in targets.values():
        for key, dep in RULES[target.kind].deps(target.attrs):
            loc = where(target.file, target.table, key)
            dep_label = parse_label(dep, package=target.label.package, where=loc)
            workspace.target(dep_label, where_=loc)
    return workspace


def _with_base(label: Label, raw: dict, seen: tuple[Label, ...] = ()) -> dict[str, Any]:
    """A target's table with `base` followed: the base target's table (itself perhaps a variant),
    with this table's keys in place of the base's (a key's whole value: a nested table too)."""
    from build_graph.rules.registry import RULES

    table, file, name, text, _line = raw[label]
    if "base" not in table:
        return table
    loc = where(file, name, "base", _line_of(text, name, "base"))
    if not isinstance(table["base"], str):
        raise LoadError("base must be a label (\":other-target\")", where=loc)
    base_label = parse_label(table["base"], package=label.package, where=loc)
    if base_label not in raw:
        import difflib
        close = difflib.get_close_matches(str(base_label), [str(k) for k in raw], n=3, cutoff=0.6)
        raise LoadError(f"unknown base {base_label}", where=loc,
                        hint=f"did you mean {', '.join(close)}?" if close else "base names a target of the workspace")
    if base_label in (label, *seen):
        chain = " -> ".join(str(x) for x in (*seen, label, base_label))
        raise LoadError(f"base cycle: {chain}", where=loc)
    merged = dict(_with_base(base_label, raw, (*seen, label)))
    kind = merged.get("kind")
    if "kind" in table and table["kind"] != kind:
        raise LoadError(f"a variant keeps its base's kind ({kind!r}), not {table['kind']!r}",
                        where=where(file, name, "kind", _line_of(text, name, "kind")))
    fields = RULES[kind].attrs.model_fields if kind in RULES else {}
    for key, value in table.items():
        if key in ("base", "kind"):
            continue
        if fields and key not in fields:
            import difflib
            close = difflib.get_close_matches(key, list(fields), n=2)
            raise LoadError(f"unknown key {key!r} for a variant of {base_label} (kind {kind})",
                            where=where(file, name, key, _line_of(text, name, key)),
                            hint=f"did you mean {', '.join(close)}?" if close else None)
        merged[key] = value
    return merged


class UserConfig(Strict):
    """~/.config/bgraph/config.toml: settings of this user and machine, over the workspace's."""

    remote: dict[str, Any] = Field(default_factory=dict, description="overrides of WORKSPACE.toml [remote]")
    fetch: dict[str, Any] = Field(default_factory=dict, description="downloads (FetchSettings); user config only")


class FetchSettings(Strict):
    """The user config's [fetch]: what only this user, never a workspace, may grant a download."""

    file_url_dirs: list[str] = Field(default_factory=list,
                                     description="absolute directories outside the workspace that file: URLs of "
                                                 "pins and http_archive targets may read (or $BGRAPH_FILE_URL_DIRS)")


@dataclass(frozen=True)
class UserSettings:
    """The user config file's tables, each checked: [remote] as set (overrides of WORKSPACE.toml's)
    and [fetch] with its defaults."""

    remote: dict[str, Any]
    fetch: dict[str, Any]


_user_settings: dict[tuple, UserSettings] = {}


def user_settings() -> UserSettings:
    """The user config, read and checked whole, so a typo in any table is one error at the first
    command that reads it, naming that table (not only once a download asks for [fetch]); kept
    for this process while the file's stamp holds (a build reads it for several purposes)."""
    path = user_config_path()
    try:
        st = path.stat()
    except OSError:
        return UserSettings({}, {})
    if not stat.S_ISREG(st.st_mode):
        _read_toml(path, str(path))  # raises: not a regular file
    stamp = (str(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if stamp in _user_settings:
        return _user_settings[stamp]
    data, text = _read_toml(path, str(path))
    try:
        top = UserConfig.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e, str(path), text, []) from None
    tables = {}
    for name, model in (("remote", RemoteSection), ("fetch", FetchSettings)):
        try:
            tables[name] = model.model_validate(getattr(top, name)).model_dump(exclude_unset=name == "remote")
        except ValidationError as e:
            raise _validation_error(e, str(path), text, [name]) from None
    _user_settings.clear()
    _user_settings[stamp] = found = UserSettings(**tables)
    return found


def user_fetch_settings() -> dict[str, Any]:
    """The user config's [fetch] table, checked ({} where there is no config file)."""
    return user_settings().fetch


def remote_settings(ws: Workspace | None, overrides: dict[str, Any]) -> RemoteSection:
    """The [remote] settings: WORKSPACE.toml (none with `ws` None: what the user alone gives),
    then the user config file (checked whole: see user_settings), then `overrides` (command-line
    flags that were given)."""
    merged = ws.model.remote.model_dump(exclude_unset=True) if ws is not None else {}
    merged.update(user_settings().remote)
    merged.update(overrides)
    return RemoteSection.model_validate(merged)
