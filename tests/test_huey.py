"""Huey in this process, on a private Redis: ``@huey.task()`` over ``@once_per_schedule``,
the slot carried in the task's keyword arguments, ``run_schedules --enqueue`` sending
slots to Huey, Huey's retries as attempts of one row, a message delivered twice counted
as a duplicate, and ``periodic()``'s stamped slots. The consumer's part is played by
Huey's own ``Huey.dequeue`` and ``Huey.execute`` (what a consumer's worker calls); real
consumer processes: tests/test_huey_e2e.py.
"""

from __future__ import annotations

import functools
import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from io import StringIO
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("huey")  # the [huey] extra: the version matrix's smoke venvs lack it

from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone as dj_timezone
from huey import CancelExecution, MemoryHuey, RedisHuey, RetryTask
from huey.consumer import Worker
from huey.exceptions import RateLimitExceeded

from django_taskguard import once_per_schedule, registry
from django_taskguard.contrib.huey import (
    SLOT_KWARG,
    enqueue_for_slot,
    find,
    install,
    message_id,
    periodic,
    signature_for_slot,
)
from django_taskguard.contrib.huey.worker import classify_raise
from django_taskguard.exceptions import InvalidSchedule, TaskGuardError
from django_taskguard.models import RunState, TaskRun, TaskSchedule
from django_taskguard.owner import Owner, pid_space

from .support import huey_app
from .support.huey_support import JOBS_MODULE, fresh_jobs
from .support.redis_server import RedisServer
from .support.runs import make_run

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]
SECOND = timedelta(seconds=1)
MINUTE = timedelta(minutes=1)
JOBS = {"TASKGUARD": {"BACKEND": "database", "SCHEDULE_MODULES": [JOBS_MODULE]}}


@pytest.fixture
def jobs(redis_server: RedisServer) -> Iterator[ModuleType]:
    """tests/support/huey_jobs.py, freshly decorated, on a private Redis."""
    with fresh_jobs(redis_server.url) as module:
        yield module


@pytest.fixture
def queue(jobs: ModuleType) -> Any:
    """tests/support/huey_app.py's Huey instance, on the private Redis."""
    return huey_app.huey


def latest(every: timedelta) -> datetime:
    now = dj_timezone.now()
    epoch = datetime(1970, 1, 1, tzinfo=now.tzinfo)
    return now - (now - epoch) % every


def minute_of(now: datetime) -> datetime:
    """The minute slot of Huey's naive UTC ``now``, aware."""
    return now.replace(second=0, microsecond=0, tzinfo=timezone.utc)


def consume(huey: Any) -> int:
    """Run what the queue holds, as a consumer's worker does, until it is empty; how many
    messages ran."""
    ran = 0
    while (task := huey.dequeue()) is not None:
        huey.execute(task)
        ran += 1
    return ran


def row(name: str) -> TaskRun:
    return TaskRun.objects.get(task_name=name)


# -- composition --------------------------------------------------------------------


def test_find__a_huey_task_over_a_scheduled_function(jobs):
    assert find(jobs.tick).func is jobs.tick.func
    assert find(jobs.beat).func is jobs.beat.func  # periodic() makes a Huey task too
    assert find(jobs.djtick) is None  # a django.tasks task: contrib.tasks' recogniser
    assert find(MemoryHuey("plain").task()(lambda: None)) is None  # not guarded
    assert find(jobs.tick.func) is None  # the function itself is no task


def test_find__through_a_wrapping_decorator_like_djhueys_db_task():
    """djhuey's ``db_task`` gives Huey ``close_db(function)``, a ``functools.wraps`` copy."""

    def close_db(fn: Any) -> Any:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        return inner

    guarded = once_per_schedule(every=MINUTE, name="tests.huey.wrapped")(lambda: "ran")
    try:
        own = MemoryHuey("wrapped")
        task = own.task()(close_db(guarded))
        assert find(task).func is guarded
        slot = latest(MINUTE)
        enqueue_for_slot(task, slot)
        (message,) = own.pending()
        assert message.kwargs == {SLOT_KWARG: slot.isoformat()}
    finally:
        registry.unregister("tests.huey.wrapped")


