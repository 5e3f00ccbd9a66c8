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

import functools
import logging
from collections import deque
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from django.db import DatabaseError
from django.utils.translation import ngettext

from . import data_schedules, ledger, pauses
from .conf import taskguard_settings
from .cron import NEXT_SLOT_HORIZON
from .exceptions import BackendUnavailable
from .ledger import owed as owed_store
from .ledger import schedules as store
from .logfields import log_fields
from .models import TaskSchedule
from .owner import actor
from .policy import Policy
from .schedules import StoredSchedule, rebuild
from .signals import run_missed
from .states import RunState

logger = logging.getLogger("taskguard.missed")

# Slots judged per read and write; batches per schedule and sweep (the rest: the next sweep).
SWEEP_BATCH = 1_000
MAX_BATCHES = 50
# Due schedules read at a time (memory bounded by the page, whatever the schedules).
SWEEP_PAGE = 500
EPSILON = timedelta(microseconds=1)
# Pending slots ended per statement.
PENDING_BATCH = 10_000
# Slots of one owed window judged per sweep (the rest: the next sweep).
OWED_SLOTS = SWEEP_BATCH * MAX_BATCHES
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
        # The targets' policies looked up this sweep (a data schedule that leaves its grace
        # empty follows its target's): each target once, whatever its schedules.
        policies: dict[str, Policy] = {}
        if not dry_run:
            _end_pending_of_all(now, task, result, policies)
            _judge_owed(now, floor, task, result)
        due = store.sweep_due(now, task)
        for start in range(0, len(due), SWEEP_PAGE):
            rows = store.sweep_page(due[start : start + SWEEP_PAGE])
            _sweep_page(rows, now, floor, dry_run, result, policies)
    except (BackendUnavailable, DatabaseError):
        # A long-lived caller (run_schedules' sweeper thread) sweeps again later: drop a
        # connection that failed so that the next sweep reconnects.
        try:
            ledger.settle_connection()
        except Exception:
            logger.warning(
                "taskguard: the sweep could not close a failed connection",
                exc_info=True,
                extra=log_fields("connection.close_failed"),
            )
        raise
    return result


@dataclass
class _Work:
    """One schedule in a page: the slots it still has to judge, ``(judged, end]``."""

    row: TaskSchedule
    schedule: StoredSchedule
    grace: timedelta  # what it follows (data_schedules.followed)
    judged: datetime
    end: datetime
    found: _Found
    taken: int = 0  # slot batches judged this sweep
    slots: list[datetime] = field(default_factory=list)  # the batch being judged
    until: datetime | None = None  # where this batch ends


def _sweep_page(
    rows: list[TaskSchedule],
    now: datetime,
    floor: datetime,
    dry_run: bool,
    result: SweepResult,
    policies: dict[str, Policy],
) -> None:
    """Judge a page of due schedules together: the early refusals, then batches of slots
    across schedules (one read of rows, one write of missed and one of skipped slots, one
    write of the marks per batch of about ``SWEEP_BATCH`` slots)."""
    windows = store.pause_windows_many(rows)
    works: list[_Work] = []
    idle: list[tuple[TaskSchedule, datetime | None, datetime]] = []
    for row in rows:
        try:
            work = _start(row, now, floor, windows[row.task_name], policies)
        except Exception:
            _skip(row)
            continue
        if work.end <= work.judged:
            idle.append((row, None, _next_due(work)))
        else:
            works.append(work)
    if not dry_run:
        _miss_refused_early(works, result)
        store.mark_swept_many(idle)
    queue = deque(works)
    while queue:
        batch: list[_Work] = []
        total = 0
        while queue and total < SWEEP_BATCH:
            work = queue.popleft()
            try:
                work.slots = work.schedule.slots_between(work.judged, work.end, SWEEP_BATCH)
                work.slots = [slot for slot in work.slots if _within(work.row, slot)]
            except Exception:
                _skip(work.row)
                continue
            full = len(work.slots) == SWEEP_BATCH
            work.until = work.slots[-1] if full else work.end
            batch.append(work)
            total += len(work.slots)
        _judge(batch, dry_run)
        for work in batch:
            work.judged = work.until or work.judged
            work.taken += 1
            if work.judged < work.end and work.taken < MAX_BATCHES:
                queue.append(work)
            else:
                if work.judged < work.end:
                    logger.warning(
                        "taskguard %s: the sweep judged its slots up to %s; the next sweep "
                        "goes on to %s",
                        work.row.task_name,
                        work.judged.isoformat(),
                        work.end.isoformat(),
                        extra=log_fields(
                            "sweep.partial", task=work.row.task_name, slot=work.judged
                        ),
                    )
                work.found.report(result, dry_run)


