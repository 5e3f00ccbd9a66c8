"""django.tasks composition in this process: ``@task()`` over ``@once_per_schedule`` and
``@once_per_key``, the slot that travels with an enqueued task, ``run_schedules --enqueue``
and ``backfill --enqueue`` on the Immediate and Dummy backends, and the ledger of a slot
enqueued and never run. Real worker processes: tests/test_contrib_tasks_e2e.py."""

from __future__ import annotations

import dataclasses
import importlib
from collections import Counter
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

from django_taskguard import guard, ledger, once_per_key, once_per_schedule, registry
from django_taskguard.contrib.tasks import SLOT_KWARG, enqueue_for_slot
from django_taskguard.exceptions import InvalidSchedule, TaskGuardError
from django_taskguard.handoff import hand_off
from django_taskguard.missed import sweep_missed
from django_taskguard.models import RunState, TaskRun, TaskSchedule
from django_taskguard.testing import freeze_now

TASKS_MODULE = next((m for m in ("django.tasks", "django_tasks") if find_spec(m)), None)
# A mark, not a module-level skip: the version matrix names a test of this module by its
# id, and Django 4.2 (no django.tasks) must skip it, not fail to collect it.
pytestmark = [
    pytest.mark.dialect,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(TASKS_MODULE is None, reason="needs django.tasks or django-tasks"),
]
SECOND = timedelta(seconds=1)
MINUTE = timedelta(minutes=1)
JOBS = {"TASKGUARD": {"BACKEND": "database", "SCHEDULE_MODULES": ["tests.support.djtasks_jobs"]}}


@pytest.fixture
def jobs() -> Iterator[ModuleType]:
    """tests/support/djtasks_jobs.py, freshly decorated; its schedules forgotten afterwards."""
    before = set(registry.entries())
    module = importlib.reload(importlib.import_module("tests.support.djtasks_jobs"))
    module.executed.clear()
    yield module
    for name in set(registry.entries()) - before:
        registry.unregister(name)


@pytest.fixture
def enqueued() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """The function's name and the kwargs of every task enqueued, from any thread (the
    backends are per thread)."""
    signals = importlib.import_module(f"{TASKS_MODULE}.signals")
    seen: list[tuple[str, dict[str, Any]]] = []

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        path = getattr(task_result.task, "module_path", None) or repr(task_result.task)
        seen.append((path.rpartition(".")[2], dict(task_result.kwargs)))

    signals.task_enqueued.connect(receiver, weak=False)
    yield seen
    signals.task_enqueued.disconnect(receiver)


def latest(every: timedelta) -> datetime:
    now = timezone.now()
    epoch = datetime(1970, 1, 1, tzinfo=now.tzinfo)
    return now - (now - epoch) % every


def first_seen_ago(*names: str, minutes: int = 2) -> None:
    """As if the schedules were deployed ``minutes`` ago (run_schedules fires no slot
    from before a schedule was first seen)."""
    registry.sync()
    TaskSchedule.objects.filter(task_name__in=names).update(
        first_seen=timezone.now() - timedelta(minutes=minutes), swept_until=None
    )


# -- composition --------------------------------------------------------------------


@pytest.mark.smoke  # the version matrix's smoke set (scripts/matrix.sh)
def test_enqueue_for_slot__the_slot_travels_and_is_claimed_not_recomputed(jobs):
    slot = latest(SECOND) - 30 * SECOND
    result = enqueue_for_slot(jobs.tick, slot)
    assert result.kwargs == {SLOT_KWARG: slot.isoformat()}  # JSON, in the task's kwargs
    assert result.return_value == slot.isoformat()
    run = TaskRun.objects.get(task_name="tests.djtasks.tick")
    assert (run.slot, run.state) == (slot, RunState.SUCCEEDED)

    again = enqueue_for_slot(jobs.tick, slot.isoformat())  # the same slot, as ISO text
    assert again.return_value is None
    assert jobs.executed == [f"tests.djtasks.tick {slot.isoformat()}"]
    assert TaskRun.objects.get(task_name="tests.djtasks.tick").duplicates == 1


def test_enqueue_for_slot__a_coroutine_function_gets_its_carried_slot(jobs):
    slot = latest(MINUTE) - 3 * MINUTE
    assert enqueue_for_slot(jobs.atick, slot).return_value == slot.isoformat()
    assert enqueue_for_slot(jobs.atick, slot).return_value is None  # the slot is done
    run = TaskRun.objects.get(task_name="tests.djtasks.atick")
    assert (run.slot, run.state, run.duplicates) == (slot, RunState.SUCCEEDED, 1)
    assert jobs.executed == [f"tests.djtasks.atick {slot.isoformat()}"]


