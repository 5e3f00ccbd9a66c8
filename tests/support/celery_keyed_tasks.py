"""Keyed Celery tasks of the tests (``apply_once`` and ``@once_per_key`` under a worker).

Line format: ``run KEY PID FENCE``.
"""

from __future__ import annotations

import os
import time

from celery import shared_task
from celery.exceptions import Reject

from django_taskguard import current_run, once_per_key
from django_taskguard.contrib.celery import OnceTask
from tests.support.proc import record


@shared_task(bind=True, base=OnceTask)
@once_per_key(key="order:{order_id}")
def charge(self: OnceTask, order_id: int, log: str, seconds: float = 0.2) -> int:
    run = current_run()
    record(log, f"run {run.key} {os.getpid()} {run.fence}")
    time.sleep(seconds)
    return order_id


@shared_task(bind=True, base=OnceTask)
def requeued(self: OnceTask, log: str, gate: str) -> str:
    """Unguarded: its first delivery rejects itself with requeue=True; the requeued message
    runs and waits for the file ``gate``. Lines: ``reject PID`` / ``run PID``."""
    if not os.path.exists(log):
        record(log, f"reject {os.getpid()}")
        raise Reject("first delivery: requeued", requeue=True)
    record(log, f"run {os.getpid()}")
    while not os.path.exists(gate):
        time.sleep(0.05)
    return "ran"


@shared_task(bind=True, base=OnceTask)
def plain(self: OnceTask, log: str) -> str:
    """Unguarded; ``run PID`` per execution."""
    record(log, f"run {os.getpid()}")
    return "ran"


def retry_late(task: OnceTask | object, log: str, countdown: float) -> str:
    """The first run asks for a retry ``countdown`` seconds later; lines ``run PID RETRIES``,
    and ``refused MESSAGE`` when the retry is refused."""
    from django_taskguard.exceptions import TaskGuardError

    retries = int(task.request.retries or 0)  # type: ignore[attr-defined]
    record(log, f"run {os.getpid()} {retries}")
    if retries:
        return "retried"
    try:
        raise task.retry(countdown=countdown)  # type: ignore[attr-defined]
    except TaskGuardError as exc:
        record(log, f"refused {exc}")
        raise


@shared_task(bind=True, base=OnceTask)
def once_retry_late(self: OnceTask, log: str, countdown: float) -> str:
    """A OnceTask whose retry may outlive the message's ttl."""
    return retry_late(self, log, countdown)


@shared_task(bind=True)
def plain_retry_late(self: object, log: str, countdown: float) -> str:
    """The same on a plain Task (apply_once works with any task; no retry hook)."""
    return retry_late(self, log, countdown)


@shared_task(bind=True, base=OnceTask, autoretry_for=(OSError,), retry_kwargs={"countdown": 60})
@once_per_key(key="late:{n}")
def guarded_retry_late(self: OnceTask, n: int, log: str) -> str:
    """Guarded; always raises OSError, whose autoretry (60 s later) may outlive the ttl."""
    record(log, f"run {os.getpid()} {current_run().attempt}")
    raise OSError("down")