def test_enqueue_for_slot__the_slot_travels_in_the_kwargs_and_is_claimed(jobs, queue):
    slot = latest(SECOND) - 30 * SECOND
    enqueue_for_slot(jobs.tick, slot)
    (message,) = queue.pending()
    assert message.kwargs == {SLOT_KWARG: slot.isoformat()}
    assert consume(queue) == 1
    run = row("tests.huey.tick")
    assert (run.slot, run.state, run.attempt) == (slot, RunState.SUCCEEDED, 1)
    assert jobs.executed == [f"tests.huey.tick {slot.isoformat()} 1"]


def test_enqueue_for_slot__refuses_what_it_cannot_carry(jobs, queue):
    with pytest.raises(InvalidSchedule, match="timezone-aware"):
        enqueue_for_slot(jobs.tick, datetime(2024, 1, 1, 12))
    with pytest.raises(TaskGuardError, match="decorated with @once_per_schedule"):
        enqueue_for_slot(MemoryHuey("plain").task()(lambda: None), latest(SECOND))
    with pytest.raises(TaskGuardError, match="decorated with @once_per_schedule"):
        enqueue_for_slot(jobs.djtick, latest(SECOND))
    with pytest.raises(TaskGuardError, match="not _taskguard_slot="):
        enqueue_for_slot(jobs.tick, latest(SECOND), _taskguard_slot="2024-01-01T00:00:00Z")
    assert queue.pending_count() == 0


@override_settings(**JOBS)
def test_run_schedules_enqueue__sends_each_slot_to_huey_once_across_copies(jobs, queue):
    registry.sync()
    TaskSchedule.objects.filter(task_name="tests.huey.tick").update(
        first_seen=dj_timezone.now() - 2 * MINUTE, swept_until=None
    )
    for _ in range(2):  # two copies
        args = ["--enqueue", "--once", "--task", "tests.huey.tick"]
        call_command("run_schedules", *args, stdout=StringIO())
    sent = [message.kwargs[SLOT_KWARG] for message in queue.pending()]
    assert sent and len(sent) == len(set(sent)), f"a slot was sent twice: {sent}"
    rows = TaskRun.objects.filter(task_name="tests.huey.tick")
    assert sorted(run.slot.isoformat() for run in rows) == sorted(sent)
    assert set(rows.values_list("state", flat=True)) == {RunState.PENDING}

    assert consume(queue) == len(sent)
    assert set(rows.values_list("state", flat=True)) == {RunState.SUCCEEDED}
    assert sorted(jobs.executed) == sorted(f"tests.huey.tick {slot} 1" for slot in sent)


@override_settings(**JOBS)
def test_backfill_enqueue__each_slot_without_a_row_sent_to_huey_once(jobs, queue):
    registry.discover()
    end = latest(SECOND) - 30 * SECOND
    start = end - 3 * SECOND
    span = ["--from", start.isoformat(), "--to", end.isoformat()]
    out = StringIO()
    call_command("backfill", "tests.huey.tick", *span, "--enqueue", stdout=out)
    assert "Enqueued 4 slots" in out.getvalue()
    call_command("backfill", "tests.huey.tick", *span, "--enqueue", stdout=StringIO())
    sent = sorted(message.kwargs[SLOT_KWARG] for message in queue.pending())
    assert sent == [(start + n * SECOND).isoformat() for n in range(4)]
    assert consume(queue) == 4
    assert sorted(jobs.executed) == [f"tests.huey.tick {slot} 1" for slot in sent]


# -- retries and copies ---------------------------------------------------------------


def test_retries__each_retry_is_the_next_attempt_of_one_row(jobs, queue):
    slot = latest(SECOND) - 10 * SECOND
    enqueue_for_slot(jobs.flaky, slot, failures=1)
    assert consume(queue) == 2  # the failure, then Huey's retry
    run = row("tests.huey.flaky")
    assert (run.state, run.attempt, run.duplicates) == (RunState.SUCCEEDED, 2, 0)
    assert jobs.executed == [f"tests.huey.flaky {slot.isoformat()} {n}" for n in (1, 2)]
    states = list(run.transitions.order_by("id").values_list("to_state", flat=True))
    assert states == ["running", "retrying", "running", "succeeded"]