def test_task__enqueued_without_a_slot_runs_the_schedules_latest(jobs):
    result = jobs.tick.enqueue()
    run = TaskRun.objects.get(task_name="tests.djtasks.tick")
    assert result.return_value == run.slot.isoformat()
    assert run.slot <= timezone.now() < run.slot + 2 * SECOND


def test_enqueue_for_slot__refuses_what_it_cannot_carry(jobs):
    with pytest.raises(InvalidSchedule, match="timezone-aware"):
        enqueue_for_slot(jobs.tick, datetime(2024, 1, 1, 12))
    with pytest.raises(TaskGuardError, match="decorated with @once_per_schedule"):
        enqueue_for_slot(jobs.charge, latest(SECOND), order_id=1)
    with pytest.raises(TaskGuardError, match="decorated with @once_per_schedule"):
        enqueue_for_slot(jobs.plain, latest(MINUTE))
    with pytest.raises(TaskGuardError, match="not _taskguard_slot="):
        enqueue_for_slot(jobs.tick, latest(SECOND), _taskguard_slot="2024-01-01T00:00:00Z")
    assert not TaskRun.objects.exists()


def test_once_per_key__under_task_the_key_travels_in_the_arguments(jobs):
    first = jobs.charge.enqueue(order_id=7)
    second = jobs.charge.enqueue(order_id=7)
    other = jobs.charge.enqueue(order_id=8)
    assert (first.return_value, second.return_value, other.return_value) == (7, None, 8)
    assert jobs.executed == ["tests.djtasks.charge order:7", "tests.djtasks.charge order:8"]
    rows = {run.key: run for run in TaskRun.objects.filter(task_name="tests.djtasks.charge")}
    assert {key: run.duplicates for key, run in rows.items()} == {"order:7": 1, "order:8": 0}


def test_decorators__above_a_task_refused_with_the_order_to_use(jobs):
    with pytest.raises(InvalidSchedule, match=r"put it under the task decorator: @task\(\) on"):
        once_per_schedule(every=SECOND)(jobs.tick)
    with pytest.raises(InvalidSchedule, match="put it under the task decorator"):
        once_per_key(key="order:{order_id}")(jobs.charge)


# -- the registry, run_schedules --enqueue, backfill --enqueue ------------------------


@override_settings(**JOBS)
def test_discover__knows_which_schedules_a_task_wraps(jobs):
    found = registry.discover()
    assert found["tests.djtasks.tick"].enqueue is not None
    assert found["tests.djtasks.parked"].enqueue is not None
    assert found["tests.djtasks.plain"].enqueue is None
    assert "tests.djtasks.charge" not in found  # keyed: not a schedule


@override_settings(**JOBS)
def test_run_schedules_enqueue__refuses_a_schedule_no_task_wraps(jobs):
    with pytest.raises(CommandError, match=r"tests\.djtasks\.plain.* not wrapped by a task queue"):
        call_command("run_schedules", "--enqueue", "--once", stdout=StringIO())
    assert not TaskRun.objects.exists()


@override_settings(**JOBS)
def test_run_schedules_enqueue__without_any_task_queue_is_a_command_error(jobs, monkeypatch):
    monkeypatch.setattr(registry, "QUEUE_FINDERS", [])
    with pytest.raises(CommandError, match=r"hands slots to a task queue: django\.tasks"):
        call_command("run_schedules", "--enqueue", "--once", stdout=StringIO())


@override_settings(**JOBS)
def test_run_schedules_enqueue__one_task_per_slot_across_copies(jobs, enqueued):
    """Two --once runs (two copies): each slot is enqueued once. tick's backend runs it at
    once (Immediate); parked's never does (Dummy): its row stays pending."""
    first_seen_ago("tests.djtasks.tick", "tests.djtasks.parked")
    args = ["--enqueue", "--once", "--task", "tests.djtasks.tick", "--task", "tests.djtasks.parked"]
    for _ in range(2):
        call_command("run_schedules", *args, stdout=StringIO())

    # By task and slot: tick's (every second) and parked's (every minute) share a slot at
    # each minute's start.
    sent = Counter((name, kwargs[SLOT_KWARG]) for name, kwargs in enqueued)
    assert set(sent.values()) == {1}, f"a slot was enqueued twice: {sent}"
    rows = TaskRun.objects.filter(task_name__startswith="tests.djtasks.")
    states = {(run.task_name, run.slot.isoformat()): run.state for run in rows}
    assert sorted((name.rpartition(".")[2], slot) for name, slot in states) == sorted(sent)
    assert {state for (name, _), state in states.items() if name.endswith("tick")} == {
        RunState.SUCCEEDED
    }
    assert {state for (name, _), state in states.items() if name.endswith("parked")} == {
        RunState.PENDING
    }
    assert sorted(jobs.executed) == sorted(
        f"{name} {slot}" for name, slot in states if name.endswith("tick")
    )


