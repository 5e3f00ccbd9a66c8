"""``manage.py cleanup_locks``: abandon runs whose owner died, release their locks."""

from __future__ import annotations

import json
from argparse import ArgumentParser, ArgumentTypeError
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils.translation import ngettext

from ... import ledger
from ...cleanup import BATCH_SIZE, CleanupResult, cleanup_locks
from ...exceptions import BackendUnavailable
from ...missed import sweep_missed
from ...registry import sync
from ..arguments import whole_number


def task_name(value: str) -> str:
    if not value.strip():
        raise ArgumentTypeError("the task name must not be empty")
    return value


class Command(BaseCommand):
    help = (
        "Mark runs whose lease expired (by the database clock) as abandoned, release their "
        "Redis locks if they still hold that run's token, record the slots whose Redis winner "
        "died before writing its row, remove Redis keys of no live run, and record the due "
        "slots of registered schedules that nobody claimed within their grace as missed. "
        "Never touches a "
        "live owner's run or lock; safe to run from every instance. Run it at least daily."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="Report what would be done; change nothing."
        )
        parser.add_argument(
            "--task", type=task_name, default=None, help="Only this task (default: every task)."
        )
        parser.add_argument(
            "--json",
            action="store_true",
            dest="as_json",
            help="Print the counts as one JSON object.",
        )
        parser.add_argument(
            "--batch-size",
            type=whole_number(1),
            default=BATCH_SIZE,
            help=f"Stale runs read per query (default: {BATCH_SIZE}).",
        )

    def handle(
        self,
        *args: Any,
        dry_run: bool,
        task: str | None,
        as_json: bool,
        batch_size: int,
        **options: Any,
    ) -> None:
        try:
            ledger.ensure_reachable()
            result = cleanup_locks(task=task, dry_run=dry_run, batch_size=batch_size)
            if not dry_run:
                sync()  # the schedules the code declares (a dry run changes nothing)
            result.missed_slots = sweep_missed(task=task, dry_run=dry_run).missed_slots
        except BackendUnavailable as exc:
            raise CommandError(f"cleanup_locks failed: {exc}") from exc
        if as_json:
            self.stdout.write(json.dumps(result.as_dict()))
        else:
            self.stdout.write(describe(result))


def describe(result: CleanupResult) -> str:
    """``Abandoned 3 stale runs, released 2 locks, removed 1 orphan key`` (or ``Would ...``).

    Slots recorded for a Redis winner that died before its row are named only
    when there are some.
    """
    unrecorded = result.unrecorded_slots
    if result.dry_run:
        parts = [
            ngettext("Would abandon %d stale run", "Would abandon %d stale runs", result.stale_runs)
            % result.stale_runs,
            ngettext("would release %d lock", "would release %d locks", result.released_locks)
            % result.released_locks,
            ngettext(
                "would remove %d orphan key", "would remove %d orphan keys", result.orphan_keys
            )
            % result.orphan_keys,
        ]
        recorded = ngettext(
            "would record %d slot whose Redis winner died",
            "would record %d slots whose Redis winner died",
            unrecorded,
        )
    else:
        parts = [
            ngettext("Abandoned %d stale run", "Abandoned %d stale runs", result.stale_runs)
            % result.stale_runs,
            ngettext("released %d lock", "released %d locks", result.released_locks)
            % result.released_locks,
            ngettext("removed %d orphan key", "removed %d orphan keys", result.orphan_keys)
            % result.orphan_keys,
        ]
        recorded = ngettext(
            "recorded %d slot whose Redis winner died",
            "recorded %d slots whose Redis winner died",
            unrecorded,
        )
    if unrecorded:
        parts.append(recorded % unrecorded)
    missed = result.missed_slots
    if missed:
        noun = ngettext("missed slot", "missed slots", missed)
        parts.append(f"{'would record' if result.dry_run else 'recorded'} {missed} {noun}")
    return ", ".join(parts) + "."
