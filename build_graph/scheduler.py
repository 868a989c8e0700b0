"""Runs jobs in parallel within a job count and a memory budget. Knows nothing of caching.

A job may end its use of the slot before its work is done: it returns Later(fn), and `fn` (its
second part: a sandboxed action's outputs taken into the store and its result filed) runs on a
filer thread while the slot goes to the next job. The job's future is done only when `fn` is:
whoever waits on it (the build's dependents) sees the whole result or its failure, never less.

Each job runs on a thread of its own, started when it gets its slot (bwrap's --die-with-parent
kills a sandbox when the thread that started it exits: the job's thread outlives its process).
Long-lived workers instead were tried (issue 34, item 3) and were not faster: 1.05-1.12x the
wall time of a thread per job in three runs of 150-200 cold genrules on a loaded 2-core machine
(BENCHMARKS.md). The filers, which start no process, live until join().

Pending jobs are started highest priority first (build_graph/priority.py: an action's expected
time to the end of the build), first come first served among equals, and a job that does not fit
the memory budget is passed over for the next one that does. A build plans a wave of ready
targets under hold(), so that the wave's most urgent action takes the first free slot rather
than the first one planned."""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from contextlib import contextmanager
from concurrent.futures import Future
from typing import Any, Callable


class Later:
    """What a job returns to give its slot back before its work is done: `fn` runs off the slot
    (on a filer thread), and its value or exception is the job's."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn


# How long hold() may keep free slots idle while a wave is planned: a wave of thousands of targets
# must not keep the cores waiting (a genrule's plan is ~0.3 ms; 50 ms is ~150 of them).
HOLD_S = 0.05

# The priority of the job each job thread runs: a runner that hands the job's work to another
# queue (remote execution: REAPI's ExecutionPolicy.priority) passes the same order on.
_job = threading.local()


def running_priority() -> float:
    """The priority the job running on this thread was submitted with (0.0 off a job's thread)."""
    return getattr(_job, "priority", 0.0)


class Scheduler:
    """At most `jobs` jobs at once, and the sum of their declared memory kept under `max_mem_mb`
    (a job larger than the whole budget still runs, alone)."""

    def __init__(self, jobs: int, max_mem_mb: int, stop_on_failure: bool = False):
        self.jobs = max(1, jobs)
        self.stop_on_failure = stop_on_failure  # a failed job starts nothing more (no --keep-going)
        self.max_mem_mb = max_mem_mb
        # A heap of (-priority, submission number, fn, memory, future): highest priority first,
        # then first submitted (the number is unique, so fn and future are never compared).
        self._pending: list[tuple[float, int, Callable[[], Any], int, Future]] = []
        self._seq = 0
        self._held_until = 0.0  # hold(): no launch before this (monotonic), unless released
        self._running = 0
        self._mem = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.peak_running = 0
        self.peak_mem_mb = 0
        self.cancelled = False
        # Second parts of jobs (Later), each run on one of at most `jobs` filer threads; they
        # end once closed and nothing is left (or can come) for them.
        self._filing: deque[tuple[Callable[[], Any], Future]] = deque()
        self._filers: list[threading.Thread] = []
        self._filers_busy = 0
        self._file_wake = threading.Condition(self._lock)
        self._closed = False

    def submit(self, fn: Callable[[], Any], memory_mb: int, priority: float = 0.0) -> Future:
        """Queue `fn` (declaring `memory_mb`); it starts when a slot and the memory are free and
        no pending job of higher `priority` (or an equal one submitted earlier) fits first."""
        fut: Future = Future()
        with self._lock:
            heapq.heappush(self._pending, (-priority, self._seq, fn, memory_mb, fut))
            self._seq += 1
            self._launch()
        return fut

    @contextmanager
    def hold(self):
        """Start nothing new while the caller submits a wave of jobs, then start the best of them:
        the wave's order is its priorities', not its submissions'. After HOLD_S seconds the next
        submission or finished job starts what fits (a long wave keeps no slot idle for long)."""
        with self._lock:
            self._held_until = time.monotonic() + HOLD_S
        try:
            yield
        finally:
            with self._lock:
                self._held_until = 0.0
                self._launch()

    def _fits(self, mem: int) -> bool:
        return self._running < self.jobs and (self._running == 0 or self._mem + mem <= self.max_mem_mb)

    def _launch(self) -> None:
        """Start every pending job that fits (called with the lock held), best first. A job that
        does not fit is passed over for the next that does: a big job waits while small ones keep
        the cores busy. Starting one only takes slots and memory, so a job passed over stays
        unfit for the rest of this call."""
        if self._held_until and time.monotonic() < self._held_until:
            return
        passed: list[tuple[float, int, Callable[[], Any], int, Future]] = []
        try:
            while self._pending and not self.cancelled and self._running < self.jobs:
                item = heapq.heappop(self._pending)
                if not self._fits(item[3]):
                    passed.append(item)
                    continue
                self._start(item[2], item[3], item[4], -item[0])
        finally:
            for item in passed:
                heapq.heappush(self._pending, item)

    def _start(self, fn: Callable[[], Any], mem: int, fut: Future, priority: float = 0.0) -> None:
        """Take a slot and `mem` for `fn` and start its thread (called with the lock held)."""
        started = False
        try:
            self._running += 1
            self._mem += mem
            self.peak_running = max(self.peak_running, self._running)
            self.peak_mem_mb = max(self.peak_mem_mb, self._mem)
            t = threading.Thread(target=self._work, args=(fn, mem, fut, priority), daemon=True)
            self._threads.append(t)
            t.start()
            started = True
        finally:
            if not started:
                # Ctrl-C or SIGTERM (raised in the main thread between any two bytecodes)
                # landed here: give the slot back, else the filers, which end once nothing
                # runs, never end and join() hangs.
                self._running -= 1
                self._mem -= mem
                fut.cancel()

    def _work(self, fn: Callable[[], Any], mem: int, fut: Future, priority: float = 0.0) -> None:
        _job.priority = priority
        later = None
        try:
            if fut.set_running_or_notify_cancel():
                try:
                    value = fn()
                    if isinstance(value, Later):
                        later = value.fn
                    else:
                        fut.set_result(value)
                except BaseException as e:  # reported through the future
                    self._failed(fut, e)
        finally:
            with self._lock:
                if later is not None:  # queued before the slot is freed: join() waits for it
                    self._file(later, fut)
                self._running -= 1
                self._mem -= mem
                self._launch()
                if not self._running:
                    self._file_wake.notify_all()  # once closed, idle filers may end

    def _failed(self, fut: Future, e: BaseException) -> None:
        if self.stop_on_failure:
            with self._lock:
                self.cancelled = True  # before the job's slot is freed for the next job
        fut.set_exception(e)

    def _file(self, fn: Callable[[], Any], fut: Future) -> None:
        """Queue a second part for the filers (called with the lock held): a waiting filer takes
        it, or one that is about to look for the next; up to `jobs` of them."""
        self._filing.append((fn, fut))
        if len(self._filers) < min(self.jobs, self._filers_busy + len(self._filing)):
            t = threading.Thread(target=self._filer, name=f"bgraph-filer-{len(self._filers) + 1}", daemon=True)
            self._filers.append(t)
            t.start()
        self._file_wake.notify()

    def _filer(self) -> None:
        while True:
            with self._lock:
                while not self._filing:
                    if self._closed and not self._running:  # no job can queue more
                        self._filers.remove(threading.current_thread())
                        return
                    self._file_wake.wait()
                fn, fut = self._filing.popleft()
                self._filers_busy += 1
            try:
                fut.set_result(fn())
            except BaseException as e:  # reported through the future
                self._failed(fut, e)
            finally:
                with self._lock:
                    self._filers_busy -= 1

    def cancel_pending(self) -> None:
        """Drop queued jobs (first failure, or Ctrl-C); running ones finish or are killed by the runner."""
        with self._lock:
            self.cancelled = True
            pending, self._pending = self._pending, []
        for *_job, fut in pending:
            # cancel() alone does not wake concurrent.futures.wait(); this does.
            if fut.cancel():
                fut.set_running_or_notify_cancel()

    def close(self) -> None:
        """Let the filers end once nothing is left to file and no job runs (without waiting)."""
        with self._lock:
            self._closed = True
            self._file_wake.notify_all()

    def join(self) -> None:
        """Wait for the running jobs (and any they start) to finish and be filed, and for the
        filers to end."""
        self.close()
        while True:
            with self._lock:
                threads = [t for t in self._threads if t.is_alive()] + list(self._filers)
            if not threads:
                return
            for t in threads:
                t.join()
