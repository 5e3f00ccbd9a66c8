"""Dramatiq in this process, on Dramatiq's own ``StubBroker`` and ``Worker``: the slot rides
in the message options, ``Retries``' retries are attempts of one row, a message delivered
twice is a counted duplicate, and ``run_schedules --enqueue`` sends due slots to actors.
Real worker processes on a Redis broker: tests/test_dramatiq_e2e.py."""

from __future__ import annotations

import importlib
import logging
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta
from importlib.util import find_spec
from io import StringIO
from types import ModuleType
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings
from django.utils import timezone

from django_taskguard import registry
from django_taskguard.exceptions import InvalidSchedule, TaskGuardError
from django_taskguard.models import RunState, TaskRun, TaskSchedule
from django_taskguard.owner import Owner, pid_space

from .support.runs import make_run
from .support.waiting import wait_for

pytestmark = [
    pytest.mark.dialect,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not find_spec("dramatiq"), reason="needs dramatiq"),
]
SECOND = timedelta(seconds=1)
MINUTE = timedelta(minutes=1)
JOBS = {"TASKGUARD": {"BACKEND": "database", "SCHEDULE_MODULES": ["tests.support.dramatiq_jobs"]}}


@pytest.fixture
def jobs() -> Iterator[ModuleType]:
    """tests/support/dramatiq_jobs.py on a fresh StubBroker; its schedules forgotten after."""
    before = set(registry.entries())
    module = importlib.reload(importlib.import_module("tests.support.dramatiq_jobs"))
    module.executed.clear()
    module.release.clear()
    yield module
    module.release.set()
    module.broker.close()
    for name in set(registry.entries()) - before:
        registry.unregister(name)


@pytest.fixture
def worker(jobs: ModuleType) -> Iterator[Any]:
    """A Dramatiq worker (one thread) on the jobs' stub broker."""
    import dramatiq

    running = dramatiq.Worker(jobs.broker, worker_timeout=50, worker_threads=1)
    running.start()
    yield running
    jobs.release.set()
    running.stop()


def latest(every: timedelta) -> datetime:
    now = timezone.now()
    epoch = datetime(1970, 1, 1, tzinfo=now.tzinfo)
    return now - (now - epoch) % every


def drain(jobs: ModuleType, worker: Any, queue: str = "default") -> None:
    jobs.broker.join(queue, timeout=30_000, fail_fast=False)
    worker.join()


def rows(task_name: str, **where: Any) -> bool:
    return TaskRun.objects.filter(task_name=task_name, **where).exists()


def transitions(run: TaskRun) -> list[tuple[str, str]]:
    return list(run.transitions.order_by("id").values_list("from_state", "to_state"))


# -- the message --------------------------------------------------------------------------


def test_send_for_slot__the_slot_rides_in_the_options_and_is_claimed_not_recomputed(jobs, worker):
    from dramatiq import Message

    from django_taskguard.contrib.dramatiq import SLOT_OPTION, send_for_slot

    slot = latest(SECOND) - 30 * SECOND
    sent = send_for_slot(jobs.once, slot, 7)
    assert (sent.args, sent.kwargs) == ((7,), {})  # the arguments are the actor's own
    queued = Message.decode(jobs.broker.queues["default"].queue[0])
    assert queued.options[SLOT_OPTION] == slot.isoformat()
    assert queued.args == (7,) and queued.kwargs == {}

    drain(jobs, worker)
    run = TaskRun.objects.get(task_name="tests.dramatiq.once")
    assert (run.slot, run.state, run.attempt) == (slot, RunState.SUCCEEDED, 1)
    assert jobs.executed == [f"tests.dramatiq.once {slot.isoformat()} 1"]


def test_send_for_slot__refuses_what_cannot_carry_a_slot(jobs):
    import dramatiq
    from dramatiq.brokers.stub import StubBroker

    from django_taskguard.contrib.dramatiq import message_options, send_for_slot

    bare = StubBroker()  # no TaskguardMiddleware
    try:

        @dramatiq.actor(broker=bare, actor_name="unguarded")
        def unguarded() -> None: ...

        with pytest.raises(TaskGuardError, match="decorated with @once_per_schedule"):
            send_for_slot(unguarded, latest(SECOND))
        guarded = dramatiq.actor(jobs.once.fn, broker=bare, actor_name="guarded")
        with pytest.raises(TaskGuardError, match="has no TaskguardMiddleware"):
            send_for_slot(guarded, latest(SECOND))
    finally:
        bare.close()
    with pytest.raises(InvalidSchedule, match="timezone-aware"):
        send_for_slot(jobs.once, datetime(2026, 1, 1, 12))
    with pytest.raises(TaskGuardError, match="together"):
        message_options(latest(SECOND), schedule="x[y]")
    with pytest.raises(TaskGuardError, match="whole number"):
        message_options(latest(SECOND), schedule="x[y]", version=0)
    assert not jobs.broker.queues["default"].qsize()


