"""``manage.py check_schedules``: non-zero exit when a task is late, missed slots or fails."""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils.translation import ngettext

from ... import health
from ...exceptions import BackendUnavailable, NotMigrated

# Exit statuses: 1 a task is unhealthy, 2 the ledger could not be read, 3 its tables are
# not there (manage.py migrate was not run: not "database down").
UNHEALTHY_EXIT = 1
UNREACHABLE_EXIT = 2
NOT_MIGRATED_EXIT = 3


class Command(BaseCommand):
    help = (
        "Judge every registered schedule and every task the ledger has runs of: late (its "
        "latest due slot has no run past its grace, or a run's owner is presumed dead), "
        "missed slots within MONITOR_WINDOW_HOURS, its last HEALTH_FAILURES runs failed, or a "
        "run of it has been alive too long (hung?); and whether the upkeep ran within "
        "3 intervals (UPKEEP_INTERVAL_SECONDS; a day with it off: cleanup_locks from cron). "
        f"Exit {UNHEALTHY_EXIT} naming each unhealthy task and why; paused tasks are healthy "
        f"and said to be paused. Exit {UNREACHABLE_EXIT} when the database cannot be read, "
        f"{NOT_MIGRATED_EXIT} when taskguard's migrations were not applied there."
    )

    # A probe run every minute answers fast and always: no system checks (they may ask Redis).
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--json",
            action="store_true",
            dest="as_json",
            help="Print the verdict as one JSON object (what the health/ URL answers).",
        )
        parser.add_argument("--task", default=None, help="Only this task (default: every task).")

    def handle(self, *args: Any, as_json: bool, task: str | None, **options: Any) -> None:
        try:
            verdict = health.check(task=task)
        except BackendUnavailable as exc:
            code = NOT_MIGRATED_EXIT if isinstance(exc, NotMigrated) else UNREACHABLE_EXIT
            raise CommandError(f"check_schedules failed: {exc}", returncode=code) from exc
        if task is not None and not verdict.tasks:
            raise CommandError(f"no schedule and no run of a task named {task!r}")
        if as_json:
            self.stdout.write(json.dumps(verdict.as_dict()))
        else:
            self.stdout.write(report(verdict))
        if not verdict.healthy:
            raise CommandError(verdict_error(verdict), returncode=UNHEALTHY_EXIT)


def verdict_error(verdict: health.Verdict) -> str:
    """The unhealthy tasks by name, and the upkeep's problem."""
    said = []
    count = len(verdict.unhealthy)
    if count:
        said.append(
            ngettext(
                "%(n)d task is unhealthy: %(names)s",
                "%(n)d tasks are unhealthy: %(names)s",
                count,
            )
            % {"n": count, "names": health.names(verdict.unhealthy)}
        )
    if verdict.upkeep_problem:
        said.append(verdict.upkeep_problem)
    return "; ".join(said)


def report(verdict: health.Verdict) -> str:
    """One line per task (and one per problem), then a summary line."""
    lines: list[str] = []
    width = max((len(t.task) for t in verdict.tasks), default=0)
    # As wide as the widest label (LATE/MISSED is wider than OK), so the names line up.
    labels = [_label(task) for task in verdict.tasks]
    left = max((len(label) for label in [*labels, "UPKEEP"]), default=0)
    for label, task in zip(labels, verdict.tasks, strict=True):
        lines.append(f"{label:{left}} {task.task:{width}}  {_facts(task)}")
        lines.extend(f"{'':{left}} {'':{width}}  {p.code}: {p.detail}" for p in task.problems)
    if verdict.upkeep_problem:
        lines.append(f"{'UPKEEP':{left}} {verdict.upkeep_problem}")
    unhealthy = len(verdict.unhealthy)
    if not verdict.tasks:
        lines.append("No schedules registered and no runs recorded yet.")
    elif unhealthy:
        total = len(verdict.tasks)
        tasks = ngettext("%(total)d task", "%(total)d tasks", total) % {"total": total}
        lines.append(
            ngettext(
                "%(n)d of %(tasks)s is unhealthy.", "%(n)d of %(tasks)s are unhealthy.", unhealthy
            )
            % {"n": unhealthy, "tasks": tasks}
        )
    else:
        lines.append(
            ngettext(
                "%(total)d task is healthy.", "All %(total)d tasks are healthy.", len(verdict.tasks)
            )
            % {"total": len(verdict.tasks)}
        )
    if verdict.upkeep_problem:
        lines.append("The upkeep is unhealthy (see UPKEEP above).")
    return "\n".join(lines)


def _label(task: health.TaskHealth) -> str:
    if task.paused:
        return "PAUSED"
    if not task.problems:
        return "OK"
    return "/".join(sorted({p.code for p in task.problems})).upper()


def _facts(task: health.TaskHealth) -> str:
    parts = [task.words] if task.words else []
    if task.paused:
        since = f" since {task.paused_at.isoformat()}" if task.paused_at else ""
        why = f" ({task.paused_reason})" if task.paused_reason else ""
        parts.append(f"paused{since}{why}: healthy, no alarms while paused")
    finished = task.last_success.finished_at if task.last_success else None
    parts.append(f"last success {finished.isoformat() if finished else 'never'}")
    if task.next_slot is not None and not task.paused:
        parts.append(f"next slot {task.next_slot.isoformat()}")
    ack, until = task.acknowledgement, task.acknowledged_until
    if ack is not None and until is not None:
        parts.append(f"problems up to {until.isoformat()} acknowledged by {ack.by} ({ack.reason})")
    return "; ".join(parts)