def _start(
    row: TaskSchedule,
    now: datetime,
    floor: datetime,
    windows: list[store.PauseWindow],
    policies: dict[str, Policy],
) -> _Work:
    """What the sweep judges of ``row``: its slots after its mark (and ``starts``) up to its
    grace ago (and ``ends``)."""
    judged = max(row.swept_until or row.first_seen, floor)
    if row.starts is not None:
        judged = max(judged, row.starts - EPSILON)
    grace = data_schedules.followed(row, policies).grace
    end = now - grace
    if row.ends is not None:
        end = min(end, row.ends)
    schedule = rebuild(row.cron, row.cron_day_or, store.zone_of(row), row.every)
    return _Work(row, schedule, grace, judged, end, _Found(row, windows, grace))


def _within(row: TaskSchedule, slot: datetime) -> bool:
    return (row.starts is None or slot >= row.starts) and (row.ends is None or slot <= row.ends)


def _next_due(work: _Work) -> datetime:
    """When the sweep next needs to look at ``work``'s schedule: its first slot after what it
    judged, plus its grace (never, when its ``ends`` comes first)."""
    row = work.row
    return _next_look(
        row.cron, row.cron_day_or, store.zone_of(row), row.every, work.judged, row.starts,
        row.ends, work.grace,
    )  # fmt: skip


@functools.lru_cache(maxsize=4_096)
def _next_look(
    cron: str,
    day_or: bool,
    zone: str,
    every: timedelta | None,
    judged: datetime,
    starts: datetime | None,
    ends: datetime | None,
    grace: timedelta,
) -> datetime:
    # Cached: 10,000 schedules of one cron swept to the same slot share their next look.
    after = judged if starts is None else max(judged, starts - EPSILON)
    slot = rebuild(cron, day_or, zone, every).next_slot(after)
    if slot is None:  # a cron with no slot within its horizon: look again then
        return after + NEXT_SLOT_HORIZON
    if ends is not None and slot > ends:
        return store.NEVER
    return slot + grace


def _judge(batch: list[_Work], dry_run: bool) -> None:
    """One batch: which slots have no row, written as missed (or skipped while paused), and
    each schedule's mark and next look moved over what the batch judged."""
    pairs = [(work.row.task_name, slot) for work in batch for slot in work.slots]
    without: dict[str, list[datetime]] = {}
    for name, slot in ledger.pairs_without_row(pairs) if pairs else []:
        without.setdefault(name, []).append(slot)
    missed: list[tuple[str, datetime, str]] = []
    skipped: list[tuple[str, datetime, str]] = []
    for work in batch:
        work.found.sort(without.get(work.row.task_name, []), missed, skipped)
    written_missed = _write(RunState.MISSED, missed, dry_run)
    written_skipped = _write(RunState.SKIPPED, skipped, dry_run)
    for work in batch:
        work.found.count(written_missed, written_skipped)
    if not dry_run:
        store.mark_swept_many([(work.row, work.until, _next_due(_after(work))) for work in batch])