def test_data_schedule_option__the_run_is_recorded_under_its_identity_and_version(jobs, worker):
    from django_taskguard.contrib.dramatiq import message_options

    slot = latest(SECOND) - 10 * SECOND
    options = message_options(slot, schedule="tests.dramatiq.once[nightly]", version=3)
    jobs.once.send_with_options(args=(1,), **options)
    drain(jobs, worker)
    run = TaskRun.objects.get(slot=slot)
    assert (run.task_name, run.state, run.schedule_version) == (
        "tests.dramatiq.once[nightly]",
        RunState.SUCCEEDED,
        3,
    )


# -- retries and redeliveries -------------------------------------------------------------


def test_retries__the_retry_is_the_next_attempt_of_the_same_row(jobs, worker):
    from django_taskguard.contrib.dramatiq import send_for_slot

    slot = latest(SECOND) - 5 * SECOND
    send_for_slot(jobs.flaky, slot)
    drain(jobs, worker)
    (run,) = TaskRun.objects.filter(task_name="tests.dramatiq.flaky")
    assert (run.slot, run.state, run.attempt, run.duplicates) == (
        slot,
        RunState.SUCCEEDED,
        2,
        0,
    )
    assert transitions(run) == [
        ("pending", "running"),
        ("running", "retrying"),
        ("retrying", "running"),
        ("running", "succeeded"),
    ]
    assert jobs.executed == [f"tests.dramatiq.flaky {slot.isoformat()} {n}" for n in (1, 2)]


def test_retries__exhausted_is_failed_and_throws_is_no_retry(jobs, worker):
    from django_taskguard.contrib.dramatiq import send_for_slot

    slot = latest(SECOND) - 5 * SECOND
    send_for_slot(jobs.flaky, slot, fail_attempts=10)  # max_retries=3: four attempts
    send_for_slot(jobs.throws, slot)
    drain(jobs, worker)
    flaky = TaskRun.objects.get(task_name="tests.dramatiq.flaky")
    assert (flaky.state, flaky.attempt) == (RunState.FAILED, 4)
    assert [to for _, to in transitions(flaky)].count("retrying") == 3
    assert "OSError: attempt 4 fails" in flaky.error
    throws = TaskRun.objects.get(task_name="tests.dramatiq.throws")
    assert (throws.state, throws.attempt) == (RunState.FAILED, 1)
    assert "ValueError" in throws.error


def test_delivered_twice__the_second_delivery_is_a_counted_duplicate(jobs, worker):
    from django_taskguard.contrib.dramatiq import message_options

    slot = latest(SECOND) - 5 * SECOND
    message = jobs.once.message_with_options(args=(1,), **message_options(slot))
    jobs.broker.enqueue(message)
    jobs.broker.enqueue(message)  # the same message id and retry count, delivered again
    drain(jobs, worker)
    run = TaskRun.objects.get(task_name="tests.dramatiq.once")
    assert (run.state, run.attempt, run.duplicates) == (RunState.SUCCEEDED, 1, 1)
    assert jobs.executed == [f"tests.dramatiq.once {slot.isoformat()} 1"]


def test_stale_copy_of_a_retried_message__a_counted_duplicate_not_the_retry(jobs, worker):
    """The attempt asked for a retry (message id, retry 1, ten minutes away); a copy of the
    message it ran from (retry 0) comes back first: it does not start attempt 2."""
    from django_taskguard.contrib.dramatiq import message_key, message_options

    slot = latest(SECOND) - 5 * SECOND
    message = jobs.later.message_with_options(**message_options(slot))
    jobs.broker.enqueue(message)
    # The retry waits in the delay queue for ten minutes: the queue itself is not joined.
    wait_for(lambda: rows("tests.dramatiq.later", state=RunState.RETRYING), what="a retry")
    run = TaskRun.objects.get(task_name="tests.dramatiq.later")
    assert run.retry_by == message_key(message.message_id, 1)

    jobs.broker.enqueue(message)
    wait_for(lambda: rows("tests.dramatiq.later", duplicates=1), what="the copy counted")
    jobs.broker.queues["default"].join()  # nothing left to process but the retry
    run.refresh_from_db()
    assert (run.state, run.attempt, run.duplicates) == (RunState.RETRYING, 1, 1)
    assert jobs.executed == [f"tests.dramatiq.later {slot.isoformat()} 1"]


