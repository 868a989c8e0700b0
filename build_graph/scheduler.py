"""Runs jobs in parallel within a job count and a memory budget. Knows nothing of caching."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable


class Scheduler:
    """At most `jobs` jobs at once, and the sum of their declared memory kept under `max_mem_mb`
    (a job larger than the whole budget still runs, alone)."""

    def __init__(self, jobs: int, max_mem_mb: int, stop_on_failure: bool = False):
        self.jobs = max(1, jobs)
        self.stop_on_failure = stop_on_failure  # a failed job starts nothing more (no --keep-going)
        self.max_mem_mb = max_mem_mb
        self._pending: deque[tuple[Callable[[], Any], int, Future]] = deque()
        self._running = 0
        self._mem = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.peak_running = 0
        self.peak_mem_mb = 0
        self.cancelled = False

    def submit(self, fn: Callable[[], Any], memory_mb: int) -> Future:
        fut: Future = Future()
        with self._lock:
            self._pending.append((fn, memory_mb, fut))
        self._launch()
        return fut

    def _fits(self, mem: int) -> bool:
        return self._running < self.jobs and (self._running == 0 or self._mem + mem <= self.max_mem_mb)

    def _launch(self) -> None:
        with self._lock:
            while self._pending and not self.cancelled:
                # First job that fits: a big job waits while small ones keep the cores busy.
                for i, (fn, mem, fut) in enumerate(self._pending):
                    if self._fits(mem):
                        del self._pending[i]
                        break
                else:
                    return
                self._running += 1
                self._mem += mem
                self.peak_running = max(self.peak_running, self._running)
                self.peak_mem_mb = max(self.peak_mem_mb, self._mem)
                t = threading.Thread(target=self._work, args=(fn, mem, fut), daemon=True)
                self._threads.append(t)
                t.start()

    def _work(self, fn: Callable[[], Any], mem: int, fut: Future) -> None:
        try:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # reported through the future
                    if self.stop_on_failure:
                        with self._lock:
                            self.cancelled = True  # before the finally below could launch the next job
                    fut.set_exception(e)
        finally:
            with self._lock:
                self._running -= 1
                self._mem -= mem
            self._launch()

    def cancel_pending(self) -> None:
        """Drop queued jobs (first failure, or Ctrl-C); running ones finish or are killed by the runner."""
        with self._lock:
            self.cancelled = True
            pending, self._pending = list(self._pending), deque()
        for _fn, _mem, fut in pending:
            # cancel() alone does not wake concurrent.futures.wait(); this does.
            if fut.cancel():
                fut.set_running_or_notify_cancel()

    def join(self) -> None:
        for t in list(self._threads):
            t.join()
