"""The missed-slot sweep: a due slot that no instance claimed within its grace is
recorded ``missed`` (a paused task's: ``skipped``, reason ``paused``).

A slot handed to a task queue (``run_schedules --enqueue``, ``backfill --enqueue``) has a
``pending`` row; one that no worker started within its grace of being handed out is ended
the same way (a compare-and-set from ``pending``: a worker's claim and the sweep never both
win). It needs no scheduler alive: ``cleanup_locks`` (from cron) and ``run_schedules``
both run it, any number of copies at once (every write is an insert that does nothing
when the slot has a row). It reads the schedules from ``TaskSchedule`` and checks,
per schedule, the slots after the last sweep's mark (``swept_until``; the first time,
after the schedule was first seen) up to ``now - grace``.

Bounded: per schedule and sweep at most ``MISSED_ROWS_CAP`` rows are written. When
more slots than that are missing (a one-second schedule down for a week), the oldest
``MISSED_ROWS_CAP - 1`` are recorded one by one and one summary row, on the newest
missing slot, says how many others it stands for and from when to when. A window of
more than ``ENUMERATE_CAP`` slots is not listed at all: one summary row on its newest
slot says how many slots have no row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from . import ledger
from .conf import taskguard_settings
from .ledger import schedules as store
from .models import TaskSchedule
from .owner import actor
from .schedules import Schedule, rebuild
from .signals import run_missed
from .states import RunState

logger = logging.getLogger("taskguard.missed")

MISSED_ROWS_CAP = 100
ENUMERATE_CAP = 10_000
# Slots this close to the retention horizon are left alone (the guard refuses them).
HORIZON_MARGIN = timedelta(hours=1)


@dataclass
class SweepResult:
    missed_slots: int = 0  # rows written as missed (a summary row counts once)
    paused_slots: int = 0  # rows written as skipped (paused)
    summarized: int = 0  # further missing slots only counted in a summary row
    tasks: dict[str, int] = field(default_factory=dict)  # task -> missing slots


def sweep_missed(
    *, task: str | None = None, dry_run: bool = False, now: datetime | None = None
) -> SweepResult:
    """Record the due slots of every known schedule that nobody claimed within its grace."""
    now = now or ledger.database_now()
    floor = now - timedelta(days=taskguard_settings.PRUNE_AFTER_DAYS) + HORIZON_MARGIN
    result = SweepResult()
    for row in store.stored():
        if task is not None and row.task_name != task:
            continue
        _sweep_one(row, now, floor, dry_run, result)
    return result


def _sweep_one(
    row: TaskSchedule, now: datetime, floor: datetime, dry_run: bool, result: SweepResult
) -> None:
    start = max(row.swept_until or row.first_seen, floor)
    end = now - row.grace
    if not dry_run:
        _end_pending(row, end, result)
    if end <= start:
        return
    if not dry_run and not row.paused:
        _miss_refused_early(row, start, end, result)
    schedule = rebuild(row.cron, row.cron_day_or, row.time_zone, row.every)
    missing, total = _missing(row.task_name, schedule, start, end)
    if total:
        result.tasks[row.task_name] = total
        rows = _rows(row, missing, total, start, end)
        state = RunState.SKIPPED if row.paused else RunState.MISSED
        written = len(rows) if dry_run else _write(state, rows)
        if row.paused:
            result.paused_slots += written
        else:
            result.missed_slots += written
        result.summarized += max(total - len(rows), 0)
        if written and not row.paused and not dry_run:
            logger.warning("taskguard %s: %d due slots were missed", row.task_name, total)
            run_missed.send(sender=row.task_name, slot=missing[-1], reason=rows[-1][2], count=total)
    if not dry_run:
        store.mark_swept(row.task_name, end)


def _end_pending(row: TaskSchedule, end: datetime, result: SweepResult) -> None:
    """Slots handed to a task queue (``pending``) at or before ``end`` (their grace ago)
    that no worker started end like slots nobody fired (a late worker may still run a
    missed one: catch-up). By hand-out time, whatever the slot: a backfilled slot is old
    when it is handed out."""
    if row.paused:
        state = RunState.SKIPPED
        why = f"paused: {row.paused_reason or 'paused'} (enqueued, not started; the sweep)"
    else:
        state = RunState.MISSED
        grace = row.grace.total_seconds()
        why = f"missed: enqueued, but no worker started it within its grace ({grace:g}s)"
    ended: list[datetime] = []
    while True:  # in batches, until none is left
        batch = ledger.end_pending(
            row.task_name, end, state=state, reason=why, actor=actor("sweep"), limit=ENUMERATE_CAP
        )
        ended += batch
        if len(batch) < ENUMERATE_CAP:
            break
    if not ended:
        return
    result.tasks[row.task_name] = result.tasks.get(row.task_name, 0) + len(ended)
    if row.paused:
        result.paused_slots += len(ended)
        return
    result.missed_slots += len(ended)
    logger.warning("taskguard %s: %d enqueued slots were never started", row.task_name, len(ended))
    run_missed.send(sender=row.task_name, slot=ended[-1], reason=why, count=len(ended))


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
        row.task_name, start, end, reason=why, actor=actor("sweep"), limit=MISSED_ROWS_CAP
    )
    if count:
        result.missed_slots += count
        result.tasks[row.task_name] = result.tasks.get(row.task_name, 0) + count
        logger.warning("taskguard %s: %d due slots were only called early", row.task_name, count)


def _missing(
    task_name: str, schedule: Schedule, start: datetime, end: datetime
) -> tuple[list[datetime], int]:
    """The slots in ``(start, end]`` with no row (listed when the window is small enough),
    and how many there are."""
    expected = schedule.count_between(start, end, ENUMERATE_CAP + 1)
    if expected == 0:
        return [], 0
    have = ledger.count_slots(task_name, start, end)
    if have >= expected:
        return [], 0
    if expected > ENUMERATE_CAP:
        newest = schedule.latest_slot(end)
        exact = schedule.count_between(start, end, 10**9) if expected <= 10**7 else expected
        gone = max(exact - have, 1)
        return ([] if ledger.row_exists(task_name, newest) else [newest]), gone
    existing = ledger.slots_in(task_name, start, end)
    slots = [slot for slot in schedule.slots_between(start, end, expected) if slot not in existing]
    return slots, len(slots)


def _rows(
    row: TaskSchedule, missing: list[datetime], total: int, start: datetime, end: datetime
) -> list[tuple[str, datetime, str]]:
    grace = row.grace.total_seconds()
    if row.paused:
        why = f"paused: {row.paused_reason or 'paused'} (recorded by the missed-slot sweep)"
    else:
        why = f"missed: no instance claimed it within its grace ({grace:g}s)"
    if total <= MISSED_ROWS_CAP and len(missing) == total:
        return [(row.task_name, slot, why) for slot in missing]
    if not missing:
        return []
    listed = missing[: MISSED_ROWS_CAP - 1] if len(missing) == total else []
    last = missing[-1]
    others = total - len(listed) - 1
    summary = (
        f"{why}; this row also stands for {others} other slots between {start.isoformat()} and "
        f"{end.isoformat()} that have no row (at most {MISSED_ROWS_CAP} rows per task and sweep)"
    )
    return [(row.task_name, slot, why) for slot in listed] + [(row.task_name, last, summary)]


def _write(state: str, rows: list[tuple[str, datetime, str]]) -> int:
    return ledger.insert_unheld_many(state, rows, actor=actor("sweep"))
