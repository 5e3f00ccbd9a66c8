"""The attempt in progress, as seen from inside the guarded function."""

from __future__ import annotations

import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property

from .exceptions import LeaseLost, TaskGuardError
from .models import TaskRun


@dataclass
class ActiveRun:
    """One live attempt of one (task, slot): what ``current_run()`` returns."""

    id: int
    task_name: str
    slot: datetime
    attempt: int
    fence: int
    owner: str
    lease_seconds: float
    deadline: float = 0.0  # time.monotonic() by which the lease must be renewed
    lost: threading.Event = field(default_factory=threading.Event)
    lost_reason: str = ""

    def __post_init__(self) -> None:
        if not self.deadline:
            self.deadline = time.monotonic() + self.lease_seconds

    @property
    def token(self) -> str:
        return self.owner.rsplit(":", 1)[-1]

    @cached_property
    def run(self) -> TaskRun:
        """The ``TaskRun`` row (read from the database on first access)."""
        return TaskRun.objects.get(pk=self.id)

    def lease_valid(self) -> bool:
        return not self.lost.is_set() and time.monotonic() < self.deadline

    def check(self) -> None:
        """Raise ``LeaseLost`` if this attempt may no longer hold its lease.

        Call it before side effects that must not happen twice; pass
        ``fence`` along to stores that can reject stale writers.
        """
        if not self.lease_valid():
            reason = self.lost_reason or "the lease was not renewed before its deadline"
            raise LeaseLost(
                f"{self.task_name!r} slot {self.slot.isoformat()} attempt {self.attempt} "
                f"(fence {self.fence}) lost its lease: {reason}"
            )


_current: ContextVar[ActiveRun | None] = ContextVar("taskguard_current_run", default=None)


def current_run() -> ActiveRun:
    """Return the attempt the calling code runs under; raise outside a guarded call."""
    run = _current.get()
    if run is None:
        raise TaskGuardError("current_run() is only available inside a guarded function")
    return run
