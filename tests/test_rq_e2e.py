"""RQ end to end, in real processes: two ``run_schedules --enqueue`` copies hand a
one-second schedule's slots to an RQ queue on a private Redis, and two real ``rq worker``
processes (forking a work horse per job) run them, for ``TASKGUARD_SCHEDULER_TEST_SECONDS``
(default 10) after the first slot ran. Meanwhile: jobs whose first attempt fails are
retried by RQ (``Retry``, at once and after an interval, through the scheduler of a worker
started with ``--with-scheduler``) as the second attempt of their row; a job's work horse
is SIGKILLed mid-run and the copies' upkeep records its run ``abandoned``; that job
requeued (``rq requeue``'s ``Job.requeue()``), and a finished tick's job enqueued again,
run as counted duplicates. Every slot gets one start and one end check-in (a webhook), sent
from the work horse before RQ's ``os._exit``, and no work horse ever holds the upkeep lease.

Executions are counted outside the ledger: each appends a line to a log with O_APPEND
(tests/support/rq_jobs.py).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import ModuleType

import pytest
from django.db import connections

from django_taskguard.models import RunState, TaskRun, Upkeep

from .support.checkin_receivers import Receiver
from .support.children import executions, python
from .support.redis_server import RedisServer
from .support.waiting import wait_for

rq = pytest.importorskip("rq")

from rq import Queue, Worker  # noqa: E402
from rq.job import Job, JobStatus  # noqa: E402
from rq.registry import FinishedJobRegistry, StartedJobRegistry  # noqa: E402

from django_taskguard.contrib.rq import enqueue_for_slot, job_id_for  # noqa: E402

# Barely depends on the database: scripts/test.sh runs it in the PostgreSQL pass only.
pytestmark = [pytest.mark.processes, pytest.mark.once, pytest.mark.timeout(300)]
SECOND = timedelta(seconds=1)
HOUR = timedelta(hours=1)
QUEUES = ("tg-tick", "tg-other")


class Processes:
    """The children of one test, each in its own process group; all killed at the end."""

    def __init__(self, env: dict[str, str], scratch: Path) -> None:
        self.env, self.scratch = env, scratch
        self.started: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *command: str, **extra: str) -> subprocess.Popen[bytes]:
        with (self.scratch / f"{name}.out").open("ab") as stream:
            process = subprocess.Popen(
                [python(), *command],
                env={**self.env, **extra},
                stdout=stream,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started[name] = process
        return process

    def stop(self, *names: str) -> list[int | None]:
        for name in names:
            self.started[name].send_signal(signal.SIGTERM)
        return [self.started[name].wait(timeout=60) for name in names]

    def output(self, *names: str) -> str:
        return "".join((self.scratch / f"{name}.out").read_text() for name in names)

    def kill_all(self) -> None:
        for process in self.started.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


@pytest.fixture
def processes(child_env: dict[str, str], scratch: Path) -> Iterator[Processes]:
    started = Processes(child_env, scratch)
    try:
        yield started
    finally:
        started.kill_all()


class UpkeepHolders:
    """Every process that held the fleet-wide upkeep lease while it watched (sampled every
    50 ms: a holder that dies with it holds it 10 s at least)."""

    def __init__(self) -> None:
        self.pids: set[int] = set()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        try:
            while not self._halt.wait(0.05):
                for holder in Upkeep.objects.exclude(holder="").values_list("holder", flat=True):
                    # upkeep@HOST:PID#TOKEN
                    self.pids.add(int(holder.rpartition("#")[0].rpartition(":")[2]))
        finally:
            connections.close_all()

    def stop(self) -> set[int]:
        self._halt.set()
        self._thread.join(timeout=10)
        return self.pids


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as started:
        yield started


@pytest.fixture
def jobs(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """tests/support/rq_jobs.py in this process, its queues on the private Redis."""
    monkeypatch.setenv("TASKGUARD_TEST_RQ_URL", redis_server.url)
    module = importlib.reload(importlib.import_module("tests.support.rq_jobs"))
    yield module
    module.REDIS.close()


def hour_slot() -> datetime:
    now = datetime.now(timezone.utc)
    return now.replace(minute=0, second=0, microsecond=0) - HOUR


def row(task: str, slot: datetime | None = None) -> TaskRun | None:
    runs = TaskRun.objects.filter(task_name=task)
    return (runs.filter(slot=slot) if slot is not None else runs).first()


def test_rq__two_enqueuers_two_workers_each_slot_once(
    processes: Processes,
    jobs: ModuleType,
    redis_server: RedisServer,
    scratch: Path,
    receiver: Receiver,
) -> None:
    log = scratch / "executions.log"
    processes.env.update(
        TASKGUARD_TEST_SCHEDULE_MODULES="tests.support.rq_jobs",
        TASKGUARD_TEST_SCHEDULE_LOG=str(log),
        TASKGUARD_TEST_RQ_URL=redis_server.url,
        # A webhook check-in per start and end of a slot, sent from the work horse (which
        # RQ ends with os._exit right after the job) and per abandoned run from the upkeep.
        TASKGUARD_TEST_CHECKINS=json.dumps({"webhook": {"url": f"{receiver.url}/webhook"}}),
    )
    redis = jobs.REDIS
    holders = UpkeepHolders()
    # The automatic upkeep on, every 5 s, in every process: the copies run it; a work
    # horse, which RQ ends with os._exit, must not take its lease (and die holding it).
    upkeep = {"TASKGUARD_TEST_UPKEEP": "5"}
    worker = ["-m", "rq.cli", "worker", "-c", "tests.support.rq_config", "--logging_level"]
    # One worker runs RQ's scheduler too: it enqueues the retries that have an interval.
    for n, scheduler in enumerate((["--with-scheduler"], [])):
        processes.start(
            f"worker{n}", *worker, "INFO", "--name", f"w{n}", *scheduler, *QUEUES, **upkeep
        )
    wait_for(lambda: len(Worker.all(connection=redis)) == 2, timeout=60, what="two rq workers")

    # RQ's retry: attempt 1 fails, attempt 2 (the retry) succeeds; one row.
    retried = hour_slot()
    enqueue_for_slot(jobs.flaky, retried)
    enqueue_for_slot(jobs.later, retried)  # the same, its retry scheduled 1 s later
    # A job whose work horse is SIGKILLed mid-run.
    held = hour_slot()
    held_job = enqueue_for_slot(jobs.hold, held)
    assert held_job is not None

    copy = ["-m", "tests.support.scheduler_child", "--enqueue", "--task", jobs.TICK]
    copy += ["--sweep-every", "1"]
    for n in range(2):
        processes.start(f"copy{n}", *copy, **upkeep)

    def lines(task: str) -> list[list[str]]:
        return [words for words in executions(log) if words[0] == task]

    horse = wait_for(lambda: lines(jobs.HOLD), timeout=60, what="the held job's body")
    os.kill(int(horse[0][2]), signal.SIGKILL)
    wait_for(lambda: lines(jobs.TICK), timeout=60, what="a first tick")
    window_opened = datetime.now(timezone.utc)
    seconds = float(os.environ.get("TASKGUARD_SCHEDULER_TEST_SECONDS", "10"))
    job = Job.fetch(held_job.id, connection=redis)
    wait_for(lambda: job.get_status() == JobStatus.FAILED, timeout=30, what="the held job failed")
    assert "Work-horse terminated unexpectedly" in str(job.latest_result().exc_string)
    abandoned = wait_for(
        lambda: (run := row(jobs.HOLD)) is not None and run.state == RunState.ABANDONED and run,
        timeout=60,
        what="the SIGKILLed horse's run abandoned by the copies' upkeep",
    )
    ending = abandoned.transitions.get(to_state=RunState.ABANDONED)
    assert ending.owner.startswith("cleanup@"), ending.owner

    time.sleep(max(0.0, seconds - (datetime.now(timezone.utc) - window_opened).total_seconds()))
    ended = datetime.now(timezone.utc)
    assert processes.stop("copy0", "copy1") == [0, 0]
    outputs = processes.output("copy0", "copy1")
    assert "raised" not in outputs and "Traceback" not in outputs, outputs[-3000:]

    tick_queue = Queue("tg-tick", connection=redis)
    started = StartedJobRegistry(queue=tick_queue)
    wait_for(
        lambda: tick_queue.count == 0 and started.count == 0,
        timeout=60,
        what="the workers to run every tick",
    )

    # A job run a second time: the held job requeued by an operator after its worker died
    # (its run is abandoned: on_stale="abandon"), and a finished tick's job enqueued again.
    done = [datetime.fromisoformat(words[1]) for words in lines(jobs.TICK)]
    again = min(done)
    job.requeue()
    tick_queue.enqueue_job(Job.fetch(job_id_for(jobs.TICK, again), connection=redis))
    wait_for(
        lambda: row(jobs.HOLD).duplicates == 1 and row(jobs.TICK, again).duplicates == 1,
        timeout=60,
        what="the two copies counted as duplicates",
    )
    for task in (jobs.FLAKY, jobs.LATER):
        wait_for(lambda: row(task) and row(task).state == RunState.SUCCEEDED,  # noqa: B023
                 timeout=60, what=f"{task}'s second attempt")  # fmt: skip
    copies = {processes.started[f"copy{n}"].pid for n in range(2)}
    assert processes.stop("worker0", "worker1") == [0, 0]
    assert holders.stop() <= copies and holders.pids, (holders.pids, copies)

    # Every attempt of every slot ran once, counted outside the ledger (a slot has one
    # attempt but the retried one), and every slot from the first to the last of the window ran.
    counts = Counter((words[0], words[1], words[3]) for words in executions(log))
    assert set(counts.values()) == {1}, [key for key, n in counts.items() if n > 1]
    slots = sorted(done)
    last = max(slot for slot in slots if slot <= ended - 2 * SECOND)
    window = [slot for slot in slots if slot <= last]
    expected = int((last - slots[0]) / SECOND) + 1
    assert window == [slots[0] + n * SECOND for n in range(expected)], "a slot was not run"
    assert expected >= seconds - 3, f"only {expected} slots in the window"

    ticks = TaskRun.objects.filter(task_name=jobs.TICK)
    assert {run.slot: run.state for run in ticks} == dict.fromkeys(slots, RunState.SUCCEEDED)
    assert sum(run.duplicates for run in ticks) == 1
    # One job per slot, named by the slot: enqueued by one copy only.
    finished = set(FinishedJobRegistry(queue=tick_queue).get_job_ids())
    assert finished == {job_id_for(jobs.TICK, slot) for slot in slots}
    made = Counter(re.findall(r"enqueued \(RQ job (\S+) on queue", outputs))
    assert set(made) == finished and set(made.values()) == {1}

    # The retries: two attempts of one row, the first failed and retried by RQ (at once,
    # and scheduled by its scheduler).
    for task in (jobs.FLAKY, jobs.LATER):
        assert [words[3] for words in lines(task)] == ["1", "2"]
        retried_run = row(task, retried)
        assert (retried_run.attempt, retried_run.duplicates) == (2, 0)
        states = retried_run.transitions.order_by("id").values_list("to_state", flat=True)
        assert list(states) == [
            RunState.RUNNING, RunState.RETRYING, RunState.RUNNING, RunState.SUCCEEDED,
        ]  # fmt: skip

    # Exactly one start and one end check-in per slot (the retried slot's too: its retry is
    # not a new check-in), from the work horses; the abandoned run's from the upkeep.
    sent = Counter(
        (hook["task"], datetime.fromisoformat(hook["slot"]), hook["event"])
        for hook in (record["json"] for record in receiver.of("webhook"))
    )
    ends = ("start", "end")
    wanted = {(jobs.TICK, slot, event): 1 for slot in slots for event in ends}
    wanted.update(
        {(task, retried, event): 1 for task in (jobs.FLAKY, jobs.LATER) for event in ends}
    )
    # Of the tasks this test fires (the module's other schedules are swept too: STRICT's
    # minute slots, unfired here, are recorded missed after its 5 s grace).
    fired = (jobs.TICK, jobs.FLAKY, jobs.LATER)
    assert {key: n for key, n in sent.items() if key[0] in fired} == wanted
    assert sent[(jobs.HOLD, held, "abandoned")] == 1

    # The killed horse's run: one execution, abandoned, its requeued job a duplicate.
    assert len(lines(jobs.HOLD)) == 1
    hold = row(jobs.HOLD, held)
    assert (hold.state, hold.attempt, hold.duplicates) == (RunState.ABANDONED, 1, 1)
