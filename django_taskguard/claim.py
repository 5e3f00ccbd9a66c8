"""Claim a slot: make this call the slot's live attempt, or say who has it.

One upsert decides most calls; a row that is pending, retrying or stale
(its owner's lease expired) is decided by a compare-and-set in the ledger
(:func:`ledger.start_attempt`, :func:`ledger.take_over`, :func:`ledger.abandon`),
following ``on_stale``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime

from django.db import DatabaseError

from . import ledger
from .context import ActiveRun
from .exceptions import BackendUnavailable, TaskGuardError
from .ledger import Row
from .logfields import log_fields
from .owner import new_owner, new_token
from .signals import run_abandoned
from .states import DUPLICATE_STATES, PRUNABLE_STATES, RunState

logger = logging.getLogger("taskguard.guard")

CLAIM_ROUNDS = 3
EARLY_TAKEN = (
    "claimed on time: the skipped row only recorded a call refused for being ahead of the "
    "clock (SLOT_TOLERANCE_SECONDS)"
)


@dataclass(frozen=True)
class Taken:
    """The slot belongs to another attempt (or is finished); this call does not run."""

    state: str
    lease_left: float | None = None  # of the live attempt, when state is running (db clock)


def claim_slot(
    task_name: str,
    slot: datetime,
    owner: str,
    lease: float,
    on_stale: str,
    *,
    count_live: bool = True,
    key: str | None = None,
    keep: float | None = None,
    take_missed: bool = True,
    message_id: str | None = None,
) -> ActiveRun | Taken:
    """Make this call the slot's live attempt, or say who has it.

    ``key``: the (task, key) row of ``@once_per_key`` instead (``slot`` is the
    claim's time); a finished one older than ``keep`` seconds is deleted and the
    key claimed anew.

    The first statement is the one-round-trip upsert; only a row that is
    pending, retrying or stale needs a second, compare-and-set step, and a
    lost compare-and-set goes round again against the fresh row.
    ``count_live=False``: finding a live attempt does not count a duplicate.
    ``take_missed``: a row the sweep recorded ``missed`` is run late (``catchup`` other
    than ``"none"``); the transition log keeps the alarm.
    ``message_id``: the message carrying this call (Celery's task id and retry count). A row
    retrying for a retry that another message carries is not this call's: a counted
    duplicate (unless that retry is overdue).
    """
    abandon = on_stale == "abandon"
    for _ in range(CLAIM_ROUNDS):
        sent = time.monotonic()
        row = _claim_row(task_name, slot, owner, lease, abandon, count_live, key)
        if row is None:
            continue
        if row.owner == owner:
            return _active(row, task_name, slot, lease, sent, key)
        try:
            decided = _decide(row, owner, lease, abandon, slot, task_name, take_missed, message_id)
            if isinstance(decided, Taken) and _reopened(row, key, keep):
                continue  # the key's keep ran out: its row is gone, claim it anew
        except DatabaseError as exc:
            raise _database_down(task_name, exc) from exc
        if isinstance(decided, Taken):
            return decided
        if decided is not None:
            active = _active(decided, task_name, slot, lease, sent, key)
            active.claimed_from, active.message_id = row.state, message_id
            return active
    raise TaskGuardError(
        f"could not settle the claim of {task_name!r} slot {slot.isoformat()} after "
        f"{CLAIM_ROUNDS} rounds of contention"
    )


def _reopened(row: Row, key: str | None, keep: float | None) -> bool:
    """A finished keyed row whose ``keep`` ran out is deleted: True when it was."""
    if key is None or keep is None or row.state not in PRUNABLE_STATES:
        return False
    return ledger.reopen_key(row.id, keep)


def claim_many(
    slot: datetime, wanted: list[tuple[str, float]]
) -> dict[str, ActiveRun | Taken | None] | None:
    """Claim ``slot`` for many tasks (``(task, lease seconds)``, ``on_stale="abandon"``) in
    one statement. Per task: this call's attempt, ``Taken`` (finished, abandoned or live
    elsewhere; counted as a duplicate), or None when the row needs the one-task path
    (pending, retrying, missed, stale). None when the database cannot batch (SQLite)."""
    wanted = sorted(wanted)
    owners = [new_owner(new_token()) for _ in wanted]
    sent = time.monotonic()
    names = [name for name, _ in wanted]
    try:
        rows = ledger.claim_many(names, slot, owners, [lease for _, lease in wanted])
    except DatabaseError as exc:
        rows = _read_back_many(names, slot, exc)
    if rows is None:
        return None
    decided: dict[str, ActiveRun | Taken | None] = {}
    for (name, lease), owner in zip(wanted, owners, strict=True):
        row = rows.get(name)
        if row is not None and row.owner == owner:
            decided[name] = _active(row, name, slot, lease, sent)
        elif row is not None and _plainly_taken(row):
            decided[name] = Taken(row.state)
        else:
            decided[name] = None
    return decided


def _read_back_many(names: list[str], slot: datetime, exc: DatabaseError) -> dict[str, Row]:
    """The batch claim's reply was lost: it may or may not have committed. Read the rows
    back (a row with one of our owners is ours) instead of leaving won rows unrun."""
    if not ledger.connection_lost(exc):
        raise ledger.unreachable(exc) from exc
    logger.warning(
        "taskguard batch claim of slot %s interrupted (%s); reading back",
        slot,
        exc,
        extra=log_fields("claim.interrupted", slot=slot, reason=exc),
    )
    with ledger.translated:
        ledger.settle_connection()
        rows = ledger.read_many(names, slot)
    return rows or {}


def _plainly_taken(row: Row) -> bool:
    """Counted a duplicate under ``on_stale="abandon"`` (the batch's policy)."""
    if row.state == RunState.RUNNING:
        return not row.expired
    if row.state == RunState.SKIPPED and row.attempt == 0:
        return False  # perhaps an early call's refusal: the one-task path decides
    return row.state in DUPLICATE_STATES or row.state == RunState.ABANDONED


def _claim_row(
    task_name: str,
    slot: datetime,
    owner: str,
    lease: float,
    abandon: bool,
    count_live: bool = True,
    key: str | None = None,
) -> Row | None:
    try:
        return ledger.claim(
            task_name, slot, owner, lease, abandon_is_final=abandon, count_live=count_live, key=key
        )
    except DatabaseError as exc:
        if not ledger.connection_lost(exc):
            raise _database_down(task_name, exc) from exc
        # The insert may or may not have committed: read back before deciding.
        logger.warning(
            "taskguard claim of %s interrupted (%s); reading back",
            task_name,
            exc,
            extra=log_fields("claim.interrupted", task=task_name, slot=slot, key=key, reason=exc),
        )
        try:
            ledger.settle_connection()
            row = ledger.read(task_name, slot, key)
        except DatabaseError as again:
            raise _database_down(task_name, again) from again
        return row if row is not None and row.owner == owner else None


def _database_down(task_name: str, exc: Exception) -> BackendUnavailable:
    said = ledger.unreachable(exc)  # NotMigrated stays NotMigrated
    return type(said)(f"{task_name!r} did not run: {said}")


def _decide(
    row: Row,
    owner: str,
    lease: float,
    abandon: bool,
    slot: datetime,
    task_name: str,
    take_missed: bool = True,
    message_id: str | None = None,
) -> Row | Taken | None:
    """Decide a row someone else created. ``None``: it changed under us, go round."""
    state = row.state
    if state == RunState.MISSED and take_missed:
        return ledger.start_attempt(row, owner, lease, "claimed late, after it was recorded missed")
    if state == RunState.PENDING:
        return ledger.start_attempt(row, owner, lease, "claimed")
    if state == RunState.RETRYING:
        reason = f"attempt {row.attempt + 1}"
        started = ledger.start_attempt(row, owner, lease, reason, message_id)
        if started is None and ledger.count_other_copy(row.id, message_id):
            return Taken(RunState.RETRYING)  # another message carries the retry
        return started
    if state == RunState.RUNNING and row.expired:
        dead = f"lease of {row.owner} expired at {_iso(row.lease_until)}"
        if abandon:
            return _abandon_stale(row, owner, dead, task_name, slot)
        return ledger.take_over(row, owner, lease, f"{dead}; on_stale=retry")
    if state == RunState.ABANDONED and not abandon:
        return ledger.take_over(row, owner, lease, "on_stale=retry")
    if state == RunState.SKIPPED and row.attempt == 0:
        # Perhaps only an early call's refusal: then this call, on time, takes the slot
        # (compare-and-set: the ledger checks it is one). Otherwise the slot is skipped.
        taken = ledger.take_refused_early(row, owner, lease, EARLY_TAKEN)
        if taken is not None:
            return taken
    return Taken(state, row.lease_left if state == RunState.RUNNING else None)


def _abandon_stale(row: Row, owner: str, dead: str, task_name: str, slot: datetime) -> Taken | None:
    reason = f"{dead}; on_stale=abandon, so the slot is not run again"
    if ledger.abandon(row, actor=owner, reason=reason, count_duplicate=True) is None:
        return None
    run_abandoned.send(sender=task_name, run_id=row.id, slot=slot, reason=reason)
    return Taken(RunState.ABANDONED)


def _active(
    row: Row,
    task_name: str,
    slot: datetime,
    lease: float,
    sent: float,
    key: str | None = None,
) -> ActiveRun:
    assert row.fence is not None
    return ActiveRun(
        id=row.id,
        task_name=task_name,
        slot=slot,
        attempt=row.attempt,
        fence=int(row.fence),
        owner=row.owner,
        lease_seconds=lease,
        deadline=sent + lease,
        key=key,
    )


def _iso(value: datetime | None) -> str:
    return value.isoformat() if value else "?"