def _after(work: _Work) -> _Work:
    """``work`` as it stands once this batch is judged (for its next look)."""
    return _Work(
        work.row, work.schedule, work.grace, work.until or work.judged, work.end, work.found
    )


def _write(
    state: str, rows: list[tuple[str, datetime, str]], dry_run: bool
) -> set[tuple[str, datetime]] | None:
    """Write ``rows``; the pairs not written because they had a row by then (None: all of
    them were written, or this is a dry run)."""
    if dry_run or not rows:
        return None
    written = ledger.insert_unheld_many(state, rows, actor=actor("sweep"))
    # A claim, or another copy's sweep (in the same state), got the others first: not ours,
    # neither counted nor signalled here (run_missed, and so a missed check-in, once).
    left = {(name, slot) for name, slot, _ in rows if (name, slot) not in written}
    return left or None


def _skip(row: TaskSchedule) -> None:
    # This schedule's own trouble (a stored zone this copy's tzdata lacks, a cron it cannot
    # read): its mark stays where it was, the others go on.
    logger.exception(
        "taskguard %s: the sweep skipped this schedule (its slots are judged again next sweep)",
        row.task_name,
        extra=log_fields("sweep.schedule_failed", task=row.task_name),
    )


class _Found:
    """One schedule's slots without a row, sorted into missed and paused, and what was
    written."""

    def __init__(
        self,
        row: TaskSchedule,
        windows: list[store.PauseWindow],
        grace: timedelta,
        reason: str | None = None,
    ) -> None:
        self.row = row
        self.windows = windows
        self.missed_reason = reason or _missed_reason(grace)
        self.missed = self.paused = 0
        self.last_missed: datetime | None = None
        self.missed_slots: list[datetime] = []  # every slot recorded missed, oldest first
        self._missed: list[datetime] = []
        self._paused: list[datetime] = []

    def sort(
        self,
        slots: list[datetime],
        missed: list[tuple[str, datetime, str]],
        skipped: list[tuple[str, datetime, str]],
    ) -> None:
        name = self.row.task_name
        self._missed, self._paused = [], []
        for slot in slots:
            window = next((w for w in self.windows if w.covers(slot)), None)
            if window is None:
                missed.append((name, slot, self.missed_reason))
                self._missed.append(slot)
            else:
                skipped.append((name, slot, _paused_reason(self.row, window)))
                self._paused.append(slot)

    def count(
        self,
        left_missed: set[tuple[str, datetime]] | None,
        left_skipped: set[tuple[str, datetime]] | None,
    ) -> None:
        """Count what this batch wrote (``left_*``: pairs another writer took first)."""
        name = self.row.task_name
        missed = [s for s in self._missed if left_missed is None or (name, s) not in left_missed]
        self.missed += len(missed)
        self.paused += sum(
            1 for s in self._paused if left_skipped is None or (name, s) not in left_skipped
        )
        if missed:
            self.last_missed = missed[-1]
            self.missed_slots.extend(missed)

    def report(self, result: SweepResult, dry_run: bool) -> None:
        name = self.row.task_name
        if self.missed or self.paused:
            result.tasks[name] = result.tasks.get(name, 0) + self.missed + self.paused
        result.missed_slots += self.missed
        result.paused_slots += self.paused
        if self.missed and not dry_run and self.last_missed is not None:
            logger.warning(
                ngettext(
                    "taskguard %s: %d due slot was missed",
                    "taskguard %s: %d due slots were missed",
                    self.missed,
                ),
                name,
                self.missed,
                extra=log_fields(
                    "sweep.missed",
                    task=name,
                    slot=self.last_missed,
                    state="missed",
                    reason=self.missed_reason,
                ),
            )
            run_missed.send(
                sender=name,
                slot=self.last_missed,
                reason=self.missed_reason,
                count=self.missed,
                slots=self.missed_slots,
            )