def test_retries__the_last_failure_ends_the_row_failed(jobs, queue):
    slot = latest(SECOND) - 10 * SECOND
    enqueue_for_slot(jobs.flaky, slot, failures=5)
    assert consume(queue) == 3  # retries=2: three attempts
    run = row("tests.huey.flaky")
    assert (run.state, run.attempt) == (RunState.FAILED, 3)
    assert "attempt 3 fails" in run.error


def test_once_per_key__a_retry_is_the_next_attempt_a_second_send_a_duplicate(jobs, queue):
    jobs.charge(order_id=7)
    assert consume(queue) == 2  # the failure, then Huey's retry
    jobs.charge(order_id=7)  # sent again after it succeeded: the key is done
    assert consume(queue) == 1
    run = TaskRun.objects.get(task_name="tests.huey.charge")
    assert (run.key, run.state, run.attempt, run.duplicates) == (
        "order:7",
        RunState.SUCCEEDED,
        2,
        1,
    )
    assert jobs.executed == ["tests.huey.charge order:7 1", "tests.huey.charge order:7 2"]


def test_retry_task__the_next_attempt_of_one_row(jobs, queue):
    slot = latest(SECOND) - 10 * SECOND
    enqueue_for_slot(jobs.raising, slot, kind="retry")  # retries=0: RetryTask still retries
    assert consume(queue) == 2
    run = row("tests.huey.raising")
    assert (run.state, run.attempt, run.duplicates) == (RunState.SUCCEEDED, 2, 0)
    assert "RetryTask" in run.transitions.get(to_state=RunState.RETRYING).reason


def test_cancel_execution__the_slot_is_skipped_with_the_reason(jobs, queue):
    slot = latest(SECOND) - 10 * SECOND
    enqueue_for_slot(jobs.raising, slot, kind="cancel")
    assert consume(queue) == 1  # Huey does not retry it
    run = row("tests.huey.raising")
    assert (run.state, run.attempt) == (RunState.SKIPPED, 1)
    assert "CancelExecution" in run.transitions.get(to_state=RunState.SKIPPED).reason


@pytest.mark.parametrize(
    ("exc", "retries", "expected"),
    [
        (OSError("down"), 2, ("retrying", 1, 0.0)),
        (OSError("down"), 0, None),
        (RetryTask("again", delay=5), 0, ("retrying", 0, 5.0)),  # Huey adds one, takes one
        (CancelExecution("no", retry=False), 2, ("skipped", None, None)),
        (CancelExecution("no"), 2, ("retrying", 1, 0.0)),
        (CancelExecution("no"), 0, ("skipped", None, None)),
        (RateLimitExceeded("k", 3, retry=True), 0, ("retrying", 0, 3.0)),
        (RateLimitExceeded("k", 3, retry=False), 1, ("retrying", 0, 3.0)),
        (RateLimitExceeded("k", 3, retry=False), 0, None),
    ],
)
def test_classify_raise__what_huey_does_next(exc, retries, expected):
    """Each outcome as Huey's ``_execute`` treats the exception (the retry's count left)."""
    task = MemoryHuey("classify").task()(lambda: None).s(retries=retries)
    ending = classify_raise(task, exc)
    if expected is None:
        assert ending is None
        return
    state, left, within = expected
    assert ending.state == state
    assert ending.retry_by == (None if left is None else f"{task.id}/{left}")
    assert ending.retry_within == within


@pytest.mark.parametrize("hooked", [False, True], ids=["not-installed", "installed"])
def test_install__without_the_hooks_a_retry_is_a_duplicate_with_them_an_attempt(
    redis_server: RedisServer, hooked: bool
):
    """A Huey instance of one's own: before install(), the retry finds its slot failed."""
    slot = latest(SECOND) - 10 * SECOND
    own = RedisHuey("own", url=redis_server.url)
    if hooked:
        install(own)
    ran: list[int] = []

    def body() -> None:
        ran.append(1)
        if len(ran) == 1:
            raise OSError("the first attempt fails")

    task = own.task(retries=1)(once_per_schedule(name="tests.huey.own")(body))
    enqueue_for_slot(task, slot)
    assert consume(own) == 2
    run = row("tests.huey.own")
    seen = (len(ran), run.state, run.attempt, run.duplicates)
    if hooked:
        assert seen == (2, RunState.SUCCEEDED, 2, 0)
    else:
        assert seen == (1, RunState.FAILED, 1, 1)


