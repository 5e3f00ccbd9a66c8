"""Guarded functions that APScheduler runs (tests/test_apscheduler.py and its children).

``tick`` has no schedule of its own: its slot can only come from the run's scheduled time
(``TaskguardExecutor``). Every execution appends ``TASK SLOT PID`` to
``TASKGUARD_TEST_SCHEDULE_LOG`` with O_APPEND: executions counted outside the ledger.
"""

from __future__ import annotations

import os

from django_taskguard import current_run, once_per_schedule
from tests.support.proc import record

LOG = os.environ.get("TASKGUARD_TEST_SCHEDULE_LOG", "")


@once_per_schedule(name="tests.aps.tick")
def tick() -> str:
    if LOG:
        record(LOG, f"tests.aps.tick {current_run().slot.isoformat()} {os.getpid()}")
    return "ticked"
