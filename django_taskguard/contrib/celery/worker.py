"""Worker side: the slot source of guarded Celery tasks, and how their retries go.

A guarded Celery task (``@shared_task`` over ``@once_per_schedule()``) takes
its slot from the ``taskguard_slot`` header and its identity from the Celery
task name plus the schedule name (:func:`decorating.task_identity`). Retries and
redeliveries of the message are attempts on the same row. A data schedule's message
(``taskguard_version``) is recorded under the schedule's identity, with its version.
"""

from __future__ import annotations

import logging
from datetime import datetime
from functools import partial
from typing import Any, NoReturn, cast

from celery import Task, current_app
from celery.exceptions import Ignore, Reject, Retry
from celery.signals import (
    task_postrun,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)
from django.utils import timezone

from ... import checkins, ledger, schedules
from ...conf import taskguard_settings
from ...context import active_run
from ...decorating import SLOT_SOURCES, CallContext, guarded_policy
from ...endings import Ending
from ...exceptions import TaskGuardError
from ...logfields import log_fields
from ...owner import actor
from ...signal_handlers import run_startup_cleanup
from ...states import RunState
from ...upkeep import Timer, maybe_upkeep
from .enqueue import retry_refusal
from .headers import (
    BACKFILL_HEADER,
    DEFERRED_HEADER,
    PERIODIC_TASK_HEADER,
    SCHEDULE_HEADER,
    SLOT_HEADER,
    VERSION_HEADER,
    from_celery,
    grace_of,
    message_headers,
    task_identity,
)

logger = logging.getLogger("taskguard.celery")


def celery_call_context() -> CallContext | None:
    """The slot source for guarded Celery tasks (registered in ``SLOT_SOURCES``).

    Answers only for the body of the Celery task being executed, and only when
    that body is a guarded function and no guarded run is active yet (so a
    guarded function called *from* a task body keeps its own name and slot).
    """
    task = current_app.current_task
    if task is None or active_run() is not None:
        return None
    body = getattr(task, "__wrapped__", None)  # the function given to @task
    if body is None or guarded_policy(body) is None:
        return None
    request = task.request
    headers = message_headers(request)
    schedule_name = headers.get(SCHEDULE_HEADER) or headers.get(PERIODIC_TASK_HEADER)
    name = task_identity(task.name, schedule_name)
    if request.called_directly:
        return CallContext(task_name=name)
    slot = headers.get(SLOT_HEADER)
    keyed = callable(getattr(body, "key_of", None))  # @once_per_key: no slot to find
    if slot is None and not keyed and getattr(body, "schedule", None) is None:
        record_no_slot(getattr(body, "task_name", None) or name, request)
    return CallContext(
        slot=slot,
        task_name=name,
        classify_raise=partial(classify_raise, task, request),
        instance=getattr(request, "hostname", None) or None,
        on_busy=partial(defer, task, request) if _may_be_stranded(request, headers) else None,
        message_id=_message_id(request),
        grace=grace_of(headers),
        backfill=bool(headers.get(BACKFILL_HEADER)),
        schedule_version=version_of(headers),
    )


def version_of(headers: dict[str, Any]) -> int | None:
    """A data schedule's ``taskguard_version`` header (None: not a data schedule's message).
    With it, the run is recorded under ``task[schedule]`` whatever ``name=`` the task has."""
    value = headers.get(VERSION_HEADER)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise TaskGuardError(
            f"the {VERSION_HEADER} header must be a whole number, not {value!r}"
        ) from None


def _message_id(request: Any, retries: int = 0) -> str | None:
    """The message's identity: its task id and retry count, ``retries`` more.

    Celery's retry (``Task.retry``, ``autoretry_for``) keeps the id and adds one to the
    count; a requeue (``Reject(requeue=True)``) and a put-back (:func:`defer`) keep both;
    another beat's copy has its own id. So a stale copy of an earlier message (a put-back
    or redelivery of the attempt that asked for the retry) is not the retry.
    """
    if not getattr(request, "id", None):
        return None
    return f"{request.id}/{int(request.retries or 0) + retries}"


