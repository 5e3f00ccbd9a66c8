"""The missed-slot sweep: a due slot that no instance claimed within its grace is
recorded ``missed`` (a slot due while the task was paused: ``skipped``, reason ``paused``).

A slot handed to a task queue (``run_schedules --enqueue``, ``backfill --enqueue``), or
given back by an attempt that ended before its function started, has a ``pending`` row;
one that nobody started within its grace of being handed out (or given back) is ended
the same way (a compare-and-set from ``pending``: a worker's claim and the sweep never both
win). It needs no scheduler alive: ``cleanup_locks`` (from cron) and ``run_schedules``
both run it, any number of copies at once (every write is an insert that does nothing
when the slot has a row). It reads the schedules from ``TaskSchedule`` (not the removed
ones: nothing fires them) and checks, per schedule, the slots after the last sweep's mark
(``swept_until``; the first time, after the schedule was first seen) up to ``now - grace``.

Every slot of the schedule in that window is judged by itself (is there a row at this
slot?), never by counting rows: rows off the schedule's grid (an interval changed between
deploys, an explicit ``run_for_slot``) hide nothing. It goes in batches of
``SWEEP_BATCH`` slots (one read and one write each, memory bounded by the batch), at most
``MAX_BATCHES`` per schedule and sweep; ``swept_until`` moves after each batch over the
slots that batch judged, so a long outage is recorded over a few sweeps, never skipped.
Each slot is labelled by the pause state at its own time: every pause the schedule's
history keeps (its ``paused``/``resumed`` events), and its latest pause kept on the row. A
schedule that raises (a stored zone this copy's tzdata lacks) is logged and skipped, its
mark left where it was; the database's own errors end the sweep (the next one retries).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import DatabaseError

from . import ledger
from .conf import taskguard_settings
from .exceptions import BackendUnavailable
from .ledger import schedules as store
from .models import TaskSchedule
from .owner import actor
from .schedules import rebuild
from .signals import run_missed
from .states import RunState

logger = logging.getLogger("taskguard.missed")

# Slots judged per read and write; batches per schedule and sweep (the rest: the next sweep).
SWEEP_BATCH = 1_000
MAX_BATCHES = 50
# Pending slots ended per statement.
PENDING_BATCH = 10_000
# Slots this close to the retention horizon are left alone (the guard refuses them).
HORIZON_MARGIN = timedelta(hours=1)


@dataclass
class SweepResult:
    missed_slots: int = 0  # rows written as missed
    paused_slots: int = 0  # rows written as skipped (paused)
    tasks: dict[str, int] = field(default_factory=dict)  # task -> slots recorded this sweep


def sweep_missed(
    *, task: str | None = None, dry_run: bool = False, now: datetime | None = None
) -> SweepResult:
    """Record the due slots of every known schedule that nobody claimed within its grace."""
    try:
        now = now or ledger.database_now()
        floor = now - timedelta(days=taskguard_settings.PRUNE_AFTER_DAYS) + HORIZON_MARGIN
        result = SweepResult()
        for row in store.watched(store.stored()):
            if task is not None and row.task_name != task:
                continue
            try:
                _sweep_one(row, now, floor, dry_run, result)
            except (BackendUnavailable, DatabaseError):
                raise  # the database's trouble, not this schedule's: the next sweep retries
            except Exception:
                # This schedule's own trouble (a stored zone this copy's tzdata lacks, a
                # cron it cannot read): its mark stays where it was, the others go on.
                logger.exception(
                    "taskguard %s: the sweep skipped this schedule (its slots are judged "
                    "again next sweep)",
                    row.task_name,
                )
    except (BackendUnavailable, DatabaseError):
        # A long-lived caller (run_schedules' sweeper thread) sweeps again later: drop a
        # connection that failed so that the next sweep reconnects.
        try:
            ledger.settle_connection()
        except Exception:
            logger.warning(
                "taskguard: the sweep could not close a failed connection", exc_info=True
            )
        raise
    return result


def _sweep_one(
    row: TaskSchedule, now: datetime, floor: datetime, dry_run: bool, result: SweepResult
) -> None:
    judged = max(row.swept_until or row.first_seen, floor)
    end = now - row.grace
    if not dry_run:
        _end_pending(row, end, result)
    if row.starts is not None:  # a data schedule's bounds: no slot outside them fires
        judged = max(judged, row.starts - timedelta(microseconds=1))
    if row.ends is not None:
        end = min(end, row.ends)
    if end <= judged:
        return
    if not dry_run and not row.paused:
        _miss_refused_early(row, judged, end, result)
    schedule = rebuild(row.cron, row.cron_day_or, store.zone_of(row), row.every)
    found = _Found(row)
    for _ in range(MAX_BATCHES):
        slots = schedule.slots_between(judged, end, SWEEP_BATCH)
        until = slots[-1] if len(slots) == SWEEP_BATCH else end
        found.record(ledger.slots_without_row(row.task_name, slots), dry_run)
        if not dry_run:
            store.mark_swept(row.task_name, until)
        judged = until
        if until >= end:
            break
    else:
        logger.warning(
            "taskguard %s: the sweep judged its slots up to %s; the next sweep goes on to %s",
            row.task_name,
            judged.isoformat(),
            end.isoformat(),
        )
    found.report(result, dry_run)


class _Found:
    """One schedule's slots without a row, written as they are found, and what was written."""

    def __init__(self, row: TaskSchedule) -> None:
        self.row = row
        self.windows = store.pause_windows(row)
        grace = row.grace.total_seconds()
        self.missed_reason = f"missed: no instance claimed it within its grace ({grace:g}s)"
        self.missed = self.paused = 0
        self.last_missed: datetime | None = None

    def record(self, slots: list[datetime], dry_run: bool) -> None:
        missed: list[datetime] = []
        paused: dict[str, list[datetime]] = {}
        for slot in slots:
            window = next((w for w in self.windows if w.covers(slot)), None)
            if window is None:
                missed.append(slot)
            else:
                paused.setdefault(_paused_reason(self.row, window), []).append(slot)
        for reason, skipped in paused.items():
            self.paused += self._write(RunState.SKIPPED, skipped, reason, dry_run)
        self.missed += self._write(RunState.MISSED, missed, self.missed_reason, dry_run)
        if missed:
            self.last_missed = missed[-1]

    def _write(self, state: str, slots: list[datetime], reason: str, dry_run: bool) -> int:
        if dry_run or not slots:
            return len(slots)
        rows = [(self.row.task_name, slot, reason) for slot in slots]
        return ledger.insert_unheld_many(state, rows, actor=actor("sweep"))

    def report(self, result: SweepResult, dry_run: bool) -> None:
        name = self.row.task_name
        if self.missed or self.paused:
            result.tasks[name] = result.tasks.get(name, 0) + self.missed + self.paused
        result.missed_slots += self.missed
        result.paused_slots += self.paused
        if self.missed and not dry_run and self.last_missed is not None:
            logger.warning("taskguard %s: %d due slots were missed", name, self.missed)
            run_missed.send(
                sender=name, slot=self.last_missed, reason=self.missed_reason, count=self.missed
            )


