"""Worker side: ``TaskguardMiddleware`` tells a guarded actor's function which message it runs.

The middleware notes the message a worker thread is about to process; the slot source
(:func:`dramatiq_call_context`, registered in ``SLOT_SOURCES``) reads its options when the
actor's function is a guarded one: the slot it was sent for, its identity for
``guard.begin`` (message id and retry count), and how Dramatiq's ``Retries`` middleware
will treat an exception (a retry follows: the attempt ends ``retrying`` and only that
retry starts the next attempt of the same row).
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from functools import partial
from typing import Any, NoReturn

from dramatiq import Actor, Broker, Middleware
from dramatiq.broker import MessageProxy
from dramatiq.common import q_name
from dramatiq.errors import ActorNotFound, Retry
from dramatiq.middleware import Retries, SkipMessage
from dramatiq.middleware.retries import DEFAULT_MAX_BACKOFF
from dramatiq.worker import Worker, WorkerThread

from ... import ledger
from ...context import active_run
from ...decorating import CallContext, dotted_name, guarded_policy
from ...endings import Ending
from ...logfields import log_fields
from ...signal_handlers import run_startup_cleanup
from ...states import RunState
from .options import (
    BACKFILL_OPTION,
    DEFERRED_OPTION,
    SLOT_OPTION,
    deferrals_of,
    message_key,
    retries_of,
    schedule_of,
)

logger = logging.getLogger("taskguard.dramatiq")

# The message this thread processes, with its broker (set by the middleware around it).
_processing: ContextVar[tuple[Broker, MessageProxy] | None] = ContextVar(
    "taskguard_dramatiq_message", default=None
)


class TaskguardMiddleware(Middleware):
    """Add it to the broker of every process that sends or runs guarded actors::

        broker.add_middleware(TaskguardMiddleware())

    (with django-dramatiq: ``"django_taskguard.contrib.dramatiq.TaskguardMiddleware"`` in
    ``DRAMATIQ_BROKER["MIDDLEWARE"]``). A worker's guarded actors then claim the slot their
    message carries; a worker process that boots runs the startup cleanup
    (``STARTUP_CLEANUP``); a worker thread that stops closes its ledger connection.
    """

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        _processing.set((broker, message))

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        _processing.set(None)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        _processing.set(None)

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        run_startup_cleanup()

    def before_worker_thread_shutdown(self, broker: Broker, thread: WorkerThread) -> None:
        # The ledger's connection of this thread, opened by its guarded calls: closed with
        # the thread, not left to the garbage collector (the database counts it until then).
        ledger.settle_connection()


def dramatiq_call_context() -> CallContext | None:
    """The slot source of guarded actors (registered in ``SLOT_SOURCES``).

    Answers only for the function of the actor whose message is being processed, when that
    function is a guarded one and no guarded run is active yet (a guarded function that
    the actor calls keeps its own name and slot). The run's name is the decorator's
    (``name=`` or the function's dotted path: what ``run_schedules --enqueue`` recorded),
    or a data schedule's identity.
    """
    processing = _processing.get()
    if processing is None or active_run() is not None:
        return None
    broker, message = processing
    try:
        actor = broker.get_actor(message.actor_name)
    except ActorNotFound:
        return None
    guarded: Any = actor.fn
    policy = guarded_policy(guarded)
    if policy is None:
        return None
    options = message.options
    schedule = schedule_of(options)
    retries = retries_of(options)
    slot = options.get(SLOT_OPTION)
    name = schedule[0] if schedule else getattr(guarded, "task_name", None) or dotted_name(guarded)
    # on_stale="retry": a copy that meets a live attempt is put back, so that it takes the
    # slot over if that attempt's owner turns out dead (under "abandon" it would only be
    # counted later instead of now).
    retry = policy.on_stale == "retry"
    return CallContext(
        slot=slot,
        task_name=schedule[0] if schedule else None,
        classify_raise=partial(classify_raise, broker, actor, message),
        on_busy=partial(put_back, broker, message, name, slot) if retry else None,
        message_id=message_key(message.message_id, retries),
        schedule_version=schedule[1] if schedule else None,
        backfill=bool(options.get(BACKFILL_OPTION)),
    )


def put_back(
    broker: Broker, message: MessageProxy, task_name: str, slot: Any, seconds_left: float
) -> NoReturn:
    """Send the message again, due once the live attempt's lease has run out, and skip this
    delivery (``endings.OnBusy``).

    The copy keeps the message id and retry count (it is the same message, not a retry of
    it) and counts the put-back in ``taskguard_deferred``. When it comes back, the slot has
    ended (the copy is a counted duplicate) or its owner is dead (its lease expired: the copy
    takes it over). ``SkipMessage`` acks this delivery without ``Retries`` seeing it: the
    worker treats it, raised while processing, as a skip.
    """
    delay = max(1.0, seconds_left + 1.0)
    again = message.copy(
        queue_name=q_name(message.queue_name),
        options={DEFERRED_OPTION: deferrals_of(message.options) + 1},
    )
    again.options.pop("eta", None)
    broker.enqueue(again, delay=int(delay * 1000))
    logger.warning(
        "taskguard: %s slot %s is held by a live attempt; message %s put back for %.1fs",
        task_name,
        slot,
        message.message_id,
        delay,
        extra=log_fields("message.deferred", task=task_name, slot=slot),
    )
    raise SkipMessage(f"taskguard: the slot is held by a live attempt; again in {delay:.1f}s")


def classify_raise(
    broker: Broker, actor: Actor[Any, Any], message: MessageProxy, exc: BaseException
) -> Ending | None:
    """What ``exc`` means to Dramatiq: a retry follows (``Retries`` will re-enqueue the
    message), or None (a failure).

    The same reading as ``Retries``' own: no ``Retries`` middleware, an exception in the
    actor's ``throws``, or no retries left (``retry_when``, else ``max_retries``) is a
    failure. ``retry_when`` is asked here and again by ``Retries``: it must give the same
    answer twice.
    """
    retrying = next((m for m in broker.middleware if isinstance(m, Retries)), None)
    if retrying is None:
        return None
    options = message.options
    throws = options.get("throws") or actor.options.get("throws")
    if throws and isinstance(exc, throws):
        return None
    retries = retries_of(options)
    retry_when = actor.options.get("retry_when", retrying.retry_when)
    if retry_when is not None:
        if not retry_when(retries, exc):
            return None
    else:
        default = actor.options.get("max_retries", retrying.max_retries)
        max_retries = options.get("max_retries", default)
        if max_retries is not None and retries >= max_retries:
            return None
    by = message_key(message.message_id, retries + 1)  # the retry: same id, one more retry
    if isinstance(exc, Retry):
        seconds = None if exc.delay is None else exc.delay / 1000
        return Ending(RunState.RETRYING, f"retry requested: {exc}", seconds, by)
    reason = f"{type(exc).__name__}: {exc}; a retry will follow (dramatiq Retries)"
    return Ending(RunState.RETRYING, reason, _longest_backoff(retrying, actor, options), by)


def _longest_backoff(retrying: Retries, actor: Actor[Any, Any], options: dict[str, Any]) -> float:
    """The longest delay (seconds) ``Retries`` may choose for this retry: its exponential
    backoff, doubled at most by its jitter, capped by ``max_backoff``."""
    low = options.get("min_backoff", actor.options.get("min_backoff", retrying.min_backoff))
    high = options.get("max_backoff", actor.options.get("max_backoff", retrying.max_backoff))
    high = min(high, DEFAULT_MAX_BACKOFF)
    retries = min(retries_of(options), 32)
    return float(min(low * 2**retries * 2, high)) / 1000
