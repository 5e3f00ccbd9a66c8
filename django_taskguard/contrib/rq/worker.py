"""Worker side: the slot source of guarded functions run as RQ jobs, and how their retries go.

In the work horse, a guarded function that is the job's own function takes its slot from
the job's ``meta`` (:data:`.enqueue.SLOT_META`, put there at enqueue time: never recomputed,
so a job that waited in a backed-up queue still claims its own slot). The job's id and
retry count name the message carrying each attempt (guard.begin's ``message_id``): an RQ
retry (``Retry(max=...)``) is the next attempt of the same row, and the same job run
again (requeued after its work horse died, enqueued again after it ended) is another copy:
a counted duplicate, never a second success.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from rq import get_current_job
from rq.job import Job

from ... import checkins, upkeep
from ...conf import taskguard_settings
from ...context import active_run
from ...decorating import SLOT_SOURCES, CallContext, guarded_policy
from ...endings import Ending
from ...states import RunState
from .enqueue import BACKFILL_META, RETRY_MAX_META, SLOT_META


def rq_call_context() -> CallContext | None:
    """The slot source for guarded RQ jobs (registered in ``SLOT_SOURCES``).

    Answers only inside a job whose own function is a guarded one, and only when no
    guarded run is active yet (a guarded function called *from* a job's body keeps its own
    slot and name). Inside any RQ job, it turns this process's automatic upkeep off.
    """
    job = get_current_job()
    if job is None:
        return None
    if active_run() is not None:
        return None
    try:
        func = job.func
    except Exception:  # not importable here: not ours to answer for
        return None
    if guarded_policy(func) is None:
        return None
    meta = job.meta or {}
    return CallContext(
        slot=meta.get(SLOT_META),
        classify_raise=partial(classify_raise, job),
        instance=job.worker_name or None,
        message_id=message_id(job),
        backfill=bool(meta.get(BACKFILL_META)),
    )


def message_id(job: Job, retries: int = 0) -> str | None:
    """The message carrying this attempt: ``<job id>/<retry count>``, ``retries`` more.

    RQ keeps the retries left; the count is the ``Retry``'s ``max`` (recorded in the meta at
    enqueue time) minus them. None for a job taskguard did not enqueue (no count known):
    its attempts are then told apart by nothing but the row.
    """
    meta = job.meta or {}
    if RETRY_MAX_META not in meta:
        return None
    done = int(meta[RETRY_MAX_META]) - int(job.retries_left or 0)
    return f"{job.id}/{done + retries}"


def classify_raise(job: Job, exc: BaseException) -> Ending | None:
    """What ``exc`` means to RQ: a retry follows while the job has retries left (RQ retries
    any exception then), else None (a failure). A retry with an interval is scheduled: it
    needs a worker started with ``--with-scheduler``."""
    if not isinstance(exc, Exception) or not job.should_retry:
        return None
    interval = float(job.get_retry_interval())
    reason = f"{type(exc).__name__}: {exc}; RQ retries the job ({job.retries_left} retries left)"
    return Ending(RunState.RETRYING, reason, interval, message_id(job, retries=1))


def flush_checkins(job: Job, connection: Any, *result_or_exc_info: Any) -> None:
    """RQ's success, failure and stopped callback of the jobs taskguard enqueues: in the work
    horse, which RQ ends with ``os._exit`` right after its job, the check-ins the attempt
    queued are sent first, for at most the check-ins' ``timeout``. Never raises."""
    settings = taskguard_settings.CHECKINS
    if settings:
        checkins.flush(float(settings.get("timeout", 5)))


def in_job() -> bool:
    """Whether this process runs an RQ job now: its work horse ends with os._exit as soon as
    the job ends, so it starts no automatic upkeep (``upkeep.VETOES``: an upkeep thread there
    would die holding the fleet-wide lease); the run_schedules copies keep it."""
    return get_current_job() is not None


def register() -> None:
    """Wire RQ in (idempotent): guarded jobs find their slot in the job's meta; no upkeep
    thread in a work horse, whatever it runs."""
    if rq_call_context not in SLOT_SOURCES:
        SLOT_SOURCES.append(rq_call_context)
    if in_job not in upkeep.VETOES:
        upkeep.VETOES.append(in_job)
