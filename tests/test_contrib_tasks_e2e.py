"""django.tasks end to end, in real processes on PostgreSQL: three ``run_schedules
--enqueue`` copies hand a one-second schedule's slots to django-tasks-db's queue and two
``db_worker`` processes run them, for ``TASKGUARD_SCHEDULER_TEST_SECONDS`` (default 30; 10 in
CI) from the first slot run. Every slot of the window runs exactly once, is enqueued exactly
once, and has one succeeded row. Keyed tasks enqueued twice per key run once per key.

Executions are counted outside the ledger: each appends a line to a log with O_APPEND
(tests/support/djtasks_jobs.py).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from importlib.util import find_spec
from pathlib import Path

import pytest
from django.db import connections

from django_taskguard.models import RunState, TaskRun

from .support.children import executions, slots_of, start, stop, window
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


def ticks(log: Path) -> list[tuple[str, str]]:
    """(task, slot or key) of each execution so far."""
    return [(words[0], words[1]) for words in executions(log)]


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
    copies = [start(env, scratch / f"copy{n}.out", *copy) for n in range(3)]

    # The window opens at the first slot run (the copies and workers are up: starting Django
    # can take seconds on a busy machine) and lasts TASKGUARD_SCHEDULER_TEST_SECONDS.
    began = wait_for(
        lambda: min(slots_of(TICK, ticks(log)), default=None), timeout=60, what="a first tick"
    )
    seconds = float(os.environ.get("TASKGUARD_SCHEDULER_TEST_SECONDS", "30"))
    time.sleep(
        max(0.0, (began + timedelta(seconds=seconds) - datetime.now(timezone.utc)).total_seconds())
    )
    ended = datetime.now(timezone.utc)
    assert stop(copies) == [0, 0, 0]
    outputs = "".join((scratch / f"copy{n}.out").read_text() for n in range(3))
    assert "raised" not in outputs, outputs[-3000:]
    wait_for(lambda: queue_left() == 0, timeout=60, what="the workers to empty the queue")
    assert stop(workers) == [0, 0]

    done = ticks(log)
    counts = Counter(done)
    assert set(counts.values()) == {1}, f"run twice: {[k for k, v in counts.items() if v > 1]}"
    assert sorted(key for task, key in done if task == CHARGE) == [
        f"order:{n}" for n in range(KEYS)
    ]
    slots = slots_of(TICK, done)
    # Every slot from the first to just before the copies stopped ran, once.
    kept = window(slots, began, ended)
    assert len(kept) >= seconds - 3, f"only {len(kept)} slots in the window"

    rows = TaskRun.objects.filter(task_name=TICK)
    assert {run.slot: run.state for run in rows} == dict.fromkeys(slots, RunState.SUCCEEDED)
    # One task per slot was enqueued, not one per copy: the pending row decided.
    enqueued = DBTaskResult.objects.filter(task_path="tests.support.djtasks_jobs.tick")
    assert enqueued.count() == len(slots)
    assert set(enqueued.values_list("status", flat=True)) == {"SUCCESSFUL"}
    keyed = TaskRun.objects.filter(task_name=CHARGE)
    assert sorted(keyed.values_list("state", "duplicates")) == [(RunState.SUCCEEDED, 1)] * KEYS
