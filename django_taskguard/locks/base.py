"""What a lock backend must do, and how its keys are named.

The database row always decides (G4). A lock backend is the fast path in
front of it: it lets a losing call return after one round trip without
touching the database, and it carries the owner's liveness (a lease that
the heartbeat extends). The database backend is the null lock: every call
goes straight to the row.
"""

from __future__ import annotations

import enum
import functools
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from datetime import datetime
from datetime import timezone as dt_timezone


class Acquired(enum.Enum):
    WON = "won"  # we hold the fast-path lock; go on to claim the row
    LOST = "lost"  # someone else holds it; the duplicate was counted by the backend
    BYPASSED = "bypassed"  # the backend could not answer; decide on the database alone
    FINISHED = "finished"  # the slot is over (a finished-slot marker); counted as a duplicate


class LockBackend(ABC):
    name: str = "abstract"

    @abstractmethod
    def acquire(
        self,
        key: str,
        token: str,
        lease_seconds: float,
        task_name: str = "",
        *,
        count: bool = True,
    ) -> Acquired:
        """Take ``key`` for ``token`` for ``lease_seconds``, or count a duplicate.

        ``task_name`` is recorded next to the count, so that a slot whose
        winner died before its database row can still be recorded by cleanup.
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

    def finish(self, key: str, token: str) -> int:
        """The winner's row is recorded finished: release ``key`` (leaving a finished-slot
        marker where the backend keeps one) and return the duplicates counted for it."""
        return self.release_counted(key, token)

    def sweep(self, task: str | None, dry_run: bool) -> tuple[int, int]:
        """Backend-side cleanup: ``(unrecorded slots recorded, orphan keys removed)``."""
        return 0, 0

    def take_duplicates(self, key: str) -> int:
        """Return and reset the duplicates counted for ``key`` (folded into the row)."""
        return 0

    def holder(self, key: str) -> str | None:
        """The token ``key`` holds now, or None (cleanup and the admin read it)."""
        return None

    def scan_run_keys(self) -> Iterator[tuple[str, str | None]]:
        """Every run key under the prefix with its token, found incrementally (``SCAN``)."""
        return iter(())


@functools.lru_cache(maxsize=1024)
def task_digest(task_name: str) -> str:
    """A fixed-length, key-safe stand-in for a task name of any length or alphabet."""
    return hashlib.sha256(task_name.encode("utf-8")).hexdigest()[:32]


@functools.lru_cache(maxsize=1024)
def slot_label(slot: datetime) -> str:
    """``20261121T210000.000000Z``: sortable, fixed-width, UTC."""
    return slot.astimezone(dt_timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")


def run_key(prefix: str, task_name: str, slot: datetime) -> str:
    """The fast-path lock key of one (task, slot); never raw user text."""
    return f"{prefix}:run:{task_digest(task_name)}:{slot_label(slot)}"


def parse_run_key(key: str) -> tuple[str, datetime] | None:
    """``(task_digest, slot)`` of a key made by :func:`run_key`, or None for other keys."""
    parts = key.rsplit(":", 3)
    if len(parts) != 4 or parts[1] != "run":
        return None
    try:
        slot = datetime.strptime(parts[3], "%Y%m%dT%H%M%S.%fZ").replace(tzinfo=dt_timezone.utc)
    except ValueError:
        return None
    return parts[2], slot
