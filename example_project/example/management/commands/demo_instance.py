"""One "instance" of the site: fires the demo schedule at every tick, like APScheduler would."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

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

    def handle(self, *args: Any, name: str, log: str, ticks: int, go: str, **options: Any) -> None:
        period = DEMO_EVERY.total_seconds()
        self.stdout.write("ready")  # up: the demo picks tick 0 once every instance is
        self.stdout.flush()
        start = Path(go)
        while not start.exists():
            time.sleep(0.02)
        start_at = float(start.read_text())
        won = 0
        for tick in range(ticks):
            # Like a scheduler inside each replica: every instance wakes up a little
            # after the fire time, each with its own jitter.
            time.sleep(max(0.0, start_at + tick * period + random.uniform(0.05, 0.4) - time.time()))
            if demo_tick(name, log) is not None:
                won += 1
        self.stdout.write(f"{name}: won {won} of {ticks} ticks")
