"""django-q2 end to end: two real ``manage.py qcluster`` processes on the ORM broker (the
test database), fed by two "schedulers" that enqueue a one-second schedule's slots with
``intended=<slot>`` (what a django-q2 ``Schedule`` with ``intended_date_kwarg`` passes; its
own scheduler fires at most once a minute), for ``TASKGUARD_SCHEDULER_TEST_SECONDS``
(default 12). Every slot runs once; a task that runs past django-q2's ``retry`` is
presented again by the broker and counted a duplicate, not run twice; a failed attempt's
re-presentation is the next attempt of the same row; a SIGKILLed worker's run ends
``abandoned``. Executions are counted outside the ledger (tests/support/q_jobs.py).

Also, in this process: django-q2's own scheduler function passes the intended time under
the Schedule's ``intended_date_kwarg``, and the guarded function claims that slot.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import time
from collections import Counter
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from importlib.util import find_spec
from pathlib import Path

import pytest
from django.core.management import call_command

from django_taskguard.exceptions import TaskGuardError
from django_taskguard.models import RunState, TaskRun
from django_taskguard.testing import freeze_now

from .support.children import executions, start
from .support.waiting import wait_for

pytestmark = pytest.mark.dialect

if not find_spec("django_q"):
    pytest.skip("needs django-q2", allow_module_level=True)

SECOND = timedelta(seconds=1)
RETRY = 5  # django-q2's retry in the children: a task unacknowledged this long comes back
SLOT = datetime(2026, 11, 24, 21, 0, tzinfo=dt_timezone.utc)


def lines(log: Path, task: str) -> list[list[str]]:
    return [words for words in executions(log) if words[0] == task]


def row(task: str) -> TaskRun | None:
    return TaskRun.objects.filter(task_name=task).first()


@pytest.mark.processes
@pytest.mark.once
@pytest.mark.timeout(240)
def test_qcluster__two_clusters_two_schedulers_each_slot_once_redeliveries_counted(
    child_env, scratch
):
    from django_q.tasks import async_task

    log = scratch / "executions.log"
    env = {
        **child_env,
        "TASKGUARD_TEST_SCHEDULE_LOG": str(log),
        "TASKGUARD_TEST_Q_RETRY": str(RETRY),
        "TASKGUARD_TEST_Q_TIMEOUT": str(RETRY - 2),
        "TASKGUARD_TEST_Q_WORKERS": "3",
    }
    clusters = [
        start(env, scratch / f"cluster{n}.out", "-m", "django", "qcluster") for n in range(2)
    ]

    def outputs() -> str:
        return "".join((scratch / f"cluster{n}.out").read_text()[-2000:] for n in range(2))

    try:
        # A long task (its own timeout beyond retry), a failing one, a hanging one.
        async_task("tests.support.q_jobs.slow", RETRY + 6, intended=SLOT.isoformat(), timeout=60)
        async_task("tests.support.q_jobs.flaky", intended=(SLOT + SECOND).isoformat())
        async_task(
            "tests.support.q_jobs.hang", intended=(SLOT + 2 * SECOND).isoformat(), timeout=60
        )
        seconds = float(os.environ.get("TASKGUARD_SCHEDULER_TEST_SECONDS", "12"))
        began = datetime.now(dt_timezone.utc)
        enqueuers = [
            start(
                env,
                scratch / f"enqueuer{n}.out",
                "-m",
                "tests.support.q_enqueuer",
                str(seconds),
                str(scratch / f"fired{n}.txt"),
            )
            for n in range(2)
        ]

        # The hanging task's worker is SIGKILLed mid-run: its run is abandoned, not re-run.
        hung = wait_for(
            lambda: lines(log, "tests.q.hang"),
            timeout=60,
            what="the hanging task to start",
            describe=outputs,
        )
        os.kill(int(hung[0][2]), signal.SIGKILL)

        assert [proc.wait(timeout=seconds + 60) for proc in enqueuers] == [0, 0]
        ended = datetime.now(dt_timezone.utc)
        fired = [
            datetime.fromisoformat(line)
            for n in range(2)
            for line in (scratch / f"fired{n}.txt").read_text().split()
        ]
        slots = sorted(set(fired))
        # Each enqueued slot ran exactly once (its second message was a duplicate).
        wait_for(
            lambda: (
                len(lines(log, "tests.q.tick")) >= len(slots)
                and TaskRun.objects.filter(
                    task_name="tests.q.tick", state=RunState.SUCCEEDED
                ).count()
                >= len(slots)
            ),
            timeout=60,
            what="every enqueued slot to run",
            describe=outputs,
        )
        done = Counter(datetime.fromisoformat(words[1]) for words in lines(log, "tests.q.tick"))
        assert set(done.values()) == {1}, [slot for slot, n in done.items() if n > 1]
        assert sorted(done) == slots
        first, last = slots[0], slots[-1]
        assert slots == [first + n * SECOND for n in range(len(slots))], "a slot was skipped"
        assert began <= first and last <= ended and len(slots) >= 3
        # Both schedulers fired the slots between their start-ups and their ends.
        twice = [slot for slot, n in Counter(fired).items() if n == 2]
        assert twice and set(Counter(fired).values()) <= {1, 2}
        ticks = TaskRun.objects.filter(task_name="tests.q.tick")
        assert sorted(ticks.values_list("slot", "state", "attempt")) == [
            (slot, RunState.SUCCEEDED, 1) for slot in slots
        ]
        wait_for(
            lambda: sum(ticks.values_list("duplicates", flat=True)) == len(twice),
            timeout=30,
            what="every second message counted",
        )

        # The long task: presented again after retry while it ran; one execution, and the
        # re-presentation counted on its row.
        wait_for(
            lambda: (run := row("tests.q.slow")) is not None and run.state == RunState.SUCCEEDED,
            timeout=60,
            what="the long task to end",
            describe=outputs,
        )
        slow = row("tests.q.slow")
        assert slow is not None and slow.attempt == 1
        assert slow.duplicates >= 1, "the broker did not hand the long task out again"
        assert len(lines(log, "tests.q.slow")) == 1

        # The failing task: its re-presentation is attempt 2 of the same row.
        wait_for(
            lambda: (run := row("tests.q.flaky")) is not None and run.state == RunState.SUCCEEDED,
            timeout=60,
            what="the failing task's retry",
            describe=outputs,
        )
        flaky = row("tests.q.flaky")
        assert flaky is not None and flaky.attempt == 2
        assert [words[3] for words in lines(log, "tests.q.flaky")] == ["1", "2"]
        assert list(flaky.transitions.values_list("to_state", flat=True).order_by("id")) == [
            RunState.RUNNING,
            RunState.RETRYING,
            RunState.RUNNING,
            RunState.SUCCEEDED,
        ]

        # The SIGKILLed run: once its lease (3 s) has lapsed, cleanup_locks (or the
        # re-presentation, whichever comes first) records it abandoned; it never runs again.
        hang = row("tests.q.hang")
        assert hang is not None
        wait_for(
            lambda: (
                TaskRun.objects.filter(pk=hang.pk, lease_until__lt=_db_now()).exists()
                or TaskRun.objects.get(pk=hang.pk).state == RunState.ABANDONED
            ),
            timeout=30,
            what="the killed run's lease to lapse",
        )
        call_command("cleanup_locks", stdout=io.StringIO())
        hang.refresh_from_db()
        assert hang.state == RunState.ABANDONED and hang.attempt == 1
        # Its message comes back after retry (the killed worker never acknowledged it): a
        # counted duplicate, not a second run.
        wait_for(
            lambda: TaskRun.objects.get(pk=hang.pk).duplicates >= 1,
            timeout=60,
            what="the killed task to be handed out again",
            describe=outputs,
        )
        assert len(lines(log, "tests.q.hang")) == 1
        assert TaskRun.objects.get(pk=hang.pk).state == RunState.ABANDONED
    finally:
        for proc in clusters:
            proc.send_signal(signal.SIGTERM)
        for proc in clusters:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    everything = "".join((scratch / f"cluster{n}.out").read_text() for n in range(2))
    for trouble in ("TaskGuardError", "LeaseLost", "Could not save", "Could not create", "Error:"):
        assert trouble not in everything.replace("OSError:", "OSError"), everything[-4000:]


@pytest.mark.processes
@pytest.mark.once
@pytest.mark.timeout(240)
def test_run_schedules_enqueue__two_copies_hand_each_slot_to_a_qcluster_once(child_env, scratch):
    """``on_django_q``: two ``run_schedules --enqueue`` copies hand a one-second schedule's
    slots to django-q2 (one task per slot: the pending row decides) and a qcluster runs
    each once."""
    from django_q.models import OrmQ, Task

    log = scratch / "executions.log"
    env = {
        **child_env,
        "TASKGUARD_TEST_SCHEDULE_LOG": str(log),
        "TASKGUARD_TEST_SCHEDULE_MODULES": "tests.support.q_jobs",
        "TASKGUARD_TEST_Q_WORKERS": "3",
    }
    cluster = start(env, scratch / "cluster.out", "-m", "django", "qcluster")
    copy = ["-m", "tests.support.scheduler_child", "--enqueue", "--task", "tests.q.every"]
    seconds = float(os.environ.get("TASKGUARD_SCHEDULER_TEST_SECONDS", "12"))
    try:
        began = datetime.now(dt_timezone.utc)
        copies = [start(env, scratch / f"copy{n}.out", *copy) for n in range(2)]
        time.sleep(seconds)  # the copies hand out slots for this long
        ended = datetime.now(dt_timezone.utc)
        for proc in copies:
            proc.send_signal(signal.SIGTERM)
        assert [proc.wait(timeout=60) for proc in copies] == [0, 0]
        wait_for(lambda: not OrmQ.objects.exists(), timeout=60, what="the queue to empty")
        wait_for(
            lambda: (
                not TaskRun.objects.filter(task_name="tests.q.every")
                .exclude(state=RunState.SUCCEEDED)
                .exists()
            ),
            timeout=60,
            what="every handed-out slot to end",
        )
    finally:
        cluster.send_signal(signal.SIGTERM)
        try:
            cluster.wait(timeout=30)
        except subprocess.TimeoutExpired:
            cluster.kill()
            cluster.wait(timeout=10)
    outputs = "".join((scratch / f"copy{n}.out").read_text() for n in range(2))
    assert "raised" not in outputs and "Traceback" not in outputs, outputs[-3000:]

    done = Counter(datetime.fromisoformat(words[1]) for words in lines(log, "tests.q.every"))
    assert set(done.values()) == {1}, [slot for slot, n in done.items() if n > 1]
    slots = sorted(done)
    assert slots and began <= slots[0] and slots[-1] <= ended
    assert slots == [slots[0] + n * SECOND for n in range(len(slots))], "a slot was not run"
    rows = TaskRun.objects.filter(task_name="tests.q.every")
    assert sorted(rows.values_list("slot", flat=True)) == slots
    # One django-q2 task per slot, not one per copy.
    assert Task.objects.filter(func="tests.support.q_jobs.every_second").count() == len(slots)


def _db_now() -> datetime:
    from django.db.models.functions import Now

    value = TaskRun.objects.annotate(now=Now()).values_list("now", flat=True).first()
    assert value is not None
    return value


@pytest.mark.django_db(transaction=True)
def test_scheduler__a_schedules_intended_date_kwarg_is_the_slot_claimed():
    """django-q2's scheduler function, run twice on two schedules due for the same time
    (two clusters' schedulers, in effect), enqueues two tasks carrying that time under
    ``intended_date_kwarg``; run as the worker runs them, one executes for that slot and
    the other is a duplicate."""
    from django_q.brokers import get_broker
    from django_q.models import OrmQ, Schedule
    from django_q.scheduler import scheduler
    from django_q.signing import SignedPackage

    from tests.support import q_jobs

    due = datetime.now(dt_timezone.utc).replace(microsecond=0) - 10 * SECOND
    for name in ("a", "b"):
        Schedule.objects.create(
            name=name,
            func="tests.support.q_jobs.tick",
            schedule_type=Schedule.ONCE,
            next_run=due,
            intended_date_kwarg="intended",
            repeats=1,
        )
    broker = get_broker()
    scheduler(broker=broker)
    packages = [SignedPackage.loads(message.payload) for message in OrmQ.objects.all()]
    assert [package["kwargs"]["intended"] for package in packages] == [due.isoformat()] * 2
    results = [q_jobs.tick(*package["args"], **package["kwargs"]) for package in packages]
    assert results == ["ticked", None]
    assert list(TaskRun.objects.values_list("task_name", "slot", "state")) == [
        ("tests.q.tick", due, RunState.SUCCEEDED)
    ]


@pytest.mark.django_db(transaction=True)
def test_classify_raise__a_raise_django_q2_hands_out_again_is_a_retry_of_that_task():
    from django_q.models import Task

    from django_taskguard.contrib.django_q import classify_raise

    task = {"id": "6f1c", "name": "six-foxtrot"}
    ending = classify_raise(task, OSError("boom"))
    assert ending is not None and ending.state == RunState.RETRYING
    assert (ending.retry_by, ending.retry_within) == ("6f1c", 60.0)  # the settings' retry
    assert classify_raise({**task, "ack_failure": True}, OSError("boom")) is None
    assert classify_raise(task, KeyboardInterrupt()) is None
    # max_attempts=3 in the settings: after two recorded attempts, this one is the last.
    Task.objects.create(
        id="6f1c", name="six-foxtrot", func="f", started=SLOT, stopped=SLOT, success=False,
        attempt_count=2,
    )  # fmt: skip
    assert classify_raise(task, OSError("boom")) is None


@pytest.mark.django_db(transaction=True)
def test_enqueue_for_slot__the_slot_travels_as_slot_kwarg_and_bad_calls_are_refused():
    from django_q.models import OrmQ
    from django_q.signing import SignedPackage

    from django_taskguard.contrib.django_q import enqueue_for_slot
    from django_taskguard.decorators import SLOT_KWARG
    from tests.support import q_jobs

    enqueue_for_slot(q_jobs.tick, SLOT.astimezone(dt_timezone(timedelta(hours=2))))
    (package,) = [SignedPackage.loads(message.payload) for message in OrmQ.objects.all()]
    assert package["kwargs"] == {SLOT_KWARG: SLOT.isoformat()}
    with freeze_now(SLOT):  # the worker's clock at the slot: older than retention, never run
        assert q_jobs.tick(*package["args"], **package["kwargs"]) == "ticked"
    assert list(TaskRun.objects.values_list("slot", flat=True)) == [SLOT]
    with pytest.raises(TaskGuardError, match="decorated with @once_per_schedule"):
        enqueue_for_slot(print, SLOT)
    with pytest.raises(TaskGuardError, match="not _taskguard_slot="):
        enqueue_for_slot(q_jobs.tick, SLOT, _taskguard_slot=SLOT.isoformat())
    assert OrmQ.objects.count() == 1


def test_on_django_q__needs_a_scheduled_guarded_function_and_known_options():
    from django_taskguard.contrib.django_q import on_django_q
    from tests.support import q_jobs

    with pytest.raises(TaskGuardError, match="with @once_per_schedule"):
        on_django_q(q_jobs.tick)  # guarded, but no schedule of its own
    with pytest.raises(TaskGuardError, match="with @once_per_schedule"):
        on_django_q(print)
    with pytest.raises(TaskGuardError, match="not broker, retry"):
        on_django_q(q_jobs.every_second, retry=5, broker=None)
    made = on_django_q(q_jobs.every_second, group="g")
    assert (made.func, made.q_options) == (q_jobs.every_second, {"group": "g"})
