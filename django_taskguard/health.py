"""Is every task running as scheduled? One verdict for ``check_schedules``, ``health/``
and the admin's overview.

A task is unhealthy when it is

- **late**: its latest slot due past its grace has no run, or one of its runs is
  still ``running`` with a lease that expired by the database's clock (its owner
  is presumed dead: running too long);
- **failing** or **missed**: a registered schedule's latest slot that came out (by slot:
  succeeded, failed, abandoned or missed; skipped slots and slots in flight are passed
  over) did not succeed ("the 21:00 slot was abandoned: ..."), until a later slot
  succeeds or the problem is acknowledged. A task with no schedule (seen only in the
  ledger) is failing when its last ``HEALTH_FAILURES`` finished runs all failed (or were
  abandoned by a dead owner);
- **failing** too: none of its last ``HEALTH_FAILURES`` due slots
  succeeded, whatever the reason (missed, failed, skipped), while the latest due slot
  is not running. Slots due while a run of it was alive are not counted (skipped behind
  a long run under ``overlap="skip"``: a long body is not a failing one): not while a
  run is alive, nor those due before its latest success finished;
- **late** too: a registered schedule whose last ``LATE_START_RUNS`` started slots
  all started later after their slot than its bound (``late_after=``, else
  ``LATE_START_SECONDS``; no bound: no rule). A slot's start is its first attempt's (a
  retried slot is passed over: its row keeps only the latest attempt's start);
- **running** too long: a run alive (its lease renewed) for longer than
  ``HEALTH_FAILURES`` intervals of its schedule and at least ``HUNG_AFTER`` ("running
  for 1h 10m: hung?"): a hung body and a long one look alike until then.

Beside the tasks, the **upkeep** (:mod:`.upkeep`): when schedules are registered and no
upkeep (automatic, or ``cleanup_locks``) finished within ``UPKEEP_INTERVALS`` intervals
(a day and an hour with the automatic upkeep off), the verdict is unhealthy and says so.

An acknowledgement (``manage.py acknowledge``, the admin) covers the slots at or before
its ``until`` (``TaskSchedule.acknowledged_until``): none of them makes the task late,
failing or missed; a problem in a later slot fails it again. The slots recorded missed
within ``MONITOR_WINDOW_HOURS`` are counted and shown, not judged: the latest outcome is.

A paused task is healthy, and says it is paused. Every task is judged: every read
is an index probe per task, in statements of ``ledger.FACTS_CHUNK`` tasks each, so
the verdict costs the same on a million runs as on ten.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.utils.timezone import get_default_timezone_name
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from . import data_schedules, lateness, ledger
from .conf import taskguard_settings
from .ledger import schedules as schedule_store
from .ledger import upkeep as upkeep_store
from .models import ScheduleEvent, ScheduleEventKind, TaskSchedule
from .policy import Policy
from .schedules import Schedule, StoredSchedule, rebuild
from .states import LIVE_STATES, RunState

LATE, MISSED, FAILING, RUNNING = "late", "missed", "failing", "running"
LATE_START = "late_start"  # its slots keep starting late (``lateness``); ``late``: overdue
# A run alive for longer than this (and than HEALTH_FAILURES intervals) is reported.
HUNG_AFTER = timedelta(hours=1)
OK, PAUSED, UNHEALTHY = "ok", "paused", "unhealthy"


@dataclass(frozen=True)
class Problem:
    code: str  # late | missed | failing | running
    detail: str


@dataclass
class TaskHealth:
    """One task's verdict, and what the overview shows beside it."""

    task: str
    schedule: StoredSchedule | None = None
    words: str = ""
    paused: bool = False
    paused_at: datetime | None = None
    paused_reason: str = ""
    grace: timedelta = timedelta(0)
    first_seen: datetime | None = None
    ends: datetime | None = None  # a data schedule's end: no slot after it is due
    resumed_at: datetime | None = None  # the end of its latest pause
    last_success: ledger.LastRun | None = None
    alive_since: datetime | None = None  # when its oldest run alive now started
    latest_due: datetime | None = None
    next_slot: datetime | None = None
    registered: bool = False  # it has a schedule row (it can be paused and acknowledged)
    acknowledged_until: datetime | None = None
    acknowledgement: ScheduleEvent | None = None  # the latest one
    missed_in_window: int = 0  # slots recorded missed within MONITOR_WINDOW_HOURS
    late_after: timedelta | None = None  # its own late-start bound (None: the setting's)
    problems: list[Problem] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.paused:
            return PAUSED
        return UNHEALTHY if self.problems else OK

    @property
    def healthy(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "status": self.status,
            "healthy": self.healthy,
            "problems": [{"code": p.code, "detail": p.detail} for p in self.problems],
            "schedule": self.words or None,
            "paused": self.paused,
            "paused_at": _iso(self.paused_at),
            "paused_reason": self.paused_reason or None,
            "last_success": _iso(self.last_success.finished_at if self.last_success else None),
            "last_success_slot": _iso(self.last_success.slot if self.last_success else None),
            "latest_slot_past_grace": _iso(self.latest_due),
            "next_slot": _iso(self.next_slot),
            "missed_in_window": self.missed_in_window,
            "acknowledged_until": _iso(self.acknowledged_until),
            "acknowledgement": _event_dict(self.acknowledgement),
        }

    def acknowledged(self, slot: datetime | None) -> bool:
        """Whether an acknowledgement covers ``slot``."""
        until = self.acknowledged_until
        return slot is not None and until is not None and slot <= until


