"""APScheduler 3 on ``TaskguardExecutor``: three processes, each with its own
``BackgroundScheduler`` firing a one-second epoch-aligned interval job for
``TASKGUARD_SCHEDULER_TEST_SECONDS`` (default 8), run each slot once, counted outside the
ledger (tests/support/aps_jobs.py); a run that starts late claims the time it was
scheduled for; bad arguments are clear errors."""

from __future__ import annotations

import os
import select
import subprocess
import time
from collections import Counter
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

import pytest

from django_taskguard.contrib.apscheduler import TaskguardExecutor, epoch_interval
from django_taskguard.exceptions import TaskGuardError
from django_taskguard.models import RunState, TaskRun

from .support.children import executions, python
from .support.waiting import wait_for

pytestmark = pytest.mark.dialect

SECOND = timedelta(seconds=1)


def read_line(proc: subprocess.Popen[str], timeout: float = 60.0) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the child printed nothing"
    return proc.stdout.readline().strip()


@pytest.mark.processes
@pytest.mark.once
@pytest.mark.timeout(180)
def test_three_processes__each_fires_every_second__each_slot_runs_once(child_env, scratch):
    log = scratch / "executions.log"
    stop = scratch / "stop"
    env = {**child_env, "TASKGUARD_TEST_SCHEDULE_LOG": str(log)}
    seconds = float(os.environ.get("TASKGUARD_SCHEDULER_TEST_SECONDS", "8"))
    procs = []
    for n in range(3):
        with (scratch / f"child{n}.err").open("w") as stderr:
            procs.append(
                subprocess.Popen(
                    [python(), "-m", "tests.support.aps_child", str(stop)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                )
            )
    try:
        assert [read_line(proc) for proc in procs] == ["ready"] * 3
        all_ready = datetime.now(dt_timezone.utc)
        time.sleep(seconds)  # the three schedulers fire together for this long
        stopped = datetime.now(dt_timezone.utc)
        stop.touch()
        assert [read_line(proc) for proc in procs] == ["done"] * 3
        assert [proc.wait(timeout=30) for proc in procs] == [0, 0, 0]
    finally:
        stop.touch()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            assert proc.stdout is not None
            proc.stdout.close()
    errors = "".join((scratch / f"child{n}.err").read_text() for n in range(3))
    assert "Traceback" not in errors and "raised an exception" not in errors, errors[-3000:]

    done = Counter(datetime.fromisoformat(words[1]) for words in executions(log))
    assert set(done.values()) == {1}, [slot for slot, n in done.items() if n > 1]
    slots = sorted(done)
    assert len(slots) >= seconds - 3, f"only {len(slots)} slots ran"
    assert slots == [slots[0] + n * SECOND for n in range(len(slots))], "a slot was not run"
    assert all(slot.microsecond == 0 for slot in slots), "slots are the scheduled instants"
    rows = {run.slot: run for run in TaskRun.objects.filter(task_name="tests.aps.tick")}
    assert sorted(rows) == slots
    assert {run.state for run in rows.values()} == {RunState.SUCCEEDED}
    # While all three schedulers ran, the other two calls of each slot were duplicates.
    shared = [slot for slot in slots if all_ready + SECOND < slot < stopped - SECOND]
    assert shared, "the three schedulers never ran together"
    assert {rows[slot].duplicates for slot in shared} == {2}


@pytest.mark.django_db(transaction=True)
def test_executor__a_late_run_claims_the_time_it_was_scheduled_for():
    from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED, EVENT_JOB_MISSED
    from apscheduler.schedulers.background import BackgroundScheduler

    from tests.support.aps_jobs import tick

    scheduled = datetime.now(dt_timezone.utc).replace(microsecond=0) - 5 * SECOND
    scheduler = BackgroundScheduler(executors={"default": TaskguardExecutor(max_workers=1)})
    ended: list[object] = []
    scheduler.add_listener(
        lambda event: ended.append(event),
        mask=EVENT_JOB_EXECUTED | EVENT_JOB_ERROR | EVENT_JOB_MISSED,
    )
    scheduler.add_job(tick, "date", run_date=scheduled, misfire_grace_time=60)
    scheduler.start()
    try:
        wait_for(lambda: ended, timeout=30, what="the job to run")
    finally:
        scheduler.shutdown(wait=True)
    assert getattr(ended[0], "retval", None) == "ticked", getattr(ended[0], "traceback", None)
    assert list(TaskRun.objects.values_list("task_name", "slot", "state")) == [
        ("tests.aps.tick", scheduled, RunState.SUCCEEDED)
    ]


@pytest.mark.django_db(transaction=True)
def test_slot_source__a_guarded_job_outside_the_executor_has_no_slot():
    """Without TaskguardExecutor (or APScheduler 4), nothing says which slot a schedule-less
    guarded job is for: a clear error, and nothing runs."""
    from tests.support.aps_jobs import tick

    with pytest.raises(TaskGuardError, match="has no slot"):
        tick()
    assert not TaskRun.objects.exists()


@pytest.mark.parametrize("workers", [0, 1001, True, "4", 2.5])
def test_executor__max_workers_out_of_bounds_is_refused(workers):
    with pytest.raises(TaskGuardError, match=r"\(max_workers=\) must be a whole number from 1 to"):
        TaskguardExecutor(max_workers=workers)


@pytest.mark.parametrize(
    ("every", "options", "message"),
    [
        (timedelta(0), {}, "at least one second"),
        (60, {}, "at least one second"),
        (timedelta(minutes=1), {"jitter": 5}, "no jitter"),
        (timedelta(minutes=1), {"start_date": "2026-01-01"}, "sets start_date itself"),
    ],
)
def test_epoch_interval__bad_arguments_are_refused(every, options, message):
    with pytest.raises(TaskGuardError, match=message):
        epoch_interval(every, **options)


def test_epoch_interval__every_process_gets_the_same_instants():
    now = datetime.now(dt_timezone.utc)
    fires = {epoch_interval(timedelta(minutes=5)).get_next_fire_time(None, now) for _ in range(2)}
    (fire,) = fires
    assert fire.timestamp() % 300 == 0 and now <= fire < now + timedelta(minutes=5)
