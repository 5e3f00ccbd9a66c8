"""Due slots that ``run_schedules`` could not fire because the database failed (reading
them, or their claim: the guard fails closed, nothing was claimed): kept and tried again
:data:`RETRY_SECONDS` after the first of them failed, while the caller judges them still
worth it (within their grace). The sweep judges whatever is dropped."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

from .logfields import log_fields

logger = logging.getLogger("taskguard.scheduler")

# Tried again this long after the first failure; at most LIMIT kept (the oldest dropped).
RETRY_SECONDS = 1.0
LIMIT = 10_000

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class Carried(Generic[K, T]):
    """Items by key, carried from the pool's threads and the loop alike (a lock)."""

    def __init__(self) -> None:
        self._items: dict[K, T] = {}
        self._lock = threading.Lock()
        self._retry_at = 0.0

    def carry(self, items: Iterable[tuple[K, T]]) -> None:
        with self._lock:
            if not self._items:
                self._retry_at = time.monotonic() + RETRY_SECONDS
            self._items.update(items)
            dropped = len(self._items) - LIMIT
            for key in list(self._items)[: max(dropped, 0)]:
                del self._items[key]
        if dropped > 0:
            logger.warning(
                "run_schedules: %d due slots the database failed are not tried again (more "
                "than %d wait); the sweep records them",
                dropped,
                LIMIT,
                extra=log_fields("scheduler.retry_dropped"),
            )

    def take(self) -> list[T]:
        """Every item, once their retry time has come (else none)."""
        with self._lock:
            if not self._items or time.monotonic() < self._retry_at:
                return []
            taken, self._items = list(self._items.values()), {}
        return taken

    def retry_in(self) -> float | None:
        """Seconds until the items are tried again (None: there are none)."""
        with self._lock:
            if not self._items:
                return None
            return max(self._retry_at - time.monotonic(), 0.0)