def _event_dict(event: ScheduleEvent | None) -> dict[str, Any] | None:
    if event is None:
        return None
    return {
        "by": event.by or None,
        "at": _iso(event.at),
        "origin": event.origin,
        "reason": event.reason,
        "until": _iso(event.until),
    }


@dataclass(frozen=True)
class UpkeepHealth:
    """When the upkeep last finished, and why that is a problem (``problem`` "" when not)."""

    finished_at: datetime | None
    ran_by: str
    error: str
    limit: timedelta  # no upkeep for longer than this is a problem
    problem: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "healthy": not self.problem,
            "finished_at": _iso(self.finished_at),
            "ran_by": self.ran_by or None,
            "error": self.error or None,
            "limit_seconds": self.limit.total_seconds(),
            "problem": self.problem or None,
        }


@dataclass
class Verdict:
    checked_at: datetime
    tasks: list[TaskHealth]
    window: timedelta
    upkeep: UpkeepHealth | None = None  # None: no schedule is registered, nothing to keep

    @property
    def healthy(self) -> bool:
        return all(task.healthy for task in self.tasks) and not self.upkeep_problem

    @property
    def upkeep_problem(self) -> str:
        """Why the upkeep is a problem ("" when it is not)."""
        return self.upkeep.problem if self.upkeep is not None else ""

    @property
    def unhealthy(self) -> list[TaskHealth]:
        return [task for task in self.tasks if not task.healthy]

    def as_dict(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "checked_at": _iso(self.checked_at),
            "window_hours": self.window / timedelta(hours=1),
            "unhealthy": [task.task for task in self.unhealthy],
            "upkeep": self.upkeep.as_dict() if self.upkeep is not None else None,
            "tasks": [task.as_dict() for task in self.tasks],
        }