def classify_raise(task: Task[Any, Any], request: Any, exc: BaseException) -> Ending | None:
    """What ``exc`` means to Celery: a retry follows, the call is dropped on purpose, or
    None (a failure).

    A retry follows ``self.retry()`` (``Retry``), ``Reject(requeue=True)`` and
    ``autoretry_for`` (minus ``dont_autoretry_for``) while retries are left
    (``retry_kwargs["max_retries"]`` or the task's ``max_retries``; None is
    unlimited). ``Ignore`` (which ``self.replace()`` raises too) and
    ``Reject(requeue=False)`` drop the call: ``skipped``, with the reason.
    """
    by = _message_id(request, retries=1)  # the retry Celery sends: same id, one more retry
    if isinstance(exc, Retry):
        return Ending(RunState.RETRYING, f"retry requested: {exc}", _seconds_until(exc.when), by)
    if isinstance(exc, Reject):
        if getattr(exc, "requeue", False):
            again = _message_id(request)  # the message itself, back in the queue
            return Ending(RunState.RETRYING, f"rejected and requeued: {exc}", retry_by=again)
        return Ending(RunState.SKIPPED, f"rejected by the task (celery Reject): {exc}")
    if isinstance(exc, Ignore):
        return Ending(RunState.SKIPPED, "ignored by the task (celery Ignore, or self.replace())")
    if request.called_directly:
        return None
    autoretry_for = tuple(getattr(task, "autoretry_for", ()) or ())
    if not autoretry_for or not isinstance(exc, autoretry_for):
        return None
    dont = tuple(getattr(task, "dont_autoretry_for", ()) or ())
    if dont and isinstance(exc, dont):
        return None
    retry_kwargs = getattr(task, "retry_kwargs", None) or {}
    max_retries = retry_kwargs.get("max_retries", task.max_retries)
    if max_retries is None or request.retries + 1 <= max_retries:
        reason = f"{type(exc).__name__}: {exc}; a retry will follow (autoretry_for)"
        delay = _autoretry_delay(task, request, retry_kwargs)
        jitter = getattr(task, "retry_backoff", False) and getattr(task, "retry_jitter", True)
        if retry_refusal(task, request, 0.0 if jitter else delay, max_retries) is not None:
            return None  # OnceTask.retry refuses it: the message would expire first
        return Ending(RunState.RETRYING, reason, delay, by)
    return None


def _seconds_until(when: Any) -> float | None:
    """A Celery retry's ``when`` (seconds, or an ETA) as seconds from now."""
    if isinstance(when, (int, float)) and not isinstance(when, bool):
        return max(float(when), 0.0)
    if isinstance(when, datetime):
        return max((when - timezone.now()).total_seconds(), 0.0)
    return None


def _autoretry_delay(task: Task[Any, Any], request: Any, retry_kwargs: dict[str, Any]) -> float:
    """The longest delay Celery's autoretry may pick for this retry (jitter only shortens it)."""
    if "countdown" in retry_kwargs:
        return float(retry_kwargs["countdown"])
    backoff = getattr(task, "retry_backoff", False)
    if backoff:
        factor = 1 if backoff is True else int(backoff)
        longest = float(getattr(task, "retry_backoff_max", 600) or 600)
        retries = int(request.retries or 0)
        return min(longest, factor * 2.0**retries)
    delay: float = float(task.default_retry_delay or 0)
    return delay


def _may_be_stranded(request: Any, headers: dict[str, Any]) -> bool:
    """A message that may be the only one left for its slot while another attempt's
    lease still runs: a broker redelivery (its worker may be dead), a message we
    put back before, or a retry (it may overtake the end of its own previous
    attempt). Such a message is put back, never acked as a duplicate."""
    if request.is_eager:
        return False
    redelivered = bool((request.delivery_info or {}).get("redelivered"))
    return redelivered or DEFERRED_HEADER in headers or bool(request.retries)


