"""Signals taskguard sends.

Every signal is sent with ``sender`` = the task name (a ``str``). A keyed run
(``@once_per_key``) is sent like a slot's: its ``run.key`` says which key, its
``slot`` is when the key was claimed.

- ``run_started(run)``: an attempt won its slot and is about to call the function.
- ``run_succeeded(run, result)``; ``run_failed(run, exception, state)``: ``state`` is
  ``failed``, or ``retrying`` when another attempt of the same run follows (a Celery retry).
- ``run_skipped(task_name, slot, reason)``: the slot was recorded ``skipped``; with ``key``
  when it was an ``@once_per_key`` message that expired (``apply_once``: no slot of a schedule).
- ``duplicate_suppressed(task_name, slot, state)``: this call found the slot taken;
  ``state`` is the row's, or ``"finished"`` when Redis's finished-slot marker decided
  (the row was not read); and ``key``, for an ``@once_per_key`` call.
- ``run_abandoned(run_id, slot, reason)``: a run was marked ``abandoned``: its owner died
  (found by cleanup or a later caller), or it was interrupted (``KeyboardInterrupt``,
  ``SystemExit``).
- ``run_missed(slot, reason)``: a due slot was recorded ``missed`` (by the missed-slot
  sweep, or a call later than its grace under ``catchup="none"``); the sweep sends it once
  per task and sweep, with ``slot`` the newest missed slot, ``count`` how many and ``slots``
  all of them (oldest first; a single slot's signal has no ``count`` or ``slots``).
- ``run_given_back(run, reason)``: an attempt ended before its function started (its
  ``run_started`` may have been sent) and gave its slot or key back: nothing ran, the row is
  back in the state its claim found it in (``pending``, ``retrying`` or ``missed``).
- ``lease_lost(run)``: an attempt lost its lease (not renewed in time, or fenced out).
- ``checkin_failed(service, event, error)``: a check-in (``TASKGUARD["CHECKINS"]``) could not
  be delivered after its tries, or was dropped (the queue was full); ``service`` is
  ``"sentry"``, ``"healthchecks"``, ``"cronitor"`` or ``"webhook"``, ``event`` the check-in's
  kind (``"start"``, ``"end"``, ``"missed"``, ``"abandoned"``). Sent from the sending thread
  (a drop: from the thread whose check-in found the queue full), with ``send_robust``.
"""

import functools
from collections.abc import Callable
from typing import Any

from django.dispatch import Signal

run_started = Signal()
run_succeeded = Signal()
run_failed = Signal()
run_skipped = Signal()
duplicate_suppressed = Signal()
run_abandoned = Signal()
lease_lost = Signal()
run_given_back = Signal()
run_missed = Signal()
checkin_failed = Signal()


def never_raising(
    said: Callable[[str], None],
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Wrap one of taskguard's own receivers of these signals so that it never raises: a
    receiver that raised would fail the task (``run_started``'s gives the slot back). Its
    error is handed to ``said`` (with the receiver's name), called inside the ``except``
    so that ``logger.exception`` there logs it with its traceback."""

    def wrap(receiver: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(receiver)
        def guarded(*args: Any, **kwargs: Any) -> None:
            try:
                receiver(*args, **kwargs)
            except Exception:
                said(receiver.__name__)

        return guarded

    return wrap
