"""The scheduler starts the highest-priority ready job first (issue 36), first come first served
among equals, and keeps its memory rule, cancellation and stop-on-failure."""

from __future__ import annotations

import threading
import time

from build_graph.scheduler import HOLD_S, Scheduler


def _recorder(sched: Scheduler):
    """A gate job that holds the one slot, and a job factory that records the order jobs start in."""
    gate, started = threading.Event(), []

    def job(name: str):
        return lambda: started.append(name)

    first = sched.submit(lambda: gate.wait(5), 10)
    return gate, started, job, first


def test_the_highest_priority_pending_job_starts_first():
    sched = Scheduler(jobs=1, max_mem_mb=100)
    gate, started, job, _ = _recorder(sched)
    for name, prio in [("low", 1.0), ("high", 9.0), ("mid", 5.0), ("none", 0.0), ("high-too", 9.0)]:
        sched.submit(job(name), 10, priority=prio)
    gate.set()
    sched.join()
    assert started == ["high", "high-too", "mid", "low", "none"]  # equals: first submitted first


def test_without_priorities_jobs_start_in_submission_order():
    sched = Scheduler(jobs=1, max_mem_mb=100)
    gate, started, job, _ = _recorder(sched)
    for i in range(20):
        sched.submit(job(str(i)), 10)
    gate.set()
    sched.join()
    assert started == [str(i) for i in range(20)]


def test_a_job_over_the_memory_left_is_passed_over_for_a_lower_one_that_fits():
    """Two slots, 100 MB: a 60 MB job runs; the urgent 80 MB job does not fit beside it, so the
    less urgent 30 MB job takes the second slot; the 80 MB job starts when the 60 MB one ends."""
    sched = Scheduler(jobs=2, max_mem_mb=100)
    gate, started = threading.Event(), []
    big = sched.submit(lambda: gate.wait(5) and started.append("60"), 60)
    urgent = sched.submit(lambda: started.append("80"), 80, priority=10.0)
    small = sched.submit(lambda: started.append("30"), 30, priority=1.0)
    assert small.result(timeout=5) is None and not urgent.done()
    gate.set()
    sched.join()
    assert started == ["30", "60", "80"] and big.done() and urgent.done()
    assert sched.peak_mem_mb == 90


def test_cancel_pending_drops_prioritised_jobs():
    sched = Scheduler(jobs=1, max_mem_mb=100)
    gate, started, job, first = _recorder(sched)
    queued = [sched.submit(job(str(i)), 10, priority=float(i)) for i in range(5)]
    sched.cancel_pending()
    assert all(f.cancelled() for f in queued)
    gate.set()
    sched.join()
    assert started == [] and first.result() is True


def test_a_failure_starts_no_higher_priority_job_after_it():
    sched = Scheduler(jobs=1, max_mem_mb=100, stop_on_failure=True)
    gate = threading.Event()

    def boom():
        gate.wait(5)
        raise RuntimeError("boom")

    failing = sched.submit(boom, 10)
    ran = threading.Event()
    queued = sched.submit(ran.set, 10, priority=100.0)
    gate.set()
    assert isinstance(failing.exception(timeout=5), RuntimeError)
    time.sleep(0.1)
    assert not ran.is_set() and not queued.done()
    sched.cancel_pending()
    sched.join()
    assert queued.cancelled()


def test_a_held_wave_starts_its_best_job_first_not_its_first_submitted():
    """Without hold() the first job submitted takes the free slot at once; under hold() the wave's
    highest-priority job does."""
    for held, expected in [(False, "first"), (True, "urgent")]:
        sched = Scheduler(jobs=1, max_mem_mb=100)
        started: list[str] = []
        if held:
            with sched.hold():
                sched.submit(lambda: started.append("first"), 10, priority=1.0)
                sched.submit(lambda: started.append("urgent"), 10, priority=5.0)
                assert started == [] and sched.peak_running == 0  # nothing started inside the wave
        else:
            sched.submit(lambda: started.append("first"), 10, priority=1.0)
            sched.submit(lambda: started.append("urgent"), 10, priority=5.0)
        sched.join()
        assert started[0] == expected


def test_a_long_wave_keeps_no_slot_idle_past_the_hold():
    """A wave that plans for longer than HOLD_S: the next submission starts what fits."""
    sched = Scheduler(jobs=1, max_mem_mb=100)
    ran = threading.Event()
    with sched.hold():
        sched.submit(ran.set, 10)
        time.sleep(HOLD_S * 2)
        sched.submit(lambda: None, 10)
        assert ran.wait(5)  # started inside the wave, once the hold had run out
    sched.join()
