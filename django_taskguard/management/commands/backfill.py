"""``manage.py backfill TASK --from ISO --to ISO [--enqueue]``: run (or enqueue) each slot of
a range that has no row, or whose row the sweep recorded ``missed`` (it never ran)."""

from __future__ import annotations

import dataclasses
import time
from argparse import ArgumentParser
from datetime import datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from ... import guard, ledger
from ...conf import taskguard_settings
from ...exceptions import BackendUnavailable, DuplicateRun
from ...handoff import hand_off
from ...models import RunState, ScheduleSource
from ...registry import Entry
from ..arguments import aware_datetime
from ..discovery import RUNNER, sync_schedules, unknown_schedule

BACKFILL_MAX_SLOTS = 10_000
ONE_MICROSECOND = timedelta(microseconds=1)
# A slot still missed after the guard refused it is tried again after each pause (s): the
# call holding its key is taking the row over, or lets the key go within moments.
HELD_RETRY_PAUSES = (0.0, 0.5, 1.0, 2.0)


class Command(BaseCommand):
    help = (
        "Run, through the guard and in order, every slot of TASK's schedule from --from to "
        "--to (both included) that has no row in the ledger or that the sweep recorded "
        "missed (it never ran). Running it twice is harmless: a slot that ran is never run "
        f"again. At most {BACKFILL_MAX_SLOTS:,} slots; slots "
        "older than PRUNE_AFTER_DAYS are refused (their rows may have been pruned)."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("task", help="The task's name.")
        parser.add_argument("--from", dest="start", type=aware_datetime, required=True)
        parser.add_argument("--to", dest="end", type=aware_datetime, required=True)
        parser.add_argument(
            "--dry-run", action="store_true", help="List what would run; run nothing."
        )
        parser.add_argument(
            "--enqueue",
            action="store_true",
            help="Enqueue each slot to the backend of the django.tasks task that wraps TASK "
            "instead of running it here (its workers run it).",
        )

    def handle(
        self,
        *args: Any,
        task: str,
        start: datetime,
        end: datetime,
        dry_run: bool,
        enqueue: bool,
        **options: Any,
    ) -> None:
        if end < start:
            raise CommandError("--to is before --from")
        try:
            entry = self._entry(task)
            if enqueue and entry.enqueue is None:
                raise CommandError(
                    f"--enqueue: {task} is not wrapped by a django.tasks @task() (put @task() "
                    f"above @once_per_schedule), so there is no backend to enqueue to"
                )
            slots, refused, taken, missed = self._plan(entry, start, end, enqueue)
        except BackendUnavailable as exc:
            raise CommandError(f"backfill failed: {exc}") from exc
        self._say_plan(task, len(slots), refused, taken, missed, dry_run=dry_run, enqueue=enqueue)
        if dry_run:
            for slot in slots:
                self.stdout.write(f"  {slot.isoformat()}")
            return
        if enqueue:
            failed = sum(1 for slot in slots if not self._enqueue(entry, slot))
            self.stdout.write(f"Enqueued {len(slots) - failed} slots of {task}; {failed} raised.")
            if failed:
                raise CommandError(f"{failed} slots of {task} could not be enqueued")
            return
        ends = [self._run(entry, slot) for slot in slots]
        raised, left = ends.count("raised"), ends.count("not run")
        self.stdout.write(
            f"Ran {ends.count('ran')} slots of {task}; {raised} raised; {left} not run."
        )
        if raised:
            raise CommandError(f"{raised} slots of {task} raised (recorded failed)")
        if left:
            raise CommandError(
                f"{left} slots of {task} were not run: still missed, their lock held by "
                f"another call; backfill them again"
            )

    def _say_plan(
        self, task: str, slots: int, refused: int, taken: int, missed: int, *, dry_run: bool,
        enqueue: bool,
    ) -> None:  # fmt: skip
        if refused:
            self.stdout.write(
                f"{refused} slots are older than PRUNE_AFTER_DAYS "
                f"({taskguard_settings.PRUNE_AFTER_DAYS} days): the guard refuses them (their "
                f"rows may have been pruned), so they are not run."
            )
        doing = "enqueue" if enqueue else "run"
        verb = f"Would {doing}" if dry_run else ("Enqueueing" if enqueue else "Running")
        self.stdout.write(f"{verb} {slots} slots of {task} ({taken} already have a row).")
        if missed and enqueue:
            self.stdout.write(
                f"{missed} slots recorded missed by the sweep are not enqueued (a missed row is "
                f"taken over where it runs): backfill them without --enqueue."
            )
        elif missed:
            self.stdout.write(
                f"{missed} of them were recorded missed by the sweep (they never ran): each "
                f"is taken over once (missed -> running)."
            )

    def _entry(self, task: str) -> Entry:
        found = sync_schedules(self, RUNNER)
        entry = found.get(task)
        if entry is None:
            raise unknown_schedule(task, found)
        if entry.source != ScheduleSource.FUNCTION:
            raise CommandError(
                f"{task} is a Celery task; backfill runs plain functions only (enqueueing "
                f"stamped messages is not supported yet)"
            )
        return entry

    def _plan(
        self, entry: Entry, start: datetime, end: datetime, enqueue: bool
    ) -> tuple[list[datetime], int, int, int]:
        """The slots to run, how many are refused as too old, how many have a row that
        ran (or runs), how many were recorded missed (to run; with ``enqueue``: left)."""
        now = timezone.now()
        end = min(end, now)
        after = start - ONE_MICROSECOND
        count = entry.schedule.count_between(after, end, BACKFILL_MAX_SLOTS + 1)
        if count > BACKFILL_MAX_SLOTS:
            raise CommandError(
                f"the range holds more than {BACKFILL_MAX_SLOTS:,} slots of {entry.task_name}; "
                f"backfill it in parts"
            )
        every = entry.schedule.slots_between(after, end, count)
        floor = now - timedelta(days=taskguard_settings.PRUNE_AFTER_DAYS)
        recent = [slot for slot in every if slot >= floor]
        rows = ledger.states_at(entry.task_name, recent)
        missed = sum(1 for state in rows.values() if state == RunState.MISSED)
        todo = [slot for slot in recent if rows.get(slot, RunState.MISSED) == RunState.MISSED]
        if enqueue:
            todo = [slot for slot in todo if slot not in rows]
        return todo, len(every) - len(recent), len(rows) - missed, missed

    def _run(self, entry: Entry, slot: datetime) -> str:
        """Run one slot: "ran" (here or elsewhere), "raised", or "not run" (still missed)."""
        # An operator's explicit call: a slot the sweep recorded missed runs whatever the
        # catch-up policy (the guard takes it over from missed, once across every caller).
        policy = entry.policy
        if policy.catchup == "none":
            policy = dataclasses.replace(policy, catchup="latest")
        for pause in HELD_RETRY_PAUSES:
            time.sleep(pause)
            elsewhere = False
            try:
                result = guard.execute(entry.task_name, slot, policy, entry.func, (), {})
            except DuplicateRun:  # on_duplicate="raise": another call has the slot
                result, elsewhere = None, True
            except Exception as exc:
                self.stdout.write(f"  {slot.isoformat()}: raised {type(exc).__name__}: {exc}")
                return "raised"
            row = ledger.read(entry.task_name, slot)
            # Still missed after the guard said no: another call holds the slot's key
            # (it is taking the row over, or it is a late call that will let it go).
            if result is not None or row is None or row.state != RunState.MISSED:
                break
        else:
            self.stdout.write(f"  {slot.isoformat()}: not run (still missed; its lock is held)")
            return "not run"
        state = row.state if row is not None else "no row"
        done = " (ran)" if result is not None else " (run elsewhere)" if elsewhere else ""
        self.stdout.write(f"  {slot.isoformat()}: {state}{done}")
        return "ran"

    def _enqueue(self, entry: Entry, slot: datetime) -> bool:
        try:
            outcome = hand_off(entry, slot, scheduled=False)
        except Exception as exc:
            self.stdout.write(f"  {slot.isoformat()}: raised {type(exc).__name__}: {exc}")
            return False
        self.stdout.write(f"  {slot.isoformat()}: {outcome}")
        return True
