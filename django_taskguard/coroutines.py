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
until its lease lapsed); then the ``CancelledError`` is raised. An attempt cancelled
before its function started gives its slot or key back (``Attempt.give_back``: nothing
ran); one cancelled in its function is recorded like any interrupted one.

When nobody can wait any more (the loop is closing and cancels the step too, or the
coroutine is closed and never resumed), every step that ends an attempt still runs:
an attempt claimed meanwhile is given back by the claiming thread itself if it has not
handed the attempt over yet, else in a thread of its own; a finish (``returned``,
``raised``, a give-back) the loop cancelled before a worker thread took it runs in a
thread of its own (each such step runs once, whichever thread takes it first; when no
thread can be started, on the loop's thread; an error of such a step is logged, there is
nobody to raise it to). A claim the coroutine gave up on before it was opened is given
back without ``run_started``. No attempt is left ``running`` with a live heartbeat.

The steps run on one bounded pool of threads for the whole process (not the loop's
default executor): its threads outlive event loops, so a connection kept by
``CONN_MAX_AGE`` is reused instead of piling up with every ``asyncio.run``, and the
number of connections the ledger holds is bounded.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from asgiref.sync import AsyncToSync, sync_to_async
from django.db import close_old_connections

from . import ledger
from .context import calling
from .guard import REFUSED, Attempt, Refused, Started, not_started_reason
from .logfields import log_fields
from .process import per_process
from .upkeep import maybe_upkeep

T = TypeVar("T")
R = TypeVar("R")

