"""Enqueuer side: which RQ queue a schedule's slots go to, and the job each slot makes.

``@enqueue_on(queue)`` goes on top of ``@once_per_schedule`` and names the queue::

    @enqueue_on("default", retry=Retry(max=3))
    @once_per_schedule(every=timedelta(minutes=5))
    def sync(): ...

``run_schedules --enqueue`` then hands each due slot to that queue (:data:`registry.QUEUE_FINDERS`):
one job per slot, its id derived from the task and the slot (:func:`job_id_for`), enqueued
with RQ's ``unique=True`` (a second enqueue of the same slot is refused by Redis, not run),
and the slot in the job's ``meta`` (:data:`SLOT_META`), where the worker reads it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from django.core.exceptions import ImproperlyConfigured
from rq import Callback, Queue, Retry
from rq.exceptions import DuplicateJobError
from rq.job import Job

from ... import registry, schedules
from ...decorating import dotted_name, guarded_policy
from ...decorators import backfill_enqueued
from ...exceptions import TaskGuardError
from ...logfields import log_fields

logger = logging.getLogger("taskguard.rq")

# The job's meta keys: the slot it runs for (ISO-8601 UTC), and how many retries its
# ``Retry`` allowed at enqueue time (RQ keeps only the retries left; the difference is the
# retry count, which names the message carrying each attempt, see ``worker.message_id``);
# with ``backfill --enqueue``, that the job is an operator's backfill (no lateness policy).
SLOT_META = "taskguard_slot"
RETRY_MAX_META = "taskguard_retry_max"
BACKFILL_META = "taskguard_backfill"
# RQ's callback, by its dotted path (the worker imports it), run after each job taskguard
# enqueues (``worker`` imports this module: the path is named, not imported).
FLUSH_CALLBACK = "django_taskguard.contrib.rq.worker.flush_checkins"
# The attribute ``@enqueue_on`` sets on the guarded function.
TARGET_ATTRIBUTE = "taskguard_rq"

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Target:
    """Where ``@enqueue_on`` sends a guarded function's slots, and with which job options."""

    queue: str | Queue
    connection: Any = None  # a redis.Redis; None: django-rq's RQ_QUEUES names the queue
    options: dict[str, Any] = field(default_factory=dict)

    def resolve(self) -> Queue:
        """The ``rq.Queue`` to enqueue to."""
        if isinstance(self.queue, Queue):
            return self.queue
        if self.connection is not None:
            return Queue(self.queue, connection=self.connection)
        try:
            import django_rq
        except ImportError:
            raise ImproperlyConfigured(
                f"@enqueue_on({self.queue!r}) has no connection: give it connection= (a "
                f"redis.Redis), an rq.Queue, or install django-rq and name the queue in RQ_QUEUES"
            ) from None
        try:
            queue: Queue = django_rq.get_queue(self.queue)
        except KeyError:
            raise ImproperlyConfigured(
                f"@enqueue_on({self.queue!r}): RQ_QUEUES (django-rq) has no queue named "
                f"{self.queue!r}"
            ) from None
        return queue

    @property
    def name(self) -> str:
        return self.queue.name if isinstance(self.queue, Queue) else self.queue


def enqueue_on(
    queue: str | Queue,
    *,
    connection: Any = None,
    retry: Retry | None = None,
    timeout: int | None = None,
    result_ttl: int | None = None,
    ttl: int | None = None,
    failure_ttl: int | None = None,
) -> Callable[[F], F]:
    """Send the slots of the ``@once_per_schedule`` function below to the RQ queue ``queue``.

    ``queue``: an ``rq.Queue``, or a queue name with ``connection=`` (a ``redis.Redis``), or a
    name alone, looked up in django-rq's ``RQ_QUEUES``. ``retry``, ``timeout``,
    ``result_ttl``, ``ttl``, ``failure_ttl``: the job options, as ``Queue.enqueue`` takes
    them. Returns the function itself (call it, or ``run_for_slot``, as before).
    """
    if isinstance(queue, str):
        if not queue.strip():
            raise TaskGuardError("enqueue_on() needs a queue name, not an empty string")
    elif not isinstance(queue, Queue):
        raise TaskGuardError(f"enqueue_on() takes a queue name or an rq.Queue, not {queue!r}")
    elif connection is not None:
        raise TaskGuardError(
            "enqueue_on(): give connection= with a queue name; an rq.Queue has its own"
        )
    if retry is not None and not isinstance(retry, Retry):
        raise TaskGuardError(f"enqueue_on(retry=) takes an rq.Retry, not {retry!r}")
    options = {
        name: value
        for name, value in (
            ("retry", retry),
            ("timeout", timeout),
            ("result_ttl", result_ttl),
            ("ttl", ttl),
            ("failure_ttl", failure_ttl),
        )
        if value is not None
    }
    target = Target(queue, connection, options)

    def decorate(func: F) -> F:
        if guarded_policy(func) is None or not callable(getattr(func, "run_for_slot", None)):
            raise TaskGuardError(
                f"@enqueue_on goes above @once_per_schedule (its slots are what it enqueues); "
                f"{func!r} is not a @once_per_schedule function"
            )
        if "<locals>" in func.__qualname__:
            raise TaskGuardError(
                f"@enqueue_on: {dotted_name(func)} is defined inside a function; an RQ worker "
                f"imports a job's function by its dotted path, so it must be a module's"
            )
        setattr(func, TARGET_ATTRIBUTE, target)
        return func

    return decorate


