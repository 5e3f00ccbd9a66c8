"""The scheduler loop behind ``manage.py run_schedules``.

It fires every registered plain-function schedule at its slots, in this process, on a
bounded pool of threads (with ``enqueue``: hands each due slot to the schedule's task
queue instead, see :mod:`.handoff`). Any number of copies may run on any number of hosts: each
copy fires every slot and the guard decides which call runs it (G1-G3 as for any
guarded call). Slots are computed on this process's clock (``timezone.now()``);
clocks that disagree by less than ``SLOT_TOLERANCE_SECONDS`` still agree on every
slot, because a slot is a fixed point of the schedule, not "now".

Catch-up, per schedule (see docs/schedules.md): ``latest`` fires the newest due slot;
``none`` fires every due slot and the guard records a slot later than its grace
``missed``; ``all`` fires every slot after the task's newest row, in order, at most
``max_catchup`` (the newest ones).
"""

from __future__ import annotations

import functools
import heapq
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Protocol

from django.db import DatabaseError, connections
from django.utils import timezone

from . import ledger
from .batch import SuccessWriter
from .conf import taskguard_settings
from .data_firing import DataSchedules, Due, Firing, Job, slots_after
from .dispatch import NOT_RUN_HERE, Dispatcher, batchable, not_run
from .dispatch import Entry as DueEntry
from .exceptions import BackendUnavailable
from .guard import refused_early
from .handoff import hand_off
from .logfields import log_fields
from .missed import sweep_missed
from .pool import Pool
from .registry import Entry
from .upkeep import automatic, due_here, run_upkeep, upkeep_wait

logger = logging.getLogger("taskguard.scheduler")

# How far ahead the next slot of a schedule is looked for (a cron that fires once a year).
LOOKAHEAD = timedelta(days=400)
# The loop wakes at least this often (a stop, a clock step).
MAX_SLEEP = 1.0
# A clock that goes back more than this (a step, not jitter) is logged.
CLOCK_STEP = timedelta(seconds=1)


