"""A mirror's package indexes (dists/SUITE/COMPONENT/binary-ARCH/Packages.{xz,gz}): download and parse.

The download goes through `requests` with retries (connection errors and 5xx); a mirror that
does not answer is an error naming it and the file; a 404 means the mirror does not carry
that suite (another configured one may). Parsing is python-debian's deb822 reader.
"""

from __future__ import annotations

import io
import lzma
import os
import re
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

import requests
from debian.deb822 import Deb822
from debian.debian_support import Version
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from build_graph.debian.sources import AptSource
from build_graph.errors import FetchError


# Tried in this order; every Debian mirror serves .xz, small or old ones .gz or plain.
def _unxz(data: bytes) -> bytes:
    return _bounded(lzma.LZMADecompressor(), data)


def _ungz(data: bytes) -> bytes:
    return _bounded(zlib.decompressobj(wbits=31), data)  # 31: the gzip format, as gzip.decompress reads


def _bounded(d, data: bytes) -> bytes:
    """`data` decompressed, up to MAX_INDEX_BYTES: a few hundred KB of xz can hold gigabytes of
    zeros, which decompressing whole took into memory (a MemoryError traceback, or the OOM killer)."""
    out = d.decompress(data, MAX_INDEX_BYTES + 1)
    if len(out) > MAX_INDEX_BYTES:
        raise _TooLarge()
    if not d.eof:
        raise EOFError("the compressed data ends early")
    if d.unused_data:  # a second stream: never in Debian's indexes, and not silently dropped
        raise EOFError("data follows the compressed stream")
    return out


class _TooLarge(Exception):
    pass


VARIANTS = ((".xz", _unxz), (".gz", _ungz), ("", lambda b: b))
FIELDS = ["Package", "Version", "Architecture", "Filename", "SHA256", "Size", "Depends", "Pre-Depends", "Provides"]
MIRROR_HINT = ("check the network and the mirror; mirrors come from [debian] mirrors in WORKSPACE.toml, "
               "else from apt's sources (/etc/apt/sources.list, /etc/apt/sources.list.d)")


def session() -> requests.Session:
    """A session that retries connection errors and 5xx answers a few times, briefly."""
    s = requests.Session()
    retry = Retry(total=2, connect=2, read=2, status=2, backoff_factor=0.25,
                  status_forcelist=(500, 502, 503, 504), allowed_methods=("GET",), raise_on_status=False)
    s.mount("http://", HTTPAdapter(max_retries=retry))
    s.mount("https://", HTTPAdapter(max_retries=retry))
    return s


def no_answer(exc: BaseException) -> str:
    """The innermost reason of a network error, short (e.g. '[Errno 111] Connection refused')."""
    reason = exc
    while True:
        inner = getattr(reason, "reason", None) or reason.__cause__ or reason.__context__
        if inner is None or inner is reason or not isinstance(inner, BaseException):
            break
        reason = inner
    text = str(reason)
    # urllib3 prefixes its connection object: "<...HTTPConnection object at 0x..>: Failed to ..."
    return text.split(">: ", 1)[-1].strip() or type(exc).__name__


MAX_INDEX_BYTES = 1 << 30  # a Packages index, compressed or not (Debian's largest are ~50 MB)


def get(url: str, s: requests.Session, timeout: float = 60, file_roots: list | None = None) -> bytes | None:
    """The bytes at `url` (http(s) or file:), None for a 404; FetchError if the mirror does not answer.
    `file_roots`: where a file: URL the workspace wrote may lie (the workspace and the directories
    the user allows: fetch_guard.py), None for one apt's own configuration names. Either way a
    file: URL must name a regular file (a FIFO hung `bgraph deb lock`, /dev/zero filled memory)."""
    if url.startswith("file:"):
        from build_graph.fetch_guard import open_file_url

        try:
            fd = open_file_url(url, file_roots)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise FetchError(f"cannot read {url}: {e.strerror}", hint=MIRROR_HINT) from None
        try:
            with os.fdopen(fd, "rb") as f:
                data = f.read(MAX_INDEX_BYTES + 1)
        except OSError as e:
            raise FetchError(f"cannot read {url}: {e.strerror}", hint=MIRROR_HINT) from None
        if len(data) > MAX_INDEX_BYTES:
            raise _too_large(url)
        return data
    try:
        with s.get(url, timeout=timeout, stream=True) as r:
            if r.status_code in (403, 404, 410):
                return None
            if not r.ok:
                raise FetchError(f"{url} answered HTTP {r.status_code}", hint=MIRROR_HINT)
            length = r.headers.get("Content-Length", "")
            if length.isdecimal() and int(length) > MAX_INDEX_BYTES:
                raise _too_large(url)
            data = bytearray()
            for chunk in r.iter_content(1 << 20):  # read whole, an endless body filled memory
                data += chunk
                if len(data) > MAX_INDEX_BYTES:
                    raise _too_large(url)
            return bytes(data)
    except requests.RequestException as e:
        raise FetchError(f"{url} does not answer ({no_answer(e)})", hint=MIRROR_HINT) from None


def _too_large(url: str) -> FetchError:
    return FetchError(f"{url} is larger than {MAX_INDEX_BYTES >> 20} MiB, more than a Packages index is",
                      hint=MIRROR_HINT)


@dataclass(frozen=True)
class Candidate:
    """One package version an index offers."""

    package: str
    version: str
    architecture: str
    suite: str
    filename: str  # pool path, relative to the mirror base
    sha256: str
    size: int
    depends: str = ""
    pre_depends: str = ""
    provides: str = ""

    @property
    def ver(self) -> Version:
        return Version(self.version)


