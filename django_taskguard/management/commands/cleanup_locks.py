"""``manage.py cleanup_locks``: abandon runs whose owner died, release their locks."""

from __future__ import annotations

import difflib
import json
from argparse import ArgumentParser, ArgumentTypeError
from contextlib import nullcontext
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils.translation import ngettext

from ... import ledger, upkeep
from ...cleanup import BATCH_SIZE, CleanupResult, cleanup_locks
from ...exceptions import BackendUnavailable
from ...locks import get_backend
from ...missed import sweep_missed
from ...owner import actor
from ..arguments import whole_number
from ..discovery import OPERATOR, sync_schedules


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
            "--task",
            type=task_name,
            default=None,
            help="Only this task, and its per-schedule names (a Celery task 'app.job' also "
            "matches 'app.job[nightly]'). Default: every task.",
        )
        parser.add_argument(
            "--json",
            action="store_true",
            dest="as_json",
            help="Print the result as one JSON object (counts, the runs touched, runs in flight).",
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
        # A whole run (no --task, no --dry-run) is an upkeep: recorded in the Upkeep row,
        # for the health verdict, when no automatic upkeep holds the lease meanwhile. It
        # renews the lease while it works, as the automatic upkeep does: a cleanup longer
        # than the lease does not let another process's upkeep start beside it.
        holder = upkeep.unique(actor("cleanup_locks"))
        recording = False
        try:
            ledger.ensure_reachable()
            recording = task is None and not dry_run and upkeep.take_now(holder)
            with upkeep.Keeping(holder, upkeep.hold_now()) if recording else nullcontext() as lease:
                result = self.clean(task, dry_run, batch_size)
        except BaseException as exc:
            if recording:  # not a run the health verdict may count
                upkeep.give_back(holder)
            if isinstance(exc, BackendUnavailable):
                raise CommandError(f"cleanup_locks failed: {exc}") from exc
            raise
        if lease is not None and lease.lost.is_set():
            self.stderr.write(
                "cleanup_locks: another process took the upkeep's lease while this run worked "
                "(its renewals failed until it lapsed); this run is not recorded as an upkeep."
            )
        elif recording:
            counts = {k: v for k, v in result.as_dict().items() if type(v) is int}
            upkeep.finish(holder, counts, [])
        if as_json:
            self.stdout.write(json.dumps(result.as_dict()))
        else:
            self.stdout.write(describe(result))
            for line in details(result):
                self.stdout.write(line)

    def clean(self, task: str | None, dry_run: bool, batch_size: int) -> CleanupResult:
        result = cleanup_locks(task=task, dry_run=dry_run, batch_size=batch_size)
        if task is not None and not touched(result):
            refuse_unknown(task)
        if not dry_run:  # save the schedules the code declares (a dry run changes nothing)
            sync_schedules(self, OPERATOR)
        result.missed_slots = sweep_missed(task=task, dry_run=dry_run).missed_slots
        return result


def touched(result: CleanupResult) -> bool:
    """Whether cleanup found anything at all (a task with no row may have Redis records)."""
    counts = result.as_dict()
    return bool(result.in_flight) or any(
        counts[name]
        for name in ("stale_runs", "orphan_keys", "unrecorded_slots", "missed_slots")
        if name in counts
    )


def refuse_unknown(task: str) -> None:
    """A ``--task`` no run has ever had is a typo: say so, with the names that are close.

    A task whose only trace is a claim record in Redis (its first slot's winner died
    before its row) is known: recording that slot is what ``--task`` is for then.
    """
    known = set(ledger.known_task_names())
    if task not in known:
        known |= get_backend().claimed_task_names()
    bases = {name.split("[", 1)[0] for name in known}
    if task in known or task in bases:
        return
    close = difflib.get_close_matches(task, sorted(set(known) | bases), n=5, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    raise CommandError(f"no run of a task named {task!r} is in the ledger.{hint}")


def details(result: CleanupResult) -> list[str]:
    """One line per run touched (or that would be), per run in flight, and why 0 locks."""
    verb = "would abandon" if result.dry_run else "abandoned"
    lines = [
        f"  {verb}: {run.task} slot {run.slot.isoformat()} owner {run.owner}: {run.reason}"
        for run in result.runs
    ]
    if result.stale_runs > len(result.runs):
        lines.append(f"  ... and {result.stale_runs - len(result.runs)} more")
    if result.stale_runs and not result.released_locks:
        lines.append(
            "  No lock to release: each key had already expired with its lease (a Redis lock "
            "lives exactly as long as the lease), or the backend is the database."
        )
    for flight in result.in_flight:
        lines.append(
            f"  in flight: {flight.task} slot {flight.slot.isoformat()} owner {flight.owner}: "
            f"its lease runs until {flight.lease_until.isoformat()} "
            f"(in {flight.seconds_left:.0f} s); if its owner is dead, it is stale then and a "
            f"later cleanup_locks abandons it"
        )
    return lines


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
