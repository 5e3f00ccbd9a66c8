"""Dramatiq end to end: two real ``dramatiq`` worker processes on a private Redis broker
(one thread and one prefetched message each, so that both run slots), two ``run_schedules
--enqueue`` copies firing a one-second schedule for ``TASKGUARD_SCHEDULER_TEST_SECONDS``
(default 10) once the first slot has run.

Every slot of the window runs exactly once (counted outside the ledger: each execution
appends a line to a log with O_APPEND, tests/support/dramatiq_jobs.py) and is sent once,
not once per copy. Meanwhile ``Retries``' retry is the second attempt of one row, and a
message delivered twice is a counted duplicate. Then a worker is SIGKILLed in the middle of
a run: upkeep (``cleanup_locks``) ends the run ``abandoned`` once its lease lapsed, and the
broker's redelivery of its message (after the dead worker's heartbeat timed out) is a
counted duplicate, not a second run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from django_taskguard.cleanup import cleanup_locks
from django_taskguard.models import RunState, TaskRun

from .support.children import executions, python
from .support.waiting import wait_for

if not find_spec("dramatiq"):
    pytest.skip("needs dramatiq", allow_module_level=True)

# Barely depends on the database: scripts/test.sh runs it in the PostgreSQL pass only.
pytestmark = [pytest.mark.processes, pytest.mark.once, pytest.mark.timeout(300)]
SECOND = timedelta(seconds=1)
TICK = "tests.dramatiq.tick"
OPEN_STATES = (RunState.PENDING, RunState.RUNNING, RunState.RETRYING)
# A worker that sent no heartbeat for this long is dead to the broker, which then requeues
# its messages. Longer than the hold run's lease (2 s, renewed) by 5 s, so that the
# upkeep ends the killed run before the redelivery comes.
HEARTBEAT_MS = 7_000


class Processes:
    """Workers and copies started as real processes, each in its own process group."""

    def __init__(self, env: dict[str, str], scratch: Path) -> None:
        self.env = env
        self.scratch = scratch
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *command: str) -> subprocess.Popen[bytes]:
        with (self.scratch / f"{name}.out").open("ab") as out:
            process = subprocess.Popen(
                [python(), *command],
                env=self.env,
                cwd=self.scratch,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.running[name] = process
        return process

    def worker(self, name: str) -> subprocess.Popen[bytes]:
        return self.start(
            name,
            "-m",
            "dramatiq",
            "tests.support.dramatiq_jobs",
            "--processes",
            "1",
            "--threads",
            "1",
            "--worker-shutdown-timeout",
            "10000",
        )

    def copy(self, name: str) -> subprocess.Popen[bytes]:
        return self.start(
            name,
            "-m",
            "tests.support.scheduler_child",
            "--enqueue",
            "--task",
            TICK,
            "--sweep-every",
            "1",
        )

    def stop(self, *names: str) -> list[int]:
        for name in names:  # the group's leader, as an orchestrator does: it stops the rest
            self.running[name].send_signal(signal.SIGTERM)
        return [self.running[name].wait(timeout=60) for name in names]

    def ready(self, name: str) -> bool:
        """Whether the worker's process said it is ready (Dramatiq logs it at INFO)."""
        return "ready for action" in (self.scratch / f"{name}.out").read_text(errors="replace")

    def owner_of(self, pid: int) -> str:
        group = os.getpgid(pid)
        return next(name for name, process in self.running.items() if process.pid == group)

    def kill_all(self) -> None:
        for process in self.running.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)

    def describe(self) -> str:
        runs = list(TaskRun.objects.values_list("task_name", "slot", "state", "attempt"))
        outputs = "\n".join(
            f"--- {name}\n{(self.scratch / f'{name}.out').read_text(errors='replace')[-6000:]}"
            for name in self.running
        )
        return f"runs: {runs}\n{outputs}"


@pytest.fixture
def processes(child_env, scratch) -> Iterator[Processes]:
    running = Processes(child_env, scratch)
    try:
        yield running
    finally:
        running.kill_all()


@pytest.fixture
def sender(redis_server) -> Iterator[Any]:
    """A Redis broker on the workers' server, for the messages this process sends (built
    by hand: this process declares no actors and registers no schedules)."""
    from dramatiq.brokers.redis import RedisBroker

    from django_taskguard.contrib.dramatiq import TaskguardMiddleware

    broker = RedisBroker(url=redis_server.url, heartbeat_timeout=HEARTBEAT_MS)
    broker.add_middleware(TaskguardMiddleware())
    yield broker
    broker.close()


def send(broker: Any, actor_name: str, slot: datetime, queue: str = "default", **kwargs: Any):
    from dramatiq import Message

    from django_taskguard.contrib.dramatiq import message_options

    message = Message(
        queue_name=queue,
        actor_name=actor_name,
        args=(),
        kwargs=kwargs,
        options=message_options(slot),
    )
    return broker.enqueue(message)


def ran(log: Path) -> list[tuple[str, str, int, int]]:
    """(task, slot, pid, attempt) of every execution."""
    return [(w[0], w[1], int(w[2]), int(w[4])) for w in executions(log)]


