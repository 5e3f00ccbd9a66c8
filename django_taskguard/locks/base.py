"""What a lock backend must do (its keys are named in ``keys``).

The database row always decides (G4). A lock backend is the fast path in
front of it: it lets a losing call return after one round trip without
touching the database, and it carries the owner's liveness (a lease that
the heartbeat extends). The database backend is the null lock: every call
goes straight to the row.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterator
from datetime import datetime

from .keys import run_key, slot_label, task_digest

__all__ = ["Acquired", "LockBackend", "run_key", "slot_label", "task_digest"]


class Acquired(enum.Enum):
    WON = "won"  # we hold the fast-path lock; go on to claim the row
    LOST = "lost"  # someone else holds it; the duplicate was counted by the backend
    BYPASSED = "bypassed"  # the backend could not answer; decide on the database alone
    FINISHED = "finished"  # the slot is over (a finished-slot marker); counted as a duplicate


class LockBackend(ABC):
    name: str = "abstract"

    @abstractmethod
    def key(self, task_name: str, slot: datetime) -> str:
        """The key this backend locks (task, slot) under; what the other methods take."""

    def keyed(self, task_name: str, key: str) -> str:
        """The key this backend locks an ``@once_per_key`` run (task, key) under."""
        return ""

    def key_for(self, task_name: str, slot: datetime, key: str | None) -> str:
        """:meth:`key` of a slot's run, :meth:`keyed` of a keyed run (``key`` not None)."""
        return self.key(task_name, slot) if key is None else self.keyed(task_name, key)

    @abstractmethod
    def acquire(
        self,
        key: str,
        token: str,
        lease_seconds: float,
        task_name: str = "",
        *,
        count: bool = True,
        run_key: str = "",
    ) -> Acquired:
        """Take ``key`` for ``token`` for ``lease_seconds``, or count a duplicate.

        ``task_name`` (and ``run_key``, a keyed run's key) is recorded next to the
        count, so that a run whose winner died before its database row can still
        be recorded by cleanup.
        ``count=False``: a lost call is not counted (it will be put back).
        """

    @abstractmethod
    def extend(self, key: str, token: str, lease_seconds: float) -> bool:
        """Extend ``key`` only while it still holds ``token``; False when it does not."""

    @abstractmethod
    def release(self, key: str, token: str) -> bool:
        """Delete ``key`` only while it still holds ``token``."""

    def release_counted(self, key: str, token: str) -> int:
        """Release ``key`` (compare-and-delete) and return the duplicates counted for it.

        One round trip where the backend allows; the winner calls it once its
        function has returned, just before recording the outcome.
        """
        count = self.take_duplicates(key)
        self.release(key, token)
        return count

    def finish(self, key: str, token: str, marker_seconds: float | None = None) -> int:
        """The winner's row is recorded finished: release ``key`` (leaving a finished-slot
        marker where the backend keeps one, for ``marker_seconds`` at most when given)
        and return the duplicates counted for it."""
        return self.release_counted(key, token)

    def sweep(self, task: str | None, dry_run: bool) -> tuple[int, int]:
        """Backend-side cleanup: ``(unrecorded slots recorded, orphan keys removed)``."""
        return 0, 0

    def claimed_task_names(self) -> set[str]:
        """Tasks the backend holds claim records of (a slot may have no row yet)."""
        return set()

    def take_duplicates(self, key: str) -> int:
        """Return and reset the duplicates counted for ``key`` (folded into the row)."""
        return 0

    def holder(self, key: str) -> str | None:
        """The token ``key`` holds now, or None (cleanup and the admin read it)."""
        return None

    def scan_run_keys(self) -> Iterator[tuple[str, str | None]]:
        """Every run key under the prefix with its token, found incrementally (``SCAN``)."""
        return iter(())
