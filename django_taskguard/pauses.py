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
from .logfields import log_fields
from .models import ScheduleEventKind, ScheduleEventOrigin

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
                    logger.warning(
                        "taskguard could not read the paused tasks (%s)",
                        exc,
                        extra=log_fields("pause.read_failed", task=task_name, reason=exc),
                    )
                _cache = (time.monotonic(), paused)
    return paused.get(task_name)


def pause(
    task_name: str,
    reason: str,
    *,
    by: str = "",
    origin: ScheduleEventOrigin = ScheduleEventOrigin.CODE,
) -> bool:
    """Pause a known schedule and keep the event (who, from where, why); False when it is
    unknown or already paused (nothing is kept then)."""
    reason = reason or "paused"
    changed = store.set_paused(task_name, reason)
    forget()
    if changed:
        store.record_event(task_name, ScheduleEventKind.PAUSED, origin=origin, by=by, reason=reason)
    return changed


def resume(
    task_name: str,
    *,
    by: str = "",
    origin: ScheduleEventOrigin = ScheduleEventOrigin.CODE,
    reason: str = "",
) -> bool:
    """Resume a paused schedule and keep the event; False when it is unknown or not paused."""
    changed = store.set_paused(task_name, None)
    forget()
    if changed:
        store.record_event(
            task_name, ScheduleEventKind.RESUMED, origin=origin, by=by, reason=reason
        )
    return changed


def forget() -> None:
    """Read the paused tasks again on the next call (this process)."""
    global _cache
    _cache = (float("-inf"), {})
