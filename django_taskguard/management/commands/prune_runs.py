"""``manage.py prune_runs``: delete finished runs (and their transitions) past retention."""

from __future__ import annotations

from argparse import ArgumentParser
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils.translation import ngettext

from ... import ledger
from ...conf import taskguard_settings
from ...exceptions import BackendUnavailable
from ...retention import BATCH_SIZE, CLOCK_MARGIN, prune_runs
from ...states import PRUNABLE_STATES
from ..arguments import whole_number


class Command(BaseCommand):
    help = (
        f"Delete finished runs ({', '.join(PRUNABLE_STATES)}) whose slot is older than "
        "--older-than days (and an hour, for clock skew), with their transitions, in short "
        "batches. Never running, pending or retrying runs."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--older-than",
            type=whole_number(1, unit="days"),
            default=None,
            metavar="DAYS",
            help="Age of the slot in days, at least TASKGUARD['PRUNE_AFTER_DAYS'] (the default; "
            "guarded calls refuse slots older than it, so a pruned slot never runs again).",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Count what would be deleted; delete nothing."
        )
        parser.add_argument(
            "--batch-size",
            type=whole_number(1, 10_000),
            default=BATCH_SIZE,
            help=f"Runs deleted per transaction (default: {BATCH_SIZE}).",
        )

    def handle(
        self,
        *args: Any,
        older_than: int | None,
        dry_run: bool,
        batch_size: int,
        **options: Any,
    ) -> None:
        horizon = taskguard_settings.PRUNE_AFTER_DAYS
        age = horizon if older_than is None else older_than
        if age < horizon:
            raise CommandError(
                f"--older-than {age} is below TASKGUARD['PRUNE_AFTER_DAYS'] ({horizon}): a "
                f"guarded call still runs a slot up to {horizon} days old, and would run a "
                f"pruned one again. Lower PRUNE_AFTER_DAYS to prune younger runs."
            )
        try:
            before = ledger.database_now() - timedelta(days=age) - CLOCK_MARGIN
            result = prune_runs(before, dry_run=dry_run, batch_size=batch_size)
        except BackendUnavailable as exc:
            raise CommandError(f"prune_runs failed: {exc}") from exc
        runs = ngettext("%d finished run", "%d finished runs", result.runs) % result.runs
        transitions = (
            ngettext("%d transition", "%d transitions", result.transitions) % result.transitions
        )
        verb = "Would delete" if dry_run else "Deleted"
        self.stdout.write(f"{verb} {runs} and {transitions} older than {age} days.")
