"""``manage.py import_celery_beat [--dry-run]``: django-celery-beat's ``PeriodicTask`` rows
become data schedules (:mod:`django_taskguard.contrib.celery.importer`).

Exit status: 0 when every row was imported, updated, left unchanged *or refused* (the
refusals are listed with their reasons: a solar row stays a solar row, and importing the
others is still right); non-zero only on an error (django-celery-beat missing, the database
unreachable). Running it again is harmless: an unchanged row writes nothing."""

from __future__ import annotations

from argparse import ArgumentParser
from collections import Counter
from importlib.util import find_spec
from typing import Any

from django.apps import apps
from django.core.management.base import BaseCommand, CommandError

from ... import data_schedules
from ...exceptions import TaskGuardError
from ...ledger import schedules as store
from ...models import ScheduleEventOrigin
from ..discovery import operator

# What each outcome of ledger.schedules.define counts as, and how it is said.
COUNTED = {
    "created": "imported",
    "adopted": "imported",
    "edited": "updated",
    "enabled": "updated",
    "disabled": "updated",
    "unchanged": "unchanged",
}
SAID = {
    "created": ("Would import", "Imported"),
    "adopted": ("Would convert", "Converted"),
    "edited": ("Would update", "Updated"),
    "enabled": ("Would enable", "Enabled"),
    "disabled": ("Would disable", "Disabled"),
    "unchanged": ("Unchanged", "Unchanged"),
}


class Command(BaseCommand):
    help = (
        "Turn django-celery-beat's periodic tasks into data schedules: crontab (in its own "
        "time zone) and interval rows, with their names, arguments, enabled state, start and "
        "expiry; the last run time is kept so that no slot runs twice during the switch. "
        "Clocked, solar and one-off rows are refused, each with its reason. Queues, headers "
        "and other options are not carried (the rows that have them are listed). Running it "
        "again updates what changed and writes nothing else. Exits 0 with refusals listed; "
        "non-zero only on an error."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="Say what would be done; write nothing."
        )

    def handle(self, *args: Any, dry_run: bool, **options: Any) -> None:
        if find_spec("django_celery_beat") is None or not apps.is_installed("django_celery_beat"):
            raise CommandError(
                "django-celery-beat is not installed here (or not in INSTALLED_APPS): there "
                "are no periodic tasks to import"
            )
        from django_celery_beat.models import PeriodicTask

        from ...contrib.celery import importer

        rows = list(PeriodicTask.objects.select_related("crontab", "interval").order_by("name"))
        counts: Counter[str] = Counter()
        options_kept: list[str] = []
        try:
            for row in rows:
                counts[self._one(importer, row, dry_run=dry_run)] += 1
                dropped = importer.not_carried(row)
                if dropped:
                    options_kept.append(f"{row.name} ({', '.join(dropped)})")
        except TaskGuardError as exc:
            raise CommandError(f"import_celery_beat failed: {exc}") from exc
        if options_kept:
            self.stdout.write(
                "Not carried (a data schedule has no queue, routing, headers, priority nor "
                "expiry in seconds; the worker's defaults apply): " + "; ".join(options_kept)
            )
        would = "Would import" if dry_run else "Imported"
        self.stdout.write(
            f"{would} {counts['imported']}, updated {counts['updated']}, unchanged "
            f"{counts['unchanged']}, refused {counts['refused']} (of {len(rows)} periodic "
            f"tasks{'; nothing written' if dry_run else ''})."
        )

    def _one(self, importer: Any, row: Any, *, dry_run: bool) -> str:
        """Import one row (or say what would be done); return what it counts as."""
        try:
            found = importer.convert(row)
            plan = store.would_define(found.task_name, found.values, adopt=importer.ADOPTS)
        except (importer.Refused, store.NotDataSchedule) as exc:
            self.stdout.write(f"Refused {row.name!r}: {exc}")
            return "refused"
        kind = plan.kind
        if not dry_run and kind != "unchanged":
            store.define(
                found.task_name,
                found.values,
                origin=ScheduleEventOrigin.COMMAND,
                grace_of=data_schedules.grace_of,
                by=operator(),
                reason=importer.REASON,
                first_seen=found.first_seen,
                adopt=importer.ADOPTS,
            )
        said = SAID[kind][0 if dry_run else 1]
        line = f"{said} {row.name!r} as {found.task_name}: {importer.describe(found.values)}"
        if kind == "adopted":
            line += " (its TaskguardDatabaseScheduler entry: same identity, its runs kept)"
        elif kind in ("edited", "enabled", "disabled"):
            line += f" (changed: {', '.join(plan.changes)})"
        elif kind == "created" and found.first_seen is not None:
            last_run = row.last_run_at.isoformat()
            line += f"; no slot at or before its last run ({last_run}) fires again"
        if not found.values["enabled"]:
            line += " [disabled]"
        self.stdout.write(line)
        return COUNTED[kind]
