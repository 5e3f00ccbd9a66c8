"""The bounded set of worker threads ``run_schedules`` fires on.

A worker survives any job: an exception, or a ``SystemExit`` raised by a body, is
logged and the worker takes the next job (a dead worker would leave its copy up and
running nothing). A job submitted ``first`` goes ahead of the queue: a claimed attempt
whose lease is already running is never queued behind other work.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from django.db import connections

from .logfields import log_fields

logger = logging.getLogger("taskguard.scheduler")

Job = Callable[[], None]
# How far back the rate of ended jobs is counted (seconds).
RATE_WINDOW = 2.0


class Pool:
    """Daemon worker threads (a call still running at exit is cut off; its lease lapses
    and ``cleanup_locks`` records it ``abandoned``)."""

    def __init__(self, workers: int) -> None:
        self._jobs: collections.deque[Job | None] = collections.deque()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # a job was queued
        self._idle = threading.Condition(self._lock)  # a job ended
        self._busy = 0  # submitted and not finished
        self._running = 0
        self._ended: collections.deque[float] = collections.deque()  # when jobs ended (RATE_WINDOW)
        self._threads = [
            threading.Thread(target=self._work, name=f"taskguard-fire-{n}", daemon=True)
            for n in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job, *, first: bool = False) -> None:
        with self._lock:
            self._busy += 1
            if first:
                self._jobs.appendleft(job)
            else:
                self._jobs.append(job)
            self._ready.notify()

    @property
    def busy(self) -> int:
        return self._busy

    def wait_free(self, timeout: float) -> int:
        """How many workers could start a job now (none running one, none queued for);
        waits up to ``timeout`` for one to be, 0 if none was."""
        with self._lock:
            self._idle.wait_for(lambda: self._free() > 0, timeout)
            return max(self._free(), 0)

    def _free(self) -> int:
        return len(self._threads) - self._running - len(self._jobs)

    def rate(self) -> float:
        """Jobs ended per second, over the last ``RATE_WINDOW`` seconds."""
        with self._lock:
            self._forget(time.monotonic())
            return len(self._ended) / RATE_WINDOW

    def _forget(self, now: float) -> None:
        while self._ended and self._ended[0] < now - RATE_WINDOW:
            self._ended.popleft()

    def drain(self, timeout: float | None) -> bool:
        """Wait until every submitted job has finished; False if ``timeout`` passed first."""
        with self._lock:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def close(self) -> None:
        with self._lock:
            self._jobs.extend([None] * len(self._threads))
            self._ready.notify_all()

    def _next(self) -> Job | None:
        with self._lock:
            self._ready.wait_for(lambda: bool(self._jobs))
            job = self._jobs.popleft()
            if job is not None:
                self._running += 1
            return job

    def _work(self) -> None:
        try:
            while (job := self._next()) is not None:
                try:
                    job()
                except BaseException:  # SystemExit from a body too: this worker goes on
                    logger.exception(
                        "a run_schedules job raised; the worker goes on",
                        extra=log_fields("scheduler.job_failed"),
                    )
                finally:
                    with self._lock:
                        self._running -= 1
                        self._busy -= 1
                        now = time.monotonic()
                        self._ended.append(now)
                        self._forget(now)
                        self._idle.notify_all()
        finally:
            connections.close_all()