def test_put_back__on_stale_retry_a_copy_that_meets_a_live_run_comes_back_later(jobs, caplog):
    """A copy delivered while the first delivery runs is sent again (same id and retry
    count, ``taskguard_deferred``), due after the lease; back at a finished slot, counted."""
    import dramatiq

    from django_taskguard.contrib.dramatiq import message_options

    worker = dramatiq.Worker(jobs.broker, worker_timeout=50, worker_threads=2)
    worker.start()
    try:
        slot = latest(SECOND) - 5 * SECOND
        message = jobs.hold_retry.message_with_options(**message_options(slot))
        jobs.broker.enqueue(message)
        wait_for(lambda: jobs.executed, what="the first delivery's run")
        jobs.broker.enqueue(message)  # delivered again while it runs

        def deferred() -> list[logging.LogRecord]:
            return [r for r in caplog.records if getattr(r, "event", "") == "message.deferred"]

        wait_for(deferred, what="the copy put back")
        run = TaskRun.objects.get(task_name="tests.dramatiq.hold_retry")
        assert (run.state, run.duplicates) == (RunState.RUNNING, 0)  # not counted: put back
        assert message.message_id in deferred()[0].getMessage()
        jobs.release.set()
        drain(jobs, worker)
    finally:
        jobs.release.set()
        worker.stop()
    run.refresh_from_db()
    assert (run.state, run.attempt, run.duplicates) == (RunState.SUCCEEDED, 1, 1)
    assert jobs.executed == [f"tests.dramatiq.hold_retry {slot.isoformat()} 1"]


def test_once_per_key__a_retry_is_an_attempt_and_a_second_send_a_duplicate(jobs, worker):
    jobs.charge.send(-1)
    jobs.charge.send(-1)
    drain(jobs, worker)
    run = TaskRun.objects.get(task_name="tests.dramatiq.charge")
    assert (run.key, run.state, run.attempt, run.duplicates) == (
        "order:-1",
        RunState.SUCCEEDED,
        2,
        1,
    )
    assert jobs.executed == ["tests.dramatiq.charge order:-1 1", "tests.dramatiq.charge order:-1 2"]


@pytest.mark.file_and_server
@pytest.mark.processes
def test_worker_boot__runs_the_startup_cleanup_when_the_setting_asks(jobs):
    """A worker process that boots abandons this host's runs whose process is gone."""
    import dramatiq

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    owner = Owner(socket.gethostname(), int(gone.stdout), pid_space(), "aa").format()
    run = make_run(minute=0, owner=owner, lease=3600)
    for wanted in (False, True):
        settings = {"BACKEND": "database", "STARTUP_CLEANUP": wanted}
        with override_settings(TASKGUARD=settings):
            worker = dramatiq.Worker(jobs.broker, worker_timeout=50, worker_threads=1)
            worker.start()
            worker.stop()
        run.refresh_from_db()
        assert run.state == (RunState.ABANDONED if wanted else RunState.RUNNING)


# -- run_schedules --enqueue --------------------------------------------------------------


def first_seen_ago(*names: str, minutes: int = 2) -> None:
    registry.sync()
    TaskSchedule.objects.filter(task_name__in=names).update(
        first_seen=timezone.now() - timedelta(minutes=minutes), swept_until=None
    )


@override_settings(**JOBS)
def test_run_schedules_enqueue__two_copies_send_each_due_slot_to_the_actor_once(jobs):
    from dramatiq import Message

    from django_taskguard.contrib.dramatiq import SLOT_OPTION

    first_seen_ago("tests.dramatiq.tick")
    args = ["--enqueue", "--once", "--task", "tests.dramatiq.tick"]
    for _ in range(2):
        call_command("run_schedules", *args, stdout=StringIO())
    queue = jobs.broker.queues["default"].queue
    sent = [Message.decode(data) for data in queue]
    assert sent and {m.actor_name for m in sent} == {"tick"}
    slots = [m.options[SLOT_OPTION] for m in sent]
    assert len(slots) == len(set(slots)), f"a slot was sent twice: {slots}"
    assert all(m.args == () and m.kwargs == {} for m in sent)
    rows = TaskRun.objects.filter(task_name="tests.dramatiq.tick")
    assert sorted(run.slot.isoformat() for run in rows) == sorted(slots)
    assert set(rows.values_list("state", flat=True)) == {RunState.PENDING}


