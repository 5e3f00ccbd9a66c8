"""The upkeep runs itself (issue 22): with APScheduler-style callers only (no
``cleanup_locks``, no ``run_schedules``), the processes that call guarded functions fold
the duplicate counts, abandon a killed run and record a gap's slots missed; one process
at a time holds the lease; the health verdict says when no upkeep ran."""

from __future__ import annotations

import io
import itertools
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connections
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

from django_taskguard import health, metrics, once_per_schedule, upkeep
from django_taskguard.models import RunState, TaskRun, TaskSchedule, Upkeep

from .support.children import Child, python
from .support.monitoring import due_slot, finished, run_check, schedule
from .support.redis_server import RedisServer
from .support.redis_support import redis_backend
from .support.runs import make_run
from .support.slots import BASE_SLOT
from .support.waiting import wait_for

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]
INTERVAL = 5  # UPKEEP_INTERVAL_SECONDS of the callers
TOKEN = "probe-token-0123456789"


@pytest.fixture
def callers_env(child_env: dict[str, str], redis_server: RedisServer) -> dict[str, str]:
    """Children on the Redis lock backend (a private server) with the upkeep every 5 s."""
    return {
        **child_env,
        "TASKGUARD_TEST_BACKEND": "redis",
        "TASKGUARD_TEST_REDIS_URL": redis_server.url,
        "TASKGUARD_TEST_UPKEEP": str(INTERVAL),
    }


@pytest.fixture
def started() -> Iterator[list[Child]]:
    """The callers a test starts; every one still alive is killed at its end."""
    children: list[Child] = []
    yield children
    for child in children:
        if child.process.poll() is None:
            child.killed()


def caller(env: dict[str, str], log: Path, task: str, delay: float, **options: str) -> Child:
    argv = ["caller", "--task", task, "--log", str(log), "--delay", str(delay), "--seconds", "300"]
    for name, value in options.items():
        argv += [f"--{name}", value]
    child = Child(env, *argv)
    child.started()
    return child


def finished_upkeep() -> Upkeep | None:
    return Upkeep.objects.filter(finished_at__isnull=False).first()


def runs(task: str) -> list[TaskRun]:
    return list(TaskRun.objects.filter(task_name=task).order_by("slot"))


@pytest.mark.file_and_server
@pytest.mark.processes
def test_callers_only__duplicates_folded_and_a_killed_run_abandoned(
    callers_env: dict[str, str], scratch: Path, started: list[Child]
) -> None:
    """Three callers of each slot, 0.4 s apart: the first wins and finishes before the
    others call, so their counts stay in Redis until an upkeep folds them (the winner's
    release folds only what came while it ran). A caller SIGKILLed mid-run: its run is
    abandoned by the upkeep of the others."""
    task, log, hang = "tests.upkeep.callers", scratch / "log", scratch / "hang"
    for index in range(3):
        started.append(caller(callers_env, log, task, 0.1 + 0.4 * index, lease="3", go=str(hang)))
    wait_for(
        lambda: sum(run.duplicates == 2 for run in runs(task)) >= 3,
        timeout=60,
        what="three slots with their two duplicates folded",
        describe=lambda: str([(r.slot, r.state, r.duplicates) for r in runs(task)]),
    )
    assert all(run.duplicates <= 2 for run in runs(task))
    kept = wait_for(finished_upkeep, what="an upkeep's end recorded")
    pids = {str(child.process.pid) for child in started}
    assert kept.ran_by.startswith("upkeep@") and kept.ran_by.rsplit(":", 1)[1] in pids
    assert kept.finished_at is not None and not kept.error

    # The next slot but one hangs in whichever caller wins it; that caller is killed.
    now = timezone.now()
    slot = now.replace(microsecond=0) - timedelta(seconds=now.second % 2) + timedelta(seconds=4)
    hang.write_text(slot.isoformat())
    hung = wait_for(
        lambda: [line for line in log.read_text().splitlines() if line.startswith("hang ")],
        timeout=30,
        what="a caller hanging in its body",
    )
    pid = int(hung[0].split()[1])
    victim = next(child for child in started if child.process.pid == pid)
    assert TaskRun.objects.get(task_name=task, slot=slot).state == RunState.RUNNING
    victim.killed()
    abandoned = wait_for(
        lambda: TaskRun.objects.filter(task_name=task, slot=slot, state=RunState.ABANDONED).first(),
        timeout=60,
        what="the killed caller's run abandoned by the upkeep",
    )
    assert (
        abandoned.transitions.filter(to_state=RunState.ABANDONED).get().owner.startswith("cleanup@")
    )