def defer(task: Task[Any, Any], request: Any, seconds_left: float) -> NoReturn:
    """Put the message back until the live attempt's lease has run out.

    Republishes the same task id with the same headers (and the same retry
    count: this is not a Celery retry of the body) and a countdown, then raises
    ``Retry`` so the worker acks this copy. When it comes back, the slot has
    either ended (the message is a plain duplicate) or its owner is dead (the
    lease expired: on_stale decides, takeover or ``abandoned``).
    """
    countdown = max(1.0, seconds_left + 1.0)
    headers = dict(request.headers or {})
    headers.update(message_headers(request))
    headers[DEFERRED_HEADER] = int(headers.get(DEFERRED_HEADER) or 0) + 1
    signature = task.signature_from_request(
        request, request.args, request.kwargs, countdown=countdown, headers=headers
    )
    signature.apply_async()
    logger.warning(
        "taskguard: %s slot %s is held by a live attempt; message %s (redelivered or "
        "retried) put back for %.1fs",
        task.name,
        headers.get(SLOT_HEADER),
        request.id,
        countdown,
        extra=log_fields("message.deferred", task=task.name, slot=headers.get(SLOT_HEADER)),
    )
    raise Retry(
        f"taskguard: the slot is held by a live attempt; checking again in {countdown:.1f}s",
        when=cast(Any, countdown),
        sig=signature,
    )


def record_no_slot(task_name: str, request: Any) -> NoReturn:
    """Record a message that has no slot as a ``skipped`` run, then raise.

    The row is keyed by the time the worker received the message (there is no
    slot to key it by); its reason says which task id came without a slot.
    """
    reason = (
        f"no slot: message {request.id} carried no {SLOT_HEADER} header (not sent by a "
        f"taskguard beat scheduler) and the task has no cron=, every= or schedule="
    )
    ledger.ensure_autocommit()
    run_id = ledger.insert_skipped(task_name, timezone.now(), reason=reason, actor=actor("worker"))
    recorded = f"recorded as run {run_id}" if run_id is not None else "not recorded"
    raise TaskGuardError(f"{task_name!r} did not run: {reason} ({recorded})")


def upkeep_after_task(**kwargs: Any) -> None:
    """After a task ended (its result stored), in the process that ran it (a prefork child
    too): the upkeep, in a thread, when this process is due to attempt it."""
    maybe_upkeep()


# The worker's main process attempts the upkeep at its interval whether or not tasks come:
# an idle worker (or a prefork parent, whose tasks run in its children) still sweeps.
TIMER = Timer()


def start_upkeep_timer(**kwargs: Any) -> None:
    """``worker_ready``: in the worker's main process (a prefork pool's parent; the one
    process of solo and threads pools), whether or not tasks come."""
    TIMER.start()


def stop_upkeep_timer(**kwargs: Any) -> None:
    """``worker_shutdown`` (a warm shutdown): no thread is left behind, and an upkeep under
    way is recorded (at most 30 s)."""
    TIMER.stop()


def flush_checkins(**kwargs: Any) -> None:
    """A prefork pool process leaves through ``os._exit`` (no ``atexit``): its queued
    check-ins are sent first, for at most the check-ins' ``timeout``."""
    settings = taskguard_settings.CHECKINS
    if settings:
        checkins.flush(float(settings.get("timeout", 5)))


def register() -> None:
    """Wire Celery in (idempotent): guarded tasks find their slot in the message,
    ``schedule=`` takes a celery ``crontab``/``schedule``, a worker that is ready runs
    the startup cleanup (``STARTUP_CLEANUP``) and the upkeep's timer, and a task that ended
    may start the upkeep."""
    if celery_call_context not in SLOT_SOURCES:
        SLOT_SOURCES.append(celery_call_context)
    if from_celery not in schedules.TRANSLATORS:
        schedules.TRANSLATORS.append(from_celery)
    worker_ready.connect(run_startup_cleanup, dispatch_uid="taskguard.startup_cleanup")
    worker_ready.connect(start_upkeep_timer, dispatch_uid="taskguard.upkeep_timer", weak=False)
    worker_shutdown.connect(stop_upkeep_timer, dispatch_uid="taskguard.upkeep_timer", weak=False)
    task_postrun.connect(upkeep_after_task, dispatch_uid="taskguard.upkeep", weak=False)
    worker_process_shutdown.connect(flush_checkins, dispatch_uid="taskguard.checkins", weak=False)
