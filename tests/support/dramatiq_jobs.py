"""Dramatiq actors over guarded functions (``@dramatiq.actor`` on top), for
tests/test_contrib_dramatiq.py (reloaded there by a fixture: each load makes a fresh broker)
and for tests/test_dramatiq_e2e.py's children: ``dramatiq tests.support.dramatiq_jobs``
workers and ``run_schedules --enqueue`` copies (``TASKGUARD["SCHEDULE_MODULES"]`` names it).

The broker: Dramatiq's ``StubBroker``, or a ``RedisBroker`` on
``TASKGUARD_TEST_DRAMATIQ_URL`` (a private redis-server) whose workers count as dead after
``TASKGUARD_TEST_DRAMATIQ_HEARTBEAT`` ms without a heartbeat, with the queue maintenance
(requeueing a dead worker's messages) at every command. Every execution appends
``TASK SLOT PID TIME ATTEMPT`` to ``TASKGUARD_TEST_SCHEDULE_LOG`` with O_APPEND:
executions counted outside the ledger.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from datetime import timedelta

import django
from django.apps import apps

if not apps.ready:  # a dramatiq worker imports this module first
    django.setup()

import dramatiq
from dramatiq.brokers.redis import MAINTENANCE_SCALE, RedisBroker
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import AsyncIO

from django_taskguard import current_run, once_per_key, once_per_schedule
from django_taskguard.contrib.dramatiq import TaskguardMiddleware
from tests.support.proc import record

LOG = os.environ.get("TASKGUARD_TEST_SCHEDULE_LOG", "")
URL = os.environ.get("TASKGUARD_TEST_DRAMATIQ_URL", "")
HOLD_SECONDS = float(os.environ.get("TASKGUARD_TEST_HOLD_SECONDS", "120"))
TICK_SECONDS = float(os.environ.get("TASKGUARD_TEST_TICK_SECONDS", "0"))  # how long tick runs
executed: list[str] = []  # this process's executions: "TASK SLOT-OR-KEY ATTEMPT"
release = threading.Event()  # lets ``hold`` return at once (tests in this process)


broker: dramatiq.Broker
if URL:
    heartbeat = int(os.environ.get("TASKGUARD_TEST_DRAMATIQ_HEARTBEAT", "60000"))
    broker = RedisBroker(url=URL, heartbeat_timeout=heartbeat, maintenance_chance=MAINTENANCE_SCALE)
else:
    broker = StubBroker()
broker.add_middleware(AsyncIO())
broker.add_middleware(TaskguardMiddleware())
dramatiq.set_broker(broker)


def _note(*, key: str | None = None) -> None:
    run = current_run()
    what = f"{run.task_name} {key or run.slot.isoformat()}"
    executed.append(f"{what} {run.attempt}")
    if LOG:
        record(LOG, f"{what} {os.getpid()} {time.time():.6f} {run.attempt}")


@dramatiq.actor(broker=broker, max_retries=0)
@once_per_schedule(every=timedelta(seconds=1), name="tests.dramatiq.tick")
def tick() -> None:
    _note()
    time.sleep(TICK_SECONDS)


# A failure at the first attempt, a success at the second: Retries' retry is attempt 2.
@dramatiq.actor(broker=broker, max_retries=3, min_backoff=100, max_backoff=200)
@once_per_schedule(name="tests.dramatiq.flaky")
def flaky(fail_attempts: int = 1) -> str:
    _note()
    if current_run().attempt <= fail_attempts:
        raise OSError(f"attempt {current_run().attempt} fails")
    return "done"


# Retries ask for later than any test waits: the retry stays in the delay queue.
@dramatiq.actor(broker=broker, max_retries=3, min_backoff=600_000, max_backoff=600_000)
@once_per_schedule(name="tests.dramatiq.later")
def later() -> None:
    _note()
    raise OSError("fails; retried in ten minutes")


@dramatiq.actor(broker=broker, max_retries=5, throws=(ValueError,))
@once_per_schedule(name="tests.dramatiq.throws")
def throws() -> None:
    _note()
    raise ValueError("an expected error: no retry")


@dramatiq.actor(broker=broker, max_retries=0)
@once_per_schedule(name="tests.dramatiq.once")
def once(value: int = 0) -> int:
    _note()
    return value


# Holds its slot (a two-second lease, renewed) until released or killed.
@dramatiq.actor(broker=broker, queue_name="hold", max_retries=0)
@once_per_schedule(name="tests.dramatiq.hold", lease_seconds=2)
def hold() -> None:
    _note()
    release.wait(HOLD_SECONDS)


# The same under on_stale="retry": a copy that meets it live is put back, not counted.
@dramatiq.actor(broker=broker, max_retries=0)
@once_per_schedule(name="tests.dramatiq.hold_retry", lease_seconds=2, on_stale="retry")
def hold_retry() -> None:
    _note()
    release.wait(HOLD_SECONDS)


@dramatiq.actor(broker=broker, max_retries=2, min_backoff=100, max_backoff=200)
@once_per_key(key="order:{order_id}", name="tests.dramatiq.charge")
def charge(order_id: int) -> int:
    _note(key=f"order:{order_id}")
    if current_run().attempt == 1 and order_id < 0:
        raise OSError("the first attempt of a negative order fails")
    return order_id


# A coroutine function under the guard, under an actor (Dramatiq's AsyncIO middleware).
@dramatiq.actor(broker=broker, max_retries=0)
@once_per_schedule(every=timedelta(minutes=1), name="tests.dramatiq.atick")
async def atick() -> None:
    await asyncio.sleep(0)
    _note()


# A late call is recorded missed, not run (catchup="none"); an operator's backfill runs it.
# Its own queue: the tests of the default queue see none of its messages.
@dramatiq.actor(broker=broker, queue_name="strict", max_retries=0)
@once_per_schedule(
    every=timedelta(minutes=1),
    catchup="none",
    grace=timedelta(seconds=5),
    name="tests.dramatiq.strict",
)
def strict() -> None:
    _note()


# A schedule no actor wraps: run_schedules --enqueue has nowhere to send it.
@once_per_schedule(every=timedelta(minutes=1), name="tests.dramatiq.plain")
def plain() -> None:
    _note()


NAMES = ("tests.dramatiq.tick", "tests.dramatiq.plain")
