"""Is every task running as scheduled? One verdict for ``check_schedules``, ``health/``
and the admin's overview.

A task is unhealthy when it is

- **late**: its latest slot due past its grace has no run, or one of its runs is
  still ``running`` with a lease that expired by the database's clock (its owner
  is presumed dead: running too long);
- **missed**: slots of it were recorded ``missed`` within ``MONITOR_WINDOW_HOURS``;
- **failing**: its last ``HEALTH_FAILURES`` finished runs all failed (or were
  abandoned by a dead owner).

A paused task is healthy, and says it is paused. Every read is an index probe
per task (at most ``MAX_TASKS`` tasks), a fixed number of statements in all, so
the verdict costs the same on a million runs as on ten.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from croniter import croniter
from django.utils.timezone import get_default_timezone, get_default_timezone_name
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from . import ledger
from .conf import taskguard_settings
from .ledger import schedules as schedule_store
from .models import TaskSchedule
from .schedules import CronSchedule, IntervalSchedule, Schedule, rebuild, wall_to_utc
from .states import RunState

# Tasks judged per verdict: the registered schedules, then names seen in the ledger.
MAX_TASKS = 200
LATE, MISSED, FAILING = "late", "missed", "failing"
OK, PAUSED, UNHEALTHY = "ok", "paused", "unhealthy"


@dataclass(frozen=True)
class Problem:
    code: str  # late | missed | failing
    detail: str


@dataclass
class TaskHealth:
    """One task's verdict, and what the overview shows beside it."""

    task: str
    schedule: Schedule | None = None
    words: str = ""
    paused: bool = False
    paused_at: datetime | None = None
    paused_reason: str = ""
    grace: timedelta = timedelta(0)
    first_seen: datetime | None = None
    last_success: ledger.LastRun | None = None
    latest_due: datetime | None = None
    next_slot: datetime | None = None
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
        }


@dataclass
class Verdict:
    checked_at: datetime
    tasks: list[TaskHealth]
    window: timedelta
    left_out: bool = False  # more than MAX_TASKS tasks: the others were not judged

    @property
    def healthy(self) -> bool:
        return all(task.healthy for task in self.tasks)

    @property
    def unhealthy(self) -> list[TaskHealth]:
        return [task for task in self.tasks if not task.healthy]

    def as_dict(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "checked_at": _iso(self.checked_at),
            "window_hours": self.window / timedelta(hours=1),
            "unhealthy": [task.task for task in self.unhealthy],
            "left_out": self.left_out,
            "tasks": [task.as_dict() for task in self.tasks],
        }


def check(*, task: str | None = None) -> Verdict:
    """Judge every known task (or one): raises ``BackendUnavailable`` when the ledger
    cannot be read. A handful of statements whatever the number of runs and tasks:
    every task's facts are read by one statement of index probes."""
    now = ledger.database_now()
    window = timedelta(hours=taskguard_settings.MONITOR_WINDOW_HOURS)
    tasks, left_out = known_tasks()
    if task is not None:
        tasks = [t for t in tasks if t.task == task]
    names = [t.task for t in tasks]
    successes = ledger.latest_in_state(names, RunState.SUCCEEDED)
    for health in tasks:
        health.last_success = successes.get(health.task)
        if health.schedule is not None:
            health.latest_due = health.schedule.latest_slot(now - health.grace)
            health.next_slot = next_slot(health.schedule, now)
    asks = [(t.task, t.latest_due if _expected(t) else None) for t in tasks if not t.paused]
    failures = taskguard_settings.HEALTH_FAILURES
    facts = ledger.task_facts(asks, now - window, failures)
    for health in tasks:
        if health.task in facts:
            judge(health, facts[health.task], now, window, failures)
    return Verdict(now, tasks, window, left_out)


