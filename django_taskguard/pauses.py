"""Paused tasks: a paused task's slots are recorded ``skipped`` (reason ``paused``), never run.

The guard asks :func:`paused_reason` after it has won a slot, before the body.
The set of paused tasks is read from the ledger at most once per
``PAUSE_CACHE_SECONDS`` per process (one query a second, whatever the call
rate): a pause or a resume takes effect on every instance within that time.
A read that fails is tried once more on a new connection; when that fails too,
the call raises (the guard gives the slot back) instead of going on with an
answer older than the bound.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from . import ledger
from .exceptions import BackendUnavailable
from .ledger import schedules as store
from .logfields import log_fields
from .models import ScheduleEventOrigin

logger = logging.getLogger("taskguard.pauses")

PAUSE_CACHE_SECONDS = 1.0

_lock = threading.Lock()
_cache: tuple[float, dict[str, str]] = (float("-inf"), {})


def _after_fork() -> None:
    """A forked child's lock is free, and it reads the paused tasks afresh: held at the
    fork by another thread of its parent, the lock would be held in the child for good."""
    global _lock, _cache
    _lock = threading.Lock()
    _cache = (float("-inf"), {})


os.register_at_fork(after_in_child=_after_fork)


def paused_reason(task_name: str) -> str | None:
    """Why ``task_name`` is paused, or None when it is not; ``BackendUnavailable`` when
    the paused tasks could not be read and the last answer is older than the bound."""
    global _cache
    read_at, paused = _cache
    if time.monotonic() - read_at >= PAUSE_CACHE_SECONDS:
        with _lock:
            read_at, paused = _cache
            if time.monotonic() - read_at >= PAUSE_CACHE_SECONDS:
                started = time.monotonic()  # the answer is as old as the read's start
                paused = _read(task_name)
                _cache = (started, paused)
    return paused.get(task_name)


def _read(task_name: str) -> dict[str, str]:
    """The paused tasks from the ledger, read once more on a new connection when the
    first read failed (a connection the server ended). The last answer is never kept in
    its place: a resume (or a pause) it missed would be acted on past the bound."""
    try:
        return store.paused()
    except BackendUnavailable as exc:
        logger.warning(
            "taskguard could not read the paused tasks (%s); reading again on a new connection",
            exc,
            extra=log_fields("pause.read_failed", task=task_name, reason=exc),
        )
    ledger.settle_connection()
    try:
        return store.paused()
    except BackendUnavailable as exc:
        ledger.settle_connection()
        raise type(exc)(
            f"{task_name!r} did not run: whether it is paused could not be read ({exc})"
        ) from exc


def pause(
    task_name: str,
    reason: str,
    *,
    by: str = "",
    origin: ScheduleEventOrigin = ScheduleEventOrigin.CODE,
) -> bool:
    """Pause a known schedule and keep the event (who, from where, why: ``reason``, the
    operator's own words or nothing); False when it is unknown or already paused (nothing
    is kept then)."""
    try:
        return store.change_pause(task_name, reason, origin=origin, by=by, note=reason)
    finally:
        forget()


def resume(
    task_name: str,
    *,
    by: str = "",
    origin: ScheduleEventOrigin = ScheduleEventOrigin.CODE,
    reason: str = "",
) -> bool:
    """Resume a paused schedule and keep the event; False when it is unknown or not paused."""
    try:
        return store.change_pause(task_name, None, origin=origin, by=by, note=reason)
    finally:
        forget()


def paused_words(reason: str) -> str:
    """A skipped slot's reason for a pause: ``paused: why``, or ``paused`` when none was
    given."""
    return f"paused: {reason}" if reason else "paused"


def why(reason: str) -> str:
    """`` (why)`` to follow the word "paused" in a sentence, or nothing when no reason was
    given."""
    return f" ({reason})" if reason else ""


def forget() -> None:
    """Read the paused tasks again on the next call (this process)."""
    global _cache
    _cache = (float("-inf"), {})