def test_dramatiq__two_copies_two_workers_each_slot_once_retry_redelivery_sigkill(
    processes, sender, redis_server, scratch
):
    log = scratch / "executions.log"
    processes.env.update(
        TASKGUARD_TEST_SCHEDULE_MODULES="tests.support.dramatiq_jobs",
        TASKGUARD_TEST_SCHEDULE_LOG=str(log),
        TASKGUARD_TEST_DRAMATIQ_URL=redis_server.url,
        TASKGUARD_TEST_DRAMATIQ_HEARTBEAT=str(HEARTBEAT_MS),
        # One message at a time per worker, and a tick longer than a slot: a busy worker
        # fetches nothing, so the next slot goes to the other one (both run slots).
        dramatiq_queue_prefetch="1",
        TASKGUARD_TEST_TICK_SECONDS="1.3",
    )
    workers = ["worker0", "worker1"]
    for name in workers:
        processes.worker(name)
    describe = processes.describe
    wait_for(
        lambda: all(processes.ready(name) for name in workers), 90, "the workers", describe=describe
    )
    copies = ["copy0", "copy1"]
    for name in copies:
        processes.copy(name)

    # The window: from the first slot a worker ran, for the test's seconds.
    wait_for(lambda: any(r[0] == TICK for r in ran(log)), 90, "a first slot", describe=describe)
    began = time.monotonic()

    # Meanwhile: a retry (attempt 1 fails, Retries sends attempt 2) and a message
    # delivered twice (the same message id and retry count).
    base = timezone.now().replace(microsecond=0) - 30 * SECOND
    send(sender, "flaky", base)
    twice = send(sender, "once", base, value=1)
    sender.enqueue(twice)

    seconds = float(os.environ.get("TASKGUARD_SCHEDULER_TEST_SECONDS", "10"))
    time.sleep(max(0.0, seconds - (time.monotonic() - began)))
    stopped = timezone.now()
    assert processes.stop(*copies) == [0, 0]
    outputs = "".join((scratch / f"{name}.out").read_text() for name in copies)
    assert "raised" not in outputs, outputs[-3000:]
    wait_for(
        lambda: not TaskRun.objects.filter(state__in=OPEN_STATES).exists(),
        60,
        "the workers to run every slot sent",
        describe=describe,
    )

    # Every slot of the window ran once, and was sent once (its row was pending first).
    done = ran(log)
    counts = Counter((task, slot) for task, slot, _, _ in done)
    ticks = sorted(datetime.fromisoformat(slot) for task, slot, _, _ in done if task == TICK)
    assert counts[(TICK, ticks[0].isoformat())] == 1
    assert {n for (task, _), n in counts.items() if task == TICK} == {1}, counts
    last = max(slot for slot in ticks if slot <= stopped - 2 * SECOND)
    window = [slot for slot in ticks if slot <= last]
    expected = int((last - ticks[0]) / SECOND) + 1
    assert window == [ticks[0] + n * SECOND for n in range(expected)], "a slot was not run"
    assert expected >= seconds / 2, f"only {expected} slots in the window"
    rows = TaskRun.objects.filter(task_name=TICK)
    assert {run.slot: (run.state, run.attempt, run.duplicates) for run in rows} == dict.fromkeys(
        ticks, (RunState.SUCCEEDED, 1, 0)
    )
    assert len({pid for task, _, pid, _ in done if task == TICK}) == 2, "one worker ran them all"

    # The retry was attempt 2 of the same row; the second delivery a counted duplicate.
    flaky = TaskRun.objects.get(task_name="tests.dramatiq.flaky")
    assert (flaky.slot, flaky.state, flaky.attempt) == (base, RunState.SUCCEEDED, 2)
    assert [(t, a) for t, s, _, a in done if t == "tests.dramatiq.flaky"] == [
        ("tests.dramatiq.flaky", 1),
        ("tests.dramatiq.flaky", 2),
    ]
    once = TaskRun.objects.get(task_name="tests.dramatiq.once")
    assert (once.state, once.attempt, once.duplicates) == (RunState.SUCCEEDED, 1, 1)
    assert counts[("tests.dramatiq.once", base.isoformat())] == 1

    # A worker SIGKILLed in the middle of a run.
    send(sender, "hold", base, queue="hold")
    held = wait_for(
        lambda: [r for r in ran(log) if r[0] == "tests.dramatiq.hold"], 60, "the hold run"
    )
    victim = processes.owner_of(held[0][2])
    os.killpg(processes.running[victim].pid, signal.SIGKILL)
    processes.running[victim].wait(timeout=30)
    run = TaskRun.objects.get(task_name="tests.dramatiq.hold")
    wait_for(lambda: TaskRun.objects.stale().filter(pk=run.pk).exists(), 30, "lease expiry")
    assert cleanup_locks().stale_runs == 1
    run.refresh_from_db()
    # The upkeep ended it, before any redelivery came (the broker waits for the dead
    # worker's heartbeat to time out: some 6 s after the kill, the lease 2 s). A redelivery
    # first would have abandoned it itself, and been counted.
    assert (run.state, run.duplicates) == (RunState.ABANDONED, 0)
    (abandoned,) = run.transitions.filter(to_state=RunState.ABANDONED)
    assert abandoned.owner.startswith("cleanup@") and "expired" in abandoned.reason

    # The broker redelivers the dead worker's message to the other worker: counted.
    wait_for(
        lambda: TaskRun.objects.filter(pk=run.pk, duplicates=1).exists(),
        60,
        "the redelivery",
        describe=describe,
    )
    survivor = next(name for name in workers if name != victim)
    assert processes.stop(survivor) == [0]
    run.refresh_from_db()
    assert (run.state, run.attempt, run.duplicates) == (RunState.ABANDONED, 1, 1)
    assert [r for r in ran(log) if r[0] == "tests.dramatiq.hold"] == held  # run once
