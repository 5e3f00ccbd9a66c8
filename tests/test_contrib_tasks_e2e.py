"""django.tasks end to end, in real processes on PostgreSQL: three ``run_schedules
--enqueue`` copies hand a one-second schedule's slots to django-tasks-db's queue and two
``db_worker`` processes run them, for ``TASKGUARD_DJTASKS_SECONDS`` (default 60). Every
slot of the window runs exactly once, is enqueued exactly once, and has one succeeded row.
Keyed tasks enqueued twice per key run once per key.

Executions are counted outside the ledger: each appends a line to a log with O_APPEND
(tests/support/djtasks_jobs.py).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from importlib.util import find_spec

import pytest
from django.db import connections

from django_taskguard.models import RunState, TaskRun

from .support.children import executions, start, stop
from .support.waiting import wait_for

if not find_spec("django_tasks_db") or connections["default"].vendor != "postgresql":
    pytest.skip("needs django-tasks-db and PostgreSQL", allow_module_level=True)

pytestmark = [pytest.mark.processes, pytest.mark.once, pytest.mark.timeout(600)]
SECOND = timedelta(seconds=1)
TICK = "tests.djtasks.tick"
CHARGE = "tests.djtasks.charge"
KEYS = 5


def queue_left() -> int:
    from django_tasks_db.models import DBTaskResult

    return DBTaskResult.objects.filter(status__in=["READY", "RUNNING"]).count()


def test_run_schedules_enqueue__three_copies_two_db_workers_each_slot_once(child_env, scratch):
    from django_tasks_db.models import DBTaskResult

    from tests.support import djtasks_jobs

    log = scratch / "executions.log"
    env = {
        **child_env,
        "TASKGUARD_TEST_SCHEDULE_MODULES": "tests.support.djtasks_jobs",
        "TASKGUARD_TEST_SCHEDULE_LOG": str(log),
        "TASKGUARD_TEST_TASKS_BACKEND": "db",
    }
    worker = ["-m", "django", "db_worker", "--backend", "db", "--interval", "0.2"]
    workers = [
        start(env, scratch / f"worker{n}.out", *worker, "--no-startup-delay", "--no-reload")
        for n in range(2)
    ]
    # Keyed tasks, each key enqueued twice: the key travels in the arguments.
    for order_id in range(KEYS):
        for _ in range(2):
            djtasks_jobs.charge.using(backend="db").enqueue(order_id=order_id)
    copy = [
        "-m",
        "tests.support.scheduler_child",
        "--enqueue",
        "--task",
        TICK,
        "--sweep-every",
        "1",
    ]
    began = datetime.now(timezone.utc)
    copies = [start(env, scratch / f"copy{n}.out", *copy) for n in range(3)]

    seconds = float(os.environ.get("TASKGUARD_DJTASKS_SECONDS", "60"))
    time.sleep(seconds)
    ended = datetime.now(timezone.utc)
    assert stop(copies) == [0, 0, 0]
    outputs = "".join((scratch / f"copy{n}.out").read_text() for n in range(3))
    assert "raised" not in outputs, outputs[-3000:]
    wait_for(lambda: queue_left() == 0, timeout=60, what="the workers to empty the queue")
    assert stop(workers) == [0, 0]

    done = [(words[0], words[1]) for words in executions(log)]
    counts = Counter(done)
    assert set(counts.values()) == {1}, f"run twice: {[k for k, v in counts.items() if v > 1]}"
    assert sorted(key for task, key in done if task == CHARGE) == [
        f"order:{n}" for n in range(KEYS)
    ]
    slots = sorted(datetime.fromisoformat(slot) for task, slot in done if task == TICK)
    # The window: from a few seconds after the copies started (Django's start-up) to just
    # before they stopped. Every slot in it ran, once.
    first = min(slot for slot in slots if slot >= began + 5 * SECOND)
    last = max(slot for slot in slots if slot <= ended - 2 * SECOND)
    window = [slot for slot in slots if first <= slot <= last]
    expected = int((last - first) / SECOND) + 1
    assert window == [first + n * SECOND for n in range(expected)], "a slot was not run"
    assert expected >= seconds - 10, f"only {expected} slots in the window"

    rows = TaskRun.objects.filter(task_name=TICK)
    assert {run.slot: run.state for run in rows} == dict.fromkeys(slots, RunState.SUCCEEDED)
    # One task per slot was enqueued, not one per copy: the pending row decided.
    enqueued = DBTaskResult.objects.filter(task_path="tests.support.djtasks_jobs.tick")
    assert enqueued.count() == len(slots)
    assert set(enqueued.values_list("status", flat=True)) == {"SUCCESSFUL"}
    keyed = TaskRun.objects.filter(task_name=CHARGE)
    assert sorted(keyed.values_list("state", "duplicates")) == [(RunState.SUCCEEDED, 1)] * KEYS
