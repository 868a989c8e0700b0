"""Fixed-output downloads: pinned PyPI files through pip's configured index, and plain URLs.

The index is read from pip's configuration (index-url, extra-index-url, environment and
config files, through pip's public `pip config list`), never hard-coded; the simple API is parsed by pypi-simple. A download is
accepted only if its sha256 matches the pin; otherwise nothing is stored.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import requests
from pypi_simple import ACCEPT_ANY, PYPI_SIMPLE_ENDPOINT, ProjectPage
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from build_graph.errors import FetchError
from build_graph.fetch_guard import Budget, allowed_dirs, open_file_url, scrub, shown
from build_graph.model import Action, ActionResult, Tree
from build_graph.store.cas import LocalCas


def pip_indexes() -> list[str]:
    """Index URLs in pip's order: index-url (or pip's default), then extra-index-url, as pip's
    own configuration resolves them (environment, then its config files)."""
    values = _pip_config(tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("PIP_"))))
    primary = os.environ.get("PIP_INDEX_URL") or values.get("index-url") or PYPI_SIMPLE_ENDPOINT.rstrip("/")
    extra = os.environ.get("PIP_EXTRA_INDEX_URL") or values.get("extra-index-url") or ""
    return [primary, *shlex.split(extra)]


# Later sections win: pip reads [global], then the command's own section, then PIP_* variables.
_PIP_SECTIONS = ("global", "download", ":env:")


@functools.lru_cache(maxsize=8)
def _pip_config(pip_environment: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """pip's effective settings from its public `pip config list` (one `section.key='value'` line
    each, values in Python's repr), once per set of PIP_* variables; {} where pip is missing."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, dict[str, str]] = {}
    for line in out.stdout.splitlines():
        name, sep, raw = line.partition("=")
        section, _, key = name.rpartition(".")
        if not sep or section not in _PIP_SECTIONS:
            continue
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            continue
        found.setdefault(key, {})[section] = str(value)
    return {key: by_section[max(by_section, key=_PIP_SECTIONS.index)] for key, by_section in found.items()}


def http_session() -> requests.Session:
    """A requests session that retries connection failures and 5xx answers with backoff
    (urllib3's Retry), as pip does, before a download is reported as failed."""
    retry = Retry(total=4, connect=4, read=2, backoff_factor=0.5, status_forcelist=(500, 502, 503, 504),
                  allowed_methods=frozenset({"GET", "HEAD"}), raise_on_status=False)
    session = requests.Session()
    adapter = HTTPAdapter(max_retries=retry)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def _get(url: str, session: requests.Session, **kw) -> requests.Response:
    try:
        return session.get(url, timeout=60, **kw)
    except requests.RequestException as e:
        raise FetchError(f"cannot reach {shown(url)}: {scrub(str(e), url)}") from None


def _local_path(url: str) -> Path:
    return Path(unquote(urlparse(url).path))


def find_on_index(project: str, filename: str, session: requests.Session) -> tuple[list[str], list[str]]:
    """Candidate URLs for `filename` across pip's indexes, and the indexes asked."""
    found, asked = _find(project, filename, session)
    return [url for url, _local in found], asked


def _find(project: str, filename: str, session: requests.Session) -> tuple[list[tuple[str, bool]], list[str]]:
    """find_on_index's candidates, each with whether a local (file:) index page named it: the user
    configured that index, so its links are the user's, not the workspace's."""
    found, asked = [], []
    for index in pip_indexes():
        page_url = index.rstrip("/") + "/" + re.sub(r"[-_.]+", "-", project).lower() + "/"  # PEP 503
        asked.append(shown(index))
        if page_url.startswith("file:"):
            p = _local_path(page_url)
            page = p / "index.html" if p.is_dir() else p
            if not page.is_file():
                continue
            text = page.read_text(errors="replace")
            for link in _links(text, page_url):
                if link[0] == filename:
                    found.append((link[1], True))
            continue
        r = _get(page_url, session, headers={"Accept": ACCEPT_ANY})
        if r.status_code == 404:
            continue
        if not r.ok:
            continue
        page = ProjectPage.from_response(r, project)
        for pkg in page.packages:
            if pkg.filename == filename:
                found.append((pkg.url, False))
    return found, asked


def _links(html: str, base: str):
    page = ProjectPage.from_html("x", html, base_url=base)
    return [(p.filename, p.url) for p in page.packages]


CHUNK = 1 << 20


