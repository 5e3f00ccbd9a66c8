"""Huey tasks over guarded functions, for tests/test_huey.py and the children of
tests/test_huey_e2e.py (``TASKGUARD["SCHEDULE_MODULES"]`` names this module; the consumer
child imports it).

- ``tick``: ``@huey.task()`` over a one-second schedule: ``run_schedules --enqueue`` sends it;
- ``djtick``: the same through django.tasks (``@task()``), on Huey's own django.tasks
  backend in the children (``TASKS["huey"]``), the Dummy backend elsewhere;
- ``beat``: ``periodic()``, enqueued by every consumer's scheduler: each minute, or each
  second with ``TASKGUARD_TEST_HUEY_FAST_PERIODIC`` (the consumers' scheduler then looks
  at periodic tasks every second: Huey's ``Scheduler.periodic_task_seconds``, set here
  because Huey has no switch for it; only this test module does that);
- ``charge``: ``@once_per_key`` under ``@huey.task(retries=1)``, failing its first attempt;
- ``flaky``, ``raising``, ``once``, ``hold``: slots sent by the test itself (no schedule): a
  task that fails its first attempts (Huey retries), one that raises Huey's ``RetryTask`` or
  ``CancelExecution``, one sent twice, one that holds its slot.

Every execution appends ``TASK SLOT ATTEMPT PID TIME`` to ``TASKGUARD_TEST_SCHEDULE_LOG``
with O_APPEND: executions counted outside the ledger.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

from huey import CancelExecution, RetryTask
from huey.consumer import Scheduler

from django_taskguard import current_run, once_per_key, once_per_schedule
from django_taskguard.contrib.huey import periodic
from tests.support.huey_app import huey
from tests.support.proc import record

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task

LOG = os.environ.get("TASKGUARD_TEST_SCHEDULE_LOG", "")
BACKEND = "huey" if os.environ.get("TASKGUARD_TEST_HUEY_URL") else "dummy"
SECOND = timedelta(seconds=1)
BEAT_EVERY = 60 * SECOND
if os.environ.get("TASKGUARD_TEST_HUEY_FAST_PERIODIC"):
    Scheduler.periodic_task_seconds = 1
    BEAT_EVERY = SECOND
executed: list[str] = []  # this process's executions: "TASK SLOT ATTEMPT"


def _note() -> None:
    run = current_run()
    what = f"{run.task_name} {run.slot.isoformat()} {run.attempt}"
    executed.append(what)
    if LOG:
        record(LOG, f"{what} {os.getpid()} {time.time():.6f}")


@huey.task()
@once_per_schedule(every=SECOND, name="tests.huey.tick")
def tick() -> None:
    _note()


@task(backend=BACKEND)
@once_per_schedule(every=SECOND, name="tests.huey.djtick")
def djtick() -> None:
    _note()


@periodic(huey)
@once_per_schedule(every=BEAT_EVERY, name="tests.huey.beat")
def beat() -> None:
    _note()


@huey.task(retries=2)
@once_per_schedule(name="tests.huey.flaky")
def flaky(failures: int) -> None:
    """Fails its first ``failures`` attempts."""
    _note()
    if current_run().attempt <= failures:
        raise OSError(f"attempt {current_run().attempt} fails")


@huey.task(retries=1)
@once_per_key(key="order:{order_id}", name="tests.huey.charge")
def charge(order_id: int) -> None:
    """Fails its first attempt: Huey's retry is attempt 2 of the key's row."""
    run = current_run()
    executed.append(f"{run.task_name} {run.key} {run.attempt}")
    if run.attempt == 1:
        raise OSError("the card network is down")


@huey.task()
@once_per_schedule(name="tests.huey.raising")
def raising(kind: str) -> None:
    """Raises Huey's ``RetryTask`` or ``CancelExecution`` in its first attempt."""
    _note()
    if current_run().attempt == 1:
        raise {"retry": RetryTask, "cancel": CancelExecution}[kind](f"{kind} asked")


@huey.task()
@once_per_schedule(name="tests.huey.once")
def once() -> None:
    _note()


@huey.task()
@once_per_schedule(name="tests.huey.hold", lease_seconds=3)
def hold(seconds: float) -> None:
    _note()
    time.sleep(seconds)
