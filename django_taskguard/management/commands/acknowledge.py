"""``manage.py acknowledge TASK --reason TEXT [--until ISO]``: "we know" about a schedule's
failed, abandoned and missed slots, so that they stop failing health."""

from __future__ import annotations

from argparse import ArgumentParser
from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from ... import ledger
from ...acknowledgements import acknowledge, default_until
from ...exceptions import BackendUnavailable, TaskGuardError
from ...ledger import schedules as store
from ...models import ScheduleEventOrigin
from ..arguments import aware_datetime
from ..discovery import OPERATOR, operator, sync_schedules, unknown_schedule


class Command(BaseCommand):
    help = (
        "Acknowledge TASK's problems (failed, abandoned and missed slots) up to --until "
        "(default: now): they stop failing check_schedules and health/, stay visible with "
        "who, when and why, and a problem in a later slot fails health again."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("name", help="The task's name (as in the admin and the ledger).")
        parser.add_argument(
            "--reason", required=True, help="Why (kept with who and when; required)."
        )
        parser.add_argument(
            "--until",
            type=aware_datetime,
            default=None,
            help="Acknowledge the slots at or before this ISO-8601 time with its UTC offset "
            "(default: now, but no slot still in flight; a time in the future is refused).",
        )

    def handle(
        self, *args: Any, name: str, reason: str, until: datetime | None, **options: Any
    ) -> None:
        try:
            sync_schedules(self, OPERATOR)
            if until is None:
                until = default_until(name, timezone.now())
            row = store.get(name)
            if row is None:
                raise unknown_schedule(name, store.names())
            covered = ledger.problem_slots(name, row.acknowledged_until, until)
            if not acknowledge(
                name, reason, until=until, by=operator(), origin=ScheduleEventOrigin.COMMAND
            ):
                raise unknown_schedule(name, store.names())
        except TaskGuardError as exc:
            if isinstance(exc, BackendUnavailable):
                raise CommandError(f"acknowledge failed: {exc}") from exc
            raise CommandError(str(exc)) from exc
        self.stdout.write(self.said(name, until, covered, row.acknowledged_until))

    @staticmethod
    def said(name: str, until: datetime, covered: int, before: datetime | None) -> str:
        since = f" after {before.isoformat()}" if before is not None else ""
        slots = "1 problem slot" if covered == 1 else f"{covered} problem slots"
        return (
            f"Acknowledged {name} up to {until.isoformat()}: {slots} (failed, abandoned or "
            f"missed){since}. A problem in a later slot fails health again."
        )
