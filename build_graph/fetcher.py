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
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import requests
from pypi_simple import ACCEPT_ANY, PYPI_SIMPLE_ENDPOINT, ProjectPage
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from build_graph.errors import FetchError
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
        raise FetchError(f"cannot reach {url}: {e}") from None


def _local_path(url: str) -> Path:
    return Path(unquote(urlparse(url).path))


def find_on_index(project: str, filename: str, session: requests.Session) -> tuple[list[str], list[str]]:
    """Candidate URLs for `filename` across pip's indexes, and the indexes asked."""
    found, asked = [], []
    for index in pip_indexes():
        page_url = index.rstrip("/") + "/" + re.sub(r"[-_.]+", "-", project).lower() + "/"  # PEP 503
        asked.append(index)
        if page_url.startswith("file:"):
            p = _local_path(page_url)
            page = p / "index.html" if p.is_dir() else p
            if not page.is_file():
                continue
            text = page.read_text(errors="replace")
            for link in _links(text, page_url):
                if link[0] == filename:
                    found.append(link[1])
            continue
        r = _get(page_url, session, headers={"Accept": ACCEPT_ANY})
        if r.status_code == 404:
            continue
        if not r.ok:
            continue
        page = ProjectPage.from_response(r, project)
        for pkg in page.packages:
            if pkg.filename == filename:
                found.append(pkg.url)
    return found, asked


def _links(html: str, base: str):
    page = ProjectPage.from_html("x", html, base_url=base)
    return [(p.filename, p.url) for p in page.packages]


def _stream(url: str, session: requests.Session, out, h) -> int | None:
    """Copy `url` (http(s) or file:) into `out`, hashing it with `h`: None when done, else the
    HTTP status that refused it."""
    if url.startswith("file:"):
        with open(_local_path(url), "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
                out.write(chunk)
        return None
    with session.get(url, stream=True, timeout=120) as r:
        if not r.ok:
            return r.status_code
        for chunk in r.iter_content(1 << 20):
            h.update(chunk)
            out.write(chunk)
    return None


class Fetcher:
    """Runs fetch actions; verifies the pinned sha256 while streaming into the CAS."""

    def __init__(self, cas: LocalCas):
        self.cas = cas
        self.session = http_session()

    def run(self, action: Action) -> tuple[Tree, ActionResult]:
        spec = dict(action.spec)
        start = time.monotonic()
        if spec["source"] == "debian":
            return self._run_debian(spec, start)
        if spec["source"] == "pypi":
            urls, asked = find_on_index(spec["project"], spec["filename"], self.session)
            if not urls:
                raise FetchError(f"{spec['filename']} is not on any configured index",
                                 where=f"pin {spec.get('pin')}", hint=f"indexes asked: {', '.join(asked)}")
        else:
            urls = [spec["url"]]
        errors = []
        for url in urls:
            try:
                entry = self._download(url, spec["sha256"], spec.get("pin") or spec["filename"])
                break
            except FetchError as e:
                errors.append(e)
        else:
            raise errors[-1]
        tree = Tree({spec["filename"]: entry})
        result = ActionResult(self.cas.put_tree(tree), 0, self.cas.put_bytes(b"").digest,
                              self.cas.put_bytes(("\n".join(urls) + "\n").encode()).digest,
                              round(time.monotonic() - start, 3), 1)
        return tree, result

    def _download(self, url: str, sha256: str, what: str):
        fd, tmp = tempfile.mkstemp(dir=self.cas.tmp, prefix="fetch-")
        h = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as out:
                refused = _stream(url, self.session, out, h)
            if refused is not None:
                raise FetchError(f"HTTP {refused} for {url}", where=what)
            got = h.hexdigest()
            if got != sha256:
                raise FetchError(f"sha256 mismatch for {url}: expected {sha256}, got {got}; nothing was stored",
                                 where=what, hint="if the new file is trusted, update the pin's sha256")
            return self.cas.put_file(tmp, executable=False, move=True)
        except requests.RequestException as e:
            raise FetchError(f"download of {url} failed: {e}", where=what) from None
        except OSError as e:  # file: URLs (and the staging file)
            raise FetchError(f"download of {url} failed: {e.strerror or e}", where=what) from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    # -- source "debian": a pinned .deb by pool path, from the first configured mirror that has it --
    def _run_debian(self, spec: dict[str, str], start: float) -> tuple[Tree, ActionResult]:
        """Try each mirror (WORKSPACE.toml [debian] mirrors carried in the spec, else apt's sources)."""
        from build_graph.debian.index import MIRROR_HINT, session
        from build_graph.debian.sources import configured_sources, mirrors_for

        what = f"package {spec['package']} ({spec['pool']})"
        bases = (spec["mirrors"].split() if spec.get("mirrors")
                 else mirrors_for(configured_sources([], [], []), spec["suite"], spec.get("architecture", "")))
        self._deb_session = getattr(self, "_deb_session", None) or session()
        problems = []
        for base in bases:
            url = base.rstrip("/") + "/" + spec["pool"]
            entry, problem = self._download_deb(url, spec["sha256"], what)
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
                              self.cas.put_bytes(f"{url}\n".encode()).digest, round(time.monotonic() - start, 3), 1)
        return tree, result

    def _download_deb(self, url: str, sha256: str, what: str):
        """(entry, None), or (None, why this mirror could not give it); a file that does not match
        its pin is an error at once (pool files never change: the lock or the mirror is wrong)."""
        from build_graph.debian.index import no_answer

        fd, tmp = tempfile.mkstemp(dir=self.cas.tmp, prefix="fetch-")
        h = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as out:
                refused = _stream(url, self._deb_session, out, h)
            if refused is not None:
                return None, f"{url}: HTTP {refused}"
            if h.hexdigest() != sha256:
                raise FetchError(f"{url} does not match its pin: expected sha256 {sha256}, got {h.hexdigest()}; "
                                 "nothing was stored", where=what,
                                 hint="if the mirror's file is trusted, re-lock with `bgraph deb lock`")
            return self.cas.put_file(tmp, executable=False, move=True), None
        except requests.RequestException as e:
            return None, f"{url} does not answer ({no_answer(e)})"
        except FileNotFoundError:
            return None, f"{url}: no such file"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
