"""Data schedules fired by ``run_schedules`` (targets of kind function and django_tasks).

Per schedule this copy keeps a small :class:`_Slotted` (its stored schedule, shared between
schedules with the same cron or interval, its policy, its window, the newest slot handed
out) and a heap of next starts (slot + jitter), so a tick costs nothing for schedules
that are not due. The arguments are read when a slot falls due, one query per batch,
which also gives the current version: an edit the poll has not seen yet is applied then.

Changes are polled (:data:`DATA_POLL_SECONDS`, re-reading :data:`POLL_OVERLAP` against
commit delays, without the arguments, and skipping at once the versions applied already;
a full reload every :data:`FULL_RELOAD_SECONDS` as a backstop) and applied
by version (docs/schedules.md, "Editing a data schedule"):

- created, or enabled again: no slot before that (``first_seen``, or the mark the change
  set) fires;
- an edit that keeps the slots: the next slot fires with the new values (the slot in
  flight keeps what was read when it was claimed);
- an edit that moves the slots (cron, interval, zone, starts, ends): the old schedule's
  slots due before the edit and not fired yet still fire, with the old definition's
  arguments and version (as the beat sends them); then the new schedule's slots
  after the edit, none before it;
- disabled or deleted: nothing more fires.

"Run now" and the admin's backfill (:data:`data_schedules.RUNNERS`) never run a body in the
caller's process (a web request): the manual slot is recorded ``pending`` and a
``run_schedules`` copy, which looks for such rows at every poll, runs it (a django.tasks
target's, with ``--enqueue``: hands it to the task's backend; the worker's claim turns the
row ``running``).
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError
from django.utils import timezone

from . import data_schedules, guard, ledger
from .carried import Carried
from .conf import taskguard_settings
from .decorators import SCHEDULE_KWARG, SLOT_KWARG, note_version
from .exceptions import BackendUnavailable, TaskGuardError
from .handoff import hand_out
from .ledger import schedules as store
from .logfields import log_fields
from .models import TargetKind, TaskSchedule
from .policy import Policy
from .schedules import Schedule, StoredSchedule, rebuild

logger = logging.getLogger("taskguard.scheduler")

# How often each copy asks the database which data schedules changed.
DATA_POLL_SECONDS = 2.0
# Each poll reads again the changes of the last minute: a change committed after a later
# one (a long transaction) is still seen.
POLL_OVERLAP = timedelta(seconds=60)
# Every data schedule is read again this often (a backstop for anything a poll missed).
FULL_RELOAD_SECONDS = 600.0
# The target kinds run_schedules fires.
KINDS = (TargetKind.FUNCTION, TargetKind.DJANGO_TASKS)
# At most this many "run now" slots are picked up per poll.
PENDING_LIMIT = 500
# How far ahead a next slot is looked for (a cron that fires once a year).
LOOKAHEAD = timedelta(days=400)
_TICK = timedelta(microseconds=1)


def slots_after(
    schedule: Schedule, policy: Policy, since: datetime, latest: datetime
) -> list[datetime]:
    """The slots in ``(since, latest]``, the newest ``max_catchup`` of them (never one
    older than ``PRUNE_AFTER_DAYS``: the guard refuses those)."""
    horizon = timedelta(days=taskguard_settings.PRUNE_AFTER_DAYS) - timedelta(hours=1)
    since = max(since, latest - horizon)
    limit = policy.max_catchup
    count = schedule.count_between(since, latest, 10**7)
    if count > limit:
        # Start just before the first slot kept: the ``limit`` newest.
        step_back = schedule.slots_between(since, latest, count - limit + 1)
        since = step_back[-2] if len(step_back) > 1 else since
    return schedule.slots_between(since, latest, limit)


@dataclass(slots=True)
class _Slotted:
    """What this copy keeps of one data schedule between its slots."""

    target: str
    kind: str
    version: int
    schedule: StoredSchedule
    policy: Policy
    starts: datetime | None
    ends: datetime | None
    offset: timedelta  # jitter: each slot starts this long after it
    fired: datetime  # slots at or before it are not this copy's to fire any more
    start_at: datetime | None = None  # when the next slot starts; None: none ahead

    def latest(self, now: datetime) -> datetime:
        """The newest slot whose start has come, none after ``ends``."""
        latest = self.schedule.latest_slot(now - self.offset)
        if self.ends is not None and latest > self.ends:
            return self.schedule.latest_slot(self.ends)
        return latest

    def in_window(self, slot: datetime) -> bool:
        return (self.starts is None or slot >= self.starts) and (
            self.ends is None or slot <= self.ends
        )


@dataclass(frozen=True, slots=True)
class Due:
    """A slot of a data schedule to fire (``manual``: a "run now" waiting ``pending``;
    ``version``: the definition that owes it, when an edit moved the slots since, else
    None: the current one)."""

    task_name: str
    slot: datetime
    manual: bool = False
    version: int | None = None


@dataclass(frozen=True, slots=True)
class Job:
    """A due slot with what its schedule said when it was read."""

    task_name: str
    slot: datetime
    target: data_schedules.Target
    policy: Policy
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    version: int
    manual: bool
    due: Due | None = None  # what made it due (tried again from it when its claim fails)


@dataclass(frozen=True, slots=True)
class Firing:
    """A job on ``run_schedules``' batch path (:mod:`.dispatch`): claimed with the other
    schedules due at its slot in one statement, its version recorded with theirs; ``fire``
    is the one-task path (a row the batch cannot decide, a claim given back)."""

    job: Job
    data: DataSchedules

    @property
    def task_name(self) -> str:
        return self.job.task_name

    @property
    def policy(self) -> Policy:
        return self.job.policy

    @property
    def version(self) -> int:
        return self.job.version

    def func(self) -> Any:
        job = self.job
        return job.target.guarded.body(*job.args, **dict(job.kwargs))

    def fire(self, slot: datetime) -> bool:
        return self.data.run(self.job) == "ran"


class DataSchedules:
    """The data schedules one ``run_schedules`` copy fires (``names``: only those)."""

    def __init__(self, names: Collection[str] | None = None, *, enqueue: bool = False) -> None:
        self.names = None if names is None else frozenset(names)
        self.enqueue = enqueue
        self.states: dict[str, _Slotted] = {}
        self._heap: list[tuple[datetime, str]] = []
        self._cursor: datetime | None = None  # the database's time of the last poll
        self._next_poll = 0.0
        self._next_reload = 0.0
        self._targets: dict[str, data_schedules.Target | None] = {}
        self._unresolved: set[tuple[str, int]] = set()  # logged once per schedule and version
        self._policies: dict[tuple[Any, ...], Policy] = {}
        self.handed: set[tuple[str, datetime]] = set()  # manual slots submitted, not ended
        # The newest version of each schedule this copy applied (those it fires, and those
        # it dropped: disabled, deleted, a target not found): a poll skips them at once.
        self._applied: dict[str, int] = {}
        # Due slots not fired because the database failed: tried again (:meth:`carry`).
        self._carried: Carried[tuple[str, datetime], Due] = Carried()

    # -- reading the rows ------------------------------------------------------------

    def load(self, now: datetime, *, start: bool = False) -> list[Due]:
        """Read every data schedule (at start, and as the backstop); the slots due now."""
        polled = ledger.database_now()
        due: list[Due] = []
        seen = set()
        self._targets.clear()  # a module installed since is found now
        self._applied.clear()  # and a row dropped for it is applied again at the next poll
        with self._carrying(due):
            for row in store.live_data(KINDS, self.names):
                seen.add(row.task_name)
                due.extend(self.apply(row, now, start=start))
            due.extend(self.pending())
        for name in set(self.states) - seen:
            del self.states[name]
        self._heap = [(s.start_at, n) for n, s in self.states.items() if s.start_at is not None]
        heapq.heapify(self._heap)
        self._cursor = polled
        self._next_poll = time.monotonic() + DATA_POLL_SECONDS
        self._next_reload = time.monotonic() + FULL_RELOAD_SECONDS
        if start:
            logger.info(
                "run_schedules: %d data schedules",
                len(self.states),
                extra=log_fields("scheduler.data_loaded"),
            )
        return due

    def poll(self, now: datetime) -> list[Due]:
        """The changes since the last poll applied, and the slots they make due now (a
        slot the old schedule still owes, a "run now" waiting)."""
        if time.monotonic() >= self._next_reload or self._cursor is None:
            return self.load(now)
        if time.monotonic() < self._next_poll:
            return []
        self._next_poll = time.monotonic() + DATA_POLL_SECONDS
        polled = ledger.database_now()
        due: list[Due] = []
        # The last minute again, without the arguments (read when a slot is due); the
        # versions this copy applied already cost nothing more.
        changed = store.data_changed_since(self._cursor - POLL_OVERLAP, KINDS, light=True)
        with self._carrying(due):
            for row in changed:
                if self._applied.get(row.task_name, 0) >= row.version:
                    continue
                if self.names is None or row.task_name in self.names:
                    due.extend(self.apply(row, now))
            self._cursor = polled
            due.extend(self.pending())
        return due

    def pending(self) -> list[Due]:
        """The "run now" slots waiting for a copy (``pending``)."""
        found = ledger.pending_of_data(list(KINDS), PENDING_LIMIT)
        # A slot this copy enqueued stays "handed" while it is pending (a worker has not
        # claimed it yet): it is not enqueued again at every poll. Claimed or ended: forgotten.
        self.handed &= set(found)
        return [
            Due(name, slot, manual=True)
            for name, slot in found
            if (self.names is None or name in self.names) and (name, slot) not in self.handed
        ]

    # -- applying a row ----------------------------------------------------------------

    def apply(self, row: TaskSchedule, now: datetime, *, start: bool = False) -> list[Due]:
        """Take in ``row`` (a newer version than this copy has, else nothing changes);
        return the slots due now because of it."""
        known = self.states.get(row.task_name)
        if known is not None and row.version <= known.version:
            return []
        self._applied[row.task_name] = row.version
        if row.removed_at is not None or not row.enabled:
            self.states.pop(row.task_name, None)
            return []
        built = self._build(row)
        if built is None:
            self.states.pop(row.task_name, None)
            return []
        if known is None:
            return self._born(row, built, now, start)
        due: list[Due] = []
        moved = (built.schedule, built.starts, built.ends) != (
            known.schedule,
            known.starts,
            known.ends,
        )
        built.fired = known.fired
        edit = row.changed_at or now
        if row.version > known.version + 1 and row.changed_at is not None:
            # Versions this copy never saw (it was stopped, or its polls failed, across
            # them): the slots due by the edit that it has not fired yet are each owed by
            # the version in effect at its time, if that one had it (never a slot of a
            # disabled window, nor one an interval in effect then did not have).
            history = store.timeline(row, known.fired)
            due = [
                Due(row.task_name, slot, version=span.version.number)
                for span in history.spans(known.fired, edit)
                for slot in slots_after(span.schedule, known.policy, span.start, span.end)
                if span.in_window(slot)
            ][-known.policy.max_catchup :]
            built.fired = max(known.fired, edit)
        elif moved:
            # Never lost: the old schedule's slots due by the edit that this copy has not
            # fired yet still fire, up to the edit itself, whatever ``now`` says (read before
            # the poll waited on the database, it can be older than an edit the poll found).
            # Never early: the new one's start after the edit.
            owed = slots_after(known.schedule, known.policy, known.fired, edit)
            due = [
                Due(row.task_name, slot, version=known.version)
                for slot in owed
                if known.in_window(slot)
            ]
            built.fired = max(known.fired, edit)
        self.states[row.task_name] = built
        self._plan(row.task_name, built)
        return due

    def _born(self, row: TaskSchedule, state: _Slotted, now: datetime, start: bool) -> list[Due]:
        """A schedule this copy did not fire: created, enabled again, or read at start. No
        slot before it was created, enabled again or last moved (``swept_until`` marks
        those two) fires; of the others, the newest (at start; ``catchup="all"``: every
        one after the newest run), or those within grace and the newest (a change seen by
        a poll: a one-second schedule created two seconds ago loses none)."""
        born = max(row.first_seen, row.swept_until or row.first_seen) - _TICK
        latest = state.latest(now)
        since = max(born, now - state.policy.grace - state.offset)
        if start and state.policy.catchup == "all":
            newest = ledger.latest_slot(row.task_name)
            since = born if newest is None else max(born, newest)
        elif start:  # as a code schedule at start: the newest slot (the sweep judges older)
            since = max(born, latest - _TICK)
        slots = slots_after(state.schedule, state.policy, since, latest) if latest > since else []
        if state.policy.catchup == "latest" and latest > born and latest not in slots:
            slots.append(latest)
        state.fired = max(latest, born)
        self.states[row.task_name] = state
        self._plan(row.task_name, state)
        return [Due(row.task_name, slot) for slot in slots if state.in_window(slot)]

    def _build(self, row: TaskSchedule) -> _Slotted | None:
        target = self.target(row)
        if target is None:
            return None
        try:
            schedule = rebuild(row.cron, row.cron_day_or, store.zone_of(row), row.every)
        except Exception as exc:
            self._say_once(row, f"its schedule cannot be read here ({exc})")
            return None
        return _Slotted(
            target=row.function,
            kind=row.target_kind,
            version=row.version,
            schedule=schedule,
            policy=self._policy(row, target.policy),
            starts=row.starts,
            ends=row.ends,
            offset=data_schedules.jitter_offset(row.task_name, row.jitter),
            fired=row.first_seen,
        )

    def _policy(self, row: TaskSchedule, target_policy: Policy) -> Policy:
        """The row's policy, one object per distinct value (100,000 schedules share few)."""
        key = (
            row.function,
            row.catchup,
            row.grace,
            row.max_catchup,
            row.pause_after_failures,
        )
        policy = self._policies.get(key)
        if policy is None:
            policy = self._policies[key] = data_schedules.policy_of(row, target_policy)
        return policy

    def target(self, row: TaskSchedule) -> data_schedules.Target | None:
        """``row``'s target as found in this process (cached), or None (logged once per
        schedule and version: not fired, the sweep records its slots missed)."""
        name = row.function
        if name not in self._targets:
            try:
                self._targets[name] = data_schedules.resolve_target(name)
            except TaskGuardError as exc:
                self._targets[name] = None
                self._say_once(row, str(exc))
            except Exception as exc:  # its module raised on import: not this loop's end
                self._targets[name] = None
                self._say_once(row, f"importing it raised {type(exc).__name__}: {exc}")
        found = self._targets[name]
        if found is None:
            self._say_once(row, f"its target {name} cannot be found in this process")
        return found

    def _say_once(self, row: TaskSchedule, why: str) -> None:
        if (row.task_name, row.version) in self._unresolved:
            return
        self._unresolved.add((row.task_name, row.version))
        logger.error(
            "run_schedules: the data schedule %s (version %d) is not fired by this copy: %s; "
            "its slots are recorded missed after their grace",
            row.task_name,
            row.version,
            why,
            extra=log_fields("schedule.not_fired", task=row.task_name, reason=why),
        )

    # -- what is due -------------------------------------------------------------------

    def _plan(self, name: str, state: _Slotted, after: datetime | None = None) -> None:
        """Put the schedule's next start after ``after`` (default: the slot it fired last)
        on the heap (none after ``ends``); with no slot within :data:`LOOKAHEAD` (a cron of
        February 29th), a re-check then."""
        since = state.fired if after is None else max(state.fired, after)
        if state.starts is not None:
            since = max(since, state.starts - _TICK)
        if state.ends is not None and since >= state.ends:
            state.start_at = None
            return
        found = state.schedule.slots_between(since, since + LOOKAHEAD, 1)
        if found and state.ends is not None and found[0] > state.ends:
            state.start_at = None
            return
        state.start_at = found[0] + state.offset if found else since + LOOKAHEAD
        heapq.heappush(self._heap, (state.start_at, name))

    def due(self, now: datetime) -> list[Due]:
        """The slots whose start has come since the last call (cost: the schedules due)."""
        due: list[Due] = []
        while self._heap and self._heap[0][0] <= now:
            start_at, name = heapq.heappop(self._heap)
            state = self.states.get(name)
            if state is None or state.start_at != start_at:
                continue  # an older plan: the schedule changed or went since
            latest = state.latest(now)
            if latest > state.fired:
                slots = slots_after(state.schedule, state.policy, state.fired, latest)
                if state.policy.catchup == "latest":
                    # This loop woke late: slots within their grace run, older ones are left
                    # to the sweep, the newest always runs.
                    grace = state.policy.grace
                    slots = [slot for slot in slots[:-1] if now - slot <= grace] + slots[-1:]
                due.extend(Due(name, slot) for slot in slots if state.in_window(slot))
                state.fired = latest
            # No slot in (fired, now - offset]: the next one is after both (a re-check
            # popped with none come yet plans from here, not again from ``fired``).
            self._plan(name, state, now - state.offset)
        return due

    def next_start(self) -> datetime | None:
        """When the next slot starts (older plans dropped on the way)."""
        while self._heap:
            start_at, name = self._heap[0]
            state = self.states.get(name)
            if state is not None and state.start_at == start_at:
                return start_at
            heapq.heappop(self._heap)
        return None

    def next_poll_in(self) -> float:
        return max(self._next_poll - time.monotonic(), 0.0)

    # -- slots the database failed ---------------------------------------------------------

    @contextlib.contextmanager
    def _carrying(self, due: list[Due]) -> Iterator[None]:
        """Should the database fail while reading, the slots ``due`` gathered so far (a
        moving edit's owed ones: this copy counts them fired already) are tried again."""
        try:
            yield
        except (BackendUnavailable, DatabaseError):
            self.carry(due)
            raise

    def carry(self, due: Iterable[Due]) -> None:
        """Slots due and not fired because the database failed (reading them, or refusing
        their claim): tried again (:mod:`.carried`) while this copy fires their schedule and
        within their grace; the sweep judges the others. A "run now" slot is not carried:
        its ``pending`` row is found again by the next poll."""
        self._carried.carry(((item.task_name, item.slot), item) for item in due if not item.manual)

    def carried(self, now: datetime, besides: Iterable[Due] = ()) -> list[Due]:
        """The carried slots to try again now (none before their retry time), those of
        schedules this copy still fires, within their grace and not among ``besides`` (due
        again by themselves: a moving edit's owed slots)."""
        taken = self._carried.take()
        if not taken:
            return []
        again = {(item.task_name, item.slot) for item in besides}
        kept: list[Due] = []
        late = 0
        for item in taken:
            state = self.states.get(item.task_name)
            if (item.task_name, item.slot) in again or state is None:
                continue  # due again anyway; or disabled or deleted since: nothing fires
            if now - item.slot <= state.policy.grace:
                kept.append(item)
            else:
                late += 1
        if late:
            logger.warning(
                "run_schedules: %d due slots the database failed were past their grace when "
                "tried again; the sweep records them",
                late,
                extra=log_fields("scheduler.retry_dropped"),
            )
        return kept

    def retry_in(self) -> float | None:
        """Seconds until carried slots are tried again (None: none are)."""
        return self._carried.retry_in()

    # -- firing --------------------------------------------------------------------------

    def jobs(self, due: list[Due], now: datetime) -> list[Job]:
        """``due`` with what each schedule says now (one query per batch); an edit not
        polled yet is applied first, and a slot it took back is dropped."""
        if not due:
            return []
        work = list(due)
        taken: list[Due] = []  # popped from ``work``: with it, what a failure carries
        jobs: list[Job] = []
        try:
            rows = store.data_rows({item.task_name for item in due})
            self._make_jobs(work, taken, rows, now, jobs)
        except BaseException as exc:
            # None of them ran; a "run now" is found again by the next poll. The database
            # failed: all of them (and the slots an edit made owed) go round again, each
            # judged again then (_still_due).
            self.handed -= {(item.task_name, item.slot) for item in taken if item.manual}
            if isinstance(exc, (BackendUnavailable, DatabaseError)):
                self.carry(taken + work)
            raise
        jobs.reverse()
        return jobs

    def _make_jobs(
        self,
        work: list[Due],
        taken: list[Due],
        rows: dict[str, TaskSchedule],
        now: datetime,
        jobs: list[Job],
    ) -> None:
        histories: dict[str, store.Timeline] = {}
        while work:
            item = work.pop()
            taken.append(item)
            row = rows.get(item.task_name)
            if row is None or row.removed_at is not None:
                continue
            judged: store.Version | None = None
            if not item.manual:
                still, owed, judged = self._still_due(item, row, now, work, histories)
                work.extend(owed)
                if not still:
                    continue
            target = self.target(row)
            if target is None:
                continue
            state = self.states.get(item.task_name)
            policy = state.policy if state is not None else self._policy(row, target.policy)
            if item.manual:
                self.handed.add((item.task_name, item.slot))
            if judged is not None:
                # Changed after its slot: run with what the version in effect then said.
                args, kwargs = list(judged.values["args"]), dict(judged.values["kwargs"])
                version = judged.number
            elif item.version is not None and item.version != row.version:
                # Owed by the definition before an edit that moved the slots: run with
                # what that one said, as the beat does.
                args, kwargs = store.arguments_at(row, item.version)
                version = item.version
            else:
                args, kwargs, version = list(row.args), dict(row.kwargs), row.version
            jobs.append(
                Job(
                    item.task_name,
                    item.slot,
                    target,
                    policy,
                    tuple(args),
                    kwargs,
                    version,
                    item.manual,
                    item,
                )
            )

    def _still_due(
        self,
        item: Due,
        row: TaskSchedule,
        now: datetime,
        work: list[Due],
        histories: dict[str, store.Timeline],
    ) -> tuple[bool, list[Due], store.Version | None]:
        """Whether ``item`` still fires under ``row`` (a newer version is applied first),
        the slots the old definitions owe that the change makes due, and the version that
        owes ``item`` when the schedule changed after its slot (None: the current one).

        A slot at or before the latest change is judged by the version in effect at its
        time (the schedule's history): it fires only if that version, enabled, had it,
        whatever this copy knew when the slot fell due (a copy stopped, or whose database
        failed, across a disable and an enable, or across several edits). A slot after the
        latest change is judged by the schedule as it is now."""
        state = self.states.get(item.task_name)
        if state is None:
            return False, [], None
        owed: list[Due] = []
        if row.version > state.version + 1 and row.changed_at is not None:
            # Handed out while this copy knew a definition several versions old: taken
            # back, and handed out again by the versions in effect at their times (apply:
            # up to the latest change; then the heap: the new definition's after it).
            name = item.task_name
            mine = [due.slot for due in work if due.task_name == name and not due.manual]
            state.fired = min(state.fired, min([item.slot, *mine]) - _TICK)
            work[:] = [due for due in work if due.task_name != name or due.manual]
            return False, self.apply(row, now), None
        if row.version > state.version:
            owed = self.apply(row, now)
            state = self.states.get(item.task_name)
            if state is None:
                return False, [], None  # disabled or deleted meanwhile: nothing more fires
        if row.changed_at is not None and item.slot <= row.changed_at:
            history = histories.get(item.task_name)
            if history is None or item.slot < history.read_from:
                earliest = min(
                    (due.slot for due in (*work, *owed) if due.task_name == item.task_name),
                    default=item.slot,
                )
                history = histories[item.task_name] = store.timeline(row, min(earliest, item.slot))
            version = history.fires(item.slot)
            return version is not None, owed, version
        if row.changed_at is None and item.slot <= now:
            return True, owed, None  # (no change time kept: due before it, never lost)
        ours = state.schedule.latest_slot(item.slot) == item.slot and state.in_window(item.slot)
        return ours, owed, None

    def batchable(self, job: Job) -> bool:
        """A job the batch path may claim: a scheduled slot run in this process (not a
        "run now", not one handed to a django.tasks backend)."""
        return not job.manual and not (self.enqueue and job.target.kind == TargetKind.DJANGO_TASKS)

    def run(self, job: Job) -> str:
        """Fire ``job`` through the guard (or hand it to its backend); say what happened."""
        policy = job.policy
        if job.manual:  # an operator's call: no lateness policy (as backfill)
            if policy.catchup == "none":
                policy = replace(policy, catchup="latest")
        elif guard.refused_late(job.task_name, job.slot, policy, timezone.now()):
            return "late (recorded missed, catchup='none')"
        if self.enqueue and job.target.kind == TargetKind.DJANGO_TASKS:
            if job.manual:  # its pending row is there already: the worker's claim takes it
                try:
                    return f"enqueued ({_enqueue(job)})"
                except BaseException:
                    self.handed.discard((job.task_name, job.slot))  # tried again next poll
                    raise
            with self._carried_on_refusal(job):
                return hand_out(job.task_name, job.slot, functools.partial(_enqueue, job))
        if job.manual:  # run here: should the claim fail, the next poll tries again
            self.handed.discard((job.task_name, job.slot))
        ran = False
        func: Callable[..., Any] = job.target.guarded.body

        def body(*args: Any, **kwargs: Any) -> Any:
            nonlocal ran
            ran = True
            return func(*args, **kwargs)

        with self._carried_on_refusal(job):
            started = guard.begin(job.task_name, job.slot, policy)
        note_version(started, job.version)
        guard.run(started, body, job.args, dict(job.kwargs))
        return "ran" if ran else "not run here (another call has it, or it is recorded)"

    @contextlib.contextmanager
    def _carried_on_refusal(self, job: Job) -> Iterator[None]:
        """The claim (or hand-out) refused because the database failed: nothing was claimed
        (the guard fails closed), so the slot is tried again (:meth:`carry`)."""
        try:
            yield
        except BackendUnavailable:
            if job.due is not None and not job.manual:
                self.carry([job.due])
            raise