@override_settings(**JOBS)
def test_run_schedules_enqueue__refuses_a_schedule_no_actor_wraps(jobs):
    with pytest.raises(CommandError, match=r"tests\.dramatiq\.plain.* not wrapped"):
        call_command("run_schedules", "--enqueue", "--once", stdout=StringIO())
    assert not TaskRun.objects.exists()


@override_settings(**JOBS)
def test_backfill_enqueue__each_slot_without_a_row_is_sent_to_the_actor(jobs):
    from dramatiq import Message

    from django_taskguard.contrib.dramatiq import SLOT_OPTION

    first_seen_ago("tests.dramatiq.tick", minutes=10)
    end = latest(SECOND) - 60 * SECOND
    start = end - 4 * SECOND
    TaskRun.objects.create(task_name="tests.dramatiq.tick", slot=start, state=RunState.SUCCEEDED)
    args = ["tests.dramatiq.tick", "--from", start.isoformat(), "--to", end.isoformat()]
    call_command("backfill", *args, "--enqueue", stdout=StringIO())
    sent = [Message.decode(data) for data in jobs.broker.queues["default"].queue]
    assert [m.options[SLOT_OPTION] for m in sent] == [
        (start + n * SECOND).isoformat() for n in range(1, 5)
    ]
    rows = TaskRun.objects.filter(task_name="tests.dramatiq.tick").exclude(slot=start)
    assert set(rows.values_list("state", flat=True)) == {RunState.PENDING}


@override_settings(**JOBS)
def test_backfill_enqueue__catchup_none_runs_the_past_slots_as_backfill_here_does(jobs, worker):
    """Backfill is an operator's request for past slots: the worker runs each slot it was
    sent whatever catchup="none" says of a late call, as backfill without --enqueue runs
    them here (not one recorded missed)."""
    end = latest(MINUTE) - 10 * MINUTE  # long past the 5 s grace
    start = end - 2 * MINUTE
    args = ["tests.dramatiq.strict", "--from", start.isoformat(), "--to", end.isoformat()]
    call_command("backfill", *args, "--enqueue", stdout=StringIO())
    drain(jobs, worker, "strict")
    slots = [(start + n * MINUTE).isoformat() for n in range(3)]
    assert sorted(jobs.executed) == [f"tests.dramatiq.strict {slot} 1" for slot in slots]
    runs = TaskRun.objects.filter(task_name="tests.dramatiq.strict").order_by("slot")
    assert [run.state for run in runs] == [RunState.SUCCEEDED] * 3


def test_async_actor__claims_the_slot_its_message_carries(jobs, worker):
    from django_taskguard.contrib.dramatiq import send_for_slot

    slot = latest(MINUTE) - 3 * MINUTE
    send_for_slot(jobs.atick, slot)
    send_for_slot(jobs.atick, slot)
    drain(jobs, worker)
    run = TaskRun.objects.get(task_name="tests.dramatiq.atick")
    assert (run.slot, run.state, run.attempt, run.duplicates) == (slot, RunState.SUCCEEDED, 1, 1)
    assert jobs.executed == [f"tests.dramatiq.atick {slot.isoformat()} 1"]


@override_settings(**JOBS)
def test_run_schedules_enqueue__finds_an_async_actor_too(jobs):
    from dramatiq import Message

    from django_taskguard.contrib.dramatiq import SLOT_OPTION

    first_seen_ago("tests.dramatiq.atick", minutes=3)
    args = ["--enqueue", "--once", "--task", "tests.dramatiq.atick"]
    call_command("run_schedules", *args, stdout=StringIO())
    (sent,) = [Message.decode(data) for data in jobs.broker.queues["default"].queue]
    run = TaskRun.objects.get(task_name="tests.dramatiq.atick")
    assert (sent.actor_name, sent.options[SLOT_OPTION]) == ("atick", run.slot.isoformat())
    assert run.state == RunState.PENDING
