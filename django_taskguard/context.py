"""The attempt in progress, as seen from inside the guarded function."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property

from . import ledger
from .exceptions import LeaseLost, TaskGuardError
from .logfields import run_log_fields
from .models import TaskRun
from .owner import token_of
from .signals import lease_lost

logger = logging.getLogger("taskguard.guard")


@dataclass
class ActiveRun:
    """One live attempt of one (task, slot) or (task, key): what ``current_run()`` returns."""

    id: int
    task_name: str
    slot: datetime
    attempt: int
    fence: int
    owner: str
    lease_seconds: float
    deadline: float = 0.0  # time.monotonic() by which the lease must be renewed
    key: str | None = None  # an @once_per_key run's key (its slot: when the key was claimed)
    # The state the claim found the row in ("pending" for a row it created), and the message
    # that carried it: what a give-back restores (``ledger.give_back``).
    claimed_from: str = "pending"
    message_id: str | None = None
    lost: threading.Event = field(default_factory=threading.Event)
    lost_reason: str = ""
    # Set once the attempt's end is recorded: a task the coroutine spawned (it inherits
    # current_run()) or a thread that outlived the call learns it holds nothing any more.
    ended: threading.Event = field(default_factory=threading.Event)
    _lost_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.deadline:
            self.deadline = time.monotonic() + self.lease_seconds

    @property
    def token(self) -> str:
        return token_of(self.owner)

    @cached_property
    def run(self) -> TaskRun:
        """The ``TaskRun`` row (read from the ledger's database on first access)."""
        return ledger.runs().get(pk=self.id)

    def lease_valid(self) -> bool:
        return not self.lost.is_set() and time.monotonic() < self.deadline

    def mark_lost(self, reason: str) -> bool:
        """Record that this attempt lost its lease: sticky, and ``lease_lost`` is sent once.

        Called by the heartbeat, by ``check()`` past the deadline and by a
        finish that the fence refused, from whichever thread sees it first.
        Returns True for that first caller only.
        """
        with self._lost_lock:
            if self.lost.is_set():
                return False
            self.lost_reason = reason
            self.lost.set()
        logger.error(
            "taskguard run %s (%s) lost its lease: %s",
            self.id,
            self.task_name,
            reason,
            extra=run_log_fields("lease.lost", self, reason=reason),
        )
        try:
            lease_lost.send(sender=self.task_name, run=self)
        except Exception:
            logger.exception(
                "a lease_lost receiver failed",
                extra=run_log_fields("receiver.failed", self, reason="lease_lost"),
            )
        return True

    def check(self) -> None:
        """Raise ``LeaseLost`` if this attempt may no longer hold its lease.

        Call it before side effects that must not happen twice; pass
        ``fence`` along to stores that can reject stale writers. Once it has
        raised, it keeps raising (a renewal that comes back late does not undo
        what the caller was told).
        """
        if self.ended.is_set():
            raise LeaseLost(
                f"{self.task_name!r} slot {self.slot.isoformat()} attempt {self.attempt} "
                f"(fence {self.fence}) has ended: it holds no lease any more"
            )
        if not self.lease_valid():
            self.mark_lost("the lease was not renewed before its deadline")
            reason = self.lost_reason
            raise LeaseLost(
                f"{self.task_name!r} slot {self.slot.isoformat()} attempt {self.attempt} "
                f"(fence {self.fence}) lost its lease: {reason}"
            )


_current: ContextVar[ActiveRun | None] = ContextVar("taskguard_current_run", default=None)


@contextmanager
def activate(run: ActiveRun) -> Iterator[ActiveRun]:
    """Make ``run`` what ``current_run()`` returns for the block (and reset it after)."""
    token = _current.set(run)
    try:
        yield run
    finally:
        # ValueError: left from another context. A coroutine the garbage collector closes
        # runs its ``finally`` there; the value was set in the coroutine's own context,
        # which is gone, and this one never saw it: nothing to undo.
        with suppress(ValueError):
            _current.reset(token)


# Called as a guarded function starts, in its caller's context (its thread; the awaiting
# task's context for a coroutine function); returns what to call as it ends, in that same
# context, or None. ``OPENTELEMETRY`` registers one: the attempt's span made current.
FunctionHook = Callable[[ActiveRun], "Callable[[], None] | None"]
_function_hooks: list[FunctionHook] = []


def add_function_hook(hook: FunctionHook) -> None:
    """Call ``hook`` around every guarded function from now on (once, however often added)."""
    if hook not in _function_hooks:
        _function_hooks.append(hook)


def remove_function_hook(hook: FunctionHook) -> None:
    """Stop calling ``hook`` (nothing happens if it was not added)."""
    with suppress(ValueError):
        _function_hooks.remove(hook)


@contextmanager
def calling(run: ActiveRun) -> Iterator[ActiveRun]:
    """:func:`activate` ``run`` around the guarded function itself, with the function
    hooks. A hook that fails is logged and the function runs anyway."""
    undo: list[Callable[[], None]] = []
    with activate(run):
        for hook in tuple(_function_hooks):
            try:
                done = hook(run)
            except Exception:
                logger.exception(
                    "a taskguard function hook failed (run %s)",
                    run.id,
                    extra=run_log_fields("hook.failed", run, reason="function hook"),
                )
                continue
            if done is not None:
                undo.append(done)
        try:
            yield run
        finally:
            for done in reversed(undo):
                try:
                    done()
                except Exception:
                    logger.exception(
                        "a taskguard function hook failed to end (run %s)",
                        run.id,
                        extra=run_log_fields("hook.failed", run, reason="function hook end"),
                    )


def active_run() -> ActiveRun | None:
    """The attempt the calling code runs under, or None outside a guarded call."""
    return _current.get()


def current_run() -> ActiveRun:
    """Return the attempt the calling code runs under; raise outside a guarded call."""
    run = _current.get()
    if run is None:
        raise TaskGuardError("current_run() is only available inside a guarded function")
    return run