@pytest.mark.file_and_server
@pytest.mark.processes
def test_callers_only__a_gap_is_recorded_missed(
    callers_env: dict[str, str], scratch: Path, started: list[Child]
) -> None:
    """One caller registers the schedule (its upkeep saves what it declares); every caller
    stops for some slots; one starts again: its upkeep records the gap's slots missed."""
    task, log = "tests.upkeep.gap", scratch / "log"
    first = caller(callers_env, log, task, 0.1)
    started.append(first)
    wait_for(lambda: TaskSchedule.objects.filter(task_name=task).exists(), timeout=60,
             what="the schedule saved by the caller's upkeep")  # fmt: skip
    wait_for(lambda: len(runs(task)) >= 2, timeout=30, what="two slots run")
    first.killed()
    last_before = runs(task)[-1].slot
    # Four slots (8 s) with no caller at all.
    wait_for(lambda: timezone.now() > last_before + timedelta(seconds=10), timeout=30,
             what="a gap of four slots", every=0.5)  # fmt: skip
    started.append(caller(callers_env, log, task, 0.1))

    def gap() -> list[TaskRun]:
        after = [run for run in runs(task) if run.slot > last_before]
        ran = [run for run in after if run.state == RunState.SUCCEEDED]
        return [run for run in after if ran and run.slot < ran[0].slot]

    wait_for(
        lambda: len(gap()) >= 4 and all(run.state == RunState.MISSED for run in gap()),
        timeout=60,
        what="the gap's slots recorded missed",
        describe=lambda: str([(r.slot, r.state) for r in runs(task)]),
    )
    slots = [run.slot for run in gap()]
    assert all(b - a == timedelta(seconds=2) for a, b in itertools.pairwise(slots))