def check(*, task: str | None = None, schedules: Sequence[str] | None = None) -> Verdict:
    """Judge every known task (or one; or only the registered ``schedules`` named, without
    the upkeep's verdict: an admin page's rows): raises ``BackendUnavailable`` when the
    ledger cannot be read. A handful of statements whatever the number of runs (on
    PostgreSQL whatever the number of tasks; elsewhere two more per 200 tasks: each 200
    tasks' facts are read by one statement of index probes)."""
    now = ledger.database_now()
    window = timedelta(hours=taskguard_settings.MONITOR_WINDOW_HOURS)
    kept: UpkeepHealth | None = None
    if schedules is not None:
        policies: dict[str, Policy] = {}  # each target looked up once
        rows = schedule_store.judged_named(schedules)
        tasks = [from_schedule(row, policies) for row in rows]
    else:
        tasks = known_tasks()
        registered = [t for t in tasks if t.first_seen is not None]
        kept = upkeep_health(now, shortest_gap(registered, now)) if registered else None
    if task is not None:
        tasks = [t for t in tasks if t.task == task]
    acknowledgements = schedule_store.latest_events(
        ScheduleEventKind.ACKNOWLEDGED, None if schedules is None else [t.task for t in tasks]
    )
    for health in tasks:
        health.acknowledgement = acknowledgements.get(health.task)
    names = [t.task for t in tasks]
    successes = ledger.latest_in_state(names, RunState.SUCCEEDED)
    alive = ledger.alive_since(now)
    for health in tasks:
        health.last_success = successes.get(health.task)
        health.alive_since = alive.get(health.task)
        if health.schedule is not None:
            due_by = now - health.grace
            health.latest_due = health.schedule.latest_slot(min(due_by, health.ends or due_by))
            health.next_slot = _next_slot(health, now)
    asks = [(t.task, t.latest_due if _expected(t) else None) for t in tasks if not t.paused]
    failures = taskguard_settings.HEALTH_FAILURES
    late_runs = lateness.runs_to_read(late_bound(t) for t in tasks if not t.paused)
    facts = ledger.task_facts(asks, now - window, failures, late_runs)
    for health in tasks:
        if health.task in facts:
            judge(health, facts[health.task], now, failures)
            if (late := _late_starts(health, facts[health.task])) is not None:
                health.problems.append(late)
    return Verdict(now, tasks, window, kept)


# With the automatic upkeep off, ``cleanup_locks`` from cron is the upkeep: a daily job
# and an hour to spare.
CRON_UPKEEP_LIMIT = timedelta(hours=25)
# No upkeep for this many intervals is a problem.
UPKEEP_INTERVALS = 3


def shortest_gap(tasks: Sequence[TaskHealth], now: datetime) -> timedelta | None:
    """The shortest time between two slots of the tasks' schedules, plus its grace (None:
    none has a schedule). Where guarded calls start the upkeep (APScheduler, cron callers),
    it runs as often as the most frequent schedule fires, however short its interval."""
    gaps = []
    for task in tasks:
        if task.schedule is None or task.paused:
            continue
        try:
            following = task.schedule.next_slot(now)
            if following is not None:
                gaps.append(following - task.schedule.latest_slot(now) + task.grace)
        except Exception:  # a schedule that cannot be computed is judged on its own
            continue
    return min(gaps, default=None)


