"""Real Celery workers and beats on a private Redis broker (database lock backend).

Every execution of a task body appends a line to a log (O_APPEND, unfenced);
every message a beat publishes is appended to another. The ledger must agree
with both.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from django_taskguard.models import RunState, TaskRun
from tests.conftest import RedisServer, python

TICK = "tests.celery_tasks.tick"
OPEN_STATES = (RunState.PENDING, RunState.RUNNING, RunState.RETRYING)
PERSISTENT = "django_taskguard.contrib.celery:TaskguardScheduler"
DATABASE = "django_taskguard.contrib.celery:TaskguardDatabaseScheduler"


class Cluster:
    """Celery workers and beats started as real processes, each in its own group."""

    def __init__(self, env: dict[str, str], scratch: Path, broker: RedisServer) -> None:
        self.env = {
            **env,
            "TASKGUARD_TEST_BROKER_URL": broker.url,
            "TASKGUARD_TEST_VISIBILITY": "6",
            "TASKGUARD_TEST_PUBLISH_LOG": str(scratch / "published.log"),
        }
        self.scratch = scratch
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, args: list[str], **extra_env: str) -> subprocess.Popen[bytes]:
        out = open(self.scratch / f"{name}.out", "ab")  # noqa: SIM115
        process = subprocess.Popen(
            [python(), "-m", "celery", "-A", "tests.celery_app", *args],
            env={**self.env, **extra_env, "TASKGUARD_TEST_ROLE": name},
            cwd=self.scratch,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        self.processes[name] = process
        return process

    def worker(self, name: str, concurrency: int = 1) -> subprocess.Popen[bytes]:
        return self.start(
            name,
            [
                "worker",
                "-n",
                f"{name}@%h",
                "-c",
                str(concurrency),
                "-P",
                "prefork",
                "--loglevel",
                "INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
        )

    def beat(self, name: str, scheduler: str, schedule: dict[str, object] | None = None):
        return self.start(
            name,
            [
                "beat",
                "-S",
                scheduler,
                "-s",
                str(self.scratch / f"{name}.schedule"),
                "--pidfile",
                str(self.scratch / f"{name}.pid"),
                "--loglevel",
                "INFO",
                "--max-interval",
                "1",
            ],
            TASKGUARD_TEST_BEAT_SCHEDULE=json.dumps(schedule or {}),
        )

    def signal(self, name: str, sig: int) -> None:
        process = self.processes[name]
        if process.poll() is None:
            os.killpg(process.pid, sig)

    def stop(self, name: str) -> None:
        process = self.processes[name]
        self.signal(name, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.signal(name, signal.SIGKILL)
            process.wait(timeout=10)

    def stop_all(self) -> None:
        for name in list(self.processes):
            self.stop(name)

    def describe(self) -> str:
        runs = list(TaskRun.objects.values_list("task_name", "state", "attempt", "duplicates"))
        outputs = "\n".join(f"--- {name}\n{self.output(name)[-12000:]}" for name in self.processes)
        return f"runs: {runs}\n{outputs}"

    def output(self, name: str) -> str:
        return (self.scratch / f"{name}.out").read_text(errors="replace")


@pytest.fixture
def cluster(child_env, scratch, redis_server) -> Iterator[Cluster]:
    running = Cluster(child_env, scratch, redis_server)
    try:
        yield running
    finally:
        running.stop_all()


def lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(
    predicate: Callable[[], object], timeout: float, what: str, cluster: Cluster | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    details = f"\n{cluster.describe()}" if cluster is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{details}")


def published(cluster: Cluster) -> list[tuple[str, datetime, str]]:
    return [
        (entry, datetime.fromisoformat(slot), role)
        for entry, slot, role in lines(cluster.scratch / "published.log")
    ]


def drain(task_names: list[str], timeout: float = 60) -> None:
    """Wait until no run of these tasks is pending, running or retrying."""
    wait_for(
        lambda: (
            not TaskRun.objects.filter(task_name__in=task_names, state__in=OPEN_STATES).exists()
        ),
        timeout,
        "every run to finish",
    )


def assert_each_slot_ran_once(cluster: Cluster, log: Path, every: timedelta) -> dict[str, int]:
    """Slots fired = slots succeeded, no gaps, 0 duplicate executions, duplicates counted."""
    sends = Counter((f"{TICK}[{entry}]", slot) for entry, slot, _ in published(cluster))
    executed = Counter((name, datetime.fromisoformat(slot)) for _, name, slot, *_ in lines(log))
    assert executed, "nothing ran"
    assert max(executed.values()) == 1, f"duplicate executions: {executed.most_common(3)}"
    assert set(executed) == set(sends), "a fired slot did not run, or a run was never fired"
    runs = {(r.task_name, r.slot): r for r in TaskRun.objects.filter(task_name__startswith=TICK)}
    assert set(runs) == set(sends)
    for key, count in sends.items():
        run = runs[key]
        assert run.state == RunState.SUCCEEDED, (key, run.state, run.error)
        assert (run.attempt, run.duplicates) == (1, count - 1), key
    for name in {name for name, _ in sends}:
        slots = sorted(slot for task, slot in sends if task == name)
        gaps = [b for a, b in itertools.pairwise(slots) if b - a != every]
        assert not gaps, f"{name}: slots missing before {gaps}"
    return {name: sum(1 for task, _ in sends if task == name) for name, _ in sends}


def interval_task(name: str, seconds: int, log: Path) -> PeriodicTask:
    every, _ = IntervalSchedule.objects.get_or_create(
        every=seconds, period=IntervalSchedule.SECONDS
    )
    return PeriodicTask.objects.create(
        name=name, task=TICK, interval=every, kwargs=json.dumps({"log": str(log)})
    )


def test_e2e__two_workers_four_beats_every_slot_once(cluster, scratch):
    log = scratch / "executions.log"
    every = timedelta(seconds=2)
    interval_task("tick-db", 2, log)
    schedule = {"tick-file": {"task": TICK, "every": 2, "kwargs": {"log": str(log)}}}
    cluster.worker("w1")
    cluster.worker("w2")
    for n in (1, 2):
        cluster.beat(f"file-beat{n}", PERSISTENT, schedule)
        cluster.beat(f"db-beat{n}", DATABASE)
    # Every beat is up once each has published twice; then run a 20 s window.
    roles = {"file-beat1", "file-beat2", "db-beat1", "db-beat2"}
    wait_for(
        lambda: (
            {r for r, n in Counter(role for *_, role in published(cluster)).items() if n >= 2}
            >= roles
        ),
        60,
        "every beat to publish",
        cluster,
    )
    time.sleep(20)
    for name in roles:
        cluster.stop(name)
    drain([f"{TICK}[tick-file]", f"{TICK}[tick-db]"])
    fired = assert_each_slot_ran_once(cluster, log, every)
    assert min(fired.values()) >= 10
    by_beat = Counter(published(cluster))
    assert max(by_beat.values()) == 1, f"a beat sent a slot twice: {by_beat.most_common(2)}"
    assert not TaskRun.objects.filter(state__in=OPEN_STATES).exists()


def test_e2e__restarted_beats_do_not_resend_a_slot(cluster, scratch):
    log = scratch / "executions.log"
    interval_task("tick-db", 2, log)
    schedule = {"tick-file": {"task": TICK, "every": 2, "kwargs": {"log": str(log)}}}
    cluster.worker("w1")
    cluster.beat("file-beat", PERSISTENT, schedule)
    cluster.beat("db-beat", DATABASE)
    wait_for(lambda: len(published(cluster)) >= 6, 60, "the beats to publish", cluster)
    for _ in range(2):
        for name, scheduler in (("file-beat", PERSISTENT), ("db-beat", DATABASE)):
            cluster.stop(name)
            cluster.beat(name, scheduler, schedule if scheduler == PERSISTENT else None)
        time.sleep(5)
    cluster.stop("file-beat")
    cluster.stop("db-beat")
    drain([f"{TICK}[tick-file]", f"{TICK}[tick-db]"])
    sends = Counter((entry, slot) for entry, slot, _ in published(cluster))
    assert max(sends.values()) == 1, f"a slot was re-sent: {sends.most_common(2)}"
    assert_each_slot_ran_once(cluster, log, timedelta(seconds=2))


def test_e2e__autoretry_twice_then_success_and_exhausted(cluster, scratch):
    from tests import celery_tasks
    from tests.celery_app import app

    log = scratch / "executions.log"
    cluster.worker("w1")
    cluster.worker("w2")
    app.conf.broker_url = cluster.env["TASKGUARD_TEST_BROKER_URL"]
    slot = datetime.fromisoformat("2026-01-01T10:00:00+00:00")
    headers = {"taskguard_slot": slot.isoformat(), "taskguard_schedule": "ten"}
    with app.connection_for_write() as connection:
        celery_tasks.flaky.apply_async(
            kwargs={"log": str(log)}, headers=headers, connection=connection
        )
        celery_tasks.hopeless.apply_async(
            kwargs={"log": str(log)}, headers=headers, connection=connection
        )
        celery_tasks.explicit_retry.apply_async(
            kwargs={"log": str(log)}, headers=headers, connection=connection
        )
    names = [f"tests.celery_tasks.{n}[ten]" for n in ("flaky", "hopeless", "explicit_retry")]
    wait_for(lambda: TaskRun.objects.filter(task_name__in=names).count() == 3, 60, "the runs")
    drain(names, timeout=90)
    flaky, hopeless, explicit = (TaskRun.objects.get(task_name=n) for n in names)
    assert (flaky.state, flaky.attempt, flaky.slot) == (RunState.SUCCEEDED, 3, slot)
    assert (hopeless.state, hopeless.attempt) == (RunState.FAILED, 3)
    assert "attempt 3" in hopeless.error
    assert (explicit.state, explicit.attempt) == (RunState.SUCCEEDED, 2)
    runs = Counter(name for _, name, *_ in lines(log))
    assert runs == {names[0]: 3, names[1]: 3, names[2]: 2}
    attempts = [line[3] for line in lines(log) if line[1] == names[0]]
    assert attempts == ["1", "2", "3"]


@pytest.mark.parametrize("on_stale", ["retry", "abandon"])
def test_e2e__worker_sigkilled_mid_task_is_redelivered_per_on_stale(cluster, scratch, on_stale):
    from tests import celery_tasks
    from tests.celery_app import app

    log = scratch / "executions.log"
    task = {"retry": celery_tasks.slow_retry, "abandon": celery_tasks.slow_abandon}[on_stale]
    name = f"{task.name}[slow]"
    cluster.worker("w1")
    cluster.worker("w2")
    app.conf.broker_url = cluster.env["TASKGUARD_TEST_BROKER_URL"]
    slot = datetime.fromisoformat("2026-01-01T11:00:00+00:00")
    headers = {"taskguard_slot": slot.isoformat(), "taskguard_schedule": "slow"}
    with app.connection_for_write() as connection:
        task.apply_async(
            kwargs={"log": str(log), "seconds": 8}, headers=headers, connection=connection
        )
    wait_for(lambda: lines(log), 60, "the task to start")
    started_pid = int(lines(log)[0][4])
    victim = next(n for n, p in cluster.processes.items() if os.getpgid(started_pid) == p.pid)
    time.sleep(1.0)
    cluster.signal(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    final = RunState.SUCCEEDED if on_stale == "retry" else RunState.ABANDONED
    try:
        wait_for(
            lambda: TaskRun.objects.filter(task_name=name, state=final).exists(),
            90,
            f"the slot to end {final}",
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.describe()}") from None
    run = TaskRun.objects.get(task_name=name)
    events = [(line[0], int(line[4])) for line in lines(log)]
    if on_stale == "retry":
        wait_for(lambda: len(lines(log)) >= 3, 10, "the takeover to end")
        events = [(line[0], int(line[4])) for line in lines(log)]
        assert run.attempt == 2
        assert [e for e, _ in events] == ["start", "start", "end"]
        assert events[1][1] != started_pid
        reasons = list(run.transitions.values_list("reason", flat=True))
        assert any("taken over by attempt 2" in reason for reason in reasons), reasons
    else:
        assert run.attempt == 1
        assert events == [("start", started_pid)]
        abandoned = run.transitions.get(to_state=RunState.ABANDONED)
        assert "on_stale=abandon" in abandoned.reason
        assert abandoned.owner != run.owner  # recorded by the redelivered message's attempt
    assert time.monotonic() - killed_at < 90
    assert not TaskRun.objects.filter(state__in=OPEN_STATES).exists()
