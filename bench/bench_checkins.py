"""What a check-in costs the task's own thread (a script, not a test).

    python bench/bench_checkins.py [--pairs 20000]

Calls the check-in receivers of ``run_started`` and ``run_succeeded`` (what every guarded
attempt's thread runs) ``--pairs`` times in one process, under the test settings (a scratch
SQLite file of its own, migrated first and removed at the end):

- ``CHECKINS`` empty: the floor (the receivers return at once);
- configured, the task opted out (``monitors: {task: False}``);
- configured with a webhook whose local receiver holds every request: each check-in is
  queued and never sent while timing (the queue holds them all), so what is measured is the
  caller's share only (building the check-in, queueing it), with the sending thread parked.

Prints microseconds per start+end pair. The sending thread's own work (HTTP, retries) is off
the task's path by design: docs/monitoring.md, "Delivery".
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django

django.setup()

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.test import override_settings  # noqa: E402

from django_taskguard.checkins import receivers  # noqa: E402
from django_taskguard.context import ActiveRun  # noqa: E402
from tests.support.checkin_receivers import Receiver  # noqa: E402

TASK = "bench.checkins"


def measure(label: str, pairs: int) -> None:
    run = ActiveRun(
        id=1,
        task_name=TASK,
        slot=datetime(2026, 11, 1, tzinfo=UTC),
        attempt=1,
        fence=1,
        owner="bench:1:token",
        lease_seconds=60,
    )
    began = time.perf_counter()
    for _ in range(pairs):
        receivers.on_started(TASK, run)
        receivers.on_succeeded(TASK, run, result=None)
    each = (time.perf_counter() - began) / pairs * 1e6
    print(f"{label:<48} {each:8.2f} µs per start+end pair")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=20_000)
    pairs = parser.parse_args().pairs
    call_command("migrate", verbosity=0, interactive=False)
    base = settings.TASKGUARD
    with override_settings(TASKGUARD={**base, "CHECKINS": {}}):
        measure("CHECKINS = {}", pairs)
    receiver = Receiver().start()
    receiver.set_mode("webhook", "hang")
    webhook = {"webhook": {"url": f"{receiver.url}/webhook"}, "queue": 1_000_000, "timeout": 60}
    opted_out = {**webhook, "monitors": {TASK: False}}
    with override_settings(TASKGUARD={**base, "CHECKINS": opted_out}):
        measure("configured, the task opted out", pairs)
    with override_settings(TASKGUARD={**base, "CHECKINS": webhook}):
        measure("configured: a webhook (queued, not sent)", pairs)
    sys.stdout.flush()
    for database in settings.DATABASES.values():
        if database["ENGINE"].endswith("sqlite3"):
            Path(database["NAME"]).unlink(missing_ok=True)
    os._exit(0)  # the sending thread is parked on the held request


if __name__ == "__main__":
    main()
