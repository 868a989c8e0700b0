"""The remote execution stack for the tests, started on free 127.0.0.1 ports: PostgreSQL 15 (as
its `postgres` user: it refuses root), BuildGrid 0.9.1's `bgd` with execution (the tuned config
of ../shared/design/REMOTE-EXEC.md) and `bgraph worker` processes. `ExecStack` starts them in
that order and stops them in reverse; a test session starts it once (a module fixture)."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from remote_servers import _wait_for, buildgrid_bgd, buildgrid_missing_reason, free_port, stop_process

PG_BIN = Path("/usr/lib/postgresql/15/bin")
REPO = Path(__file__).resolve().parent.parent

EXEC_CONF = """
server:
  - !channel
    address: "127.0.0.1:{port}"
    insecure-mode: true
authorization:
  method: none
connections:
  - !sql-connection &sql
    connection-string: {db}
    pool-size: 5
    max-overflow: 10
storages:
  - !disk-storage &main-storage
    path: {store}
caches:
  - !lru-action-cache &main-action
    storage: *main-storage
    max-cached-refs: 100000
    allow-updates: true
    cache-failed-actions: true
schedulers:
  - !sql-scheduler &sched
    sql: *sql
    storage: *main-storage
    action-cache: *main-action
    bot-session-keepalive-timeout: {keepalive}
    session-expiry-timer-interval: 1
    poll-interval: 0.1
    bot-poll-interval: 0.1
    property-set: !dynamic-property-set
      wildcard-property-keys: [bgraph-sandbox]
    assigners:
      - !priority-age-assigner
        count: 1
        interval: 0.05
        jitter-factor: 0.05
        priority-assignment-percentage: 100
instances:
  - name: ""
    services:
      - !action-cache
        cache: *main-action
      - !execution
        scheduler: *sched
      - !cas
        storage: *main-storage
      - !bytestream
        storage: *main-storage