def upkeep_health(now: datetime, gap: timedelta | None = None) -> UpkeepHealth:
    """When the upkeep last finished (automatic, or ``cleanup_locks``), and whether its
    parts all worked, judged against ``UPKEEP_INTERVALS`` intervals, or two of ``gap`` (the
    shortest gap between slots, :func:`shortest_gap`) when that is longer, or
    ``CRON_UPKEEP_LIMIT`` with the automatic upkeep off."""
    interval = taskguard_settings.UPKEEP_INTERVAL_SECONDS
    limit = (
        CRON_UPKEEP_LIMIT if interval is None else UPKEEP_INTERVALS * timedelta(seconds=interval)
    )
    if interval is not None and gap is not None:
        limit = max(limit, 2 * gap)
    row = upkeep_store.latest()
    finished = row.finished_at if row is not None else None
    ran_by, error = (row.ran_by, row.error) if row is not None else ("", "")
    if finished is not None and now - finished <= limit:
        if error:
            failed = _(
                "the latest upkeep (%(by)s) failed in part, so what that part keeps true is not "
                "being recorded: %(error)s"
            ) % {"by": ran_by, "error": error}
            return UpkeepHealth(finished, ran_by, error, limit, failed)
        return UpkeepHealth(finished, ran_by, error, limit)
    since = _("upkeep has not run since %(when)s") % {"when": _iso(finished)}
    if finished is None:
        since = _("upkeep has never run")
    if interval is None:
        how = _(
            "the automatic upkeep is off (TASKGUARD['UPKEEP_INTERVAL_SECONDS'] = None): run "
            "cleanup_locks from cron"
        )
    else:
        how = _(
            "run_schedules, a beat, a worker or a guarded call runs it every %(every)ss, or "
            "run cleanup_locks from cron"
        ) % {"every": f"{interval:g}"}
    detail = _(
        "%(since)s (limit %(limit)s): the duplicate counts, stale runs and missed slots are "
        "not being recorded; %(how)s"
    ) % {"since": since, "limit": _human(limit), "how": how}
    return UpkeepHealth(finished, ran_by, error, limit, detail)


def known_tasks() -> list[TaskHealth]:
    """Every registered schedule (not a removed one, :func:`ledger.schedules.watched`),
    then every other task name the ledger has runs of."""
    rows = schedule_store.stored()
    policies: dict[str, Policy] = {}  # each target looked up once
    tasks = [from_schedule(row, policies) for row in schedule_store.watched(rows)]
    seen = {row.task_name for row in rows}  # a removed schedule is not judged at all
    tasks += [TaskHealth(name) for name in ledger.task_names(None) if name not in seen]
    return tasks


def from_schedule(row: TaskSchedule, policies: dict[str, Policy] | None = None) -> TaskHealth:
    schedule = build_schedule(row)
    # A data schedule's empty grace and late after: its target's (as found here).
    followed = data_schedules.followed(row, policies)
    return TaskHealth(
        row.task_name,
        schedule=schedule,
        words=describe(row),
        paused=row.paused,
        paused_at=row.paused_at if row.paused else None,
        paused_reason=row.paused_reason,
        grace=followed.grace,
        # A data schedule's bounds: no slot before its start is expected, none after its end.
        first_seen=max(row.first_seen, row.starts or row.first_seen),
        ends=row.ends,
        resumed_at=None if row.paused else row.resumed_at,
        registered=True,
        acknowledged_until=row.acknowledged_until,
        late_after=followed.late_after,
    )


def build_schedule(row: TaskSchedule) -> StoredSchedule | None:
    try:
        return rebuild(row.cron, row.cron_day_or, schedule_store.zone_of(row), row.every)
    except Exception:  # a row written by another version: shown, not judged on time
        return None


def _next_slot(health: TaskHealth, now: datetime) -> datetime | None:
    """The first slot after ``now`` that fires: not before a data schedule's start (its
    ``first_seen`` here), none after its end."""
    assert health.schedule is not None
    after = now
    if health.first_seen is not None and health.first_seen > now:
        after = health.first_seen - timedelta(microseconds=1)
    try:
        found = health.schedule.next_slot(after)
    except OverflowError:  # starts stored out of bounds (by SQL, an older version): none
        return None
    return None if found is None or (health.ends and found > health.ends) else found


def _expected(health: TaskHealth) -> bool:
    """Whether the task's latest due slot should have a run (it was registered by then)."""
    due = health.latest_due
    return due is not None and (health.first_seen is None or due >= health.first_seen)