def known_tasks() -> tuple[list[TaskHealth], bool]:
    """The registered schedules, then the other task names the ledger has runs of (at most
    ``MAX_TASKS``), and whether some were left out."""
    stored = schedule_store.stored()
    tasks = [from_schedule(row) for row in stored[:MAX_TASKS]]
    seen = {t.task for t in tasks}
    left_out = len(stored) > MAX_TASKS
    for name in ledger.task_names(MAX_TASKS + 1):
        if name in seen:
            continue
        if len(tasks) < MAX_TASKS:
            tasks.append(TaskHealth(name))
        else:
            left_out = True
    return tasks, left_out


def from_schedule(row: TaskSchedule) -> TaskHealth:
    schedule = build_schedule(row)
    return TaskHealth(
        row.task_name,
        schedule=schedule,
        words=describe(row),
        paused=row.paused,
        paused_at=row.paused_at,
        paused_reason=row.paused_reason,
        grace=row.grace,
        first_seen=row.first_seen,
    )


def build_schedule(row: TaskSchedule) -> Schedule | None:
    try:
        return rebuild(row.cron, row.cron_day_or, row.time_zone, row.every)
    except Exception:  # a row written by another version: shown, not judged on time
        return None


def _expected(health: TaskHealth) -> bool:
    """Whether the task's latest due slot should have a run (it was registered by then)."""
    due = health.latest_due
    return due is not None and (health.first_seen is None or due >= health.first_seen)


def judge(
    health: TaskHealth, facts: ledger.TaskFacts, now: datetime, window: timedelta, failures: int
) -> None:
    """Add ``health``'s problems from its facts (never called for a paused task)."""
    due = health.latest_due
    if due is not None and _expected(health):
        if facts.due_state is None:
            detail = _("slot %(slot)s has no run %(age)s after it (grace %(grace)s)") % {
                "slot": _iso(due),
                "age": _human(now - due),
                "grace": _human(health.grace),
            }
            health.problems.append(Problem(LATE, detail))
        elif facts.due_state == RunState.PENDING:
            detail = _("slot %(slot)s was handed out %(age)s ago but never started") % {
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
    if facts.missed:
        detail = ngettext(
            "%(n)d slot recorded missed in the last %(h)g hours (no instance fired it)",
            "%(n)d slots recorded missed in the last %(h)g hours (no instance fired them)",
            facts.missed,
        ) % {"n": facts.missed, "h": window / timedelta(hours=1)}
        health.problems.append(Problem(MISSED, detail))
    if facts.ended == failures and facts.failed == failures:
        detail = ngettext(
            "its last run failed (slot %(slot)s)",
            "its last %(n)d runs failed (latest slot %(slot)s)",
            failures,
        ) % {"n": failures, "slot": _iso(facts.latest_ended_slot)}
        health.problems.append(Problem(FAILING, detail))


def next_slot(schedule: Schedule, now: datetime) -> datetime | None:
    """The schedule's first slot after ``now``."""
    if isinstance(schedule, IntervalSchedule):
        return schedule.latest_slot(now) + schedule.every
    latest = schedule.latest_slot(now)
    if isinstance(schedule, CronSchedule):
        zone = ZoneInfo(schedule.tz_name) if schedule.tz_name else get_default_timezone()
        wall = now.astimezone(zone).replace(tzinfo=None, microsecond=0)
        fire = croniter(schedule.expression, wall, day_or=schedule.day_or).get_next(datetime)
        candidate = wall_to_utc(fire, zone)
        if candidate > now and schedule.latest_slot(candidate) == candidate:
            return candidate
    # Any other schedule (or a DST edge): bracket the next slot, then bisect to the second.
    low, step = now, timedelta(minutes=1)
    while schedule.latest_slot(now + step) <= latest:
        low, step = now + step, step * 2
        if step > timedelta(days=800):
            return None
    high = now + step
    while high - low > timedelta(seconds=1):
        middle = low + (high - low) / 2
        if schedule.latest_slot(middle) > latest:
            high = middle
        else:
            low = middle
    return schedule.latest_slot(high)


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