logger = logging.getLogger("taskguard.guard")

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
    call returns (``None``, a key's stored result). Afterwards, as a plain guarded call
    does, :func:`upkeep.maybe_upkeep` (a clock read; at most once per interval a thread).
    """
    try:
        return await _execute(begin, func, args, kwargs)
    finally:
        maybe_upkeep()


async def _execute(
    begin: Begin,
    func: Callable[..., Awaitable[R]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> R | None:
    await _refuse_in_callers_transaction()
    handoff = _Handoff(begin)
    try:
        started, cancelled = await _settled(handoff.open)
    except BaseException:
        handoff.give_up()  # nobody will see a claim made meanwhile through: it is ended
        raise
    if isinstance(started, Refused):
        if cancelled is not None:
            raise cancelled
        return started.result  # type: ignore[no-any-return]
    if cancelled is not None:  # cancelled while claiming: the function never started
        await _ending(functools.partial(started.give_back, not_started_reason(cancelled)))
        raise cancelled
    with calling(started.active):
        try:
            result = await func(*args, **kwargs)
        except GeneratorExit as exc:  # closed, never to be resumed: no awaiting now
            _elsewhere(functools.partial(started.raised, exc))
            raise
        except BaseException as exc:  # CancelledError too: recorded, then raised
            await _ending(functools.partial(started.raised, exc))
            raise
    returned, cancelled = await _ending(functools.partial(started.returned, result))
    if cancelled is not None:  # recorded succeeded; the caller still asked to cancel
        raise cancelled
    return returned


async def _refuse_in_callers_transaction() -> None:
    """Refuse a claim inside the transaction of the sync code that called us.

    Django's connections are per thread: the worker threads never see the caller's
    ``atomic`` block. Sync code that ran ``asyncio.run()`` is this loop's own thread:
    the check runs here, on that thread's sync connection (no I/O). A caller that
    reached this coroutine through ``async_to_sync`` has a sync thread waiting for it,
    where its transaction lives: the check runs there too.
    """
    _outside_the_loop(ledger.ensure_autocommit)  # asyncio.run() from sync code
    executors = getattr(AsyncToSync, "executors", None)  # asgiref's: set by async_to_sync
    if executors is None or hasattr(executors, "current"):
        await sync_to_async(ledger.ensure_autocommit, thread_sensitive=True)()


def _outside_the_loop(check: Callable[[], None]) -> None:
    """Run ``check`` (no await) as the sync code of this thread.

    Django's connections are asgiref ``Local(thread_critical=True)``: code on a running
    loop sees connections of its own, not those of the sync code that started the loop
    (``asyncio.run()``), where that code's transaction lives; and Django refuses blocking
    ORM calls while a loop runs in the thread. asyncio's running-loop marker is lifted for
    the call: nothing else runs on the loop meanwhile, and it is put back before returning.
    This uses ``asyncio._set_running_loop``, a private function (the hook event loops
    themselves use): asyncio has no public way to make a thread that runs a loop look like
    plain sync code for one call (``loop.run_in_executor`` would change threads, and so
    connections).
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no loop runs here (a coroutine closed by the garbage collector)
        check()
        return
    asyncio._set_running_loop(None)
    try:
        check()
    finally:
        asyncio._set_running_loop(loop)


class _Handoff:
    """The claim, made in a worker thread, handed to the awaiting coroutine; or, when
    the coroutine gave up waiting, ended by whichever side finds the other gone."""

    def __init__(self, begin: Begin) -> None:
        self._begin = begin
        self._lock = threading.Lock()
        self._gave_up = False
        self._delivered: Attempt | None = None

    def open(self) -> Started:
        """In the worker thread: claim and open the attempt, and hand it over. A claim the
        coroutine gave up on meanwhile is not made, or given back before it is opened (no
        ``run_started`` for it)."""
        if self._gave_up:
            return REFUSED
        started = self._begin()
        if not isinstance(started, Attempt):
            return started
        if self._gave_up:
            started.give_back(_GAVE_UP)
            return REFUSED
        if not started.open():
            return REFUSED
        with self._lock:
            if not self._gave_up:
                self._delivered = started
                return started
        started.give_back(_GAVE_UP)  # nobody awaits it, and its function never started
        return REFUSED

    def give_up(self) -> None:
        """On the loop: the coroutine will not see the claim through."""
        with self._lock:
            self._gave_up = True
            delivered, self._delivered = self._delivered, None
        if delivered is not None:  # handed over, but the result never reached us
            _elsewhere(functools.partial(delivered.give_back, _GAVE_UP))


_GAVE_UP = not_started_reason(asyncio.CancelledError())


class _Once(Generic[T]):
    """A step that runs at most once, in whichever thread takes it first (None: taken)."""

    def __init__(self, step: Callable[[], T]) -> None:
        self._step = step
        self._taken = threading.Lock()

    def __call__(self) -> T | None:
        if not self._taken.acquire(blocking=False):
            return None
        return self._step()


async def _ending(step: Callable[[], T]) -> tuple[T | None, asyncio.CancelledError | None]:
    """:func:`_settled` for a step that ends an attempt, which must run whatever happens to
    the loop: when the loop cancels the step itself (it is closing, maybe before a worker
    thread took the step) or the coroutine is closed, it runs in a thread of its own."""
    once = _Once(step)
    try:
        return await _settled(once)
    except (asyncio.CancelledError, GeneratorExit):  # the step's own cancellation, or closed
        _elsewhere(once)
        raise


def _elsewhere(step: Callable[[], object]) -> None:
    """Run ``step`` in a thread of its own: the loop can no longer wait for it (a non-daemon
    thread, so that the process waits for the record). When no thread can be started, it
    runs here, on the loop's thread: late, but recorded."""
    thread = threading.Thread(target=_logged, args=(step,), name="taskguard-end")
    try:
        thread.start()
    except RuntimeError:  # "can't start new thread"
        logger.warning(
            "taskguard could not start a thread to end an attempt; ending it here",
            extra=log_fields("attempt.end_failed"),
        )
        _outside_the_loop(functools.partial(_logged, step))


def _logged(step: Callable[[], object]) -> None:
    """:func:`_step`, its error logged: nobody awaits it (not threading.excepthook's print)."""
    try:
        _step(step)
    except Exception:
        logger.exception(
            "taskguard could not end an attempt after its event loop ended",
            extra=log_fields("attempt.end_failed"),
        )


# The worker threads of every guarded coroutine call in this process (made per process:
# a forked child makes its own). Bounded like asyncio's default executor.
_POOL_SIZE = min(32, (os.cpu_count() or 1) + 4)
_pool = per_process(lambda: ThreadPoolExecutor(_POOL_SIZE, thread_name_prefix="taskguard"))
_pool_lock = threading.Lock()  # one pool per process, even when two threads ask at once


def _executor() -> ThreadPoolExecutor:
    with _pool_lock:
        return _pool.get()


async def _settled(step: Callable[[], T]) -> tuple[T, asyncio.CancelledError | None]:
    """Run the blocking ``step`` in a worker thread and wait for its end, even when this
    task is cancelled meanwhile; returns its result and that cancellation (if any).

    An exception of the step is raised (it wins over a cancellation).
    """
    call = sync_to_async(_step, thread_sensitive=False, executor=_executor())
    future = asyncio.ensure_future(call(step))
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
