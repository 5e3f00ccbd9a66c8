"""``manage.py backfill TASK --from ISO --to ISO [--enqueue]``: run (or enqueue) each slot of
a range that has no row, or whose row the sweep recorded ``missed`` (it never ran).

What runs a slot depends on the schedule (:mod:`..backfill_kinds`): a code schedule's
function, or a data schedule's target (``target[name]``: a function, or a django.tasks task
with ``--enqueue``) with the row's arguments, its version recorded on the run. A Celery
beat entry (``task[entry]``, a ``TaskSchedule`` row of source ``celery``) has
nothing to run here: each slot becomes a message stamped as the beat stamps it, for its
workers (:mod:`django_taskguard.contrib.celery.backfill`); so has a data schedule whose
target is a Celery task (``handoff.SENDERS["data"]``, by its target's kind)."""

from __future__ import annotations

import dataclasses
import time
from argparse import ArgumentParser
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from ... import ledger, pauses
from ...conf import taskguard_settings
from ...exceptions import BackendUnavailable, DuplicateRun, TaskGuardError
from ...handoff import SENDERS, SlotSender
from ...ledger import schedules as schedule_store
from ...models import RunState, ScheduleSource, TargetKind, TaskSchedule
from ...registry import Entry
from ...schedules import Schedule, rebuild
from ..arguments import aware_datetime
from ..backfill_kinds import Backfilled, of_data, of_entry
from ..discovery import RUNNER, operator, sync_schedules, unknown_schedule

BACKFILL_MAX_SLOTS = 10_000
ONE_MICROSECOND = timedelta(microseconds=1)
# A slot still missed after the guard refused it is tried again after each pause (s): the
# call holding its key is taking the row over, or lets the key go within moments.
HELD_RETRY_PAUSES = (0.0, 0.5, 1.0, 2.0)


@dataclass(frozen=True)
class Plan:
    """A backfill's slots: ``slots`` to run (in order), how many are ``refused`` as too old,
    how many are ``taken`` (a row that ran, or runs), and those recorded ``missed`` (among
    ``slots``, unless left out)."""

    slots: list[datetime]
    refused: int
    taken: int
    missed: set[datetime]