def test_health__says_when_no_upkeep_ran_then_not_after_one() -> None:
    due = due_slot()
    schedule("tests.upkeep.health", first_seen=due)
    finished("tests.upkeep.health", due)
    config = {"BACKEND": "database", "UPKEEP_INTERVAL_SECONDS": INTERVAL, "HEALTH_TOKEN": TOKEN}
    with override_settings(TASKGUARD=config):
        answer = Client().get(reverse("taskguard:health"), HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
        assert answer.status_code == 503
        assert answer.json()["upkeep"]["problem"].startswith("upkeep has never run")
        verdict = health.check()
        assert not verdict.healthy
        assert [t.task for t in verdict.unhealthy] == []  # the task itself is fine
        assert verdict.upkeep_problem.startswith("upkeep has never run")
        assert verdict.as_dict()["upkeep"]["healthy"] is False
        status, out = run_check()
        assert status == 1
        assert "upkeep has never run" in out and "run cleanup_locks from cron" in out

        done = upkeep.run_upkeep("tests-holder")
        assert done["taken"] and done["errors"] == []
        verdict = health.check()
        assert verdict.upkeep_problem == ""
        assert verdict.as_dict()["upkeep"]["ran_by"] == "tests-holder"
        status, out = run_check("--task", "tests.upkeep.health")
        assert status == 0, out
        assert "UPKEEP" not in out and "never run" not in out
        answer = Client().get(reverse("taskguard:health"), HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
        assert answer.json()["upkeep"]["healthy"] is True
        body, _ = metrics.exposition("")
        assert b"\ntaskguard_upkeep_age_seconds " in body


def test_health__cleanup_locks_counts_as_an_upkeep_with_the_automatic_one_off() -> None:
    due = due_slot()
    schedule("tests.upkeep.cron", first_seen=due)
    finished("tests.upkeep.cron", due)
    verdict = health.check()  # the suite's settings: UPKEEP_INTERVAL_SECONDS = None
    assert "the automatic upkeep is off" in verdict.upkeep_problem
    call_command("cleanup_locks", stdout=io.StringIO())
    kept = Upkeep.objects.get()
    assert kept.ran_by.startswith("cleanup_locks@") and kept.held_until is None
    assert health.check().upkeep_problem == ""


def test_run_upkeep__two_processes_race_one_holds_the_lease_the_other_skips() -> None:
    """Two threads (two connections: two processes, as far as the database is concerned)
    start an upkeep at once: one takes the lease and is the row's ran_by; the other skips."""
    barrier = threading.Barrier(2)
    done: dict[str, dict[str, Any]] = {}

    def attempt(holder: str) -> None:
        try:
            barrier.wait(timeout=30)
            done[holder] = upkeep.run_upkeep(holder, interval=INTERVAL)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=attempt, args=(name,)) for name in ("one", "two")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(result["taken"] for result in done.values()) == [False, True]
    winner = next(holder for holder, result in done.items() if result["taken"])
    kept = Upkeep.objects.get()
    assert kept.ran_by == winner and kept.held_until is None
    assert upkeep.run_upkeep("three", interval=INTERVAL) == {"taken": False}  # ran just now


def _second_upkeep_once_the_first_lease_would_have_lapsed() -> dict[str, Any]:
    """Wait until the lease held now would have lapsed unrenewed, then attempt an upkeep
    from another thread (its own connection, as another process's): what it returned."""
    second: dict[str, Any] = {}

    def attempt() -> None:
        try:
            second.update(upkeep.run_upkeep("second", interval=0.5))
        finally:
            connections.close_all()

    first_until = Upkeep.objects.get().held_until
    wait_for(lambda: timezone.now() > first_until + timedelta(seconds=2), timeout=30,
             what="the lease first taken would have lapsed", every=0.2)  # fmt: skip
    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join(timeout=60)
    return second


def test_run_upkeep__a_part_longer_than_the_lease_keeps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 3 s lease and a part that works until well after it would have lapsed: the run
    renews it, so a second upkeep attempted then (due by the interval) does not run.

    Regression (issue 33): the lease was taken once; a long sweep outlived it and the next
    process ran its upkeep beside it."""
    monkeypatch.setattr(upkeep, "HOLD_AT_LEAST", timedelta(seconds=3))
    entered: list[str] = []
    second: dict[str, Any] = {}

    def slow() -> dict[str, Any]:
        entered.append("slow")
        if len(entered) > 1:  # the second upkeep, which took the lease
            return {}
        second.update(_second_upkeep_once_the_first_lease_would_have_lapsed())
        return {"slow": 1}

    monkeypatch.setattr(upkeep, "PARTS", [("slow", slow), *upkeep.PARTS])
    done = upkeep.run_upkeep("first", interval=0.5)
    assert second == {"taken": False}
    assert entered == ["slow"]
    assert done["taken"] and done["slow"] == 1 and done["errors"] == [], done
    kept = Upkeep.objects.get()
    assert kept.ran_by == "first" and kept.held_until is None


def test_cleanup_locks__a_run_longer_than_its_lease_keeps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``cleanup_locks`` with the automatic upkeep off (run from cron) takes a 3 s lease and
    works until well after it would have lapsed: it renews it, so an upkeep attempted then
    does not run beside it, and the command's run is the one recorded.

    Regression (issue 33): the command took the lease once; a long cleanup outlived it, the
    next process's upkeep ran beside it, and the command's end was not recorded."""
    from django_taskguard.management.commands import cleanup_locks as command

    monkeypatch.setattr(upkeep, "HOLD_AT_LEAST", timedelta(seconds=3))
    monkeypatch.setattr(upkeep, "RECHECK_SECONDS", 1.0)  # the lease of no interval: 3 s
    second: dict[str, Any] = {}
    cleanup = command.cleanup_locks

    def slow(**options: Any) -> Any:
        second.update(_second_upkeep_once_the_first_lease_would_have_lapsed())
        return cleanup(**options)

    monkeypatch.setattr(command, "cleanup_locks", slow)
    err = io.StringIO()
    call_command("cleanup_locks", stdout=io.StringIO(), stderr=err)
    assert second == {"taken": False}
    kept = Upkeep.objects.get()
    assert kept.ran_by.startswith("cleanup_locks@"), kept.ran_by
    assert kept.finished_at is not None and kept.held_until is None
    assert err.getvalue() == ""


def test_run_upkeep__a_run_whose_lease_was_taken_stops_at_its_next_part(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process took the lease during a part (as after it lapsed): the run stops
    before its next part, says so once, and leaves the row to the new holder."""
    ran: list[str] = []

    def robbed() -> dict[str, Any]:
        ran.append("robbed")
        later = timezone.now() + timedelta(minutes=1)
        Upkeep.objects.filter(id=1).update(holder="thief#token", held_until=later)
        return {}

    def after() -> dict[str, Any]:
        ran.append("after")
        return {}

    monkeypatch.setattr(upkeep, "PARTS", [("robbed", robbed), ("after", after)])
    with caplog.at_level(logging.DEBUG, logger="taskguard"):
        done = upkeep.run_upkeep("victim", interval=INTERVAL)
    assert ran == ["robbed"]
    assert done["taken"] and done["lost"] and done["errors"] == [upkeep.LOST], done
    (said,) = [r for r in caplog.records if r.name == "taskguard.upkeep"]
    assert getattr(said, "event", "") == "upkeep.lease_lost" and "victim" in said.getMessage()
    kept = Upkeep.objects.get()
    assert kept.holder == "thief#token" and kept.finished_at is None


def test_maybe_upkeep__at_most_once_per_interval_per_process() -> None:
    upkeep.forget()
    try:
        with override_settings(TASKGUARD={"BACKEND": "database", "UPKEEP_INTERVAL_SECONDS": 60}):
            assert upkeep.maybe_upkeep() is True
            assert upkeep.maybe_upkeep() is False  # within the interval: a clock read only
            upkeep.join(timeout=60)
            assert Upkeep.objects.get().finished_at is not None
        with override_settings(TASKGUARD={"BACKEND": "database", "UPKEEP_INTERVAL_SECONDS": None}):
            upkeep.forget()
            assert upkeep.maybe_upkeep() is False  # off
    finally:
        upkeep.forget(off=True)


def test_maybe_upkeep__not_under_djangos_test_environment_unless_a_test_asks() -> None:
    # A user's test process (Django's runner, pytest-django): a thread writing to the test
    # database beside the tests would lock SQLite under them.
    upkeep.forget(asked=False)
    try:
        with override_settings(TASKGUARD={"BACKEND": "database", "UPKEEP_INTERVAL_SECONDS": 60}):
            assert upkeep.maybe_upkeep() is False
            upkeep.forget()
            assert upkeep.maybe_upkeep() is True
            upkeep.join(timeout=60)
    finally:
        upkeep.forget(off=True)


def test_hooks__a_beat_tick_and_a_celery_task_end_start_the_upkeep(tmp_path: Path) -> None:
    from celery.signals import task_postrun

    from django_taskguard.contrib.celery import TaskguardScheduler
    from django_taskguard.contrib.celery.worker import upkeep_after_task
    from tests.support.celery_app import app

    config = {"BACKEND": "database", "UPKEEP_INTERVAL_SECONDS": 60}
    beat = TaskguardScheduler(app=app, schedule_filename=str(tmp_path / "beat"), lazy=True)
    beat.setup_schedule()
    upkeep.forget()
    try:
        with override_settings(TASKGUARD=config):
            assert beat.tick() <= 60  # a beat wakes for the upkeep at least once an interval
            upkeep.join(timeout=60)
            assert Upkeep.objects.get().finished_at is not None
            Upkeep.objects.all().delete()
            upkeep.forget()
            assert [key for key, _ in task_postrun.receivers if key[0] == "taskguard.upkeep"]
            upkeep_after_task(sender=None, task_id="t1")
            upkeep.join(timeout=60)
            assert Upkeep.objects.get().finished_at is not None
    finally:
        upkeep.forget(off=True)
        beat.close()


@pytest.mark.file_and_server
@pytest.mark.processes
def test_run_schedules__its_sweep_thread_runs_the_upkeep(
    child_env: dict[str, str], started: list[Child]
) -> None:
    """``run_schedules`` (no schedule of its own here) runs the upkeep: a stale run of
    another task is abandoned, and the Upkeep row names the command's process."""
    from .support.runs import make_run

    stale = make_run("tests.upkeep.stale")  # running, its lease expired an hour ago
    env = {**child_env, "TASKGUARD_TEST_UPKEEP": str(INTERVAL)}
    child = Child(env, "--sweep-every", "60", module="tests.support.scheduler_child")
    started.append(child)
    wait_for(
        lambda: TaskRun.objects.get(pk=stale.pk).state == RunState.ABANDONED,
        timeout=60,
        what="the stale run abandoned by run_schedules' upkeep",
    )
    kept = wait_for(finished_upkeep, what="the upkeep's end recorded")  # after its parts
    assert kept.ran_by.startswith("upkeep@") and kept.ran_by.endswith(f":{child.process.pid}")
    child.signal(signal.SIGTERM)
    child.process.communicate(timeout=60)
    assert child.process.returncode == 0


def _said(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records if getattr(record, "event", "") == event]


def test_upkeep__a_redis_outage_is_one_warning_per_process_and_the_other_parts_run(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis stopped under ON_REDIS_ERROR="database": the upkeep a guarded call starts
    cannot run its lock sweep. Said in one warning line (no traceback) for the whole
    outage however many upkeeps meet it, reported by the health verdict, and the other
    parts still run; said again when it fails anew after it worked.

    Regression (issue 33): every upkeep logged the lock sweep's full BackendUnavailable
    traceback, once per interval in every process."""
    # running, their leases expired an hour ago: each is abandoned, Redis or not
    stale = [make_run("tests.upkeep.outage_stale", minute) for minute in (0, 1)]
    schedule("tests.upkeep.outage")  # first seen a week ago, never run: slots to miss

    @once_per_schedule(name="tests.upkeep.outage_call")
    def call() -> str:
        return "ran"

    upkeep.forget()
    try:
        with (
            redis_backend(
                redis_server, ON_REDIS_ERROR="database", UPKEEP_INTERVAL_SECONDS=INTERVAL
            ),
            caplog.at_level(logging.DEBUG, logger="taskguard"),
        ):
            redis_server.stop()
            assert call.run_for_slot(BASE_SLOT) == "ran"  # on the database alone
            upkeep.join(timeout=60)  # the upkeep thread that call started
            kept = finished_upkeep()
            assert kept is not None and "lock: BackendUnavailable" in kept.error
            abandoned = TaskRun.objects.filter(pk__in=[run.pk for run in stale])
            assert {run.state for run in abandoned} == {RunState.ABANDONED}  # "stale" ran
            assert TaskRun.objects.filter(
                task_name="tests.upkeep.outage", state=RunState.MISSED
            ).exists()  # "missed" ran
            problem = health.check().upkeep_problem
            assert "failed in part" in problem and "Redis" in problem, problem

            again = upkeep.run_upkeep("tests-again", interval=0.001)  # the next interval
            assert again["taken"] and any(e.startswith("lock: ") for e in again["errors"])
            warned = [
                r.getMessage()
                for r in caplog.records
                if r.name == "taskguard.upkeep" and r.levelno >= logging.WARNING
            ]
            assert len(warned) == 1, warned  # one line for the outage, whatever it stops
            assert "lock" in warned[0].split(" cannot run")[0] and "Redis" in warned[0]
            assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"

            redis_server.start()
            back = upkeep.run_upkeep("tests-back", interval=0.001)
            assert back["taken"] and back["errors"] == []
            (available,) = _said(caplog, "upkeep.part_available")
            assert "lock" in available.getMessage()
            assert health.check().upkeep_problem == ""

            redis_server.stop()
            anew = upkeep.run_upkeep("tests-anew", interval=0.001)
            assert anew["taken"] and anew["errors"] == ["lock: " + anew["errors"][0][6:]]
            lock_lines = [
                r.levelno
                for r in _said(caplog, "upkeep.part_unavailable")
                if "lock" in r.getMessage().split(" cannot run")[0]
            ]
            assert lock_lines == [logging.WARNING, logging.DEBUG, logging.WARNING]
            assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    finally:
        upkeep.forget(off=True)


def _upkeep_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("taskguard-upkeep")]


def test_celery_worker__its_timer_starts_when_ready_and_leaves_no_thread_when_it_stops() -> None:
    """``worker_ready`` starts the worker's upkeep timer (once, however often it is sent),
    which attempts the upkeep with no task at all; ``worker_shutdown`` ends it and waits for
    the upkeep it started. With the automatic upkeep off, no timer starts."""
    from celery.signals import worker_ready, worker_shutdown

    from django_taskguard.contrib.celery.worker import TIMER

    assert _upkeep_threads() == []
    upkeep.forget()
    try:
        with override_settings(TASKGUARD={"BACKEND": "database", "UPKEEP_INTERVAL_SECONDS": 60}):
            worker_ready.send(sender=None)
            worker_ready.send(sender=None)
            assert _upkeep_threads().count("taskguard-upkeep-timer") == 1
            wait_for(finished_upkeep, timeout=60, what="an upkeep run by the timer alone")
            worker_shutdown.send(sender=None)
            assert _upkeep_threads() == []
        with override_settings(TASKGUARD={"BACKEND": "database", "UPKEEP_INTERVAL_SECONDS": None}):
            worker_ready.send(sender=None)
            assert _upkeep_threads() == []
    finally:
        TIMER.stop()
        upkeep.forget(off=True)


@pytest.mark.file_and_server
@pytest.mark.processes
@pytest.mark.parametrize("pool", ["prefork", "solo", "threads"])
def test_celery_worker__an_idle_worker_runs_the_upkeep_in_its_main_process(
    child_env: dict[str, str], redis_server: RedisServer, scratch: Path, pool: str
) -> None:
    """A real ``celery worker`` that receives no task: its main process (a prefork pool's
    parent, not a child) abandons a stale run within the upkeep interval, and again an
    interval later; a warm shutdown (SIGTERM) ends it cleanly.

    Regression (issue 33): the upkeep ran only after a task ended, so an idle worker never
    swept (stale leases, missed slots, expired Redis locks)."""
    first = make_run("tests.upkeep.idle_worker")  # running, its lease expired an hour ago
    env = {
        **child_env,
        "TASKGUARD_TEST_UPKEEP": str(INTERVAL),
        "TASKGUARD_TEST_BROKER_URL": redis_server.url,
    }
    argv = ["worker", "-P", pool, "-c", "1", "-n", f"idle-{pool}@%h", "--loglevel", "INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip
    with open(scratch / "worker.out", "ab") as out:
        worker = subprocess.Popen(
            [python(), "-m", "celery", "-A", "tests.support.celery_app", *argv],
            env=env, cwd=scratch, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:

        def abandoned(run: TaskRun) -> bool:
            return TaskRun.objects.get(pk=run.pk).state == RunState.ABANDONED

        wait_for(lambda: abandoned(first), timeout=60, what="the stale run abandoned",
                 describe=lambda: (scratch / "worker.out").read_text(errors="replace"))  # fmt: skip
        kept = wait_for(finished_upkeep, what="the upkeep's end recorded")
        assert kept.ran_by.endswith(f":{worker.pid}"), kept.ran_by  # the main process
        second = make_run("tests.upkeep.idle_worker", 1)  # after that upkeep: the next one's
        wait_for(lambda: abandoned(second), timeout=60, what="the next interval's upkeep")
        assert not TaskRun.objects.exclude(pk__in=[first.pk, second.pk]).exists()  # no task
        os.killpg(worker.pid, signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=30)
