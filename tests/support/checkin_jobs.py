"""The schedule of the check-in end-to-end tests (tests/test_checkins_e2e.py).

A ``run_schedules`` child imports this module through ``TASKGUARD["SCHEDULE_MODULES"]``:
one one-second schedule, ``TASKGUARD_TEST_SCHEDULE_PREFIX`` + ``.0`` (grace 2 s, lease
``TASKGUARD_TEST_LEASE`` if set). Every execution appends ``TASK SLOT PID TIME`` to
``TASKGUARD_TEST_SCHEDULE_LOG`` with O_APPEND: executions counted outside the ledger.

``TASKGUARD_TEST_BLOCK_GATE`` names a file: the first body that finds it renames it away
(one body only wins the rename), appends ``blocked SLOT PID`` to the log and blocks until its
process dies (the SIGKILLed run of the abandoned check-in).

Each ``checkin_failed`` signal of the process appends ``SERVICE EVENT PID`` to
``TASKGUARD_TEST_CHECKIN_FAILURES``: failed check-ins counted outside the sender.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

from django.dispatch import receiver

from django_taskguard import current_run, once_per_schedule
from django_taskguard.signals import checkin_failed
from tests.support.proc import record

LOG = os.environ.get("TASKGUARD_TEST_SCHEDULE_LOG", "")
PREFIX = os.environ.get("TASKGUARD_TEST_SCHEDULE_PREFIX", "tests.checkins")
GATE = os.environ.get("TASKGUARD_TEST_BLOCK_GATE", "")
FAILURES = os.environ.get("TASKGUARD_TEST_CHECKIN_FAILURES", "")
LEASE = float(os.environ["TASKGUARD_TEST_LEASE"]) if "TASKGUARD_TEST_LEASE" in os.environ else None


@once_per_schedule(
    every=timedelta(seconds=1),
    name=f"{PREFIX}.0",
    grace=timedelta(seconds=2),
    lease_seconds=LEASE,
)
def job() -> None:
    run = current_run()
    record(LOG, f"{run.task_name} {run.slot.isoformat()} {os.getpid()} {time.time():.6f}")
    if GATE and _took_gate():
        record(LOG, f"blocked {run.slot.isoformat()} {os.getpid()}")
        while True:
            time.sleep(60)


def _took_gate() -> bool:
    try:
        os.rename(GATE, f"{GATE}.taken")
    except FileNotFoundError:
        return False
    return True


@receiver(checkin_failed)
def _count_failure(sender: Any, service: str, event: str, **_: object) -> None:
    if FAILURES:
        record(FAILURES, f"{service} {event} {os.getpid()}")