def _paused_reason(row: TaskSchedule, window: store.PauseWindow | None) -> str:
    if row.paused and (window is None or window.end is None):
        return f"{pauses.paused_words(row.paused_reason)} (recorded by the missed-slot sweep)"
    if window is None or window.start is None or window.end is None:
        return "paused (recorded by the missed-slot sweep)"
    return (
        f"paused: due while the task was paused from {window.start.isoformat()} to "
        f"{window.end.isoformat()} (recorded by the missed-slot sweep)"
    )


def _end_pending(row: TaskSchedule, grace: timedelta, end: datetime, result: SweepResult) -> None:
    """Slots handed to a task queue or given back (``pending``) at or before ``end`` (their
    grace ago) that no worker started end like slots nobody fired (a late worker may still
    run a missed one: catch-up). By hand-out (or give-back) time, whatever the slot (a
    backfilled slot is old when it is handed out): handed out while the task was paused,
    ``skipped``."""
    window = store.pause_window(row)
    if window is not None:
        why = f"{pauses.paused_words(row.paused_reason)} (pending, not started; the sweep)"
        ended = _end_pending_all(row, end, RunState.SKIPPED, why, window.start, window.end)
        result.paused_slots += len(ended)
        _count(result, row.task_name, len(ended))
    why = (
        "missed: pending (handed out or given back) and not started within its grace "
        f"({grace.total_seconds():g}s)"
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
        extra=log_fields("sweep.pending_expired", task=row.task_name, state="missed"),
    )
    run_missed.send(sender=row.task_name, slot=ended[-1], reason=why, count=len(ended), slots=ended)


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


def _miss_refused_early(works: list[_Work], result: SweepResult) -> None:
    """Due slots whose row only recorded an early call's refusal, that no on-time call
    took within their grace, are missed like slots with no row (read for the whole page at
    once; not while paused)."""
    windows = [(w.row.task_name, w.judged, w.end) for w in works if not w.row.paused]
    _miss_refused(windows, {w.row.task_name: w.grace for w in works}, result)


def _miss_refused(
    windows: list[tuple[str, datetime, datetime]],
    graces: dict[str, timedelta],
    result: SweepResult,
) -> None:
    """Turn ``(task, after, until)`` windows' slots only called early into missed (one read
    for all of them), counted and said per task."""
    if not windows:
        return
    reasons = {
        name: (
            "missed: only a call ahead of the clock came (refused), and no instance claimed "
            f"it on time within its grace ({grace.total_seconds():g}s)"
        )
        for name, grace in graces.items()
    }
    changed = ledger.refused_early_many(windows, reasons=reasons, actor=actor("sweep"))
    for name, count in changed.items():
        result.missed_slots += count
        _count(result, name, count)
        logger.warning(
            "taskguard %s: %d due slots were only called early",
            name,
            count,
            extra=log_fields("sweep.called_early", task=name, state="missed"),
        )


def _missed_reason(grace: timedelta) -> str:
    return f"missed: no instance claimed it within its grace ({grace.total_seconds():g}s)"


def _end_pending_of_all(
    now: datetime, task: str | None, result: SweepResult, policies: dict[str, Policy]
) -> None:
    """End the pending slots past their grace: one read finds the tasks that have any (a
    schedule with none costs nothing), then each of those is ended as before, whether its
    schedule is still judged or not (one deleted or disabled after a "run now" too)."""
    names = ledger.tasks_pending(now)
    if task is not None:
        names = [name for name in names if name == task]
    for row in store.judged_named(names, every=True):
        grace = data_schedules.followed(row, policies).grace
        _end_pending(row, grace, now - grace, result)