class Stop(Protocol):
    """What stops :meth:`Scheduler.run` (a ``threading.Event`` will do)."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


@dataclass
class _Cursor:
    """Per schedule: the newest slot handed to the pool, and the next one after it."""

    fired: datetime
    next_slot: datetime | None = None


@dataclass
class Scheduler:
    entries: list[Entry]
    max_workers: int = 8
    sweep_every: float = 60.0
    batch: bool = True  # claim the schedules due at one slot together (PostgreSQL)
    enqueue: bool = False  # hand due slots to each entry's task queue instead of running them
    # Per task, when its schedule was first registered: no slot before it is fired.
    first_seen: dict[str, datetime] = field(default_factory=dict)
    _cursors: dict[str, _Cursor] = field(default_factory=dict)
    _fired: int = 0
    _clock: datetime | None = None  # the "now" of the last due()
    _heap: list[tuple[datetime, str]] = field(default_factory=list)  # (next slot, task)
    _planned: bool = False  # the heap holds every schedule's next slot
    _by_name: dict[str, Entry] = field(default_factory=dict)
    # The data schedules this copy fires (None: none, ``--task`` named code schedules only).
    data: DataSchedules | None = None

    def __post_init__(self) -> None:
        self.pool = Pool(self.max_workers)
        self.writer = SuccessWriter()
        self.stopping = threading.Event()  # no claim starts a body any more
        self.dispatcher = Dispatcher(
            self.pool, self.writer, self.stopping, self._run_slot, self._log
        )

    # -- what is due -------------------------------------------------------------

    def first_due(self, now: datetime) -> list[tuple[Entry, list[datetime]]]:
        """At start: the newest slot of each schedule; under ``catchup="all"`` every slot
        after the task's newest row (the newest ``max_catchup``). Never a slot from before
        the schedule was first registered (a new daily job does not run at deploy time)."""
        due = []
        for entry in self.entries:
            latest = entry.schedule.latest_slot(now)
            slots = [latest]
            if entry.policy.catchup == "all":
                since = ledger.latest_slot(entry.task_name)
                if since is not None and since < latest:
                    slots = self._after(entry, since, latest)
            self._cursors[entry.task_name] = _Cursor(latest)
            born = self.first_seen.get(entry.task_name)
            slots = [slot for slot in slots if born is None or slot >= born]
            if slots:
                due.append((entry, slots))
        return due

    def due(self, now: datetime) -> list[tuple[Entry, list[datetime]]]:
        """The slots that fell due since the last call, per schedule (a heap of next slots:
        a call costs nothing for the schedules that are not due)."""
        self._watch_clock(now)
        if not self._planned:
            self._planned = True
            self._by_name = {entry.task_name: entry for entry in self.entries}
            for entry in self.entries:
                self._plan(entry)
        due = []
        while self._heap and self._heap[0][0] <= now:
            _, name = heapq.heappop(self._heap)
            entry = self._by_name[name]
            cursor = self._cursors[name]
            latest = entry.schedule.latest_slot(now)
            if latest <= cursor.fired:  # a re-check (no slot was within LOOKAHEAD): none yet
                self._plan(entry, max(cursor.fired, now))
                continue
            slots = self._after(entry, cursor.fired, latest)
            if entry.policy.catchup == "latest":
                # This loop woke late (a busy host): the slots still within their grace
                # run; older ones are left to the sweep, the newest always runs.
                grace = entry.policy.grace
                slots = [slot for slot in slots[:-1] if now - slot <= grace] + [latest]
            cursor.fired = latest
            self._plan(entry, max(latest, now))
            due.append((entry, slots))
        return due

    def _plan(self, entry: Entry, after: datetime | None = None) -> None:
        """Put ``entry``'s next slot after ``after`` (default: the one it fired last) on the
        heap; with none within :data:`LOOKAHEAD` (a cron of February 29th), a re-check then."""
        cursor = self._cursors[entry.task_name]
        after = cursor.fired if after is None else after
        cursor.next_slot = self._next(entry, after)
        wake = after + LOOKAHEAD if cursor.next_slot is None else cursor.next_slot
        heapq.heappush(self._heap, (wake, entry.task_name))

    def _watch_clock(self, now: datetime) -> None:
        """Log a clock stepped back: nothing fires until it is past the slots it fired."""
        if self._clock is not None and now < self._clock - CLOCK_STEP:  # once per step
            logger.warning(
                "run_schedules: this host's clock went back %.1fs (from %s to %s); slots "
                "after the ones already fired run when the clock reaches them again",
                (self._clock - now).total_seconds(),
                self._clock.isoformat(),
                now.isoformat(),
                extra=log_fields("scheduler.clock_back"),
            )
        self._clock = now

    def next_wakeup(self) -> datetime | None:
        slots = [self._heap[0][0]] if self._heap else []
        if self.data is not None and (start := self.data.next_start()) is not None:
            slots.append(start)
        return min(slots) if slots else None

    def _after(self, entry: Entry, since: datetime, latest: datetime) -> list[datetime]:
        """The slots in ``(since, latest]``, the newest ``max_catchup`` of them."""
        return slots_after(entry.schedule, entry.policy, since, latest)

    def _next(self, entry: Entry, after: datetime) -> datetime | None:
        found = entry.schedule.slots_between(after, after + LOOKAHEAD, 1)
        return found[0] if found else None

    # -- firing ------------------------------------------------------------------

    def fire(self, due: Iterable[tuple[Entry, list[datetime]]]) -> None:
        """Hand each schedule's due slots to the pool; one schedule's run in order.

        Schedules due at the same slot are claimed together, in batches no larger than
        the workers free to start them (PostgreSQL): see :mod:`.dispatch`.
        """
        due = self._in_time(due)
        if self.enqueue:
            for entry, slots in due:
                self.pool.submit(functools.partial(self._hand_off, entry, slots))
            return
        batches: dict[datetime, list[Entry]] = {}
        now = timezone.now()
        for entry, slots in due:
            if self.batch and len(slots) == 1 and batchable(entry, slots[0], now):
                batches.setdefault(slots[0], []).append(entry)
            else:
                self.pool.submit(functools.partial(self._run, entry, slots))
        for slot, entries in batches.items():
            if len(entries) == 1:
                self.pool.submit(functools.partial(self._run, entries[0], [slot]))
                continue
            # From a random starting schedule: copies claim different ones first and
            # share the work.
            entries.sort(key=lambda entry: entry.task_name)
            start = random.randrange(len(entries))
            self.dispatcher.add(slot, entries[start:] + entries[:start])

    def _in_time(
        self, due: Iterable[tuple[Entry, list[datetime]]]
    ) -> list[tuple[Entry, list[datetime]]]:
        """The due slots this copy may fire: one more than ``SLOT_TOLERANCE_SECONDS`` ahead
        of the database's clock (this copy's clock is fast) is refused and recorded, as any
        early call's slot is, and an on-time copy still runs it."""
        due = list(due)
        if not due:
            return due
        tolerance = timedelta(seconds=taskguard_settings.SLOT_TOLERANCE_SECONDS)
        try:
            now = ledger.database_now()
        except BackendUnavailable:
            ledger.settle_connection()  # the claims say what is wrong
            return due
        kept = []
        for entry, slots in due:
            for slot in slots:
                if slot - now > tolerance:
                    self.pool.submit(functools.partial(self._refuse_early, entry, slot, tolerance))
            slots = [slot for slot in slots if slot - now <= tolerance]
            if slots:
                kept.append((entry, slots))
        return kept

    def _refuse_early(self, entry: Entry, slot: datetime, tolerance: timedelta) -> None:
        try:
            reason = refused_early(entry.task_name, slot, tolerance)
        except Exception as exc:
            reason = f"raised {type(exc).__name__}: {exc}"
        if reason is None:  # judged again: the database's clock caught up meanwhile
            (self._hand_off if self.enqueue else self._run)(entry, [slot])
            return
        outcome = f"not run here: this copy's clock is ahead of the database's clock; {reason}"
        self._log(entry, slot, outcome, 0.0)

    def _log(self, entry: DueEntry, slot: datetime, outcome: str, took: float) -> None:
        self._say(entry.task_name, slot, outcome, took)

    def _say(self, task_name: str, slot: datetime, outcome: str, took: float) -> None:
        self._fired += 1
        logger.info(
            "fired %s slot %s: %s in %.3fs",
            task_name,
            slot.isoformat(),
            outcome,
            took,
            extra=log_fields("scheduler.fired", task=task_name, slot=slot, reason=outcome),
        )

    # -- data schedules ------------------------------------------------------------

    def _fire_data(self, read: Callable[[datetime], list[Due]]) -> None:
        """Fire the data schedules' slots that ``read`` finds due (a poll, the heap), then
        those the database failed before (reading them, or their claim), read apart: one
        that keeps failing holds up no other."""
        data = self.data
        if data is None:
            return
        now = timezone.now()
        due: list[Due] = []

        def fresh() -> list[Job]:
            due.extend(read(now))
            return data.jobs(due, now)

        jobs = self._data_jobs(fresh)
        if jobs is not None:  # the database answered: the carried slots' turn
            jobs += self._data_jobs(lambda: data.jobs(data.carried(now, due), now)) or []
        if not jobs:
            return
        tolerance = timedelta(seconds=taskguard_settings.SLOT_TOLERANCE_SECONDS)
        try:
            db_now: datetime | None = ledger.database_now()
        except BackendUnavailable:
            ledger.settle_connection()
            db_now = None
        now = timezone.now()
        batches: dict[datetime, list[Firing]] = {}
        for job in jobs:
            early = db_now is not None and job.slot - db_now > tolerance
            firing = Firing(job, data)
            if (
                self.batch
                and not early
                and data.batchable(job)
                and batchable(firing, job.slot, now)
            ):
                batches.setdefault(job.slot, []).append(firing)
            else:
                self.pool.submit(functools.partial(self._run_data, job, early, tolerance))
        for slot, firings in batches.items():
            if len(firings) == 1:
                self.pool.submit(
                    functools.partial(self._run_data, firings[0].job, False, tolerance)
                )
                continue
            # As code schedules (fire): claimed together, from a random starting schedule.
            firings.sort(key=lambda firing: firing.task_name)
            start = random.randrange(len(firings))
            self.dispatcher.add(slot, firings[start:] + firings[:start])

    def _data_jobs(self, read: Callable[[], list[Job]]) -> list[Job] | None:
        """``read()``, or None when it failed (logged: the database's failure carried its
        slots, DataSchedules.carry; anything else is this copy's bug, and the sweep)."""
        try:
            return read()
        except (BackendUnavailable, DatabaseError) as exc:
            ledger.settle_connection()
            logger.warning(
                "run_schedules: the data schedules could not be read (%s); their due slots "
                "are tried again within their grace",
                exc,
                extra=log_fields("scheduler.data_read_failed", reason=exc),
            )
        except Exception:  # never the loop's end: the next tick, and the sweep, go on
            logger.exception(
                "run_schedules: reading the data schedules failed",
                extra=log_fields("scheduler.data_read_failed"),
            )
        return None

    def _run_data(self, job: Job, early: bool, tolerance: timedelta) -> None:
        assert self.data is not None
        if self.stopping.is_set():
            return  # not claimed: the sweep records it, unless another copy runs it
        started = time.monotonic()
        try:
            if early and (reason := refused_early(job.task_name, job.slot, tolerance)):
                outcome = f"not run here: this copy's clock is ahead of the database's; {reason}"
            else:
                outcome = self.data.run(job)
        except BaseException as exc:  # SystemExit from a body too: recorded failed
            outcome = f"raised {type(exc).__name__}: {exc}"
        self._say(job.task_name, job.slot, outcome, time.monotonic() - started)

    def _run_slot(self, entry: DueEntry, slot: datetime) -> None:
        self._run(entry, [slot])

    def _run(self, entry: DueEntry, slots: list[datetime]) -> None:
        for slot in slots:
            if self.stopping.is_set():
                return  # not claimed: the sweep records it, unless another copy runs it
            started = time.monotonic()
            try:
                ran = entry.fire(slot)
            except BaseException as exc:  # SystemExit from a body too: recorded failed
                outcome = f"raised {type(exc).__name__}: {exc}"
            else:
                outcome = "ran" if ran else not_run(entry, slot, NOT_RUN_HERE)
            self._log(entry, slot, outcome, time.monotonic() - started)

    def _hand_off(self, entry: Entry, slots: list[datetime]) -> None:
        for slot in slots:
            started = time.monotonic()
            try:
                outcome = hand_off(entry, slot)
            except Exception as exc:
                outcome = f"raised {type(exc).__name__}: {exc}"
            self._log(entry, slot, outcome, time.monotonic() - started)

    # -- the loop ----------------------------------------------------------------

    def run_once(self, timeout: float | None = None) -> tuple[int, bool]:
        """Fire what is due now (and sweep), wait up to ``timeout`` for it to finish;
        return the fires, and False when some calls were still running."""
        self.fire(self.first_due(timezone.now()))
        if self.data is not None:
            self._fire_data(functools.partial(self.data.load, start=True))
            if (retry := self.data.retry_in()) is not None:  # the database failed: once more
                time.sleep(retry)
                self._fire_data(lambda now: [])
        self.sweep(force=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        settled = self.dispatcher.settle(timeout)
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        finished = settled and self.pool.drain(left)
        self._close(finished, timeout)
        return self._fired, finished

    def run(self, stop: Stop, stop_timeout: float) -> bool:
        """Fire every slot until ``stop`` is set, then wait up to ``stop_timeout`` for the
        calls still running; False when some were still running. Claims not started by
        then are given back; slots not claimed yet are left to the sweep."""
        self.fire(self.first_due(timezone.now()))
        data = self.data
        if data is not None:
            self._fire_data(functools.partial(data.load, start=True))
        sweeper = threading.Thread(
            target=self._sweep_loop, args=(stop,), name="taskguard-sweep", daemon=True
        )
        sweeper.start()
        while not stop.is_set():
            self.fire(self.due(timezone.now()))
            wait = MAX_SLEEP
            if data is not None:
                self._fire_data(data.poll)
                self._fire_data(data.due)
                wait = min(wait, data.next_poll_in())
                if (retry := data.retry_in()) is not None:
                    wait = min(wait, retry)
            wakeup = self.next_wakeup()
            if wakeup is not None:
                wait = min(max((wakeup - timezone.now()).total_seconds(), 0.0), wait)
            stop.wait(wait)
        self.stopping.set()
        dropped = self.dispatcher.clear()
        if dropped:
            logger.info(
                "run_schedules stopping: %d slots left unclaimed",
                dropped,
                extra=log_fields("scheduler.stopping"),
            )
        finished = self.pool.drain(stop_timeout)
        self._close(finished, stop_timeout)
        return finished

    def _close(self, finished: bool, timeout: float | None) -> None:
        if not finished:
            logger.warning(
                "run_schedules stopping with %d calls still running after %gs: their leases "
                "lapse and cleanup_locks records them abandoned",
                self.pool.busy,
                timeout,
                extra=log_fields("scheduler.stop_timeout"),
            )
        self.dispatcher.close()
        self.pool.close()
        self.writer.close()

    def _sweep_loop(self, stop: threading.Event) -> None:
        try:
            while not stop.wait(self._sweep_wait()):
                self.sweep()
        finally:
            connections.close_all()

    def _sweep_wait(self) -> float:
        """``sweep_every``, or less when this process is due to attempt the upkeep sooner."""
        return min(self.sweep_every, upkeep_wait()) if automatic() else self.sweep_every

    def sweep(self, *, force: bool = False) -> None:
        """The upkeep when this process is due to attempt it (``force``: now; one process at
        a time across the fleet, see :mod:`.upkeep`), else this copy's missed-slot sweep."""
        if ((force and automatic()) or due_here()) and run_upkeep().get("taken"):
            return
        names = {entry.task_name for entry in self.entries}
        data = self.data
        try:
            result = sweep_missed()
        except Exception:
            logger.exception(
                "the missed-slot sweep failed; the next one tries again",
                extra=log_fields("sweep.failed"),
            )
            return
        mine = {
            name: count
            for name, count in result.tasks.items()
            if name in names or (data is not None and name in data.states)
        }
        if mine:
            logger.warning(
                "missed slots recorded: %s",
                mine,
                extra=log_fields("scheduler.missed_recorded", state="missed"),
            )
