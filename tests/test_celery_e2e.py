"""Real Celery workers and beats on a private broker, with each lock backend.

The broker is a private redis-server (or, in one scenario, a private vhost of
the machine's RabbitMQ); the lock backend is the database, or a second
private redis-server (TASKGUARD BACKEND="redis"). Every execution of a task
body appends a line to a log (O_APPEND, unfenced); every message a beat
publishes is appended to another; workers log every message taskguard puts
back and every duplicate it suppresses to a third. The ledger must agree with
all three.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from django_taskguard.cleanup import cleanup_locks
from django_taskguard.contrib.celery import SCHEDULE_HEADER, SLOT_HEADER
from django_taskguard.guard import FINISHED
from django_taskguard.locks.keys import claim_key
from django_taskguard.locks.redis_scripts import FINISHED_MARKER
from django_taskguard.models import RunState, TaskRun

from .support.children import executions, python
from .support.redis_server import RedisServer
from .support.redis_support import child_redis_env, guard_key, redis_backend
from .support.slots import BASE_SLOT
from .support.waiting import wait_for

# Barely depends on the database: scripts/test.sh runs it in the PostgreSQL pass only.
pytestmark = [pytest.mark.processes, pytest.mark.once]

TICK = "tests.support.celery_tasks.tick"
OPEN_STATES = (RunState.PENDING, RunState.RUNNING, RunState.RETRYING)
PERSISTENT = "django_taskguard.contrib.celery:TaskguardScheduler"
DATABASE = "django_taskguard.contrib.celery:TaskguardDatabaseScheduler"
KEY_PREFIX = "taskguard"  # TASKGUARD["KEY_PREFIX"] of tests/settings.py (the default)


class Cluster:
    """Celery workers and beats started as real processes, each in its own group."""

    def __init__(
        self,
        env: dict[str, str],
        scratch: Path,
        broker_url: str,
        lock: RedisServer | None = None,
    ) -> None:
        self.broker_url = broker_url
        self.lock = lock  # the lock Redis (BACKEND="redis"), None: the database backend
        self.env = {
            **(child_redis_env(env, lock) if lock is not None else env),
            "TASKGUARD_TEST_BROKER_URL": broker_url,
            "TASKGUARD_TEST_VISIBILITY": "6",
            "TASKGUARD_TEST_EVENT_LOG": str(scratch / "events.log"),
        }
        self.scratch = scratch
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, args: list[str], **extra_env: str) -> subprocess.Popen[bytes]:
        out = open(self.scratch / f"{name}.out", "ab")  # noqa: SIM115
        process = subprocess.Popen(
            [python(), "-m", "celery", "-A", "tests.support.celery_app", *args],
            env={**self.env, **extra_env, "TASKGUARD_TEST_ROLE": name},
            cwd=self.scratch,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        self.processes[name] = process
        return process

    def worker(
        self, name: str, concurrency: int = 1, max_tasks_per_child: int | None = None
    ) -> subprocess.Popen[bytes]:
        """A prefork worker; ``max_tasks_per_child``: each pool child is replaced after that
        many tasks (None: never)."""
        recycle: list[str] = []
        if max_tasks_per_child is not None:
            recycle = ["--max-tasks-per-child", str(max_tasks_per_child)]
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
                *recycle,
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
            # What beats send; a worker's put-back copies are events, not sends.
            TASKGUARD_TEST_PUBLISH_LOG=str(self.scratch / "published.log"),
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

    def kill_all(self) -> None:
        """SIGKILL every process group (teardown: nothing graceful is left to prove)."""
        for name, process in self.processes.items():
            self.signal(name, signal.SIGKILL)
            process.wait(timeout=10)

    def owner_of(self, pid: int) -> str | None:
        """The name of the worker or beat whose process group ``pid`` belongs to."""
        try:
            group = os.getpgid(pid)
        except ProcessLookupError:
            return None
        return next((n for n, p in self.processes.items() if group == p.pid), None)

    def publish(
        self, task: Any, slot: datetime, schedule: str, task_id: str | None = None, **kwargs: object
    ) -> str:
        """Send ``task`` for ``slot`` the way a taskguard beat does; return the task id
        (``task_id``: send it under this id, as a copy of an earlier message)."""
        from tests.support.celery_app import app

        app.conf.broker_url = self.broker_url
        headers = {SLOT_HEADER: slot.isoformat(), SCHEDULE_HEADER: schedule}
        with app.connection_for_write() as connection:
            result = task.apply_async(
                kwargs=kwargs, headers=headers, connection=connection, task_id=task_id
            )
        return str(result.id)

    def events(self, kind: str) -> list[list[str]]:
        """Worker events of ``kind``, each ``[EVENT, TASK_ID, SLOT, REDELIVERED, DEFERRED,
        PID, DETAIL]`` (see tests/support/celery_app.py)."""
        return [line for line in executions(self.scratch / "events.log") if line[0] == kind]

    def lock_keys(self) -> dict[str, object]:
        """Every taskguard key left in the lock Redis, with its value."""
        assert self.lock is not None
        client = self.lock.client()
        try:
            keys = sorted(k.decode() for k in client.scan_iter(match=f"{KEY_PREFIX}:*"))
            return {
                key: client.hgetall(key) if client.type(key) == b"hash" else client.get(key)
                for key in keys
            }
        finally:
            client.close()

    def fold_late_copies(self) -> None:
        """Run cleanup_locks on the lock Redis: copies that met a finished slot were counted
        there (one round trip, no database write); this adds them to their rows."""
        if self.lock is None:
            return
        with redis_backend(self.lock, KEY_PREFIX=KEY_PREFIX):
            cleanup_locks()

    def counted_in_redis(self) -> int:
        """Losing calls the lock Redis counted (HINCRBY runs only in the acquire script)."""
        assert self.lock is not None
        client = self.lock.client()
        try:
            return int(client.info("commandstats").get("cmdstat_hincrby", {}).get("calls", 0))
        finally:
            client.close()

    def describe(self) -> str:
        runs = list(TaskRun.objects.values_list("task_name", "state", "attempt", "duplicates"))
        events = "\n".join(" ".join(line) for line in executions(self.scratch / "events.log"))
        outputs = "\n".join(f"--- {name}\n{self.output(name)[-12000:]}" for name in self.processes)
        return f"runs: {runs}\nevents:\n{events}\n{outputs}"

    def output(self, name: str) -> str:
        return (self.scratch / f"{name}.out").read_text(errors="replace")


@pytest.fixture
def backend() -> str:
    """The lock backend of the cluster's workers; tests parametrize it."""
    return "database"


