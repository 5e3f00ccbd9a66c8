"""Sender side: a guarded actor's message for a slot, and ``run_schedules --enqueue``'s way
to its actors (a ``registry.QUEUE_FINDERS`` recogniser).

``@dramatiq.actor`` goes on top, the guard under it, so that the worker calls the
guarded function::

    @dramatiq.actor(max_retries=3)
    @once_per_schedule(every=timedelta(minutes=5))
    def sync(): ...
"""

from __future__ import annotations

import functools
from datetime import datetime
from inspect import iscoroutinefunction
from typing import Any

from dramatiq import Actor, Message

from ... import registry
from ...decorating import guarded_policy
from ...exceptions import TaskGuardError
from .middleware import TaskguardMiddleware
from .options import message_options


def scheduled_function(value: Any) -> Any:
    """The ``@once_per_schedule`` function a Dramatiq actor wraps, or None (for a coroutine
    function, the guarded one that Dramatiq's own wrapper calls)."""
    if not isinstance(value, Actor):
        return None
    func = value.fn
    inner = getattr(func, "__wrapped__", None)
    if iscoroutinefunction(inner) and guarded_policy(inner) is not None:
        func = inner
    if guarded_policy(func) is None or not callable(getattr(func, "run_for_slot", None)):
        return None
    return func


def send_for_slot(actor: Any, slot: datetime | str, /, *args: Any, **kwargs: Any) -> Message[Any]:
    """Send ``actor`` (``@dramatiq.actor`` over ``@once_per_schedule``) a message to run for
    ``slot`` (an aware datetime or an ISO-8601 string with an offset).

    The slot travels in the message's options; the worker's call claims it, not the slot
    current when it runs. The actor's broker must have :class:`TaskguardMiddleware` (the
    workers' broker too). Returns the enqueued message.
    """
    if scheduled_function(actor) is None:
        raise TaskGuardError(
            "send_for_slot() takes a Dramatiq actor whose function is decorated with "
            f"@once_per_schedule (@dramatiq.actor on top); got {actor!r}"
        )
    if not any(isinstance(m, TaskguardMiddleware) for m in actor.broker.middleware):
        raise TaskGuardError(
            f"the broker of {actor.actor_name!r} has no TaskguardMiddleware: its workers would "
            "not know which slot a message is for. broker.add_middleware(TaskguardMiddleware())"
        )
    options = message_options(slot)
    message: Message[Any] = actor.send_with_options(args=args, kwargs=kwargs, **options)
    return message


def _enqueue(actor: Actor[Any, Any], slot: datetime) -> str:
    message = send_for_slot(actor, slot)
    return f"dramatiq message {message.message_id} to actor {actor.actor_name!r}"


def _find(value: Any) -> registry.Queued | None:
    func = scheduled_function(value)
    if func is None:
        return None
    return registry.Queued(func=func, enqueue=functools.partial(_enqueue, value))


def register() -> None:
    """Let ``run_schedules --enqueue`` send the slots of schedules that Dramatiq actors
    wrap to those actors (idempotent)."""
    if _find not in registry.QUEUE_FINDERS:
        registry.QUEUE_FINDERS.append(_find)
