"""Consumer side: which Huey task carries a guarded call, and what its retries mean.

Huey has no "current task" of its own: :func:`install` adds a pre-execute and a
post-execute hook to a Huey instance (public ``Huey.pre_execute`` / ``post_execute``),
which note the task a consumer thread is running (the post-execute hook also starts the
upkeep when this process is due, as Celery's ``task_postrun`` does), and a start-up hook
(``Huey.on_startup``, each worker) for the startup cleanup of this host's dead runs.
The guard's slot source (:func:`huey_call_context`, in ``decorating.SLOT_SOURCES``) then
gives the call its message and its retry rule:

- the message is the task id and its retries left (``"<id>/<retries>"``): Huey's retry
  of a failed task is the same id with one retry fewer, so the retry is the attempt
  that follows, on the same row; any other copy of the message is a duplicate;
- an exception while retries are left (``@huey.task(retries=n)``), ``RetryTask`` and
  ``CancelExecution(retry=True)`` end the attempt ``retrying``: Huey sends the next one;
  ``CancelExecution`` without a retry ends it ``skipped``; the last failure, ``failed``.

The slot itself travels in the task's keyword arguments (``SLOT_KWARG``), popped by the
guarded function: nothing here recomputes it.
"""

from __future__ import annotations

import threading
from datetime import datetime, timezone
from functools import partial
from typing import Any

from huey.exceptions import CancelExecution, RateLimitExceeded, RetryTask

from ...context import active_run
from ...decorating import CallContext
from ...endings import Ending
from ...signal_handlers import run_startup_cleanup
from ...states import RunState
from ...upkeep import maybe_upkeep

HOOK = "taskguard"  # the name of the hooks install() adds (Huey keeps one per name)

_current = threading.local()  # .task: the Huey task this consumer thread runs


def install(huey: Any) -> None:
    """Let guarded functions that ``huey``'s consumer runs know their task (idempotent).

    Needed where a guarded function runs under ``@huey.task(retries=...)``: without it a
    retry finds its slot ``failed`` and counts as a duplicate. ``huey.contrib.djhuey``'s
    instance is installed by the app itself; call this for a Huey instance of your own,
    next to where you create it.
    """
    huey.pre_execute(name=HOOK)(_executing)
    huey.post_execute(name=HOOK)(_executed)
    huey.on_startup(name=HOOK)(run_startup_cleanup)


def _executing(task: Any) -> None:
    _current.task = task


def _executed(task: Any, value: Any, exception: BaseException | None) -> None:
    """After a task: forget it, and start the upkeep (a thread) when this process is due."""
    _current.task = None
    maybe_upkeep()


def current_task() -> Any:
    """The Huey task this thread is executing (under an installed instance), or None."""
    return getattr(_current, "task", None)


def huey_call_context() -> CallContext | None:
    """The slot source for calls inside a Huey task (registered in ``SLOT_SOURCES``).

    Answers only while a Huey task runs in this thread and no guarded run is active yet
    (a guarded function called from a guarded body keeps its own rules). It names no
    slot and no task: the slot travels in the task's keyword arguments, and the
    function's own name is its task name.
    """
    task = current_task()
    if task is None or active_run() is not None:
        return None
    return CallContext(classify_raise=partial(classify_raise, task), message_id=message_id(task))


def message_id(task: Any, retries: int | None = None) -> str:
    """The message's identity: the task id and its retries left (``retries`` instead)."""
    left = task.retries if retries is None else retries
    return f"{task.id}/{int(left or 0)}"


def classify_raise(task: Any, exc: BaseException) -> Ending | None:
    """What ``exc`` means to Huey (its ``Huey._execute``): a retry follows, the task was
    cancelled on purpose, or None (a failure: no retries left).

    Huey counts retries down: a retry of a failure has one fewer; ``RetryTask`` (and a
    rate limit that retries) adds one before taking one, so its retry has as many.
    """
    left = int(task.retries or 0)
    if isinstance(exc, RetryTask):
        delay = exc.delay if exc.delay is not None else _until(exc.eta, task.retry_delay)
        return _retry(task, left, f"retry requested (huey RetryTask): {exc}", delay)
    if isinstance(exc, CancelExecution):
        if exc.retry or (exc.retry is None and left):
            return _retry(task, max(left, 1) - 1, f"cancelled, to be retried: {exc}")
        return Ending(RunState.SKIPPED, f"cancelled by the task (huey CancelExecution): {exc}")
    if isinstance(exc, RateLimitExceeded) and (exc.retry or left):
        # Huey waits retry_delay, else the limit's own delay, for either retry.
        delay = task.retry_delay or exc.delay
        return _retry(task, left if exc.retry else left - 1, f"rate limited: {exc}", delay)
    if left and isinstance(exc, Exception):
        reason = f"{type(exc).__name__}: {exc}; a retry will follow ({left} left)"
        return _retry(task, left - 1, reason)
    return None


def _until(eta: datetime | None, otherwise: float | None) -> float | None:
    """Seconds from now to a Huey ``eta`` (naive: this process's local time, as Huey's
    ``normalize_time`` reads it, utc or not; Django sets it to TIME_ZONE; aware: as given)."""
    if eta is None:
        return otherwise
    if eta.tzinfo is None:
        eta = eta.astimezone()
    return max((eta - datetime.now(timezone.utc)).total_seconds(), 0.0)


def _retry(task: Any, left: int, reason: str, delay: float | None = None) -> Ending:
    within = float(delay if delay is not None else task.retry_delay or 0)
    return Ending(RunState.RETRYING, reason, within, message_id(task, left))
