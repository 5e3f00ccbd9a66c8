"""``manage.py resume_task NAME``: undo ``pause_task``."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from ...exceptions import BackendUnavailable
from ...ledger import schedules as store
from ...models import ScheduleEventOrigin
from ...pauses import resume
from ..discovery import OPERATOR, operator, sync_schedules, unknown_schedule


class Command(BaseCommand):
    help = (
        "Resume a paused task: its next slots run again. Slots recorded skipped while it "
        "was paused stay so (backfill runs only slots with no row)."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("name", help="The task's name.")

    def handle(self, *args: Any, name: str, **options: Any) -> None:
        try:
            sync_schedules(self, OPERATOR)
            if store.get(name) is None:
                raise unknown_schedule(name, store.names())
            if not resume(name, by=operator(), origin=ScheduleEventOrigin.COMMAND):
                self.stdout.write(f"{name} was not paused.")
                return
        except BackendUnavailable as exc:
            raise CommandError(f"resume_task failed: {exc}") from exc
        self.stdout.write(f"Resumed {name}.")
