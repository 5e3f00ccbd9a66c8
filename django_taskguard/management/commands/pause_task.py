"""``manage.py pause_task NAME``: a paused task's slots are recorded skipped (reason paused)."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from ...exceptions import BackendUnavailable
from ...ledger import schedules as store
from ...models import ScheduleEventOrigin
from ...pauses import PAUSE_CACHE_SECONDS, pause, why
from ..discovery import OPERATOR, operator, sync_schedules, unknown_schedule


class Command(BaseCommand):
    help = (
        "Pause a scheduled task: from now on its slots are recorded skipped with reason "
        "'paused' (on every instance within a second), never run, and raise no missed-slot "
        "alarm. resume_task undoes it."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("name", help="The task's name (as in the admin and the ledger).")
        parser.add_argument("--reason", default="", help="Why (stored and shown).")

    def handle(self, *args: Any, name: str, reason: str, **options: Any) -> None:
        try:
            sync_schedules(self, OPERATOR)
            row = store.get(name)
            if row is None:
                raise unknown_schedule(name, store.names())
            if not pause(name, reason, by=operator(), origin=ScheduleEventOrigin.COMMAND):
                self.stdout.write(f"{name} was already paused{why(row.paused_reason)}.")
                return
        except BackendUnavailable as exc:
            raise CommandError(f"pause_task failed: {exc}") from exc
        self.stdout.write(
            f"Paused {name}: its slots are recorded skipped (paused) on every instance "
            f"within {PAUSE_CACHE_SECONDS:g}s."
        )
