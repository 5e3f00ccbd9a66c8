"""A django.tasks task over a guarded function with no schedule of its own: the target of
data schedules that ``run_schedules --enqueue`` hands to the task's backend (the Immediate
backend by default: the enqueue runs it in the enqueuing process). Every execution appends
``TASK|VALUE SLOT PID TIME`` to ``TASKGUARD_TEST_SCHEDULE_LOG`` with O_APPEND."""

from __future__ import annotations

import os
import time

from django_taskguard import current_run, once_per_schedule
from tests.support.proc import record

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task

LOG = os.environ.get("TASKGUARD_TEST_SCHEDULE_LOG", "")
BACKEND = os.environ.get("TASKGUARD_TEST_TASKS_BACKEND", "default")


@task(backend=BACKEND)
@once_per_schedule()
def tenant_job(value: str) -> str:
    run = current_run()
    if LOG:
        record(
            LOG, f"{run.task_name}|{value} {run.slot.isoformat()} {os.getpid()} {time.time():.6f}"
        )
    return value