def judge(health: TaskHealth, facts: ledger.TaskFacts, now: datetime, failures: int) -> None:
    """Add ``health``'s problems from its facts (never called for a paused task)."""
    due = health.latest_due
    health.missed_in_window = facts.missed
    if due is not None and _expected(health) and not health.acknowledged(due):
        if facts.due_state is None:
            detail = _("slot %(slot)s has no run %(age)s after it (grace %(grace)s)") % {
                "slot": _iso(due),
                "age": _human(now - due),
                "grace": _human(health.grace),
            }
            health.problems.append(Problem(LATE, detail))
        elif facts.due_state == RunState.PENDING:
            detail = _(
                "slot %(slot)s is pending (handed out or given back) and not started "
                "%(age)s after it"
            ) % {
                "slot": _iso(due),
                "age": _human(now - due),
            }
            health.problems.append(Problem(LATE, detail))
    if facts.stale:
        detail = ngettext(
            "%(n)d run is still running but its lease expired (slot %(slot)s, %(age)s ago): "
            "its owner is presumed dead; cleanup_locks will abandon it",
            "%(n)d runs are still running but their leases expired (oldest slot %(slot)s, "
            "%(age)s ago): their owners are presumed dead; cleanup_locks will abandon them",
            facts.stale,
        ) % {
            "n": facts.stale,
            "slot": _iso(facts.oldest_stale_slot),
            "age": _human(now - (facts.oldest_stale_lease or now)),
        }
        health.problems.append(Problem(LATE, detail))
    failed = _outcome_problem if health.registered else _streak_problem
    if (problem := failed(health, facts, failures)) is not None:
        health.problems.append(problem)
    elif _no_success(health, facts, failures):
        health.problems.append(_no_success_problem(health, facts, failures))
    if (hung := _running_too_long(health, now, failures)) is not None:
        health.problems.append(hung)


def late_bound(health: TaskHealth) -> timedelta | None:
    """The task's late-start bound (:func:`lateness.bound`; a task without a registered
    schedule has none)."""
    return lateness.bound(health.late_after) if health.registered else None


def _late_starts(health: TaskHealth, facts: ledger.TaskFacts) -> Problem | None:
    """Its last ``LATE_START_RUNS`` slots all started late (an acknowledgement of its latest
    due slot covers them)."""
    if health.acknowledged(health.latest_due):
        return None
    detail = lateness.late_detail(facts.late_starts, late_bound(health))
    return None if detail is None else Problem(LATE_START, detail)


def _streak_problem(health: TaskHealth, facts: ledger.TaskFacts, failures: int) -> Problem | None:
    """A task without a schedule: its last ``failures`` ended runs all failed."""
    if not (facts.ended == failures and facts.failed == failures):
        return None
    detail = ngettext(
        "its last run failed (slot %(slot)s)",
        "its last %(n)d runs failed (latest slot %(slot)s)",
        failures,
    ) % {"n": failures, "slot": _iso(facts.latest_ended_slot)}
    return Problem(FAILING, detail)


_OUTCOME_WORDS: dict[str, Any] = {
    RunState.FAILED: gettext_lazy("failed"),
    RunState.ABANDONED: gettext_lazy("was abandoned"),
    RunState.MISSED: gettext_lazy("was missed"),
}


def _outcome_problem(health: TaskHealth, facts: ledger.TaskFacts, failures: int) -> Problem | None:
    """Its latest slot that came out did not succeed, and no acknowledgement covers it."""
    slot, state = facts.outcome_slot, facts.outcome_state
    if slot is None or state is None or state == RunState.SUCCEEDED or health.acknowledged(slot):
        return None
    detail = _("the %(slot)s slot %(outcome)s") % {
        "slot": _iso(slot),
        "outcome": str(_OUTCOME_WORDS.get(state, state)),
    }
    if facts.outcome_error:
        # A missed slot's reason starts with its state ("missed: no instance claimed it"):
        # said once ("was missed: no instance claimed it").
        error = facts.outcome_error.strip().removeprefix(f"{state}: ")
        detail += f": {error.splitlines()[0][:200]}"
    if failures > 1 and facts.ended == failures and facts.failed == failures:
        detail += " " + _("(its last %(n)d runs failed)") % {"n": failures}
    return Problem(MISSED if state == RunState.MISSED else FAILING, detail)