def _paused_reason(row: TaskSchedule, window: store.PauseWindow | None) -> str:
    if row.paused and (window is None or window.end is None):
        return f"paused: {row.paused_reason or 'paused'} (recorded by the missed-slot sweep)"
    if window is None or window.start is None or window.end is None:
        return "paused (recorded by the missed-slot sweep)"
    return (
        f"paused: due while the task was paused from {window.start.isoformat()} to "
        f"{window.end.isoformat()} (recorded by the missed-slot sweep)"
    )


def _end_pending(row: TaskSchedule, end: datetime, result: SweepResult) -> None:
    """Slots handed to a task queue or given back (``pending``) at or before ``end`` (their
    grace ago) that no worker started end like slots nobody fired (a late worker may still
    run a missed one: catch-up). By hand-out (or give-back) time, whatever the slot (a
    backfilled slot is old when it is handed out): handed out while the task was paused,
    ``skipped``."""
    window = store.pause_window(row)
    if window is not None:
        why = f"paused: {row.paused_reason or 'paused'} (pending, not started; the sweep)"
        ended = _end_pending_all(row, end, RunState.SKIPPED, why, window.start, window.end)
        result.paused_slots += len(ended)
        _count(result, row.task_name, len(ended))
    grace = row.grace.total_seconds()
    why = (
        f"missed: pending (handed out or given back) and not started within its grace ({grace:g}s)"
    )
    ended = _end_pending_all(row, end, RunState.MISSED, why, None, None)
    if not ended:
        return
    _count(result, row.task_name, len(ended))
    result.missed_slots += len(ended)
    logger.warning(
        "taskguard %s: %d pending slots (handed out or given back) were not started within "
        "their grace",
        row.task_name,
        len(ended),
    )
    run_missed.send(sender=row.task_name, slot=ended[-1], reason=why, count=len(ended))


def _end_pending_all(
    row: TaskSchedule,
    end: datetime,
    state: str,
    why: str,
    since: datetime | None,
    before: datetime | None,
) -> list[datetime]:
    ended: list[datetime] = []
    while True:  # in batches, until none is left
        batch = ledger.end_pending(
            row.task_name,
            end,
            state=state,
            reason=why,
            actor=actor("sweep"),
            limit=PENDING_BATCH,
            since=since,
            before=before,
        )
        ended += batch
        if len(batch) < PENDING_BATCH:
            return ended


def _miss_refused_early(
    row: TaskSchedule, start: datetime, end: datetime, result: SweepResult
) -> None:
    """Due slots whose row only recorded an early call's refusal, that no on-time call
    took within their grace, are missed like slots with no row."""
    why = (
        f"missed: only a call ahead of the clock came (refused), and no instance claimed it "
        f"on time within its grace ({row.grace.total_seconds():g}s)"
    )
    count = ledger.miss_refused_early(
        row.task_name, start, end, reason=why, actor=actor("sweep"), limit=SWEEP_BATCH
    )
    if count:
        result.missed_slots += count
        result.tasks[row.task_name] = result.tasks.get(row.task_name, 0) + count
        logger.warning("taskguard %s: %d due slots were only called early", row.task_name, count)


def _count(result: SweepResult, task_name: str, slots: int) -> None:
    if slots:
        result.tasks[task_name] = result.tasks.get(task_name, 0) + slots
