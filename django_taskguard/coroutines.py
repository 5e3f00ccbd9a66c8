"""A guarded call of a coroutine function: the claim and the end off the event loop.

The steps are :mod:`guard`'s (``begin``, ``Attempt.open``, ``returned``/``raised``),
shared with the plain path; only where they run differs. Each blocking step runs
in a worker thread through asgiref's ``sync_to_async(thread_sensitive=False)``:
the loop's default executor, one Django connection per worker thread, closed or
kept after each step as ``CONN_MAX_AGE`` says (Django's ``close_old_connections``,
as around a request). Not ``thread_sensitive=True``: that is one thread for the
whole process, so many tasks on one loop would claim one after another, and one
claim stuck on a locked row would hold up every other claim, and every ORM call of
the site's async views with it. The steps need no particular thread: a claim is
its own short transaction, and the heartbeat renews leases from its own threads.

The coroutine itself is awaited on the loop, with ``current_run()`` set in its
task's context. A step in flight when the task is cancelled is waited for (a
thread cannot be stopped, and a claim nobody sees through would hold its slot
until its lease lapsed); then the attempt is recorded like any interrupted one
and the ``CancelledError`` is raised.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from .context import activate
from .guard import REFUSED, Attempt, Refused, Started

T = TypeVar("T")
R = TypeVar("R")

Begin = Callable[[], Started]


async def execute(
    begin: Begin,
    func: Callable[..., Awaitable[R]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> R | None:
    """Await ``func(*args, **kwargs)`` once for the slot or key that ``begin`` claims.

    ``begin`` is blocking (Redis, the database) and runs in a worker thread, like the
    attempt's end. Returns what the plain path returns: the result, or what a refused
    call returns (``None``, a key's stored result).
    """
    started, cancelled = await _settled(functools.partial(_open, begin))
    if isinstance(started, Refused):
        if cancelled is not None:
            raise cancelled
        return started.result  # type: ignore[no-any-return]
    if cancelled is not None:  # cancelled while claiming: the function never started
        await _settled(functools.partial(started.raised, cancelled))
        raise cancelled
    with activate(started.active):
        try:
            result = await func(*args, **kwargs)
        except BaseException as exc:  # CancelledError too: recorded, then raised
            await _settled(functools.partial(started.raised, exc))
            raise
    returned, cancelled = await _settled(functools.partial(started.returned, result))
    if cancelled is not None:  # recorded succeeded; the caller still asked to cancel
        raise cancelled
    return returned


def _open(begin: Begin) -> Started:
    started = begin()
    if isinstance(started, Attempt) and not started.open():
        return REFUSED
    return started


async def _settled(step: Callable[[], T]) -> tuple[T, asyncio.CancelledError | None]:
    """Run the blocking ``step`` in a worker thread and wait for its end, even when this
    task is cancelled meanwhile; returns its result and that cancellation (if any).

    An exception of the step is raised (it wins over a cancellation).
    """
    future = asyncio.ensure_future(sync_to_async(_step, thread_sensitive=False)(step))
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            return await asyncio.shield(future), cancelled
        except asyncio.CancelledError as exc:
            if future.cancelled():  # the step itself was cancelled (the loop is closing)
                raise
            cancelled = exc


def _step(step: Callable[[], T]) -> T:
    """One blocking step in a worker thread, its connections handled as around a request."""
    close_old_connections()
    try:
        return step()
    finally:
        close_old_connections()