def _judge_owed(now: datetime, floor: datetime, task: str | None, result: SweepResult) -> None:
    """The owed windows whose grace has passed (ledger/owed.py: the slots of a data
    schedule's definition that an edit of its slots, a disable or a deletion ended before
    the sweep had judged them), a page of schedules at a time: each of their slots without
    a row is recorded as any other (missed, or skipped while paused), in batches across the
    page's windows. At most ``SWEEP_BATCH * MAX_BATCHES`` slots per window and sweep: the
    rest of a window stays owed."""
    ids = owed_store.owed_due(now, task)
    for start in range(0, len(ids), SWEEP_PAGE):
        _judge_owed_page(owed_store.owed_page(ids[start : start + SWEEP_PAGE]), now, floor, result)


def _judge_owed_page(
    rows: list[TaskSchedule], now: datetime, floor: datetime, result: SweepResult
) -> None:
    windows = store.pause_windows_many(rows)
    judged: list[tuple[str, list[datetime], _Found]] = []
    refused: list[tuple[str, datetime, datetime]] = []
    graces: dict[str, timedelta] = {}
    settled: list[tuple[TaskSchedule, list[owed_store.Owed]]] = []
    for row in rows:
        left: list[owed_store.Owed] = []
        for value in row.owed:
            try:
                window = owed_store.Owed.of(value)
            except Exception:  # not what the ledger wrote (edited by hand): dropped, said
                logger.exception(
                    "taskguard %s: an owed window cannot be read and is dropped: %r",
                    row.task_name,
                    value,
                    extra=log_fields("sweep.owed_dropped", task=row.task_name),
                )
                continue
            if window.due_at > now:
                left.append(window)
                continue
            try:
                slots = window.slots(floor, OWED_SLOTS)
            except Exception:  # a zone this copy's tzdata lacks: another copy may judge it
                _skip(row)
                left.append(window)
                continue
            if len(slots) == OWED_SLOTS:
                left.append(replace(window, since=slots[-1]))
                logger.warning(
                    "taskguard %s: the sweep judged its slots up to %s; the next sweep goes on "
                    "to %s",
                    row.task_name,
                    slots[-1].isoformat(),
                    window.until.isoformat(),
                    extra=log_fields("sweep.partial", task=row.task_name, slot=slots[-1]),
                )
            reason = (
                f"{_missed_reason(window.grace)}; its schedule (version {window.version}) "
                "was changed since"
            )
            found = _Found(row, windows[row.task_name], window.grace, reason)
            judged.append((row.task_name, slots, found))
            if not row.paused:
                refused.append((row.task_name, window.since, slots[-1] if slots else window.since))
                graces[row.task_name] = window.grace
        settled.append((row, left))
    _write_owed(judged)
    _miss_refused(refused, graces, result)
    for _name, _slots, found in judged:
        found.report(result, False)
    owed_store.settle(settled)


def _write_owed(judged: list[tuple[str, list[datetime], _Found]]) -> None:
    """Record the owed slots without a row, ``SWEEP_BATCH`` at a time across windows (one
    read, one write of missed and one of skipped slots per batch)."""
    pairs = [(name, slot, found) for name, slots, found in judged for slot in slots]
    for start in range(0, len(pairs), SWEEP_BATCH):
        batch = pairs[start : start + SWEEP_BATCH]
        without = set(ledger.pairs_without_row([(name, slot) for name, slot, _ in batch]))
        by_window: dict[int, tuple[_Found, list[datetime]]] = {}
        for name, slot, found in batch:
            if (name, slot) in without:
                by_window.setdefault(id(found), (found, []))[1].append(slot)
        missed: list[tuple[str, datetime, str]] = []
        skipped: list[tuple[str, datetime, str]] = []
        for found, slots in by_window.values():
            found.sort(slots, missed, skipped)
        left_missed = _write(RunState.MISSED, missed, False)
        left_skipped = _write(RunState.SKIPPED, skipped, False)
        for found, _slots in by_window.values():
            found.count(left_missed, left_skipped)


def _count(result: SweepResult, task_name: str, slots: int) -> None:
    if slots:
        result.tasks[task_name] = result.tasks.get(task_name, 0) + slots