def target_of(func: Any) -> Target | None:
    """The ``@enqueue_on`` target of a guarded function, or None."""
    target = getattr(func, TARGET_ATTRIBUTE, None)
    return target if isinstance(target, Target) else None


def task_name_of(func: Any) -> str:
    """The task name a guarded function's runs are recorded under (``name=`` or its path)."""
    return getattr(func, "task_name", None) or dotted_name(func)


_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def job_id_for(task_name: str, slot: datetime | str) -> str:
    """The RQ job id of (``task_name``, ``slot``): the same on every copy, distinct per slot.

    ``taskguard-<last part of the name>-<16 hex of the name's SHA-256>-<slot, UTC>``, in
    the characters RQ allows in a job id (letters, digits, ``_``, ``-``).
    """
    utc = schedules.normalize_slot(slot)
    stamp = utc.strftime("%Y%m%dT%H%M%S") + (f"{utc.microsecond:06d}" if utc.microsecond else "")
    tail = _UNSAFE.sub("_", task_name.rsplit(".", 1)[-1])[:40]
    digest = hashlib.sha256(task_name.encode("utf-8")).hexdigest()[:16]
    return f"taskguard-{tail}-{digest}-{stamp}Z"


def enqueue_for_slot(func: Any, slot: datetime | str, /, *args: Any, **kwargs: Any) -> Job | None:
    """Enqueue ``func`` (``@enqueue_on`` over ``@once_per_schedule``) to run for ``slot``.

    The job's id is :func:`job_id_for` the task and the slot, and its ``meta`` carries the
    slot; the worker's call claims that slot, however late it runs. Returns the job, or
    None when a job of this slot exists already (another copy enqueued it: nothing is
    enqueued again).
    """
    target = target_of(func)
    if target is None:
        raise TaskGuardError(
            f"enqueue_for_slot() takes a @once_per_schedule function with @enqueue_on(queue) "
            f"above it; got {func!r}"
        )
    utc = schedules.normalize_slot(slot)
    options = dict(target.options)
    retry = options.get("retry")
    meta = {SLOT_META: utc.isoformat(), RETRY_MAX_META: retry.max if retry is not None else 0}
    if backfill_enqueued():
        meta[BACKFILL_META] = True
    job_id = job_id_for(task_name_of(func), utc)
    queue = target.resolve()
    # Run in the work horse after the job, whatever its end: the check-ins it queued are
    # sent before RQ's os._exit (see worker.flush_checkins).
    after = Callback(FLUSH_CALLBACK)
    try:
        return queue.enqueue_call(
            func,
            args=args,
            kwargs=kwargs,
            job_id=job_id,
            meta=meta,
            unique=True,
            on_success=after,
            on_failure=after,
            on_stopped=after,
            **options,
        )
    except DuplicateJobError:
        logger.info(
            "taskguard %s slot %s: RQ job %s exists already; not enqueued again",
            task_name_of(func),
            utc.isoformat(),
            job_id,
            extra=log_fields("rq.job_exists", task=task_name_of(func), slot=utc),
        )
        return None


def _enqueue(func: Any, slot: datetime) -> str:
    job = enqueue_for_slot(func, slot)
    target = target_of(func)
    queue = target.name if target is not None else "?"
    if job is None:
        return f"RQ job {job_id_for(task_name_of(func), slot)} exists already on {queue!r}"
    return f"RQ job {job.id} on queue {queue!r}"


def _find(value: Any) -> registry.Queued | None:
    """A ``@enqueue_on`` function: its slots go to its RQ queue (``run_schedules --enqueue``)."""
    if target_of(value) is None or guarded_policy(value) is None:
        return None
    return registry.Queued(func=value, enqueue=functools.partial(_enqueue, value))


def register() -> None:
    """Let ``registry.discover`` find ``@enqueue_on`` functions (idempotent)."""
    if _find not in registry.QUEUE_FINDERS:
        registry.QUEUE_FINDERS.append(_find)
