"""The database-only backend: no fast path, the row is the lock."""

from __future__ import annotations

from datetime import datetime

from .base import Acquired, LockBackend


class DatabaseLock(LockBackend):
    name = "database"

    def key(self, task_name: str, slot: datetime) -> str:
        return ""  # nothing to lock: the row is the lock

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
        return Acquired.BYPASSED

    def extend(self, key: str, token: str, lease_seconds: float) -> bool:
        return True

    def release(self, key: str, token: str) -> bool:
        return True

    def finish(self, key: str, token: str, marker_seconds: float | None = None) -> int:
        return 0
