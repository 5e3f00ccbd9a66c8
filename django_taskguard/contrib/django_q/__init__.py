"""django-q2 glue: guarded functions run by a ``qcluster``, retries and re-presentations.

A django-q2 ``Schedule`` hands its intended time to the function it calls through the
keyword argument its ``intended_date_kwarg`` names; the guarded function takes that slot
(``@once_per_schedule(cron=..., slot_kwarg="intended")``), so that several clusters'
schedulers, or one scheduler and a backed-up queue, run each slot once::

    @once_per_schedule(cron="*/5 * * * *", slot_kwarg="intended")
    def sync_prices(): ...

    Schedule.objects.create(
        func="myapp.jobs.sync_prices", schedule_type=Schedule.CRON, cron="*/5 * * * *",
        intended_date_kwarg="intended",
    )

What this module adds in the worker (registered when ``django_q`` is an installed app):

- the task's id is the message's identity (``guard.begin``'s ``message_id``): a broker that
  presents a task again after ``Q_CLUSTER["retry"]`` seconds (the ORM, SQS, IronMQ and
  MongoDB brokers do, while the first run goes on or after it failed) presents the same id;
- a raise is a ``retrying`` attempt when django-q2 will present the task again (the broker
  does that, ``ack_failure`` is off, and ``max_attempts`` is not reached): that
  presentation is the next attempt of the same row; any other copy is a counted duplicate.

``enqueue_for_slot(func, slot)`` enqueues a guarded function for a slot from code (the
slot travels as ``decorators.SLOT_KWARG``). ``on_django_q(func)`` instead of a django-q2
``Schedule``: ``run_schedules --enqueue`` hands each due slot of the function's own
``cron=``/``every=`` to django-q2 (any number of copies; one task per slot)::

    @once_per_schedule(every=timedelta(seconds=30))
    def refresh_rates(): ...

    refresh_rates_on_q = on_django_q(refresh_rates, group="rates")
"""

from __future__ import annotations

import functools
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ... import registry
from ...context import active_run
from ...decorating import SLOT_SOURCES, CallContext, dotted_name, guarded_policy
from ...decorators import carrying_slot
from ...endings import Ending
from ...exceptions import TaskGuardError
from ...states import RunState

__all__ = ["OnDjangoQ", "enqueue_for_slot", "on_django_q", "q_call_context", "register"]

# What on_django_q() passes on to async_task for each slot.
Q_OPTIONS = ("group", "timeout", "cluster", "hook", "ack_failure", "save", "task_name")

# The task a worker process is executing (django-q2's ``pre_execute`` to
# ``post_execute_in_worker``): the called function and the task's package.
_executing: ContextVar[tuple[Any, dict[str, Any]] | None] = ContextVar(
    "taskguard_django_q_task", default=None
)


def _started(sender: Any, func: Any = None, task: Any = None, **kwargs: Any) -> None:
    _executing.set((func, task) if isinstance(task, dict) else None)


def _ended(sender: Any, **kwargs: Any) -> None:
    _executing.set(None)


def q_call_context() -> CallContext | None:
    """The slot source for guarded functions run by a qcluster (in ``SLOT_SOURCES``).

    Answers only for the function the worker called, when it is guarded and no guarded
    run is active yet (a guarded function called from it keeps its own identity). It
    gives no slot: that comes with the call (``slot_kwarg=``, ``SLOT_KWARG``).
    """
    executing = _executing.get()
    if executing is None or active_run() is not None:
        return None
    func, task = executing
    if guarded_policy(func) is None or task.get("sync"):
        return None
    message = str(task.get("id") or "") or None
    return CallContext(
        classify_raise=functools.partial(classify_raise, task),
        instance=str(task.get("cluster") or "") or None,
        message_id=message,
    )


