"""Schedules for the run_schedules tests: a child imports this module through
``TASKGUARD["SCHEDULE_MODULES"]`` (``TASKGUARD_TEST_SCHEDULE_MODULES``); the environment
says how many one-second schedules, their names, catch-up policy, grace, lease,
``on_duplicate``, whether a body checks its lease first, and how long their bodies take
(``TASKGUARD_TEST_BODY_MIX``: comma-separated seconds, schedule N taking the (N mod len)-th).

Every execution appends ``TASK SLOT PID TIME`` to ``TASKGUARD_TEST_SCHEDULE_LOG`` with
O_APPEND: executions counted outside the ledger.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django_taskguard import current_run, once_per_schedule
from tests.support.proc import record

LOG = os.environ.get("TASKGUARD_TEST_SCHEDULE_LOG", "")
PREFIX = os.environ.get("TASKGUARD_TEST_SCHEDULE_PREFIX", "tests.sched")
CATCHUP: Any = os.environ.get("TASKGUARD_TEST_CATCHUP", "latest")
COUNT = int(os.environ.get("TASKGUARD_TEST_SCHEDULES", "1"))
GRACE = timedelta(seconds=float(os.environ.get("TASKGUARD_TEST_GRACE", "2")))
EVERY = timedelta(seconds=float(os.environ.get("TASKGUARD_TEST_EVERY", "1")))
BODY_SECONDS = float(os.environ.get("TASKGUARD_TEST_BODY_SECONDS", "0"))
BODY_MIX = [float(s) for s in os.environ.get("TASKGUARD_TEST_BODY_MIX", "").split(",") if s]
LEASE = float(os.environ["TASKGUARD_TEST_LEASE"]) if "TASKGUARD_TEST_LEASE" in os.environ else None
ON_DUPLICATE: Any = os.environ.get("TASKGUARD_TEST_ON_DUPLICATE", "skip")
CHECK_LEASE = bool(os.environ.get("TASKGUARD_TEST_CHECK_LEASE"))  # check() first: LeaseLost


def _make(number: int) -> Callable[[], None | None]:
    seconds = BODY_MIX[number % len(BODY_MIX)] if BODY_MIX else BODY_SECONDS

    @once_per_schedule(
        every=EVERY,
        name=f"{PREFIX}.{number}",
        catchup=CATCHUP,
        grace=GRACE,
        lease_seconds=LEASE,
        on_duplicate=ON_DUPLICATE,
    )
    def job() -> None:
        run = current_run()
        if CHECK_LEASE:
            run.check()
        if LOG:
            record(LOG, f"{run.task_name} {run.slot.isoformat()} {os.getpid()} {time.time():.6f}")
        if seconds:
            time.sleep(seconds)

    return job


JOBS = [_make(number) for number in range(COUNT)]
