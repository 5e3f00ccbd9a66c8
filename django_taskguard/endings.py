"""How an attempt's end is recorded: fenced finishes, raised exceptions classified.

A finish is a compare-and-set on the row's state and fence: an attempt that
was taken over (or abandoned) records nothing and learns it (``LeaseLost``).
After a connection error the outcome is read back before anything is retried.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from django.db import DatabaseError

from . import ledger
from .conf import taskguard_settings
from .context import ActiveRun
from .exceptions import BackendUnavailable, LeaseLost
from .logfields import log_fields, run_log_fields
from .signals import run_abandoned, run_failed, run_skipped
from .states import TERMINAL_STATES, RunState

logger = logging.getLogger("taskguard.guard")


@dataclass(frozen=True)
class Ending:
    """How a raising attempt ends when its framework says so (see ``ClassifyRaise``).

    ``state`` is ``retrying`` (another attempt follows, due within ``retry_within``
    seconds when known, carried by the message ``retry_by`` when known: then only that
    message starts it) or ``skipped`` (the framework dropped the call on purpose).
    """

    state: str
    reason: str
    retry_within: float | None = None
    retry_by: str | None = None


# classify_raise(exc) -> an Ending when the caller's framework gives ``exc`` a meaning
# (Celery: a retry follows, the task asked to be ignored); None: it is a failure.
ClassifyRaise = Callable[[BaseException], "Ending | None"]
# on_busy(seconds) is called when another attempt holds a live lease on the slot
# (``seconds``: a hint of how long that lease has left) and must raise, to have the call
# come back later (a broker redelivery) instead of being dropped as a duplicate. Such a
# call is not counted in ``duplicates`` then; it is when it comes back to a finished slot.
OnBusy = Callable[[float], None]
# Records an attempt ``succeeded`` with a reason: True when recorded, False when it was
# fenced out; raises the database's error (the scheduler's batch writer).
RecordSuccess = Callable[[ActiveRun, str], bool]


def record_raised(
    active: ActiveRun,
    exc: BaseException,
    classify_raise: ClassifyRaise | None,
    recorded: Callable[[bool], None] | None = None,
) -> bool:
    """Record a raising attempt's end and send its signal; True when the slot is over.

    ``recorded(over)`` is called once the end is recorded, before the signal (the lock is
    freed there, so that a call a receiver makes meets the recorded row on every backend).
    Never raises: the caller re-raises the function's own exception, whatever
    recording it ran into (a ``LeaseLost`` fence refusal, the database gone).
    """
    ending = _classify(classify_raise, exc)
    # Cut before formatting: a huge message is never copied whole.
    error = f"{type(exc).__name__}: {ledger.clip(str(exc), ledger.ERROR_MAX_LENGTH)}"
    retry_within = retry_by = None
    if ending is not None:
        state, reason = ending.state, ending.reason
        if state == RunState.RETRYING:
            grace = taskguard_settings.RETRY_GRACE_SECONDS
            retry_within, retry_by = (ending.retry_within or 0.0) + grace, ending.retry_by
    elif isinstance(exc, Exception):
        state, reason = RunState.FAILED, error
    else:
        # KeyboardInterrupt, SystemExit: the process is going away mid-run.
        state, reason = RunState.ABANDONED, f"interrupted ({type(exc).__name__})"
    try:
        finish(active, state, reason, error=error, retry_within=retry_within, retry_by=retry_by)
        if recorded is not None:
            recorded(state in TERMINAL_STATES)
        if state == RunState.SKIPPED:
            run_skipped.send(sender=active.task_name, slot=active.slot, reason=reason)
        elif state == RunState.ABANDONED:
            run_abandoned.send(
                sender=active.task_name, run_id=active.id, slot=active.slot, reason=reason
            )
        else:
            run_failed.send(sender=active.task_name, run=active, exception=exc, state=state)
    except LeaseLost:
        logger.warning(
            "taskguard run %s was taken over; its end (%s) is not recorded",
            active.id,
            state,
            extra=run_log_fields("run.taken_over", active, state=state),
        )
        return False
    except Exception:
        logger.exception(
            "taskguard could not record that run %s ended %s; the function's own "
            "exception is raised",
            active.id,
            state,
            extra=run_log_fields("record.failed", active, state=state),
        )
        return False
    return state in TERMINAL_STATES


def _classify(classify_raise: ClassifyRaise | None, exc: BaseException) -> Ending | None:
    if classify_raise is None:
        return None
    try:
        return classify_raise(exc)
    except Exception:
        logger.exception(
            "taskguard classify_raise hook failed; recording the attempt as failed",
            extra=log_fields("hook.failed", reason="classify_raise"),
        )
        return None


def finish(
    active: ActiveRun,
    to_state: str,
    reason: str,
    *,
    error: str = "",
    retry_within: float | None = None,
    retry_by: str | None = None,
) -> None:
    """Record the attempt's end, fenced: refused (``LeaseLost``) if the slot was taken over.
    A skip with no error of its own keeps its reason as the row's error (what the admin
    and the health show as why), as every other skipped row does."""
    if to_state == RunState.SKIPPED and not error:
        error = reason
    if not active.lease_valid():
        reason += " (after its lease had expired; no other attempt had taken over)"
    try:
        updated = _write(active, to_state, reason, error, retry_within, retry_by)
    except DatabaseError as exc:
        if not ledger.connection_lost(exc):
            raise BackendUnavailable(
                f"the outcome of run {active.id} could not be recorded ({exc})"
            ) from exc
        updated = _settle_finish(active, to_state, reason, error, retry_within, retry_by)
    if updated is None:
        active.mark_lost(f"fenced out: finishing as {to_state} was refused")
        raise LeaseLost(
            f"{active.task_name!r} slot {active.slot.isoformat()} attempt {active.attempt}: "
            f"finishing as {to_state} was refused because another attempt took the slot over "
            f"or it was marked abandoned (fence {active.fence})"
        )


def succeed(active: ActiveRun, record_success: RecordSuccess | None) -> None:
    """Record a returned attempt ``succeeded``, through ``record_success`` when given."""
    if record_success is None:
        finish(active, RunState.SUCCEEDED, "returned")
        return
    reason = "returned"
    if not active.lease_valid():
        reason += " (after its lease had expired; no other attempt had taken over)"
    try:
        recorded = record_success(active, reason)
    except DatabaseError:
        recorded = _settle_finish(active, RunState.SUCCEEDED, reason, "", None) is not None
    if not recorded:
        active.mark_lost("fenced out: finishing as succeeded was refused")
        raise LeaseLost(
            f"{active.task_name!r} slot {active.slot.isoformat()} attempt {active.attempt}: "
            f"finishing as succeeded was refused because another attempt took the slot over "
            f"or it was marked abandoned (fence {active.fence})"
        )


def _settle_finish(
    active: ActiveRun,
    to_state: str,
    reason: str,
    error: str,
    retry_within: float | None,
    retry_by: str | None = None,
) -> ledger.Row | None:
    """The finish's outcome is unknown after a connection error: read back, retry once."""
    try:
        ledger.settle_connection()
        current = ledger.read_by_id(active.id)
        if current is None or current.fence != active.fence:
            return None
        if current.state == to_state:
            return current
        if current.state != RunState.RUNNING:
            return None
        return _write(active, to_state, reason, error, retry_within, retry_by)
    except DatabaseError as exc:
        raise BackendUnavailable(
            f"the outcome of run {active.id} could not be recorded: database unreachable ({exc}); "
            f"the run stays 'running' until its lease expires and cleanup_locks abandons it"
        ) from exc


def _write(
    active: ActiveRun,
    to_state: str,
    reason: str,
    error: str,
    retry_within: float | None,
    retry_by: str | None = None,
) -> ledger.Row | None:
    """The fenced finish of ``active`` (``None``: it no longer owns the row)."""
    return ledger.finish(
        active.id,
        active.attempt,
        active.fence,
        active.owner,
        to_state,
        reason,
        error=error,
        retry_within=retry_within,
        retry_by=retry_by,
    )
