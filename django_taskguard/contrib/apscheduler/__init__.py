"""APScheduler glue: a guarded job's slot is the time APScheduler scheduled it for.

- **APScheduler 3**: run the jobs on :class:`TaskguardExecutor` (a thread pool). It tells
  the guarded function each run's scheduled time, so a run that starts late (a busy pool,
  a paused process) claims the slot it was fired for, never the one current when it runs::

      scheduler = BackgroundScheduler(executors={"default": TaskguardExecutor()})
      scheduler.add_job(sync_prices, epoch_interval(timedelta(minutes=5)))

- **APScheduler 4** (a pre-release): nothing to configure; the slot source reads the
  running job's ``scheduled_fire_time`` (``apscheduler.current_job``) and its id is the
  message's identity.

In both, the first guarded function a job calls (the job itself, usually) takes the job's
time; a guarded function called from inside a guarded run keeps its own slot. Every
process's scheduler must fire the same instants: cron triggers do; an interval trigger
needs a fixed ``start_date`` (:func:`epoch_interval`), or each process has its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any

from django.db import close_old_connections

from ...context import active_run
from ...decorating import SLOT_SOURCES, CallContext
from ...exceptions import TaskGuardError

__all__ = ["TaskguardExecutor", "apscheduler_call_context", "epoch_interval", "register"]

EPOCH = datetime(1970, 1, 1, tzinfo=dt_timezone.utc)
MAX_WORKERS_BOUNDS = (1, 1_000)

# The scheduled time of the APScheduler 3 run this thread executes (TaskguardExecutor).
_fire_time: ContextVar[datetime | None] = ContextVar(
    "taskguard_apscheduler_fire_time", default=None
)


def apscheduler_call_context() -> CallContext | None:
    """The slot source of guarded functions run by APScheduler (in ``SLOT_SOURCES``): the
    run's scheduled time, when no guarded run is active yet in this call."""
    if active_run() is not None:
        return None
    fire_time = _fire_time.get()
    if fire_time is not None:
        return CallContext(slot=fire_time)
    current_job = _current_job_var()
    job = current_job.get(None) if current_job is not None else None
    scheduled = getattr(job, "scheduled_fire_time", None)
    if scheduled is None:
        return None  # not in a job, or a job run by hand (no fire time): other sources
    return CallContext(slot=scheduled, message_id=str(getattr(job, "id", "")) or None)


@functools.lru_cache(maxsize=1)
def _current_job_var() -> Any:
    """APScheduler 4's ``current_job`` context variable, or None (3.x has none)."""
    try:
        from apscheduler import current_job
    except ImportError:
        return None
    return current_job


def run_at_fire_times(
    run_job: Callable[..., list[Any]], job: Any, alias: str, run_times: list[datetime], logger: str
) -> list[Any]:
    """APScheduler 3's ``run_job`` once per scheduled time, each told to the slot source.

    Database connections are closed around each run as after a request (Django's
    ``close_old_connections``: ``CONN_MAX_AGE`` applies), so a pool thread does not keep
    one open, or broken, between runs."""
    events: list[Any] = []
    for run_time in run_times:
        token = _fire_time.set(run_time)
        close_old_connections()
        try:
            events.extend(run_job(job, alias, [run_time], logger))
        finally:
            _fire_time.reset(token)
            close_old_connections()
    return events


def epoch_interval(every: timedelta, **options: Any) -> Any:
    """An APScheduler 3 ``IntervalTrigger`` that fires at whole multiples of ``every`` since
    the epoch, as ``@once_per_schedule(every=...)`` slots are: every process fires the same
    instants. ``options`` (``jitter`` excluded) pass through."""
    from apscheduler.triggers.interval import IntervalTrigger

    if not isinstance(every, timedelta) or every < timedelta(seconds=1):
        raise TaskGuardError(
            f"epoch_interval() needs a timedelta of at least one second; got {every!r}"
        )
    if "start_date" in options or options.get("jitter"):
        raise TaskGuardError("epoch_interval() sets start_date itself and takes no jitter")
    return IntervalTrigger(seconds=every.total_seconds(), start_date=EPOCH, **options)


def register() -> None:
    """Let guarded functions find their APScheduler run's scheduled time (idempotent)."""
    if apscheduler_call_context not in SLOT_SOURCES:
        SLOT_SOURCES.append(apscheduler_call_context)


def __getattr__(name: str) -> Any:
    # TaskguardExecutor subclasses APScheduler 3's BaseExecutor: imported on first use, so
    # that this module (the slot source) loads under APScheduler 4 too.
    if name == "TaskguardExecutor":
        from .v3 import TaskguardExecutor

        return TaskguardExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