def _enqueue(job: Job) -> str:
    return _send(job.target, job.task_name, job.slot, job.version, job.args, job.kwargs)


def _send(
    target: data_schedules.Target,
    task_name: str,
    slot: datetime,
    version: int,
    args: Iterable[Any],
    kwargs: dict[str, Any],
) -> str:
    """Enqueue one slot of a data schedule to its django.tasks task's backend."""
    carried = {
        **kwargs,
        SLOT_KWARG: slot.isoformat(),
        SCHEDULE_KWARG: {"task_name": task_name, "version": version},
    }
    result = target.task.enqueue(*args, **carried)
    return f"django.tasks result {result.id} on backend {target.task.backend!r}"


# -- run now ---------------------------------------------------------------------------


def _run_now(row: TaskSchedule, slot: datetime, by: str) -> str:
    """A manual slot waits ``pending`` for a ``run_schedules`` copy, which runs it (or, with
    ``--enqueue``, hands a django.tasks target's to its backend): never in the caller's
    process, whatever the backend (the sweep ends it missed if no copy starts it within its
    grace)."""
    if ledger.insert_pending(row.task_name, slot) is None:
        return "not handed out: the slot has a row already"
    return f"handed to run_schedules (slot {slot.isoformat()} pending)"


data_schedules.RUNNERS[TargetKind.FUNCTION] = _run_now
data_schedules.RUNNERS[TargetKind.DJANGO_TASKS] = _run_now
