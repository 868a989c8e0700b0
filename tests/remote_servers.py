"""Real servers for the remote-cache tests, started on 127.0.0.1 by the tests themselves: nginx
with WebDAV PUT (Debian's nginx), and small misbehaving TCP servers for the fault tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
requires_nginx = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install -y nginx "
                                                          "libnginx-mod-http-dav-ext)")

CONF = """
worker_processes 1;
daemon off;
user {user};
pid {run}/nginx.pid;
error_log {run}/error.log;
events {{ worker_connections 256; }}
http {{
  access_log off;
  client_body_temp_path {run}/body;
  proxy_temp_path {run}/proxy;
  fastcgi_temp_path {run}/fastcgi;
  uwsgi_temp_path {run}/uwsgi;
  scgi_temp_path {run}/scgi;
  client_max_body_size 0;
  server {{
    listen 127.0.0.1:{port};
    root {store};
    location / {{
      dav_methods PUT DELETE;
      create_full_put_path on;
      dav_access user:rw group:r all:r;
    }}
  }}
  server {{
    listen 127.0.0.1:{broken_port};
    location / {{ return 503; }}
  }}
}}
"""


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL after `timeout` s; reaped either way."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(port: int, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


class Nginx:
    """nginx serving `store` over WebDAV PUT at `url`; `broken_url` answers 503 to everything."""

    def __init__(self, root: Path):
        self.run_dir, self.store = root / "run", root / "store"
        for d in (self.run_dir, self.store):
            d.mkdir(parents=True)
        self.port, self.broken_port = free_port(), free_port()
        user = "root" if _is_root() else ""
        conf = self.run_dir / "nginx.conf"
        conf.write_text(CONF.format(run=self.run_dir, store=self.store, port=self.port,
                                    broken_port=self.broken_port, user=user or "nobody"))
        if not user:
            conf.write_text(conf.read_text().replace("user nobody;\n", ""))
        self.proc = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(self.run_dir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _wait_for(self.port)
            _wait_for(self.broken_port)
        except RuntimeError:
            self.stop()
            raise RuntimeError("nginx did not start: " + (self.run_dir / "error.log").read_text()[-2000:])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/cache"

    @property
    def broken_url(self) -> str:
        return f"http://127.0.0.1:{self.broken_port}/cache"

    def files(self, kind: str) -> list[Path]:
        d = self.store / "cache" / kind
        return sorted(p for p in d.iterdir()) if d.exists() else []

    def stop(self) -> None:
        stop_process(self.proc, 10)


def _is_root() -> bool:
    return os.geteuid() == 0


class SilentServer:
    """Accepts connections and never answers (a hung server: requests must time out)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.held.append(conn)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/cache"

    def stop(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


BUILDGRID_VERSION = "0.9.1"
BUILDGRID_CONF = """
server:
  - !channel
    address: "127.0.0.1:{port}"
    insecure-mode: true
authorization:
  method: none
storages:
  - !disk-storage &main-storage
    path: {store}
caches:
  - !lru-action-cache &main-action
    storage: *main-storage
    max-cached-refs: 100000
    allow-updates: true
    cache-failed-actions: true
instances:
  - name: ""
    services:
      - !action-cache
        cache: *main-action
      - !cas
        storage: *main-storage
      - !bytestream
        storage: *main-storage
"""


def _user_home() -> Path:
    """The user's real home (conftest gives the test session a private HOME; pyenv lives here)."""
    import bgraph_testlib
    return bgraph_testlib.USER_HOME or Path.home()


def pyenv_roots() -> list[Path]:
    """Where pyenv keeps its Pythons: $PYENV_ROOT, and ~/.pyenv of the user's real home."""
    roots = [Path(os.environ["PYENV_ROOT"])] if os.environ.get("PYENV_ROOT") else []
    return roots + [r for r in [_user_home() / ".pyenv"] if r not in roots]


def python313(roots: list[Path] | None = None, path: str | None = None) -> str | None:
    """A Python 3.13 interpreter (BuildGrid 0.9.1 needs it) that runs: pyenv's own, or on PATH.
    (pyenv's shim for python3.13 is on PATH but exits 127 where 3.13 is not a selected version.)"""
    candidates = [str(c) for root in (pyenv_roots() if roots is None else roots)
                  for c in sorted(root.glob("versions/3.13*/bin/python3.13"), reverse=True)]
    candidates.append(shutil.which("python3.13", path=path) or "")
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "--version"], capture_output=True).returncode == 0:
            return candidate
    return None


def buildgrid_venv(home: Path) -> Path:
    return home / ".cache" / "bgraph-tests" / f"buildgrid-{BUILDGRID_VERSION}"


def buildgrid_missing_reason(roots: list[Path] | None = None, homes: list[Path] | None = None) -> str:
    """The skip reason where buildgrid_bgd() finds no BuildGrid and no Python 3.13 to install it
    with: it names the tool, what was looked for, and the command that fixes it (pytest -rs shows it)."""
    roots = pyenv_roots() if roots is None else roots
    homes = [_user_home(), Path.home()] if homes is None else homes
    looked = " and ".join(f"{r}/versions/3.13*/bin/python3.13" for r in roots)
    venvs = " or ".join(sorted({str(buildgrid_venv(h)) for h in homes}))
    return (f"BuildGrid {BUILDGRID_VERSION} unavailable, so the REAPI remote cache is untested: it needs "
            f"Python 3.13, and none runs here (looked for {looked} and python3.13 on PATH; no ready venv "
            f"at {venvs}). Install: pyenv install 3.13 (the tests then pip-install "
            f"buildgrid=={BUILDGRID_VERSION} into a venv of their own)")


def buildgrid_bgd(homes: list[Path] | None = None, roots: list[Path] | None = None,
                  path: str | None = None) -> str | None:
    """`bgd` of BuildGrid 0.9.1: from a venv an earlier run made (under ~/.cache/bgraph-tests of
    the user's home, only read, or of the session's), else made now in the session's home (the
    last of `homes`). None where there is none and no Python 3.13 can make one
    (see buildgrid_missing_reason)."""
    homes = [_user_home(), Path.home()] if homes is None else homes
    for home in homes:
        bgd = buildgrid_venv(home) / "bin" / "bgd"
        if bgd.exists():
            return str(bgd)
    py = python313(roots, path)
    if py is None:
        return None
    venv = buildgrid_venv(homes[-1])
    bgd = venv / "bin" / "bgd"
    try:
        subprocess.run([py, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"buildgrid=={BUILDGRID_VERSION}"],
                       check=True, capture_output=True)
    except subprocess.CalledProcessError:
        shutil.rmtree(venv, ignore_errors=True)  # never leave a half-made venv for the next run
        raise
    return str(bgd)


class BuildGrid:
    """A BuildGrid server (CAS, ActionCache, ByteStream; disk storage, no database)."""

    def __init__(self, root: Path, bgd: str):
        root.mkdir(parents=True)
        self.port = free_port()
        conf = root / "cas.yml"
        conf.write_text(BUILDGRID_CONF.format(port=self.port, store=root / "cas"))
        (root / "cas").mkdir()
        self.log = root / "bgd.log"
        self.proc = subprocess.Popen([bgd, "server", "start", "-v", str(conf)], cwd=root,
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
        try:
            _wait_for(self.port, timeout=60)
        except RuntimeError:
            self.stop()
            raise RuntimeError("BuildGrid did not start: " + self.log.read_text()[-2000:])

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_process(self.proc, 15)