thread-pool-size: {threads}
"""


def missing_reason() -> str | None:
    """Why the stack cannot run here (named), or None."""
    if not (PG_BIN / "initdb").exists():
        return (f"PostgreSQL 15 is not installed ({PG_BIN}/initdb missing): BuildGrid's execution service "
                "needs it. Install: apt-get install -y postgresql")
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "PostgreSQL's `postgres` user is missing (reinstall Debian's postgresql package)"
    if os.geteuid() != 0:
        return "the PostgreSQL server is started as the `postgres` user, which needs root"
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (apt-get install -y bubblewrap): the worker runs actions in it"
    if buildgrid_bgd() is None:
        return buildgrid_missing_reason()
    return None


def _as_postgres(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", "postgres", "--", *argv], check=True, capture_output=True, **kw)


class Postgres:
    """A private PostgreSQL 15 cluster (fsync off: a test database) on a free port."""

    def __init__(self):
        # Under /tmp, not pytest's tmp_path: the postgres user must reach it (pytest's is 0700 root).
        self.root = Path(tempfile.mkdtemp(prefix="bgraph-pg-"))
        os.chmod(self.root, 0o755)
        pg = pwd.getpwnam("postgres")
        os.chown(self.root, pg.pw_uid, pg.pw_gid)
        self.data = self.root / "data"
        self.port = free_port()
        self.log = self.root / "pg.log"
        try:
            _as_postgres(str(PG_BIN / "initdb"), "-D", str(self.data), "-U", "bgd", "--auth=trust", "-E", "UTF8",
                         "--no-sync")
            _as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-o",
                         f"-h 127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c synchronous_commit=off "
                         "-c full_page_writes=off", "start")
            _as_postgres(str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "bgd", "bgd")
        except subprocess.CalledProcessError as e:
            text = (e.stderr or b"").decode(errors="replace")[-1500:]
            log = self.log.read_text(errors="replace")[-1500:] if self.log.exists() else ""
            self.stop()
            raise RuntimeError(f"PostgreSQL did not start: {text}\n{log}") from None

    @property
    def url(self) -> str:
        return f"postgresql://bgd@127.0.0.1:{self.port}/bgd"

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            subprocess.run(["runuser", "-u", "postgres", "--", str(PG_BIN / "pg_ctl"), "-D", str(self.data),
                            "-m", "immediate", "-w", "stop"], check=False, capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


class ExecBuildGrid:
    """`bgd` with the execution service, on the Postgres database `db`."""

    def __init__(self, root: Path, db: str, keepalive: int = 10, threads: int = 40):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.bgd = buildgrid_bgd()
        self.port = free_port()
        (root / "cas").mkdir(exist_ok=True)
        self.conf = root / "exec.yml"
        self.conf.write_text(EXEC_CONF.format(port=self.port, db=db, store=root / "cas", keepalive=keepalive,
                                              threads=threads))
        migrate = subprocess.run([self.bgd, "migrate", "apply", db], check=False, capture_output=True, cwd=root)
        if migrate.returncode != 0:
            raise RuntimeError("bgd migrate failed: " + migrate.stderr.decode(errors="replace")[-2000:])
        self.log = root / "bgd.log"
        self.proc = None
        self.start()

    def start(self) -> None:
        """Start (or restart, on the same database and CAS) and wait until it listens."""
        with open(self.log, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen([self.bgd, "server", "start", "-v", str(self.conf)], cwd=self.root,
                                         stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_for(self.port, timeout=90)
        except RuntimeError:
            self.stop()
            raise RuntimeError("BuildGrid did not start: " + self.log.read_text(errors="replace")[-2000:])

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def cas_path(self, digest: str) -> Path:
        """Where the disk storage keeps blob `digest` (a test removes it to make an input missing).
        BuildGrid's disk storage (path: <root>/cas) puts blobs at cas/objects/<hash[:2]>/<hash[2:]>
        below its path; a blob it does not hold raises, so no test can pass on a lookup that missed."""
        path = self.root / "cas" / "cas" / "objects" / digest[:2] / digest[2:]
        if not path.is_file():
            raise AssertionError(f"BuildGrid's disk storage holds no blob {digest} (looked at {path})")
        return path

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 20)


class WorkerProcess:
    """`bgraph worker --slots N` as its own process (so a test can SIGKILL it)."""

    def __init__(self, url: str, root: Path, name: str, slots: int = 1, heartbeat: float | None = 1.0,
                 extra: tuple[str, ...] = ()):
        self.root = root / name
        self.root.mkdir(parents=True, exist_ok=True)
        self.log = self.root / "worker.log"
        argv = [sys.executable, "-m", "build_graph", "worker", "--server", url, "--slots", str(slots),
                "--work-dir", str(self.root / "leases"), "--cache", str(self.root / "cache"), "--name", name]
        if heartbeat:
            argv += ["--heartbeat", str(heartbeat)]
        argv += list(extra)
        # Each test worker has its own name (the bot id's first part): two workers on one host are
        # two bots, and a restart under the same name is the same bot.
        env = dict(os.environ, PYTHONPATH=str(REPO))
        with open(self.log, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind (the fault test)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        stop_process(self.proc, 20)


class ExecStack:
    """PostgreSQL + bgd + `workers` bgraph workers, stopped in reverse order by stop()."""

    def __init__(self, root: Path, workers: int = 2, keepalive: int = 10):
        self.root = root
        self.workers: list[WorkerProcess] = []
        self.pg = Postgres()
        self.grid = None
        try:
            self.grid = ExecBuildGrid(root / "bgd", self.pg.url, keepalive=keepalive)
            for i in range(workers):
                self.add_worker(f"w{i}")
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return self.grid.url

    def add_worker(self, name: str, slots: int = 1, extra: tuple[str, ...] = ()) -> WorkerProcess:
        """Start one more worker process named `name` (its bot ids are name/0...); `extra`: more
        `bgraph worker` options."""
        w = WorkerProcess(self.url, self.root / "workers", name, slots, extra=extra)
        self.workers.append(w)
        return w

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        if self.grid is not None:
            self.grid.stop()
        self.pg.stop()


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll `predicate` until it is truthy (returned), else fail naming `what`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
