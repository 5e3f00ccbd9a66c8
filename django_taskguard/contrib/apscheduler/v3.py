"""``TaskguardExecutor``: APScheduler 3's thread pool executor, telling each run's scheduled
time to the guarded function it calls (see the package's docstring)."""

from __future__ import annotations

import concurrent.futures
from datetime import datetime
from typing import Any

from ...exceptions import TaskGuardError
from . import register, run_at_fire_times

try:
    from apscheduler.executors.base import BaseExecutor, run_job
except ImportError as exc:  # APScheduler 4 has another executor API
    raise TaskGuardError(
        "TaskguardExecutor needs APScheduler 3 (pip install 'apscheduler>=3.10,<4'); under "
        "APScheduler 4 no executor is needed (docs/deployments/apscheduler.md)"
    ) from exc

MAX_WORKERS_BOUNDS = (1, 1_000)


class TaskguardExecutor(BaseExecutor):  # type: ignore[misc]
    """An APScheduler 3 executor (a pool of ``max_workers`` threads, like APScheduler's
    ``ThreadPoolExecutor``) whose runs tell guarded functions their scheduled time."""

    def __init__(self, max_workers: int = 10) -> None:
        low, high = MAX_WORKERS_BOUNDS
        if (
            isinstance(max_workers, bool)
            or not isinstance(max_workers, int)
            or not low <= max_workers <= high
        ):
            raise TaskGuardError(
                f"TaskguardExecutor(max_workers=) must be a whole number from {low} to {high}; "
                f"got {max_workers!r}"
            )
        super().__init__()
        self.max_workers = max_workers
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self, scheduler: Any, alias: str) -> None:
        super().start(scheduler, alias)
        self.pool = concurrent.futures.ThreadPoolExecutor(self.max_workers)
        register()

    def shutdown(self, wait: bool = True) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait)

    def _do_submit_job(self, job: Any, run_times: list[datetime]) -> None:
        # APScheduler 3's contract for an executor (what its own pool executors do): submit
        # run_job for the job's alias, report its events or its error back to the scheduler.
        assert self.pool is not None, "the executor has not been started"
        job_id = job.id

        def done(future: concurrent.futures.Future[list[Any]]) -> None:
            exc = future.exception()
            if exc is not None:
                self._run_job_error(job_id, exc, exc.__traceback__)
            else:
                self._run_job_success(job_id, future.result())

        future = self.pool.submit(
            run_at_fire_times, run_job, job, job._jobstore_alias, run_times, self._logger.name
        )
        future.add_done_callback(done)