@pytest.mark.file_and_server
@pytest.mark.processes
def test_install__a_workers_start_runs_the_startup_cleanup_when_it_is_on():
    """Huey's worker calls its start-up hooks (``Worker.initialize``): this host's runs
    whose process is gone are abandoned, with STARTUP_CLEANUP on only."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead = Owner(socket.gethostname(), int(gone.stdout), pid_space(), "aa").format()
    run = make_run(minute=0, owner=dead, lease=3600)
    own = MemoryHuey("startup")
    install(own)
    worker = Worker(own, threading.Event(), 0.1, 1.0, 1.15)
    worker.initialize()
    assert TaskRun.objects.get(pk=run.pk).state == RunState.RUNNING
    with override_settings(TASKGUARD={"BACKEND": "database", "STARTUP_CLEANUP": True}):
        worker.initialize()
    assert TaskRun.objects.get(pk=run.pk).state == RunState.ABANDONED


def test_delivered_twice__the_copy_is_a_counted_duplicate(jobs, queue):
    slot = latest(SECOND) - 10 * SECOND
    message = signature_for_slot(jobs.once, slot)
    queue.enqueue(message)
    queue.enqueue(message)  # the same message (id, retries) delivered again
    assert consume(queue) == 2
    run = row("tests.huey.once")
    assert (run.state, run.attempt, run.duplicates) == (RunState.SUCCEEDED, 1, 1)
    assert jobs.executed == [f"tests.huey.once {slot.isoformat()} 1"]


def test_delivered_twice__a_copy_of_the_failed_attempt_is_not_its_retry(jobs, queue):
    """The first message fails (its retry, one retry fewer, goes to the queue's end); the
    copy of the first message comes before the retry: a duplicate, not attempt 2."""
    slot = latest(SECOND) - 10 * SECOND
    message = signature_for_slot(jobs.flaky, slot, failures=1)
    assert message_id(message) == f"{message.id}/2"
    queue.enqueue(message)
    queue.enqueue(message)
    assert consume(queue) == 3
    run = row("tests.huey.flaky")
    assert (run.state, run.attempt, run.duplicates) == (RunState.SUCCEEDED, 2, 1)
    assert [line.split()[2] for line in jobs.executed] == ["1", "2"]


# -- periodic() -----------------------------------------------------------------------


def test_periodic__stamps_each_slot_once_per_process_and_the_ledger_runs_it(jobs, queue):
    now = datetime.now(timezone.utc).replace(tzinfo=None)  # Huey's clock: naive UTC
    slot = minute_of(now)
    due = [task for task in queue.read_periodic(now) if type(task).__name__ == "beat"]
    assert [task.kwargs for task in due] == [{SLOT_KWARG: slot.isoformat()}]
    assert not [t for t in queue.read_periodic(now) if type(t).__name__ == "beat"]  # said once
    # Another consumer stamps the same slot: the ledger runs one of the two.
    queue.enqueue(due[0])
    queue.enqueue(jobs.beat.s(**{SLOT_KWARG: slot.isoformat()}))
    assert consume(queue) == 2
    run = row("tests.huey.beat")
    assert (run.slot, run.state, run.duplicates) == (slot, RunState.SUCCEEDED, 1)
    later = [t for t in queue.read_periodic(now + MINUTE) if type(t).__name__ == "beat"]
    assert [task.kwargs for task in later] == [{SLOT_KWARG: (slot + MINUTE).isoformat()}]


def test_periodic__slots_between_two_looks_are_sent_within_the_grace(jobs, queue):
    """A scheduler that fell behind: the slots it passed are sent as run_schedules would
    (catchup="latest": those within the grace, 5 minutes by default)."""
    now = datetime.now(timezone.utc).replace(tzinfo=None)
    slot = minute_of(now)
    assert [t for t in queue.read_periodic(now) if type(t).__name__ == "beat"]
    later = [t for t in queue.read_periodic(now + 8 * MINUTE) if type(t).__name__ == "beat"]
    assert [task.kwargs[SLOT_KWARG] for task in later] == [(slot + 8 * MINUTE).isoformat()]
    between = sorted(message.kwargs[SLOT_KWARG] for message in queue.pending())
    # 8 minutes later: slots +1 .. +7 passed; those within 5 minutes of the look are sent.
    look = now.replace(tzinfo=timezone.utc) + 8 * MINUTE
    passed = [slot + n * MINUTE for n in range(1, 8)]
    within = [each.isoformat() for each in passed if look - each <= 5 * MINUTE]
    assert between == within
    assert 4 <= len(within) <= 5


def test_periodic__a_passed_slot_that_cannot_be_sent_is_logged_not_raised(caplog):
    """Raising would end the consumer's scheduler: the newest slot is still returned."""
    down = RedisHuey("down", url=huey_app.NOWHERE)  # nothing listens there
    guarded = once_per_schedule(every=MINUTE, name="tests.huey.down")(lambda: None)
    try:
        task = periodic(down)(guarded)
        now = datetime.now(timezone.utc).replace(tzinfo=None)
        assert down.read_periodic(now)
        with caplog.at_level(logging.ERROR, logger="taskguard.huey"):
            (due,) = down.read_periodic(now + 2 * MINUTE)
        slot = minute_of(now)
        assert due.kwargs == {SLOT_KWARG: (slot + 2 * MINUTE).isoformat()}
        failed = [r for r in caplog.records if r.event == "huey.send_failed"]
        assert [r.slot for r in failed] == [(slot + MINUTE).isoformat()]
        task.unregister()
    finally:
        registry.unregister("tests.huey.down")


def test_periodic__refuses_what_has_no_schedule_or_is_too_frequent(queue):
    with pytest.raises(InvalidSchedule, match="goes above @once_per_schedule"):
        periodic(queue)(lambda: None)
    with pytest.raises(InvalidSchedule, match="goes above @once_per_schedule"):
        periodic(queue)(once_per_schedule(name="tests.huey.noschedule")(lambda: None))
    frequent = once_per_schedule(every=10 * SECOND, name="tests.huey.frequent")(lambda: None)
    try:
        with pytest.raises(InvalidSchedule, match="closer together than a Huey consumer"):
            periodic(queue)(frequent)
    finally:
        registry.unregister("tests.huey.frequent")
    with pytest.raises(InvalidSchedule, match="sets validate_datetime itself"):
        periodic(queue, validate_datetime=lambda timestamp: True)


def test_retry_task__a_naive_eta_is_local_time_as_huey_reads_it() -> None:
    # Huey's normalize_time takes a naive eta as local time (Django sets it to TIME_ZONE):
    # two hours ahead there is two hours ahead, not hours earlier (west of UTC).
    from datetime import datetime

    from django.test import override_settings

    from django_taskguard.contrib.huey.worker import _until

    with override_settings(TIME_ZONE="America/New_York"):
        eta = datetime.now() + timedelta(hours=2)  # naive, local
        assert 7100 < (_until(eta, None) or 0) <= 7200


def test_install__the_upkeep_starts_after_a_task_even_an_unguarded_one(queue):
    """A Huey-only deployment's upkeep: the post-execute hook starts it (a thread) when this
    process is due, after any task (guard.run starts it too, but only for guarded ones)."""
    from django_taskguard import upkeep

    @queue.task()
    def plain() -> None:
        pass

    taskguard = {"BACKEND": "database", "UPKEEP_INTERVAL_SECONDS": 5}
    with override_settings(TASKGUARD=taskguard):
        upkeep.forget()  # on, as in a consumer outside the test environment
        try:
            plain()
            assert consume(queue) == 1
            assert upkeep._gate.thread is not None  # started by the hook, after the task
        finally:
            upkeep.join(timeout=30)
            upkeep.forget(off=True)  # as conftest leaves the test process