def _no_success_problem(health: TaskHealth, facts: ledger.TaskFacts, failures: int) -> Problem:
    due = health.latest_due
    detail = ngettext(
        "no success in its last due slot (%(slot)s is %(state)s; last success: %(last)s)",
        "no success in its last %(n)d due slots (latest %(slot)s is %(state)s; "
        "last success: %(last)s)",
        failures,
    ) % {
        "n": failures,
        "slot": _iso(due),
        "state": facts.due_state,
        "last": _iso(health.last_success.slot) if health.last_success else _("never"),
    }
    return Problem(FAILING, detail)


def _running_too_long(health: TaskHealth, now: datetime, count: int) -> Problem | None:
    """Its oldest run alive has run longer than ``count`` intervals and ``HUNG_AFTER``."""
    since, schedule, due = health.alive_since, health.schedule, health.latest_due
    if since is None:
        return None
    bound = HUNG_AFTER
    if schedule is not None and due is not None:
        bound = max(bound, due - expected_slots(schedule, due, count + 1)[-1])
    if now - since <= bound:
        return None
    detail = _("running for %(age)s: hung? (a run started %(since)s is alive; limit %(bound)s)")
    return Problem(
        RUNNING, detail % {"age": _human(now - since), "since": _iso(since), "bound": _human(bound)}
    )


def _no_success(health: TaskHealth, facts: ledger.TaskFacts, count: int) -> bool:
    """None of the task's last ``count`` due slots succeeded, every one of them was due
    while the task was registered and not paused and after its latest success finished
    (a slot due while that run was alive was skipped behind it, not failed), no run of it
    is alive (slots skipped behind it are not judged: :func:`_running_too_long` is), and
    the latest has a row that is not in flight (no row is late; a running one is not
    judged yet)."""
    due, schedule = health.latest_due, health.schedule
    if due is None or schedule is None or facts.due_state in LIVE_STATES or facts.due_state is None:
        return False
    if health.alive_since is not None:
        return False
    oldest = expected_slots(schedule, due, count)[-1]
    since = max((t for t in (health.first_seen, health.resumed_at) if t is not None), default=None)
    if since is not None and oldest < since:
        return False
    if health.acknowledged(oldest):
        return False
    last = health.last_success
    if last is None:
        return True
    return max(last.slot, last.finished_at or last.slot) < oldest


def expected_slots(schedule: Schedule, before: datetime, count: int) -> list[datetime]:
    """The ``count`` slots at or before ``before``, newest first."""
    slots: list[datetime] = []
    at = before
    while len(slots) < count:
        slot = schedule.latest_slot(at)
        slots.append(slot)
        at = slot - timedelta(microseconds=1)
    return slots


def describe(row: TaskSchedule) -> str:
    """The schedule in words: ``every 5 minutes``, ``cron 0 21 * * * (Europe/Paris)``."""
    if row.every is not None:
        return _("every %(interval)s") % {"interval": _interval(row.every)}
    zone = row.time_zone or get_default_timezone_name()
    return _("cron %(expression)s (%(zone)s)") % {"expression": row.cron, "zone": zone}


def _interval(every: timedelta) -> str:
    seconds = int(every.total_seconds())
    for size, one, many in (
        (86_400, _("day"), _("days")),
        (3_600, _("hour"), _("hours")),
        (60, _("minute"), _("minutes")),
        (1, _("second"), _("seconds")),
    ):
        if seconds % size == 0:
            count = seconds // size
            return str(one) if count == 1 else f"{count} {many}"
    return f"{seconds} {_('seconds')}"


def _human(delta: timedelta) -> str:
    seconds = max(0, int(delta.total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172_800:
        return f"{seconds // 3600}h {seconds % 3600 // 60}m"
    return f"{seconds // 86_400}d"


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def names(tasks: Sequence[TaskHealth]) -> str:
    return ", ".join(task.task for task in tasks)
