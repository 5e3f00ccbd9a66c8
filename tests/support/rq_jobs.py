"""Guarded functions sent to RQ queues (``@enqueue_on`` on top), for tests/test_rq.py
(imported there by a fixture, never at collection: the decorators register schedules) and
for tests/test_rq_e2e.py's children (``TASKGUARD["SCHEDULE_MODULES"]`` names this module;
an RQ worker imports each job's function by its dotted path).

``TASKGUARD_TEST_RQ_URL``: the private Redis of the queues (a client is made lazily: nothing
connects at import). Every execution appends ``TASK SLOT PID ATTEMPT TIME`` to
``TASKGUARD_TEST_SCHEDULE_LOG`` with O_APPEND: executions counted outside the ledger.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

from redis import Redis
from rq import Retry

from django_taskguard import current_run, once_per_schedule
from django_taskguard.contrib.rq import enqueue_on
from tests.support.proc import record

LOG = os.environ.get("TASKGUARD_TEST_SCHEDULE_LOG", "")
REDIS = Redis.from_url(os.environ.get("TASKGUARD_TEST_RQ_URL", "redis://127.0.0.1:1/0"))
TICK = "tests.rq.tick"
FLAKY = "tests.rq.flaky"
LATER = "tests.rq.later"
HOLD = "tests.rq.hold"
STRICT = "tests.rq.strict"
executed: list[str] = []  # this process's executions: "TASK SLOT ATTEMPT"


def _note() -> None:
    run = current_run()
    executed.append(f"{run.task_name} {run.slot.isoformat()} {run.attempt}")
    if LOG:
        record(
            LOG,
            f"{run.task_name} {run.slot.isoformat()} {os.getpid()} {run.attempt} {time.time():.6f}",
        )


@enqueue_on("tg-tick", connection=REDIS)
@once_per_schedule(every=timedelta(seconds=1), name=TICK)
def tick() -> str:
    _note()
    return current_run().slot.isoformat()


# Its first attempt fails; RQ's retry (no interval: enqueued again at once) is the second
# attempt of the same row.
@enqueue_on("tg-other", connection=REDIS, retry=Retry(max=2))
@once_per_schedule(every=timedelta(hours=1), name=FLAKY)
def flaky() -> int:
    _note()
    if current_run().attempt == 1:
        raise OSError("the first attempt fails")
    return current_run().attempt


# The same, its retry scheduled a second later: RQ's scheduler (a worker started with
# --with-scheduler) enqueues it.
@enqueue_on("tg-other", connection=REDIS, retry=Retry(max=1, interval=1))
@once_per_schedule(every=timedelta(hours=1), name=LATER)
def later() -> int:
    _note()
    if current_run().attempt == 1:
        raise OSError("the first attempt fails")
    return current_run().attempt


# Holds its slot until its work horse is SIGKILLed (a short lease: upkeep abandons it soon).
@enqueue_on("tg-other", connection=REDIS)
@once_per_schedule(every=timedelta(hours=1), name=HOLD, lease_seconds=3)
def hold() -> None:
    _note()
    time.sleep(120)


# A late call is recorded missed, not run (catchup="none"); an operator's backfill runs it.
@enqueue_on("tg-strict", connection=REDIS)
@once_per_schedule(
    every=timedelta(minutes=1), catchup="none", grace=timedelta(seconds=5), name=STRICT
)
def strict() -> None:
    _note()