class Command(BaseCommand):
    help = (
        "Run, through the guard and in order, every slot of TASK's schedule from --from to "
        "--to (both included) that has no row in the ledger or that the sweep recorded "
        "missed (it never ran). Running it twice is harmless: a slot that ran is never run "
        f"again. At most {BACKFILL_MAX_SLOTS:,} slots; slots "
        "older than PRUNE_AFTER_DAYS are refused (their rows may have been pruned). A data "
        "schedule (TASK = target[name]) runs its target with its arguments. A Celery "
        "beat entry (TASK[entry]) or a Celery task's data schedule gets one stamped message "
        "per slot, for its workers."
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
            "instead of running it here (its workers run it). A Celery beat entry's slots are "
            "always enqueued, with or without it.",
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
            found = sync_schedules(self, RUNNER)
            entry = found.get(task)
            row = None if entry is not None else self._stored(task, found)
            if row is None:
                kind = of_entry(found[task], enqueue)
            elif self._runs_here(row):
                kind = of_data(row, enqueue)
            else:
                self._backfill_beat(row, start, end, dry_run=dry_run)
                return
            plan = self._plan(kind.task_name, kind.schedule, start, end, kind.window)
        except BackendUnavailable as exc:
            raise CommandError(f"backfill failed: {exc}") from exc
        if enqueue:  # a missed row is taken over where it runs: not handed out
            plan = dataclasses.replace(
                plan, slots=[slot for slot in plan.slots if slot not in plan.missed]
            )
        self._say_plan(task, plan, dry_run=dry_run, mode="enqueue" if enqueue else "run")
        if kind.note:
            self.stdout.write(kind.note)
        if dry_run:
            for slot in plan.slots:
                self.stdout.write(f"  {slot.isoformat()}")
        elif enqueue:
            self._enqueue_all(kind, plan.slots)
        else:
            self._run_all(kind, plan.slots)

    def _enqueue_all(self, kind: Backfilled, slots: list[datetime]) -> None:
        task = kind.task_name
        failed = sum(1 for slot in slots if not self._enqueue(kind, slot))
        self.stdout.write(f"Enqueued {len(slots) - failed} slots of {task}; {failed} raised.")
        if failed:
            raise CommandError(f"{failed} slots of {task} could not be enqueued")

    def _run_all(self, kind: Backfilled, slots: list[datetime]) -> None:
        task = kind.task_name
        ends = [self._run(kind, slot) for slot in slots]
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

    def _say_plan(self, task: str, plan: Plan, *, dry_run: bool, mode: str) -> None:
        """Say what will be done; ``mode``: "run" (here), "enqueue" (to django.tasks) or
        "send" (a Celery beat entry's messages)."""
        if plan.refused:
            self.stdout.write(
                f"{plan.refused} slots are older than PRUNE_AFTER_DAYS "
                f"({taskguard_settings.PRUNE_AFTER_DAYS} days): the guard refuses them (their "
                f"rows may have been pruned), so they are not run."
            )
        doing = "run" if mode == "run" else "enqueue"
        verb = f"Would {doing}" if dry_run else ("Running" if mode == "run" else "Enqueueing")
        self.stdout.write(
            f"{verb} {len(plan.slots)} slots of {task} ({plan.taken} already have a row)."
        )
        missed = len(plan.missed)
        if missed and mode == "enqueue":
            self.stdout.write(
                f"{missed} slots recorded missed by the sweep are not enqueued (a missed row is "
                f"taken over where it runs): backfill them without --enqueue."
            )
        elif missed:
            where = " by the worker that gets its message" if mode == "send" else ""
            self.stdout.write(
                f"{missed} of them were recorded missed by the sweep (they never ran): each "
                f"is taken over once{where} (missed -> running)."
            )

    def _stored(self, task: str, found: dict[str, Entry]) -> TaskSchedule:
        """The stored schedule named ``task`` that no code declares: a Celery beat entry
        (``task[entry]``) or a data schedule (``target[name]``)."""
        row = schedule_store.get(task)
        if row is None or row.source not in (ScheduleSource.CELERY, ScheduleSource.DATA):
            raise unknown_schedule(task, {*found, *schedule_store.names()})
        if row.source == ScheduleSource.CELERY and not row.entry:
            raise unknown_schedule(task, {*found, *schedule_store.names()})
        if row.source == ScheduleSource.DATA and row.removed_at is not None:
            raise CommandError(f"{task} was deleted: define it again to backfill it")
        return row

    @staticmethod
    def _runs_here(row: TaskSchedule) -> bool:
        """A data schedule of a function or a django.tasks task: run (or enqueued) from
        here; a beat entry's or a Celery data schedule's slots go to its workers."""
        return row.source == ScheduleSource.DATA and row.target_kind != TargetKind.CELERY

    def _backfill_beat(
        self, row: TaskSchedule, start: datetime, end: datetime, *, dry_run: bool
    ) -> None:
        """Hand each slot with no row or recorded missed to the task queue whose workers run
        the schedule (a Celery beat entry: ``contrib.celery.backfill``)."""
        task = row.task_name
        maker = SENDERS.get(row.source)
        if maker is None:
            raise CommandError(
                f"{task} is a {row.source} schedule of a Celery task, and nothing here can "
                f"send its slots: no sender is registered for {row.source!r} schedules "
                f'(handoff.SENDERS; it comes with Celery: pip install "django-taskguard[celery]"'
                f", and django_taskguard.contrib.celery imported)"
            )
        try:
            sender = maker(row, operator())
        except TaskGuardError as exc:
            raise CommandError(f"{task}: {exc}") from exc
        schedule = rebuild(row.cron, row.cron_day_or, schedule_store.zone_of(row), row.every)
        plan = self._plan(task, schedule, start, end)
        self._say_plan(task, plan, dry_run=dry_run, mode="send")
        if row.paused:
            self.stdout.write(
                f"{task} is paused{pauses.why(row.paused_reason)}: the worker records each "
                f"slot skipped (paused) instead of running it; resume it first to run them."
            )
        if dry_run:
            for slot in plan.slots:
                self.stdout.write(f"  {slot.isoformat()}{' (missed)' * (slot in plan.missed)}")
            return
        with sender:
            sent = sum(self._send(sender, plan, index) for index in range(len(plan.slots)))
        left = len(plan.slots) - sent
        self.stdout.write(f"Enqueued {sent} slots of {task}; {left} had a row meanwhile.")

    def _send(self, sender: SlotSender, plan: Plan, index: int) -> bool:
        """Send one slot; True when it was enqueued. The first error stops the backfill."""
        slot = plan.slots[index]
        try:
            said = sender.hand_out(slot, missed=slot in plan.missed)
        except Exception as exc:
            self.stdout.write(f"  {slot.isoformat()}: raised {type(exc).__name__}: {exc}")
            raise CommandError(
                f"enqueueing stopped at {slot.isoformat()} ({exc}); "
                f"{len(plan.slots) - index - 1} later slots were not enqueued: backfill again"
            ) from exc
        self.stdout.write(f"  {slot.isoformat()}: {said}")
        return said.startswith("enqueued")

    def _plan(
        self,
        task: str,
        schedule: Schedule,
        start: datetime,
        end: datetime,
        window: Callable[[datetime], bool] = lambda slot: True,
    ) -> Plan:
        """The slots to run: those with no row, and those the sweep recorded missed (of
        those in the schedule's ``window``)."""
        now = timezone.now()
        end = min(end, now)
        after = start - ONE_MICROSECOND
        count = schedule.count_between(after, end, BACKFILL_MAX_SLOTS + 1)
        if count > BACKFILL_MAX_SLOTS:
            raise CommandError(
                f"the range holds more than {BACKFILL_MAX_SLOTS:,} slots of {task}; "
                f"backfill it in parts"
            )
        every = [slot for slot in schedule.slots_between(after, end, count) if window(slot)]
        floor = now - timedelta(days=taskguard_settings.PRUNE_AFTER_DAYS)
        recent = [slot for slot in every if slot >= floor]
        rows = ledger.states_at(task, recent)
        missed = {slot for slot, state in rows.items() if state == RunState.MISSED}
        todo = [slot for slot in recent if rows.get(slot, RunState.MISSED) == RunState.MISSED]
        return Plan(todo, len(every) - len(recent), len(rows) - len(missed), missed)

    def _run(self, kind: Backfilled, slot: datetime) -> str:
        """Run one slot: "ran" (here or elsewhere), "raised", or "not run" (still missed)."""
        # An operator's explicit call: a slot the sweep recorded missed runs whatever the
        # catch-up policy (the guard takes it over from missed, once across every caller).
        policy = kind.policy
        if policy.catchup == "none":
            policy = dataclasses.replace(policy, catchup="latest")
        for pause in HELD_RETRY_PAUSES:
            time.sleep(pause)
            elsewhere = False
            try:
                ran = kind.run(slot, policy)
            except DuplicateRun:  # on_duplicate="raise": another call has the slot
                ran, elsewhere = False, True
            except Exception as exc:
                self.stdout.write(f"  {slot.isoformat()}: raised {type(exc).__name__}: {exc}")
                return "raised"
            row = ledger.read(kind.task_name, slot)
            # Still missed after the guard said no: another call holds the slot's key
            # (it is taking the row over, or it is a late call that will let it go).
            if ran or row is None or row.state != RunState.MISSED:
                break
        else:
            self.stdout.write(f"  {slot.isoformat()}: not run (still missed; its lock is held)")
            return "not run"
        state = row.state if row is not None else "no row"
        done = " (ran)" if ran else " (run elsewhere)" if elsewhere else ""
        self.stdout.write(f"  {slot.isoformat()}: {state}{done}")
        return "ran"

    def _enqueue(self, kind: Backfilled, slot: datetime) -> bool:
        assert kind.enqueue is not None  # checked by of_entry / of_data
        try:
            outcome = kind.enqueue(slot)
        except Exception as exc:
            self.stdout.write(f"  {slot.isoformat()}: raised {type(exc).__name__}: {exc}")
            return False
        self.stdout.write(f"  {slot.isoformat()}: {outcome}")
        return True