@override_settings(**JOBS)
def test_enqueued_never_started__the_sweep_records_it_missed_a_late_worker_still_runs_it(jobs):
    first_seen_ago("tests.djtasks.parked")
    entry = registry.entries()["tests.djtasks.parked"]
    slot = latest(MINUTE) - MINUTE
    assert hand_off(entry, slot).startswith("enqueued (django.tasks result")
    assert hand_off(entry, slot).startswith("not enqueued here")  # another copy's call
    assert ledger.read("tests.djtasks.parked", slot).state == RunState.PENDING

    result = sweep_missed(now=ledger.database_now() + 10 * MINUTE)
    run = TaskRun.objects.get(task_name="tests.djtasks.parked", slot=slot)
    assert run.state == RunState.MISSED and result.missed_slots >= 1
    assert run.error.startswith("missed: pending (handed out or given back) and not started")

    # The worker comes back late: catch-up "latest" runs a missed slot, and the log keeps it.
    jobs.parked.call(**{SLOT_KWARG: slot.isoformat()})
    run.refresh_from_db()
    steps = [(t.from_state, t.to_state) for t in run.transitions.order_by("id")]
    assert steps == [("pending", "missed"), ("missed", "running"), ("running", "succeeded")]
    assert jobs.executed == [f"tests.djtasks.parked {slot.isoformat()}"]


@override_settings(**JOBS)
def test_backfilled_never_started__ended_by_when_it_was_handed_out_not_by_its_slot(jobs):
    """A slot long past, handed out by backfill, is outside every sweep window by slot:
    it is ended once no worker started it within its grace of being handed out."""
    first_seen_ago("tests.djtasks.parked", minutes=5)
    entry = registry.entries()["tests.djtasks.parked"]
    old = latest(MINUTE) - 30 * MINUTE  # before the schedule was first seen: no sweep's
    assert hand_off(entry, old, scheduled=False).startswith("enqueued")

    sweep_missed(now=ledger.database_now())  # just handed out: within its grace
    assert ledger.read("tests.djtasks.parked", old).state == RunState.PENDING
    result = sweep_missed(now=ledger.database_now() + 10 * MINUTE)
    run = TaskRun.objects.get(task_name="tests.djtasks.parked", slot=old)
    assert run.state == RunState.MISSED and result.missed_slots >= 1
    assert run.error.startswith("missed: pending (handed out or given back) and not started")


@override_settings(**JOBS)
def test_enqueued_catchup_none__a_worker_past_the_grace_records_it_missed_not_run(jobs):
    registry.discover()
    entry = registry.entries()["tests.djtasks.strict"]
    slot = latest(MINUTE) - 2 * MINUTE  # past its 5 s grace
    assert hand_off(entry, slot, scheduled=False).startswith("enqueued")
    assert jobs.strict.call(**{SLOT_KWARG: slot.isoformat()}) is None
    run = TaskRun.objects.get(task_name="tests.djtasks.strict", slot=slot)
    assert run.state == RunState.MISSED and run.error.startswith("late: called")
    assert [(t.from_state, t.to_state) for t in run.transitions.all()] == [("pending", "missed")]
    assert jobs.executed == []


@override_settings(**JOBS)
def test_backfill_enqueue__catchup_none_runs_the_past_slots_as_backfill_here_does(jobs, enqueued):
    """Backfill is an operator's request for past slots: the worker runs each slot it
    enqueued whatever catchup="none" says of a late call, as backfill without --enqueue
    runs them here (not one recorded missed)."""
    registry.discover()
    end = latest(MINUTE) - 10 * MINUTE  # long past the 5 s grace
    start = end - 2 * MINUTE
    span = ["--from", start.isoformat(), "--to", end.isoformat()]
    call_command("backfill", "tests.djtasks.strict", *span, "--enqueue", stdout=StringIO())
    assert len(enqueued) == 3
    for _, kwargs in enqueued:  # the worker of the Dummy backend's queue
        jobs.strict.call(**kwargs)
    slots = [(start + n * MINUTE).isoformat() for n in range(3)]
    assert jobs.executed == [f"tests.djtasks.strict {slot}" for slot in slots]
    runs = TaskRun.objects.filter(task_name="tests.djtasks.strict").order_by("slot")
    assert [run.state for run in runs] == [RunState.SUCCEEDED] * 3
    # Without --enqueue: the same slots' kind run here, the same outcome.
    here = [(start - 5 * MINUTE).isoformat(), (start - 4 * MINUTE).isoformat()]
    call_command("backfill", "tests.djtasks.strict", "--from", here[0], "--to", here[1],
                 stdout=StringIO())  # fmt: skip
    assert jobs.executed[3:] == [f"tests.djtasks.strict {slot}" for slot in here]