INDEX_HINT = ("the mirror's index is damaged or not in Debian's format: try another mirror "
              "([debian] mirrors in WORKSPACE.toml)")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SIZE = re.compile(r"[0-9]+")


def parse_packages(text: bytes, suite: str, where: str) -> Iterator[Candidate]:
    """The entries of one Packages file; an entry without a SHA256 (nothing to pin), or whose
    Version, Size, Filename or SHA256 a lock could not hold, is an error naming the index and it."""
    for para in Deb822.iter_paragraphs(io.BytesIO(text), fields=FIELDS, use_apt_pkg=False):
        name = para.get("Package")
        if not name:
            continue
        if not para.get("SHA256") or not para.get("Filename"):
            raise FetchError(f"index entry {name} {para.get('Version')} has no SHA256 or Filename", where=where,
                             hint=INDEX_HINT)
        problem = _bad_field(para)
        if problem:
            raise FetchError(f"index entry {name} {para.get('Version')}: {problem}", where=where, hint=INDEX_HINT)
        yield Candidate(name, para["Version"], para.get("Architecture", ""), suite, para["Filename"],
                        para["SHA256"], int(para.get("Size", "0")), para.get("Depends", ""),
                        para.get("Pre-Depends", ""), para.get("Provides", ""))


def _bad_field(para) -> str | None:
    """What in one index entry a lock could not hold (the lock file refuses the same on reading)."""
    version = para.get("Version", "")
    try:
        Version(version)
    except ValueError:
        return f"Version {version!r} is not a Debian version"
    size = para.get("Size", "0")
    if not _SIZE.fullmatch(size):
        return f"Size {size!r} is not a number of bytes"
    filename = para["Filename"]
    if filename.startswith("/") or ".." in filename.split("/") or not filename.endswith(".deb"):
        return f"Filename {filename!r} is not a .deb's path inside the mirror (relative, no '..')"
    if not _SHA256.fullmatch(para["SHA256"]):
        return f"SHA256 {para['SHA256']!r} is not 64 hex digits"
    return None


@dataclass
class Index:
    """Every version of every package of one architecture, highest first, across suites."""

    arch: str
    suites: list[str]
    mirrors: list[str]
    versions: dict[str, list[Candidate]]

    def describe(self) -> str:
        return f"the {self.arch} index of {', '.join(self.suites)}"


def build_index(candidates: list[Candidate], arch: str, suites: list[str], mirrors: list[str]) -> Index:
    """Group candidates by package, highest version first (earlier suite first on a tie)."""
    by_name: dict[str, list[Candidate]] = {}
    rank = {s: i for i, s in enumerate(suites)}
    for c in candidates:
        if c.architecture not in (arch, "all"):
            continue
        by_name.setdefault(c.package, []).append(c)
    for name, cands in by_name.items():
        cands.sort(key=lambda c: rank.get(c.suite, len(rank)))
        cands.sort(key=lambda c: c.ver, reverse=True)  # stable: the tie keeps suite order
        seen: set[str] = set()
        by_name[name] = [c for c in cands if not (c.version in seen or seen.add(c.version))]
    return Index(arch, suites, mirrors, by_name)


def fetch_index(sources: list[AptSource], suites: list[str], arch: str, s: requests.Session,
                progress: Callable[[str], None] = lambda m: None, workspace_roots: list | None = None) -> Index:
    """Download and parse the Packages indexes of every suite and component for `arch`.
    For each (suite, component) the first source that serves it is used. `workspace_roots`:
    where a file: mirror WORKSPACE.toml names may lie (get's file_roots); apt's own are the user's."""
    candidates: list[Candidate] = []
    used: list[str] = []
    for suite in suites:
        comps = list(dict.fromkeys(c for src in sources if suite in src.suites for c in src.components))
        for comp in comps:
            rel = f"dists/{suite}/{comp}/binary-{arch}/Packages"
            tried: list[str] = []
            failure: FetchError | None = None
            for src in sources:
                if suite not in src.suites or comp not in src.components or not src.serves(arch):
                    continue
                base = src.uri.rstrip("/")
                tried.append(base)
                roots = workspace_roots if src.origin.startswith("WORKSPACE.toml") else None
                try:
                    found = _first_variant(base, rel, s, roots)
                except FetchError as e:  # another source may serve it; else this is the error
                    failure = failure or e
                    continue
                if found is None:
                    continue
                start = time.monotonic()
                ext, text = found
                candidates += parse_packages(text, suite, f"{base}/{rel}{ext}")
                progress(f"{base}/{rel}{ext}: parsed in {time.monotonic() - start:.1f}s")
                used.append(base)
                break
            else:
                if failure is not None:
                    raise failure
                raise FetchError(f"no configured mirror serves {rel}(.xz|.gz) (asked: {', '.join(tried)})",
                                 where=f"suite {suite}", hint=MIRROR_HINT)
    return build_index(candidates, arch, suites, list(dict.fromkeys(used)))


def _first_variant(base: str, rel: str, s: requests.Session, file_roots: list | None = None
                   ) -> tuple[str, bytes] | None:
    """(extension, decompressed index) of the first variant the mirror has, or None."""
    for ext, decompress in VARIANTS:
        data = get(f"{base}/{rel}{ext}", s, file_roots=file_roots)
        if data is None:
            continue
        try:
            return ext, decompress(data)
        except _TooLarge:
            raise FetchError(f"{base}/{rel}{ext} unpacks to more than {MAX_INDEX_BYTES >> 20} MiB, more than a "
                             "Packages index is", hint=MIRROR_HINT) from None
        except (lzma.LZMAError, zlib.error, OSError, EOFError) as e:
            raise FetchError(f"{base}/{rel}{ext} is damaged ({e})", hint=MIRROR_HINT) from None
    return None
