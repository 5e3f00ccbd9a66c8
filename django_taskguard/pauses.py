"""Paused tasks: a paused task's slots are recorded ``skipped`` (reason ``paused``), never run.

The guard asks :func:`paused_reason` after it has won a slot, before the body.
The set of paused tasks is read from the ledger at most once per
``PAUSE_CACHE_SECONDS`` per process (one query a second, whatever the call
rate): a pause takes effect on every instance within that time.
"""

from __future__ import annotations

import logging
import threading
import time

from .exceptions import BackendUnavailable
from .ledger import schedules as store

logger = logging.getLogger("taskguard.pauses")

PAUSE_CACHE_SECONDS = 1.0

_lock = threading.Lock()
_cache: tuple[float, dict[str, str]] = (float("-inf"), {})


def paused_reason(task_name: str) -> str | None:
    """Why ``task_name`` is paused, or None when it is not."""
    global _cache
    read_at, paused = _cache
    if time.monotonic() - read_at >= PAUSE_CACHE_SECONDS:
        with _lock:
            read_at, paused = _cache
            if time.monotonic() - read_at >= PAUSE_CACHE_SECONDS:
                try:
                    paused = store.paused()
                except BackendUnavailable as exc:
                    # The claim just went through, so this is rare: keep the last answer.
                    logger.warning("taskguard could not read the paused tasks (%s)", exc)
                _cache = (time.monotonic(), paused)
    return paused.get(task_name)


def pause(task_name: str, reason: str) -> bool:
    """Pause a known schedule; False when it is unknown or already paused."""
    changed = store.set_paused(task_name, reason or "paused")
    forget()
    return changed


def resume(task_name: str) -> bool:
    """Resume a paused schedule; False when it is unknown or not paused."""
    changed = store.set_paused(task_name, None)
    forget()
    return changed


def forget() -> None:
    """Read the paused tasks again on the next call (this process)."""
    global _cache
    _cache = (float("-inf"), {})