def _stream(url: str, session: requests.Session, out, h, budget: Budget, roots: list[Path] | None,
            stop: threading.Event) -> int | None:
    """Copy `url` (http(s) or file:) into `out`, hashing it with `h`, within `budget`: None when
    done, else the HTTP status that refused it. A file: URL must name a regular file under `roots`
    (None: a URL the user configured); `stop` ends it between two chunks."""
    if url.startswith("file:"):
        with os.fdopen(open_file_url(url, roots), "rb") as f:
            budget.expect(os.fstat(f.fileno()).st_size)
            while chunk := f.read(CHUNK):
                _take(chunk, out, h, budget, stop)
        return None
    with session.get(url, stream=True, timeout=(30, 120)) as r:
        if not r.ok:
            return r.status_code
        length = r.headers.get("Content-Length", "")
        if length.isdigit() and "Content-Encoding" not in r.headers:
            budget.expect(int(length))
        for chunk in r.iter_content(CHUNK):
            _take(chunk, out, h, budget, stop)
    return None


def _take(chunk: bytes, out, h, budget: Budget, stop: threading.Event) -> None:
    if stop.is_set():
        raise FetchError("interrupted")
    budget.take(len(chunk))
    h.update(chunk)
    out.write(chunk)


class Fetcher:
    """Runs fetch actions; verifies the pinned sha256 while streaming into the CAS. `root`: the
    workspace, whose files (and those below the directories the user allows) file: URLs may name."""

    def __init__(self, cas: LocalCas, root: Path | None = None):
        self.cas = cas
        self.root = root
        self.session = http_session()
        self._stop = threading.Event()

    def stop(self) -> None:
        """End the downloads in progress (Ctrl-C, SIGTERM): each fails at once as interrupted,
        its partial file removed; none starts after."""
        self._stop.set()

    def _roots(self) -> list[Path]:
        """Where a file: URL the workspace named may point: the workspace, the user's directories."""
        return ([Path(os.path.realpath(self.root))] if self.root is not None else []) + allowed_dirs()

    def run(self, action: Action) -> tuple[Tree, ActionResult]:
        spec = dict(action.spec)
        start = time.monotonic()
        if spec["source"] == "debian":
            return self._run_debian(spec, start)
        what = spec.get("pin") or spec["filename"]
        if spec["source"] == "pypi":
            found, asked = _find(spec["project"], spec["filename"], self.session)
            if not found:
                raise FetchError(f"{spec['filename']} is not on any configured index",
                                 where=f"pin {spec.get('pin')}", hint=f"indexes asked: {', '.join(asked)}")
            # A link of a local index the user configured is the user's; one an http index gave
            # is not (a file: link there would read this host's files).
            candidates = [(url, None if local else self._roots) for url, local in found]
        else:
            candidates = [(spec["url"], self._roots)]
        errors = []
        for url, roots in candidates:
            try:
                limit = roots() if roots and url.startswith("file:") else None
                entry = self._download(url, spec["sha256"], what, _size(spec), limit)
                break
            except FetchError as e:
                errors.append(e)
        else:
            raise errors[-1]
        tree = Tree({spec["filename"]: entry})
        urls = [shown(url) for url, _ in candidates]
        result = ActionResult(self.cas.put_tree(tree), 0, self.cas.put_bytes(b"").digest,
                              self.cas.put_bytes(("\n".join(urls) + "\n").encode()).digest,
                              round(time.monotonic() - start, 3), 1)
        return tree, result

    def _download(self, url: str, sha256: str, what: str, size: int = 0, roots: list[Path] | None = None):
        """The CAS entry of `url`'s bytes, which must match `sha256`. A file: URL must lie under
        `roots` (None: one the user configured); for such a workspace-named file a mismatch never
        shows the file's digest (it would tell a workspace's author any host file's sha256)."""
        fd, tmp = tempfile.mkstemp(dir=self.cas.tmp, prefix="fetch-")
        h = hashlib.sha256()
        try:
            refused = self._fetch_into(fd, url, self.session, h, Budget(url, size, self.cas.tmp), roots)
            if refused is not None:
                raise FetchError(f"HTTP {refused} for {shown(url)}", where=what)
            got = h.hexdigest()
            if got != sha256:
                actual = "the file's bytes differ" if url.startswith("file:") and roots is not None else f"got {got}"
                raise FetchError(f"sha256 mismatch for {shown(url)}: expected {sha256}, {actual}; nothing was stored",
                                 where=what, hint="if the new file is trusted, update the pin's sha256")
            return self.cas.put_file(tmp, executable=False, move=True)
        except FetchError as e:
            raise e if e.where else FetchError(e.message, where=what, hint=e.hint) from None
        except requests.RequestException as e:
            raise FetchError(f"download of {shown(url)} failed: {scrub(str(e), url)}", where=what,
                             hint="check the URL and that its server answers from this machine (a proxy: "
                                  "HTTPS_PROXY)") from None
        except OSError as e:  # a file: URL's file (missing, unreadable), or the staging file
            raise FetchError(f"download of {shown(url)} failed: {scrub(e.strerror or str(e), url)}",
                             where=what) from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _fetch_into(self, fd: int, url: str, session: requests.Session, h, budget: Budget,
                    roots: list[Path] | None) -> int | None:
        """_stream into the file open at `fd` (closed here), on a thread of its own: a blocking
        read (a server that stalls, a name that does not resolve) cannot keep Ctrl-C or SIGTERM
        waiting; stop() answers at once, and that thread ends at its next chunk or time-out,
        writing only into the file the caller then removes, never into the CAS."""
        if self._stop.is_set():
            os.close(fd)
            raise FetchError(f"download of {shown(url)} interrupted; nothing was stored")
        box: dict[str, object] = {}
        done = threading.Event()

        def work() -> None:
            try:
                with os.fdopen(fd, "wb") as out:
                    box["refused"] = _stream(url, session, out, h, budget, roots, self._stop)
            except BaseException as e:  # noqa: BLE001  (handed to the caller, who raises it)
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=work, name="bgraph-download", daemon=True).start()
        while not done.wait(0.2):
            if self._stop.is_set():
                raise FetchError(f"download of {shown(url)} interrupted; nothing was stored")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box.get("refused")  # type: ignore[return-value]

    # -- source "debian": a pinned .deb by pool path, from the first configured mirror that has it --
    def _run_debian(self, spec: dict[str, str], start: float) -> tuple[Tree, ActionResult]:
        """Try each mirror (WORKSPACE.toml [debian] mirrors carried in the spec, else apt's sources)."""
        from build_graph.debian.index import MIRROR_HINT, session
        from build_graph.debian.sources import configured_sources, mirrors_for

        what = f"package {spec['package']} ({spec['pool']})"
        # The workspace's own mirrors are the workspace author's word: a file: one must lie in
        # the workspace or a directory the user allows; apt's sources are this host's.
        bases = (spec["mirrors"].split() if spec.get("mirrors")
                 else mirrors_for(configured_sources([], [], []), spec["suite"], spec.get("architecture", "")))
        roots = self._roots() if spec.get("mirrors") and any(b.startswith("file:") for b in bases) else None
        self._deb_session = getattr(self, "_deb_session", None) or session()
        problems = []
        for base in bases:
            url = base.rstrip("/") + "/" + spec["pool"]
            entry, problem = self._download_deb(url, spec["sha256"], what, _size(spec), roots)
            if entry is not None:
                break
            problems.append(problem)
        else:
            missing = any("does not answer" not in p for p in problems)
            raise FetchError(f"no mirror could give it: {'; '.join(problems) or 'no mirror configured'}", where=what,
                             hint=("mirrors keep only current versions: re-lock with `bgraph deb lock`, or fetch "
                                   "from a cache that holds it" if missing else MIRROR_HINT))
        tree = Tree({spec["filename"]: entry})
        result = ActionResult(self.cas.put_tree(tree), 0, self.cas.put_bytes(b"").digest,
                              self.cas.put_bytes(f"{shown(url)}\n".encode()).digest,
                              round(time.monotonic() - start, 3), 1)
        return tree, result

    def _download_deb(self, url: str, sha256: str, what: str, size: int = 0, roots: list[Path] | None = None):
        """(entry, None), or (None, why this mirror could not give it); a file that does not match
        its pin is an error at once (pool files never change: the lock or the mirror is wrong)."""
        from build_graph.debian.index import no_answer

        fd, tmp = tempfile.mkstemp(dir=self.cas.tmp, prefix="fetch-")
        h = hashlib.sha256()
        try:
            refused = self._fetch_into(fd, url, self._deb_session, h, Budget(url, size, self.cas.tmp), roots)
            if refused is not None:
                return None, f"{shown(url)}: HTTP {refused}"
            if h.hexdigest() != sha256:
                actual = ("its bytes differ" if url.startswith("file:") and roots is not None
                          else f"got {h.hexdigest()}")
                raise FetchError(f"{shown(url)} does not match its pin: expected sha256 {sha256}, {actual}; "
                                 "nothing was stored", where=what,
                                 hint="if the mirror's file is trusted, re-lock with `bgraph deb lock`")
            return self.cas.put_file(tmp, executable=False, move=True), None
        except FetchError as e:
            raise e if e.where else FetchError(e.message, where=what, hint=e.hint) from None
        except requests.RequestException as e:
            return None, f"{shown(url)} does not answer ({scrub(no_answer(e), url)})"
        except FileNotFoundError:
            return None, f"{shown(url)}: no such file"
        except OSError as e:  # a mirror's file that cannot be read
            raise FetchError(f"download of {shown(url)} failed: {e.strerror or e}", where=what) from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _size(spec: dict[str, str]) -> int:
    """The size a lock records for the file (Debian and Python locks), 0 where none does."""
    raw = spec.get("size", "")
    return int(raw) if raw.isdigit() else 0
