"""One "instance" of the site: fires the demo schedule at every tick, like APScheduler would."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from example.jobs import DEMO_EVERY, demo_tick


class Command(BaseCommand):
    help = "Fire example.demo_tick once per tick (used by the demo command; one per process)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", required=True)
        parser.add_argument("--log", required=True)
        parser.add_argument("--ticks", type=int, default=5)
        parser.add_argument(
            "--go", required=True, help="A file the demo writes tick 0's Unix time into."
        )
        parser.add_argument(
            "--deadline",
            type=float,
            default=120.0,
            help="Exit 1 when the go file has not appeared after this many seconds "
            "(the demo that started this instance is gone). Default: %(default)s",
        )

    def handle(
        self, *args: Any, name: str, log: str, ticks: int, go: str, deadline: float, **options: Any
    ) -> None:
        period = DEMO_EVERY.total_seconds()
        self.stdout.write("ready")  # up: the demo picks tick 0 once every instance is
        self.stdout.flush()
        start_at = self._wait_for(Path(go), deadline, name)
        won = 0
        for tick in range(ticks):
            # Like a scheduler inside each replica: every instance wakes up a little
            # after the fire time, each with its own jitter.
            time.sleep(max(0.0, start_at + tick * period + random.uniform(0.05, 0.4) - time.time()))
            if demo_tick(name, log) is not None:
                won += 1
        self.stdout.write(f"{name}: won {won} of {ticks} ticks")

    def _wait_for(self, go: Path, deadline: float, name: str) -> float:
        """Tick 0's Unix time, once the demo writes it; an orphan gives up at the deadline."""
        give_up_at = time.monotonic() + deadline
        while not go.exists():
            if time.monotonic() > give_up_at:
                raise CommandError(
                    f"{name}: no go file {go} after {deadline:g}s: the demo that started this "
                    "instance is gone"
                )
            time.sleep(0.02)
        return float(go.read_text())