@pytest.fixture
def cluster(child_env, scratch, redis_server, tmp_path, backend) -> Iterator[Cluster]:
    lock = None
    if backend == "redis":
        lock = RedisServer(tmp_path)  # a second private server: the broker's is not the lock's
        lock.start()
    running = Cluster(child_env, scratch, redis_server.url, lock)
    try:
        yield running
    finally:
        running.kill_all()
        if lock is not None:
            lock.stop()


def published(cluster: Cluster) -> list[tuple[str, datetime, str]]:
    return [
        (entry, datetime.fromisoformat(slot), role)
        for entry, slot, role in executions(cluster.scratch / "published.log")
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
    cluster.fold_late_copies()  # copies that met a finished slot were counted in Redis
    sends = Counter((f"{TICK}[{entry}]", slot) for entry, slot, _ in published(cluster))
    executed = Counter(
        (name, datetime.fromisoformat(slot)) for _, name, slot, *_ in executions(log)
    )
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


def interval_task(name: str, seconds: int, log: Path) -> object:
    """A django-celery-beat interval row for TaskguardDatabaseScheduler's beats."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    every, _ = IntervalSchedule.objects.get_or_create(
        every=seconds, period=IntervalSchedule.SECONDS
    )
    return PeriodicTask.objects.create(
        name=name, task=TICK, interval=every, kwargs=json.dumps({"log": str(log)})
    )


def assert_lock_redis_settled(cluster: Cluster) -> None:
    """No lock key and no claim record is left in the lock Redis but those of live runs."""
    if cluster.lock is None:
        return
    running = TaskRun.objects.filter(state=RunState.RUNNING)
    with redis_backend(cluster.lock, KEY_PREFIX=KEY_PREFIX):
        keys = [guard_key(r.task_name, r.slot) for r in running]
    live = {*keys, *map(claim_key, keys)}
    leftover: dict[str, object] = {}

    def settled() -> bool:
        # A late copy still on its way holds a key for a moment: give it time. Claim
        # records of copies that met a finished slot are folded into their rows first;
        # finished markers lapse on their own.
        cluster.fold_late_copies()
        leftover.clear()
        leftover.update(
            (k, v)
            for k, v in cluster.lock_keys().items()
            if k not in live and v != FINISHED_MARKER.encode()
        )
        return not leftover

    try:
        wait_for(settled, 15, "the lock Redis to settle")
    except AssertionError:
        raise AssertionError(f"keys left in the lock Redis: {leftover}") from None


@pytest.mark.celery_beat
@pytest.mark.parametrize(
    ("backend", "window"), [("database", 20), ("redis", 8)], ids=["database", "redis"]
)
def test_e2e__two_workers_four_beats_every_slot_once(cluster, scratch, backend, window):
    log = scratch / "executions.log"
    every = timedelta(seconds=2)
    interval_task("tick-db", 2, log)
    schedule = {"tick-file": {"task": TICK, "every": 2, "kwargs": {"log": str(log)}}}
    cluster.worker("w1")
    cluster.worker("w2")
    for n in (1, 2):
        cluster.beat(f"file-beat{n}", PERSISTENT, schedule)
        cluster.beat(f"db-beat{n}", DATABASE)
    # Every beat is up once each has published twice; then run a window of seconds.
    roles = {"file-beat1", "file-beat2", "db-beat1", "db-beat2"}
    wait_for(
        lambda: (
            {r for r, n in Counter(role for *_, role in published(cluster)).items() if n >= 2}
            >= roles
        ),
        60,
        "every beat to publish",
        describe=cluster.describe,
    )
    time.sleep(window)
    for name in roles:
        cluster.stop(name)
    drain([f"{TICK}[tick-file]", f"{TICK}[tick-db]"])
    # Copies that met a finished slot were counted in the lock Redis: fold them first.
    cluster.fold_late_copies()
    fired = assert_each_slot_ran_once(cluster, log, every)
    assert min(fired.values()) >= window // 2
    by_beat = Counter(published(cluster))
    assert max(by_beat.values()) == 1, f"a beat sent a slot twice: {by_beat.most_common(2)}"
    assert not TaskRun.objects.filter(state__in=OPEN_STATES).exists()
    # Every suppressed copy is one duplicate on its row, wherever it was counted.
    suppressed = Counter((line[2], line[1]) for line in cluster.events("duplicate"))
    assert sum(suppressed.values()) == sum(r.duplicates for r in TaskRun.objects.all())
    if backend == "redis":
        # Losers the lock Redis counted (one round trip, no database write) were folded
        # into TaskRun.duplicates by the winners: the per-slot counts above include them.
        assert cluster.counted_in_redis() > 0, "no copy lost the race in Redis"
        assert_lock_redis_settled(cluster)


@pytest.mark.celery_beat
def test_e2e__restarted_beats_do_not_resend_a_slot(cluster, scratch):
    """Rolling restarts of two beats of each kind: no beat re-sends a slot it sent before
    its restart, and no slot goes unsent.

    One beat of each kind is up at every moment, so a restart that takes longer than
    the 2 s interval on a loaded machine leaves no gap in the slots.
    """
    log = scratch / "executions.log"
    interval_task("tick-db", 2, log)
    schedule = {"tick-file": {"task": TICK, "every": 2, "kwargs": {"log": str(log)}}}
    beats = {"file-beat1": PERSISTENT, "db-beat1": DATABASE,
             "file-beat2": PERSISTENT, "db-beat2": DATABASE}  # fmt: skip

    def start(name: str) -> None:
        cluster.beat(name, beats[name], schedule if beats[name] == PERSISTENT else None)

    def sent_by(name: str) -> int:
        return sum(1 for *_, role in published(cluster) if role == name)

    cluster.worker("w1")
    for name in beats:
        start(name)
    wait_for(
        lambda: all(sent_by(n) >= 2 for n in beats),
        60,
        "every beat to publish",
        describe=cluster.describe,
    )
    for _ in range(2):
        for pair in (("file-beat1", "db-beat1"), ("file-beat2", "db-beat2")):
            before = {name: sent_by(name) for name in pair}
            for name in pair:
                cluster.stop(name)
                start(name)
            # Back in service: each restarted beat has sent again (from its schedule).
            wait_for(
                lambda: all(sent_by(n) >= before[n] + 2 for n in pair),  # noqa: B023
                60,
                f"{pair} to publish after their restart",
                describe=cluster.describe,
            )
    for name in beats:
        cluster.stop(name)
    drain([f"{TICK}[tick-file]", f"{TICK}[tick-db]"])
    by_beat = Counter(published(cluster))
    assert max(by_beat.values()) == 1, f"a beat re-sent a slot: {by_beat.most_common(2)}"
    assert_each_slot_ran_once(cluster, log, timedelta(seconds=2))


def test_e2e__autoretry_twice_then_success_and_exhausted(cluster, scratch):
    from tests.support import celery_tasks
    from tests.support.celery_app import app

    log = scratch / "executions.log"
    cluster.worker("w1")
    cluster.worker("w2")
    app.conf.broker_url = cluster.env["TASKGUARD_TEST_BROKER_URL"]
    slot = BASE_SLOT + timedelta(hours=10)
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
    names = [
        f"tests.support.celery_tasks.{n}[ten]" for n in ("flaky", "hopeless", "explicit_retry")
    ]
    wait_for(lambda: TaskRun.objects.filter(task_name__in=names).count() == 3, 60, "the runs")
    drain(names, timeout=90)
    flaky, hopeless, explicit = (TaskRun.objects.get(task_name=n) for n in names)
    assert (flaky.state, flaky.attempt, flaky.slot) == (RunState.SUCCEEDED, 3, slot)
    assert (hopeless.state, hopeless.attempt) == (RunState.FAILED, 3)
    assert "attempt 3" in hopeless.error
    assert (explicit.state, explicit.attempt) == (RunState.SUCCEEDED, 2)
    runs = Counter(name for _, name, *_ in executions(log))
    assert runs == {names[0]: 3, names[1]: 3, names[2]: 2}
    attempts = [line[3] for line in executions(log) if line[1] == names[0]]
    assert attempts == ["1", "2", "3"]


@pytest.mark.parametrize(
    ("on_stale", "backend"), [("retry", "database"), ("abandon", "database"), ("retry", "redis")]
)
def test_e2e__worker_sigkilled_mid_task_is_redelivered_per_on_stale(
    cluster, scratch, on_stale, backend
):
    from tests.support import celery_tasks

    log = scratch / "executions.log"
    task = {"retry": celery_tasks.slow_retry, "abandon": celery_tasks.slow_abandon}[on_stale]
    name = f"{task.name}[slow]"
    cluster.worker("w1")
    cluster.worker("w2")
    slot = BASE_SLOT + timedelta(hours=11)
    cluster.publish(task, slot, "slow", log=str(log), seconds=4)
    wait_for(lambda: executions(log), 60, "the task to start")
    started_pid = int(executions(log)[0][4])
    victim = cluster.owner_of(started_pid)
    assert victim is not None
    time.sleep(1.0)
    cluster.signal(victim, signal.SIGKILL)
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
    events = [(line[0], int(line[4])) for line in executions(log)]
    if on_stale == "retry":
        wait_for(lambda: len(executions(log)) >= 3, 10, "the takeover to end")
        events = [(line[0], int(line[4])) for line in executions(log)]
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
    assert not TaskRun.objects.filter(state__in=OPEN_STATES).exists()
    assert_lock_redis_settled(cluster)


# --- a redelivery that finds a live lease is put back, not acked ----------------------


def attempts_of(log: Path, name: str) -> list[tuple[str, int, int, int]]:
    """``(event, attempt, pid, fence)`` of every execution of ``name``, in order."""
    return [
        (event, int(attempt), int(pid), int(fence))
        for event, task, _, attempt, pid, fence, _ in executions(log)
        if task == name
    ]


def transitions(run: TaskRun) -> list[tuple[str, str, str, str]]:
    return list(
        run.transitions.order_by("id").values_list("from_state", "to_state", "reason", "owner")
    )


@pytest.mark.parametrize("backend", ["redis"])
def test_e2e__redelivery_while_the_attempt_lives_is_put_back_then_counted_once(
    cluster, scratch, backend
):
    """A real redelivery (the Redis broker's visibility timeout, 6 s, runs out while
    attempt 1 is alive and renewing its 3 s lease) is put back with a countdown: it
    does not run, is not acked as a duplicate while the slot is open, and once attempt
    1 has succeeded it comes back and is the slot's one duplicate. With the Redis lock
    backend, the copy learns that the slot is busy from Redis alone (the database
    backend's path, from the row, runs in the next test)."""
    from tests.support import celery_tasks

    log, gate = scratch / "executions.log", scratch / "gate"
    name = f"{celery_tasks.gated.name}[gated]"
    cluster.worker("w1")
    cluster.worker("w2")
    slot = BASE_SLOT + timedelta(hours=12)
    task_id = cluster.publish(celery_tasks.gated, slot, "gated", log=str(log), gate=str(gate))
    wait_for(lambda: executions(log), 60, "attempt 1 to start", describe=cluster.describe)
    wait_for(
        lambda: cluster.events("put-back"),
        30,
        "the redelivered copy to be put back",
        describe=cluster.describe,
    )
    # Attempt 1 still runs: nothing else ran, and the put-back copy is not a duplicate.
    run = TaskRun.objects.get(task_name=name)
    assert (run.state, run.attempt, run.duplicates) == (RunState.RUNNING, 1, 0)
    gate.touch()
    wait_for(
        lambda: cluster.events("duplicate"),
        30,
        "the put-back copy to return",
        describe=cluster.describe,
    )
    drain([name])

    ((_, owner_pid, fence),) = {(a, p, f) for _, a, p, f in attempts_of(log, name)}
    assert attempts_of(log, name) == [("start", 1, owner_pid, fence), ("end", 1, owner_pid, fence)]
    put_back = cluster.events("put-back")
    assert put_back[0][1:5] == [task_id, slot.isoformat(), "1", "0"], "not the redelivery"
    assert {int(e[5]) for e in put_back} & {owner_pid} == set()
    (duplicate,) = cluster.events("duplicate")
    # decided by Redis's finished-slot marker, without reading the row: guard.FINISHED
    assert duplicate[1] == task_id and duplicate[6] == FINISHED
    assert int(duplicate[4]) >= 1, "the duplicate was not the put-back copy"
    cluster.fold_late_copies()  # it met the finished slot in Redis: counted there
    run = TaskRun.objects.get(task_name=name)
    assert (run.state, run.attempt, run.fence, run.duplicates) == (
        RunState.SUCCEEDED,
        1,
        fence,
        1,
    )
    assert [(f, t) for f, t, *_ in transitions(run)] == [
        (RunState.PENDING, RunState.RUNNING),
        (RunState.RUNNING, RunState.SUCCEEDED),
    ]
    assert_lock_redis_settled(cluster)


def test_e2e__redelivery_of_a_killed_attempt_is_put_back_then_takes_over(cluster, scratch):
    """The pool child running attempt 1 is SIGKILLed: its worker requeues the message
    (acks_late + reject_on_worker_lost) while the dead attempt's 20 s lease is still
    live. The redelivery is put back, and when it returns the lease has expired by the
    database clock: on_stale="retry" takes the slot over as attempt 2 with a new fence.
    (The Redis backend's put-back path runs in the test above.)"""
    from tests.support import celery_tasks

    log = scratch / "executions.log"
    name = f"{celery_tasks.gated_long_lease.name}[gated]"
    # Only the worker's requeue redelivers here: no visibility-timeout copies.
    cluster.env["TASKGUARD_TEST_VISIBILITY"] = "30"
    cluster.worker("w1")
    cluster.worker("w2")
    slot = BASE_SLOT + timedelta(hours=13)
    never = scratch / "never"  # attempt 1 waits for it until it is killed
    task = celery_tasks.gated_long_lease
    task_id = cluster.publish(task, slot, "gated", log=str(log), gate=str(never))
    wait_for(lambda: executions(log), 60, "attempt 1 to start", describe=cluster.describe)
    ((_, _, first_pid, first_fence),) = attempts_of(log, name)
    os.kill(first_pid, signal.SIGKILL)  # the pool child only: its worker lives on
    wait_for(
        lambda: TaskRun.objects.filter(task_name=name, state=RunState.SUCCEEDED).exists(),
        90,
        "the takeover to succeed",
        describe=cluster.describe,
    )

    run = TaskRun.objects.get(task_name=name)
    (_, _, pid, fence), *_ = attempts_of(log, name)[1:]
    assert attempts_of(log, name) == [
        ("start", 1, first_pid, first_fence),
        ("start", 2, pid, fence),
        ("end", 2, pid, fence),
    ]
    assert pid != first_pid and fence > first_fence
    assert (run.attempt, run.fence, run.duplicates) == (2, fence, 0)
    put_back = cluster.events("put-back")
    assert put_back, "the redelivery was not put back"
    assert put_back[0][1:5] == [task_id, slot.isoformat(), "1", "0"], "not the redelivery"
    assert cluster.events("duplicate") == []
    steps = transitions(run)
    assert [(f, t) for f, t, *_ in steps] == [
        (RunState.PENDING, RunState.RUNNING),
        (RunState.RUNNING, RunState.RETRYING),
        (RunState.RETRYING, RunState.RUNNING),
        (RunState.RUNNING, RunState.SUCCEEDED),
    ]
    assert "expired" in steps[1][2] and "on_stale=retry" in steps[1][2]
    assert steps[2][2] == "taken over by attempt 2"
    assert steps[0][3] != run.owner and steps[1][3] == steps[2][3] == steps[3][3] == run.owner
    assert_lock_redis_settled(cluster)


# --- RabbitMQ ------------------------------------------------------------------------

RABBITMQ = ("127.0.0.1", 5672)
SLOW_RETRY = "tests.support.celery_tasks.slow_retry"


@pytest.fixture
def rabbitmq_url() -> Iterator[str]:
    """A private vhost on the machine's RabbitMQ (guest/guest), deleted afterwards.

    RabbitMQ missing or down is a setup error (scripts/ensure-services.sh installs
    and starts it), never a skip.
    """
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        raise pytest.UsageError(
            "rabbitmqctl is not installed; the RabbitMQ e2e test needs a real broker "
            "(bash scripts/ensure-services.sh). It is never skipped."
        )
    try:
        socket.create_connection(RABBITMQ, timeout=2).close()
    except OSError as exc:
        raise pytest.UsageError(
            f"RabbitMQ does not answer on {RABBITMQ[0]}:{RABBITMQ[1]} ({exc}); start it with "
            "bash scripts/ensure-services.sh"
        ) from exc
    vhost = f"taskguard-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def rabbitmqctl(*args: str) -> None:
        done = subprocess.run([ctl, "-q", *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise pytest.UsageError(f"rabbitmqctl {' '.join(args)} failed: {done.stderr}")

    rabbitmqctl("add_vhost", vhost)
    try:
        rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield f"amqp://guest:guest@{RABBITMQ[0]}:{RABBITMQ[1]}/{vhost}"
    finally:
        rabbitmqctl("delete_vhost", vhost)


@pytest.fixture
def rabbit_cluster(child_env, scratch, rabbitmq_url) -> Iterator[Cluster]:
    running = Cluster(child_env, scratch, rabbitmq_url)
    try:
        yield running
    finally:
        running.kill_all()


def test_e2e__rabbitmq_worker_sigkilled_mid_slot_every_slot_once(rabbit_cluster, scratch):
    """py-amqp broker, 2 workers, 2 beats, acks_late, on_stale="retry". A worker is
    SIGKILLed while it runs a slot; RabbitMQ requeues its unacked message (redelivered)
    when the connection drops, and the slot is taken over once: every slot the beats
    fired completes exactly once."""
    cluster = rabbit_cluster
    log = scratch / "executions.log"
    name = f"{SLOW_RETRY}[rabbit-tick]"
    kwargs = {"log": str(log), "seconds": 1.2}
    schedule = {"rabbit-tick": {"task": SLOW_RETRY, "every": 2, "kwargs": kwargs}}
    cluster.worker("w1")
    cluster.worker("w2")
    cluster.beat("beat1", PERSISTENT, schedule)
    cluster.beat("beat2", PERSISTENT, schedule)

    def running_on_w1() -> str | None:
        ended = {(line[2], line[3]) for line in executions(log) if line[0] == "end"}
        for event, _, slot, attempt, pid, *_ in executions(log):
            live = event == "start" and (slot, attempt) not in ended
            if live and cluster.owner_of(int(pid)) == "w1":
                return slot
        return None

    try:
        victim = datetime.fromisoformat(wait_for(running_on_w1, 60, "w1 to run a slot", every=0.02))
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.describe()}") from None
    cluster.signal("w1", signal.SIGKILL)
    wait_for(
        lambda: TaskRun.objects.filter(
            task_name=name, slot=victim, state=RunState.SUCCEEDED
        ).exists(),
        60,
        "the killed slot to be taken over",
        describe=cluster.describe,
    )
    time.sleep(2)  # one more slot on the surviving worker
    cluster.stop("beat1")
    cluster.stop("beat2")
    drain([name])

    sends = Counter(slot for _, slot, _ in published(cluster))

    # drain() waits for the runs, not for the last copies the two beats sent: one may
    # still be on its way to a worker. Wait for each to be counted (one that never
    # arrives fails here).
    def counted() -> bool:
        found = dict(TaskRun.objects.filter(task_name=name).values_list("slot", "duplicates"))
        return all(found.get(slot, -1) >= sent - 1 for slot, sent in sends.items())

    wait_for(counted, 30, "every copy the beats sent to reach a worker")
    runs = {run.slot: run for run in TaskRun.objects.filter(task_name=name)}
    assert set(runs) == set(sends) and len(sends) >= 4
    gaps = [b for a, b in itertools.pairwise(sorted(sends)) if b - a != timedelta(seconds=2)]
    assert not gaps, f"slots missing before {gaps}"
    ran = [(e, datetime.fromisoformat(slot), int(a)) for e, _, slot, a, *_ in executions(log)]
    ends = Counter(slot for e, slot, _ in ran if e == "end")
    assert ends == Counter(set(sends)), "a slot did not complete exactly once"
    for slot, run in runs.items():
        attempts = [a for e, s, a in ran if e == "start" and s == slot]
        expected = [1, 2] if slot == victim else [1]
        assert (run.state, run.attempt, attempts) == (RunState.SUCCEEDED, expected[-1], expected)
        assert run.duplicates == sends[slot] - 1, (slot, run.duplicates, sends[slot])
    # Any copy put back was the dead worker's redelivered message.
    for event in cluster.events("put-back"):
        assert (datetime.fromisoformat(event[2]), event[3]) == (victim, "1"), event