@override_settings(**JOBS)
def test_hand_off__an_early_calls_refusal_does_not_keep_the_slot_from_the_queue(jobs):
    # Before: the `skipped` row a fast copy recorded made every on-time copy's hand-off
    # "not enqueued here": the slot never ran.
    registry.discover()
    entry = registry.entries()["tests.djtasks.parked"]
    slot = latest(MINUTE) + 10 * MINUTE
    assert guard.refused_early("tests.djtasks.parked", slot, timedelta(seconds=5))
    with freeze_now(slot):  # an on-time copy
        assert hand_off(entry, slot).startswith("enqueued")
        assert hand_off(entry, slot).startswith("not enqueued here")
        jobs.parked.call(**{SLOT_KWARG: slot.isoformat()})
    run = TaskRun.objects.get(task_name="tests.djtasks.parked", slot=slot)
    steps = [(t.from_state, t.to_state) for t in run.transitions.order_by("id")]
    assert steps == [
        ("pending", "skipped"),
        ("skipped", "pending"),
        ("pending", "running"),
        ("running", "succeeded"),
    ]
    assert jobs.executed == [f"tests.djtasks.parked {slot.isoformat()}"]


@override_settings(**JOBS)
def test_hand_off__a_failed_enqueue_gives_the_slot_back(jobs):
    registry.discover()
    entry = registry.entries()["tests.djtasks.parked"]

    def broken(slot: datetime) -> str:
        raise ConnectionError("the queue is down")

    slot = latest(MINUTE)
    with pytest.raises(ConnectionError):
        hand_off(dataclasses.replace(entry, enqueue=broken), slot)
    assert ledger.read("tests.djtasks.parked", slot) is None
    assert hand_off(entry, slot).startswith("enqueued")


@override_settings(**JOBS)
def test_hand_off__a_failed_late_enqueue_is_recorded_missed(jobs):
    """A slot handed out late (past its grace, behind the sweep's mark) whose enqueue
    raises: the sweep will not look at it again, so its row ends missed, not deleted."""
    registry.discover()
    registry.sync()
    entry = registry.entries()["tests.djtasks.parked"]

    def broken(slot: datetime) -> str:
        raise ConnectionError("the queue is down")

    slot = latest(MINUTE) - 10 * MINUTE
    TaskSchedule.objects.filter(task_name="tests.djtasks.parked").update(swept_until=slot)
    with pytest.raises(ConnectionError):
        hand_off(dataclasses.replace(entry, enqueue=broken), slot)
    sweep_missed()
    run = TaskRun.objects.get(task_name="tests.djtasks.parked", slot=slot)
    assert run.state == RunState.MISSED
    assert "enqueue failed" in run.error and "the queue is down" in run.error
    steps = [(t.from_state, t.to_state) for t in run.transitions.order_by("id")]
    assert steps == [("pending", "missed")]


@override_settings(**JOBS)
def test_backfill_enqueue__each_slot_without_a_row_once(jobs, enqueued):
    registry.discover()
    end = latest(MINUTE) - MINUTE
    start = end - 3 * MINUTE
    span = ["--from", start.isoformat(), "--to", end.isoformat()]
    out = StringIO()
    call_command("backfill", "tests.djtasks.parked", *span, "--enqueue", stdout=out)
    assert "Enqueued 4 slots" in out.getvalue()
    call_command("backfill", "tests.djtasks.parked", *span, "--enqueue", stdout=StringIO())
    assert sorted(kwargs[SLOT_KWARG] for _, kwargs in enqueued) == [
        (start + n * MINUTE).isoformat() for n in range(4)
    ]
    with pytest.raises(CommandError, match=r"not wrapped by a task queue's task"):
        call_command("backfill", "tests.djtasks.plain", *span, "--enqueue", stdout=StringIO())
