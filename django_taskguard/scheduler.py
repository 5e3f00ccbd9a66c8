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
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, connections
from django.utils import timezone

from . import ledger
from .batch import SuccessWriter
from .claim import Taken, claim_many
from .conf import taskguard_settings
from .context import ActiveRun
from .guard import duplicate, run_claimed
from .handoff import hand_off
from .missed import sweep_missed
from .pauses import paused_reason
from .registry import Entry
from .states import RunState

logger = logging.getLogger("taskguard.scheduler")

# How far ahead the next slot of a schedule is looked for (a cron that fires once a year).
LOOKAHEAD = timedelta(days=400)
# The loop wakes at least this often (a stop, a clock step).
MAX_SLEEP = 1.0
# Schedules claimed by one statement.
BATCH_CHUNK = 100


def _batchable(entry: Entry, slot: datetime, now: datetime) -> bool:
    """A slot the batch claim decides like the one-task path would: on_stale="abandon",
    and not one that catchup="none" records missed for being late."""
    if entry.policy.on_stale != "abandon":
        return False
    return entry.policy.catchup != "none" or now - slot <= entry.policy.grace


class Pool:
    """A bounded set of daemon worker threads (a call still running at exit is cut off;
    its lease lapses and ``cleanup_locks`` records it ``abandoned``)."""

    def __init__(self, workers: int) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._busy = 0
        self._idle = threading.Condition()
        self._threads = [
            threading.Thread(target=self._work, name=f"taskguard-fire-{n}", daemon=True)
            for n in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._idle:
            self._busy += 1
        self._jobs.put(job)

    @property
    def busy(self) -> int:
        return self._busy

    def drain(self, timeout: float | None) -> bool:
        """Wait until every submitted job has finished; False if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                try:
                    job()
                finally:
                    with self._idle:
                        self._busy -= 1
                        self._idle.notify_all()
        finally:
            connections.close_all()


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

    def __post_init__(self) -> None:
        self.pool = Pool(self.max_workers)
        self.writer = SuccessWriter()

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
        """The slots that fell due since the last call, per schedule."""
        due = []
        for entry in self.entries:
            cursor = self._cursors[entry.task_name]
            if cursor.next_slot is None:
                cursor.next_slot = self._next(entry, cursor.fired)
            if cursor.next_slot is None or cursor.next_slot > now:
                continue
            latest = entry.schedule.latest_slot(now)
            slots = self._after(entry, cursor.fired, latest)
            if entry.policy.catchup == "latest":
                # This loop woke late (a busy host): the slots still within their grace
                # run; older ones are left to the sweep, the newest always runs.
                grace = entry.policy.grace
                slots = [slot for slot in slots[:-1] if now - slot <= grace] + [latest]
            cursor.fired, cursor.next_slot = latest, None
            due.append((entry, slots))
        return due

    def next_wakeup(self) -> datetime | None:
        slots = [cursor.next_slot for cursor in self._cursors.values() if cursor.next_slot]
        return min(slots) if slots else None

    def _after(self, entry: Entry, since: datetime, latest: datetime) -> list[datetime]:
        """The slots in ``(since, latest]``, the newest ``max_catchup`` of them (never one
        older than ``PRUNE_AFTER_DAYS``: the guard refuses those)."""
        horizon = timedelta(days=taskguard_settings.PRUNE_AFTER_DAYS) - timedelta(hours=1)
        since = max(since, latest - horizon)
        limit = entry.policy.max_catchup
        count = entry.schedule.count_between(since, latest, 10**7)
        if count > limit:
            # Start just before the first slot kept: the ``limit`` newest.
            step_back = entry.schedule.slots_between(since, latest, count - limit + 1)
            since = step_back[-2] if len(step_back) > 1 else since
        return entry.schedule.slots_between(since, latest, limit)

    def _next(self, entry: Entry, after: datetime) -> datetime | None:
        found = entry.schedule.slots_between(after, after + LOOKAHEAD, 1)
        return found[0] if found else None

    # -- firing ------------------------------------------------------------------

    def fire(self, due: Iterable[tuple[Entry, list[datetime]]]) -> None:
        """Hand each schedule's due slots to the pool; one schedule's run in order.

        Schedules due at the same slot are claimed together, in one statement
        (PostgreSQL), then their bodies run on the pool: see :meth:`_claim_batch`.
        """
        if self.enqueue:
            for entry, slots in due:
                self.pool.submit(functools.partial(self._hand_off, entry, slots))
            return
        batches: dict[datetime, list[Entry]] = {}
        now = timezone.now()
        for entry, slots in due:
            if self.batch and len(slots) == 1 and _batchable(entry, slots[0], now):
                batches.setdefault(slots[0], []).append(entry)
            else:
                self.pool.submit(functools.partial(self._run, entry, slots))
        for slot, entries in batches.items():
            if len(entries) == 1:
                self.pool.submit(functools.partial(self._run, entries[0], [slot]))
                continue
            # Chunks of disjoint schedules, each its own statement and commit, taken from a
            # random starting chunk: copies win different chunks and share the work.
            entries.sort(key=lambda entry: entry.task_name)
            chunks = [entries[n : n + BATCH_CHUNK] for n in range(0, len(entries), BATCH_CHUNK)]
            start = random.randrange(len(chunks))
            for chunk in chunks[start:] + chunks[:start]:
                self.pool.submit(functools.partial(self._claim_batch, slot, chunk))

    def _claim_batch(self, slot: datetime, entries: list[Entry]) -> None:
        """One statement claims ``slot`` for every entry; the won ones run on the pool,
        the taken ones are duplicates, the others (a pending, retrying, missed or stale
        row) go the one-task way. No Redis key is set: the row is the lock."""
        lease = taskguard_settings.LEASE_SECONDS
        wanted = [(entry.task_name, entry.policy.lease_seconds or lease) for entry in entries]
        try:
            decided = claim_many(slot, wanted)
        except Exception:
            logger.exception("the batch claim of slot %s failed; firing one by one", slot)
            decided = None
        if decided is None:
            for entry in entries:
                self.pool.submit(functools.partial(self._run, entry, [slot]))
            return
        for entry in entries:
            outcome = decided.get(entry.task_name)
            if isinstance(outcome, ActiveRun):
                self.pool.submit(functools.partial(self._run_claimed, entry, outcome))
            elif isinstance(outcome, Taken):
                duplicate(entry.task_name, slot, outcome.state, entry.policy)
                self._log(entry, slot, "not run here (another call has it)", 0.0)
            else:
                self.pool.submit(functools.partial(self._run, entry, [slot]))

    def _run_claimed(self, entry: Entry, active: ActiveRun) -> None:
        started = time.monotonic()
        ran = False

        def body() -> Any:
            nonlocal ran
            ran = True
            return entry.func()

        try:
            run_claimed(active, entry.policy, body, self.writer.record)
        except Exception as exc:
            outcome = f"raised {type(exc).__name__}: {exc}"
        else:
            outcome = "ran" if ran else _not_run(entry, active.slot, "not run (recorded)")
        self._log(entry, active.slot, outcome, time.monotonic() - started)

    def _log(self, entry: Entry, slot: datetime, outcome: str, took: float) -> None:
        self._fired += 1
        logger.info(
            "fired %s slot %s: %s in %.3fs", entry.task_name, slot.isoformat(), outcome, took
        )

    def _run(self, entry: Entry, slots: list[datetime]) -> None:
        for slot in slots:
            started = time.monotonic()
            try:
                ran = entry.fire(slot)
            except Exception as exc:
                outcome = f"raised {type(exc).__name__}: {exc}"
            else:
                outcome = "ran" if ran else _not_run(entry, slot, NOT_RUN_HERE)
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

    def run_once(self) -> int:
        """Fire what is due now (and sweep), wait for it to finish; return the fires."""
        self.fire(self.first_due(timezone.now()))
        self.sweep()
        self.pool.drain(None)
        self.pool.close()
        self.writer.close()
        return self._fired

    def run(self, stop: threading.Event, stop_timeout: float) -> bool:
        """Fire every slot until ``stop`` is set, then wait up to ``stop_timeout`` for the
        calls still running; False when some were still running."""
        self.fire(self.first_due(timezone.now()))
        sweeper = threading.Thread(
            target=self._sweep_loop, args=(stop,), name="taskguard-sweep", daemon=True
        )
        sweeper.start()
        while not stop.is_set():
            self.fire(self.due(timezone.now()))
            wakeup = self.next_wakeup()
            wait = MAX_SLEEP
            if wakeup is not None:
                wait = min(max((wakeup - timezone.now()).total_seconds(), 0.0), MAX_SLEEP)
            stop.wait(wait)
        finished = self.pool.drain(stop_timeout)
        if not finished:
            logger.warning(
                "run_schedules stopping with %d calls still running after %gs: their leases "
                "lapse and cleanup_locks records them abandoned",
                self.pool.busy,
                stop_timeout,
            )
        self.pool.close()
        self.writer.close()
        return finished

    def _sweep_loop(self, stop: threading.Event) -> None:
        try:
            while not stop.wait(self.sweep_every):
                self.sweep()
        finally:
            connections.close_all()

    def sweep(self) -> None:
        names = {entry.task_name for entry in self.entries}
        try:
            result = sweep_missed()
        except Exception:
            logger.exception("the missed-slot sweep failed; the next one tries again")
            return
        mine = {name: count for name, count in result.tasks.items() if name in names}
        if mine:
            logger.warning("missed slots recorded: %s", mine)


NOT_RUN_HERE = "not run here (another call has it, or it is recorded)"


def _not_run(entry: Entry, slot: datetime, otherwise: str) -> str:
    """Why a fired slot did not run in this call: the pause when that is why (the task is
    paused, by the cached answer, and the slot's row is ``skipped``), ``otherwise`` not: a
    call that lost to a copy which ran the slot before the pause was not stopped by it."""
    reason = paused_reason(entry.task_name)
    if reason is None:
        return otherwise
    try:
        row = ledger.read(entry.task_name, slot)
    except DatabaseError:  # only the log line's words depend on it
        return otherwise
    if row is None or row.state != RunState.SKIPPED:
        return otherwise
    return f"not run: the task is paused ({reason}); the slot is recorded skipped"
