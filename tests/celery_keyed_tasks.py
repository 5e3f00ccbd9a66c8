"""Keyed Celery tasks of the tests (``apply_once`` and ``@once_per_key`` under a worker).

Line format: ``run KEY PID FENCE``.
"""

from __future__ import annotations

import os
import time

from celery import shared_task

from django_taskguard import current_run, once_per_key
from django_taskguard.contrib.celery import OnceTask
from tests.proc import record


@shared_task(bind=True, base=OnceTask)
@once_per_key(key="order:{order_id}")
def charge(self: OnceTask, order_id: int, log: str, seconds: float = 0.2) -> int:
    run = current_run()
    record(log, f"run {run.key} {os.getpid()} {run.fence}")
    time.sleep(seconds)
    return order_id
