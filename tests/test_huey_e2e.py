"""Huey end to end, in real processes on PostgreSQL and a private Redis: two Huey consumers
(``manage.py run_huey``, two threads each, periodic tasks on in both: no ``-n``) and two
``run_schedules --enqueue`` copies, for ``TASKGUARD_SCHEDULER_TEST_SECONDS`` (default 10).

- ``tests.huey.tick`` (``@huey.task()``) and ``tests.huey.djtick`` (django.tasks'
  ``@task()`` on Huey's own django.tasks backend) are sent by both copies, one
  second apart: every slot of the window runs once and is sent once (no duplicate);
- ``tests.huey.beat`` (``periodic()``) is enqueued by both consumers' schedulers, each
  second: every slot runs once, the other copy counted a duplicate;
- a task that fails once is retried by Huey: attempts 1 and 2 of one row;
- a message delivered twice runs once, the copy counted a duplicate;
- a consumer SIGKILLed while it runs a slot: ``cleanup_locks`` records it abandoned.

Executions are counted outside the ledger: each appends a line to a log with O_APPEND
(tests/support/huey_jobs.py).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from io import StringIO

import pytest

pytest.importorskip("huey")

from django.core.management import call_command
from django.db import connections

from django_taskguard.contrib.huey import enqueue_for_slot, signature_for_slot
from django_taskguard.models import RunState, TaskRun

from .support import huey_app
from .support.children import executions, slots_of, start, stop, window
from .support.huey_support import fresh_jobs
from .support.waiting import wait_for

if connections["default"].vendor != "postgresql":
    pytest.skip("needs PostgreSQL (several processes write the ledger)", allow_module_level=True)

pytestmark = [pytest.mark.processes, pytest.mark.once, pytest.mark.timeout(300)]
SECOND = timedelta(seconds=1)
SENT = ("tests.huey.tick", "tests.huey.djtick")
BEAT = "tests.huey.beat"
SECONDS = float(os.environ.get("TASKGUARD_SCHEDULER_TEST_SECONDS", "10"))


def test_huey__two_copies_two_consumers_each_slot_once(child_env, scratch, redis_server):
    log = scratch / "executions.log"
    env = {
        **child_env,
        "TASKGUARD_TEST_HUEY_URL": redis_server.url,
        "TASKGUARD_TEST_HUEY_FAST_PERIODIC": "1",
        "TASKGUARD_TEST_SCHEDULE_MODULES": "tests.support.huey_jobs",
        "TASKGUARD_TEST_SCHEDULE_LOG": str(log),
    }
    with fresh_jobs(redis_server.url) as jobs:
        huey = huey_app.huey
        consumer = ["-m", "tests.support.huey_child", "--workers", "2", "--worker-type", "thread"]
        outs = [scratch / f"consumer{n}.out" for n in range(2)]
        consumers = [start(env, out, *consumer) for out in outs]
        wait_for(
            lambda: all("consumer started" in out.read_text() for out in outs),
            timeout=60,
            what="both consumers to start",
            describe=lambda: "".join(out.read_text()[-2000:] for out in outs),
        )
        ready = datetime.now(timezone.utc)

        # A retry, and a message delivered twice (slots no schedule fires).
        past = ready.replace(microsecond=0) - 30 * SECOND
        enqueue_for_slot(jobs.flaky, past, failures=1)
        twice = signature_for_slot(jobs.once, past)
        huey.enqueue(twice)
        huey.enqueue(twice)

        copy = ["-m", "tests.support.scheduler_child", "--enqueue", "--sweep-every", "1"]
        copy += [part for task in SENT for part in ("--task", task)]
        copies = [start(env, scratch / f"copy{n}.out", *copy) for n in range(2)]
        wait_for(
            lambda: {words[0] for words in executions(log)} >= set(SENT),
            timeout=60,
            what="the copies' first slots to run",
        )
        began = datetime.now(timezone.utc)
        time.sleep(SECONDS)
        ended = datetime.now(timezone.utc)
        assert stop(copies) == [0, 0]
        outputs = "".join((scratch / f"copy{n}.out").read_text() for n in range(2))
        assert "raised" not in outputs, outputs[-3000:]
        wait_for(
            lambda: (
                huey.pending_count() == 0
                and huey.scheduled_count() == 0
                and not TaskRun.objects.filter(task_name__in=SENT, state__in=["pending", "running"])
            ),
            timeout=60,
            what="the consumers to empty the queue",
        )

        # A consumer SIGKILLed while it runs a slot.
        enqueue_for_slot(jobs.hold, past, seconds=120)
        held = wait_for(
            lambda: [line for line in executions(log) if line[0] == "tests.huey.hold"],
            timeout=30,
            what="a consumer to start the held slot",
        )
        (victim,) = [proc for proc in consumers if proc.pid == int(held[0][3])]
        beat_ended = datetime.now(timezone.utc)
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(timeout=30) == -signal.SIGKILL
        survivor = next(proc for proc in consumers if proc is not victim)
        assert stop([survivor], signal.SIGINT) == [0]  # Huey's graceful stop

    def stale_runs() -> int:
        out = StringIO()
        call_command("cleanup_locks", "--task", "tests.huey.hold", "--json", stdout=out)
        return int(json.loads(out.getvalue())["stale_runs"])

    wait_for(lambda: stale_runs() == 1, timeout=30, every=0.5, what="the held lease to lapse")

    done = [(words[0], words[1]) for words in executions(log)]
    counts = Counter((name, slot) for name, slot in done if name != "tests.huey.flaky")
    assert set(counts.values()) == {1}, f"run twice: {[k for k, v in counts.items() if v > 1]}"

    for task in SENT:
        slots = window(slots_of(task, done), began, ended)
        assert len(slots) >= SECONDS / 2, f"{task}: only {len(slots)} slots in the window"
        rows = TaskRun.objects.filter(task_name=task)
        assert {run.slot: run.state for run in rows if run.slot in slots} == dict.fromkeys(
            slots, RunState.SUCCEEDED
        )
        # Sent once per slot, not once per copy: a second message would be a duplicate.
        assert sum(run.duplicates for run in rows) == 0, task

    beats = window(slots_of(BEAT, done), ready + 2 * SECOND, beat_ended)
    rows = {run.slot: run for run in TaskRun.objects.filter(task_name=BEAT)}
    assert len(beats) >= SECONDS / 2, f"only {len(beats)} periodic slots in the window"
    assert {slot: rows[slot].state for slot in beats} == dict.fromkeys(beats, RunState.SUCCEEDED)
    # Both consumers enqueued the periodic task: the ledger counted the other copies.
    assert sum(rows[slot].duplicates for slot in beats) >= len(beats) // 2

    flaky = TaskRun.objects.get(task_name="tests.huey.flaky")
    assert (flaky.state, flaky.attempt, flaky.duplicates) == (RunState.SUCCEEDED, 2, 0)
    assert [w[2] for w in executions(log) if w[0] == "tests.huey.flaky"] == ["1", "2"]
    once = TaskRun.objects.get(task_name="tests.huey.once")
    assert (once.state, once.duplicates) == (RunState.SUCCEEDED, 1)
    hold = TaskRun.objects.get(task_name="tests.huey.hold")
    assert hold.state == RunState.ABANDONED
    assert "expired" in hold.transitions.get(to_state=RunState.ABANDONED).reason
