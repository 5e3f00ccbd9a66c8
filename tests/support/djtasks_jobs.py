"""django.tasks tasks over guarded functions (``@task()`` on top), for
tests/test_contrib_tasks.py (imported there by a fixture, never at collection: the
decorators register schedules) and for the end-to-end test's children
(``TASKGUARD["SCHEDULE_MODULES"]`` names this module; db_worker imports it by path).

``TASKGUARD_TEST_TASKS_BACKEND`` picks the backend of ``tick`` and ``charge`` (default:
the Immediate backend). Every execution appends ``TASK SLOT-OR-KEY PID TIME`` to
``TASKGUARD_TEST_SCHEDULE_LOG`` with O_APPEND: executions counted outside the ledger.
"""

from __future__ import annotations

import asyncio
import os
import time
from datetime import timedelta

from django_taskguard import current_run, once_per_key, once_per_schedule
from tests.support.proc import record

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task

LOG = os.environ.get("TASKGUARD_TEST_SCHEDULE_LOG", "")
BACKEND = os.environ.get("TASKGUARD_TEST_TASKS_BACKEND", "default")
executed: list[str] = []  # this process's executions: "TASK SLOT-OR-KEY"


def _note(what: str) -> None:
    executed.append(what)
    if LOG:
        record(LOG, f"{what} {os.getpid()} {time.time():.6f}")


@task(backend=BACKEND)
@once_per_schedule(every=timedelta(seconds=1), name="tests.djtasks.tick")
def tick() -> str:
    run = current_run()
    _note(f"{run.task_name} {run.slot.isoformat()}")
    return run.slot.isoformat()


@task(backend=BACKEND)
@once_per_key(key="order:{order_id}", name="tests.djtasks.charge")
def charge(order_id: int) -> int:
    run = current_run()
    _note(f"{run.task_name} {run.key}")
    return order_id


# A coroutine function under the guard, under @task(): the carried slot reaches it too.
@task(backend=BACKEND)
@once_per_schedule(every=timedelta(minutes=1), name="tests.djtasks.atick")
async def atick() -> str:
    await asyncio.sleep(0)
    run = current_run()
    _note(f"{run.task_name} {run.slot.isoformat()}")
    return run.slot.isoformat()


# On the Dummy backend: enqueued, never run (a queue with no worker).
@task(backend="dummy")
@once_per_schedule(every=timedelta(minutes=1), name="tests.djtasks.parked")
def parked() -> None:
    _note(f"tests.djtasks.parked {current_run().slot.isoformat()}")


# catchup="none": a slot is run within its grace of the slot or not at all.
@task(backend="dummy")
@once_per_schedule(
    every=timedelta(minutes=1),
    catchup="none",
    grace=timedelta(seconds=5),
    name="tests.djtasks.strict",
)
def strict() -> None:
    _note(f"tests.djtasks.strict {current_run().slot.isoformat()}")


# A schedule no task wraps: run_schedules --enqueue has nowhere to send it.
@once_per_schedule(every=timedelta(minutes=1), name="tests.djtasks.plain")
def plain() -> None:
    _note(f"tests.djtasks.plain {current_run().slot.isoformat()}")


NAMES = ("tests.djtasks.tick", "tests.djtasks.parked", "tests.djtasks.plain")
