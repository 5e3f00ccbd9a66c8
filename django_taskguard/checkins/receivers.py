"""The receivers that turn taskguard's own signals into check-ins (docs/monitoring.md).

Always connected; each returns at once when ``TASKGUARD["CHECKINS"]`` is empty, and never
queries: it builds a :class:`.events.CheckIn` and queues it (:func:`.sending.submit`).

- ``run_started`` -> ``start``, unless the attempt is a retry (``claimed_from ==
  "retrying"``: retries are attempts of the same check-in);
- ``run_succeeded`` -> ``end`` ok; ``run_failed`` with state ``failed`` -> ``end`` error
  (``retrying``: nothing, the next attempt ends the check-in);
- ``run_skipped`` -> ``end`` ok, state ``skipped``: a deliberate skip (a paused schedule,
  an overlap, the function's own skip after its start) is not a failure and should not page;
- ``run_abandoned`` -> ``abandoned`` (error);
- ``run_missed`` -> one ``missed`` (error) per slot: the sweep's ``slots``, the newest
  :data:`MISSED_PER_SIGNAL` of them (the rest are counted in their reason).

Only the winning attempt's process sends these signals, so only it checks in. Keyed runs
(``@once_per_key``) are not schedules: no check-ins (``run.key``; for the signals that carry
no run, the sending thread reads the row's key). A task ``monitors`` maps to ``False``: none.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from datetime import datetime
from typing import Any

from ..conf import taskguard_settings
from ..context import ActiveRun
from ..logfields import log_fields
from ..process import PerProcess, per_process
from ..signals import (
    never_raising,
    run_abandoned,
    run_failed,
    run_missed,
    run_skipped,
    run_started,
    run_succeeded,
)
from ..states import RunState
from .events import ABANDONED, END, MISSED, START, CheckIn, clipped
from .monitors import opted_out
from .sending import submit

MISSED_PER_SIGNAL = 20
_STARTS_KEPT = 10_000

# When this process saw each run start (time.monotonic()), for the end's duration.
_started: dict[int, float] = {}
_started_locks: PerProcess[threading.Lock] = per_process(threading.Lock)  # (sending.py)

logger = logging.getLogger("taskguard.checkins")


def _not_queued(receiver: str) -> None:
    logger.exception(
        "taskguard check-in not queued (%s)",
        receiver,
        extra=log_fields("checkin.not_queued", reason=receiver),
    )


# A receiver that raised would fail the task: each logs instead. Nothing in them should
# raise; a thread that cannot start might.
_never_raises = never_raising(_not_queued)


def _wanted(task_name: str) -> bool:
    settings = taskguard_settings.CHECKINS
    return bool(settings) and not opted_out(settings, task_name)


@_never_raises
def on_started(sender: str, run: ActiveRun, **kwargs: Any) -> None:
    if run.key is not None or not _wanted(run.task_name):
        return
    with _started_locks.get():
        if len(_started) >= _STARTS_KEPT:
            _started.clear()
        _started.setdefault(run.id, time.monotonic())
    if run.claimed_from == RunState.RETRYING:
        return
    submit(_of_run(START, run, RunState.RUNNING, ok=True))


@_never_raises
def on_succeeded(sender: str, run: ActiveRun, **kwargs: Any) -> None:
    if run.key is None and _wanted(run.task_name):
        submit(_of_run(END, run, RunState.SUCCEEDED, ok=True))


@_never_raises
def on_failed(sender: str, run: ActiveRun, exception: BaseException, **kwargs: Any) -> None:
    if kwargs.get("state", RunState.FAILED) != RunState.FAILED:
        return  # retrying: the next attempt ends this check-in
    if run.key is None and _wanted(run.task_name):
        reason = f"{type(exception).__name__}: {exception}"
        submit(_of_run(END, run, RunState.FAILED, ok=False, reason=reason))


@_never_raises
def on_skipped(sender: str, slot: datetime, reason: str = "", **kwargs: Any) -> None:
    if kwargs.get("key") is None and _wanted(sender):  # a keyed message's expiry: no slot
        submit(_of_slot(END, sender, slot, RunState.SKIPPED, ok=True, reason=reason))


@_never_raises
def on_abandoned(sender: str, run_id: int, slot: datetime, reason: str = "", **kwargs: Any) -> None:
    if _wanted(sender):
        checkin = _of_slot(ABANDONED, sender, slot, RunState.ABANDONED, ok=False, reason=reason)
        submit(replace(checkin, run_id=run_id, duration=_duration(run_id)))


@_never_raises
def on_missed(sender: str, slot: datetime, reason: str = "", **kwargs: Any) -> None:
    if not _wanted(sender):
        return
    slots: list[datetime] = list(kwargs.get("slots") or [slot])
    sent = slots[-MISSED_PER_SIGNAL:]
    if len(slots) > len(sent):
        reason = f"{reason} ({len(slots) - len(sent)} older missed slots not checked in)"
    for each in sent:
        checkin = _of_slot(MISSED, sender, each, RunState.MISSED, ok=False, reason=reason)
        submit(replace(checkin, verify_key=False))  # a keyed run is never recorded missed


def _of_run(event: str, run: ActiveRun, state: str, *, ok: bool, reason: str = "") -> CheckIn:
    duration = None if event == START else _duration(run.id)
    return CheckIn(
        event=event,
        task=run.task_name,
        slot=run.slot,
        state=state,
        ok=ok,
        run_id=run.id,
        attempt=run.attempt,
        reason=clipped(reason),
        duration=duration,
        generation=_generation(run),
    )


def _generation(run: ActiveRun) -> str:
    """A take-over of a run recorded ``abandoned`` is a check-in of its own (``events``)."""
    return f"taken over at fence {run.fence}" if run.claimed_from == RunState.ABANDONED else ""


def _of_slot(
    event: str, task: str, slot: datetime, state: str, *, ok: bool, reason: str
) -> CheckIn:
    return CheckIn(
        event=event,
        task=task,
        slot=slot,
        state=state,
        ok=ok,
        reason=clipped(reason),
        verify_key=True,
    )


def _duration(run_id: int) -> float | None:
    with _started_locks.get():
        began = _started.pop(run_id, None)
    return None if began is None else round(time.monotonic() - began, 3)


def connect() -> None:
    """Connect the receivers (from :func:`django_taskguard.signal_handlers.connect`)."""
    for signal, receiver in (
        (run_started, on_started),
        (run_succeeded, on_succeeded),
        (run_failed, on_failed),
        (run_skipped, on_skipped),
        (run_abandoned, on_abandoned),
        (run_missed, on_missed),
    ):
        signal.connect(receiver, dispatch_uid=f"taskguard.checkins.{receiver.__name__}")