def classify_raise(task: dict[str, Any], exc: BaseException) -> Ending | None:
    """A raise that django-q2 answers by presenting the task again after ``retry``
    seconds: ``retrying``, and only that presentation (same task id) starts the next
    attempt. None (a failure) when nothing will come back."""
    from django_q.conf import Conf

    if not isinstance(exc, Exception) or task.get("ack_failure") or not _redelivers():
        return None
    if Conf.MAX_ATTEMPTS and _attempts_so_far(str(task.get("id"))) + 1 >= Conf.MAX_ATTEMPTS:
        return None
    reason = (
        f"{type(exc).__name__}: {exc}; django-q2 presents the task again after its "
        f"retry ({Conf.RETRY} s)"
    )
    return Ending(RunState.RETRYING, reason, float(Conf.RETRY), str(task.get("id")))


def _attempts_so_far(task_id: str) -> int:
    """How many runs of the task django-q2 has recorded (``Task.attempt_count``)."""
    from django_q.models import Task

    found = Task.objects.filter(id=task_id).values_list("attempt_count", flat=True).first()
    return int(found or 0)


@functools.lru_cache(maxsize=1)
def _redelivers() -> bool:
    """Whether this cluster's broker keeps a task until it is acknowledged (ORM, SQS,
    IronMQ, MongoDB) rather than handing it out once (Redis)."""
    from django_q.brokers import Broker, get_broker

    return type(get_broker()).acknowledge is not Broker.acknowledge


def enqueue_for_slot(func: Any, slot: datetime | str, /, *args: Any, **kwargs: Any) -> str:
    """Enqueue the guarded ``func`` (the function or its dotted path) on django-q2 to run
    for ``slot`` (an aware datetime or an ISO-8601 string with an offset); returns the task id.
    ``q_options``, ``group``, ``timeout`` ... pass through to ``async_task``."""
    from django_q.tasks import async_task

    if not isinstance(func, str) and guarded_policy(func) is None:
        raise TaskGuardError(
            f"enqueue_for_slot() takes a function decorated with @once_per_schedule; got {func!r}"
        )
    return str(async_task(func, *args, **carrying_slot(kwargs, slot)))


@dataclass(frozen=True)
class OnDjangoQ:
    """A scheduled guarded function whose slots ``run_schedules --enqueue`` hands to
    django-q2 (made by :func:`on_django_q`; found at module level, like a django.tasks task)."""

    func: Any
    q_options: dict[str, Any] = field(default_factory=dict)


def on_django_q(func: Any, /, **q_options: Any) -> OnDjangoQ:
    """Have ``run_schedules --enqueue`` run ``func``'s slots on django-q2; assign the result
    to a module-level name of a module taskguard discovers (an app's ``jobs``/``tasks``).
    ``q_options``: ``group``, ``timeout``, ``cluster``, ``hook``, ``ack_failure``, ``save``,
    ``task_name``, passed to ``async_task``."""
    if guarded_policy(func) is None or getattr(func, "schedule", None) is None:
        raise TaskGuardError(
            f"on_django_q() takes a function decorated with @once_per_schedule(cron=..., "
            f"every=... or schedule=...); got {func!r}"
        )
    unknown = sorted(set(q_options) - set(Q_OPTIONS))
    if unknown:
        raise TaskGuardError(
            f"on_django_q() passes {', '.join(Q_OPTIONS)} to async_task; not {', '.join(unknown)}"
        )
    return OnDjangoQ(func, dict(q_options))


def _enqueue(queued: OnDjangoQ, slot: datetime) -> str:
    task_id = enqueue_for_slot(dotted_name(queued.func), slot, **queued.q_options)
    return f"django-q2 task {task_id}"


def _find(value: Any) -> registry.Queued | None:
    if not isinstance(value, OnDjangoQ):
        return None
    return registry.Queued(func=value.func, enqueue=functools.partial(_enqueue, value))


def register() -> None:
    """Wire django-q2 in (idempotent): the worker's current task is the slot source's, and
    ``run_schedules --enqueue`` finds the functions given to :func:`on_django_q`."""
    from django_q.signals import post_execute_in_worker, pre_execute

    if q_call_context not in SLOT_SOURCES:
        SLOT_SOURCES.append(q_call_context)
    if _find not in registry.QUEUE_FINDERS:
        registry.QUEUE_FINDERS.append(_find)
    pre_execute.connect(_started, dispatch_uid="taskguard.django_q.started", weak=False)
    post_execute_in_worker.connect(_ended, dispatch_uid="taskguard.django_q.ended", weak=False)
