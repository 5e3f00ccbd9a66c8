"""run_schedules' data schedules, in this process: what falls due when, under edits, the
window, jitter, run now, and the per-tick cost (tests/test_data_run_schedules.py runs
real copies)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

import pytest
from django.core.management import CommandError, call_command
from django.db import connections
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_taskguard import (
    carried,
    define_schedule,
    delete_schedule,
    once_per_schedule,
    registry,
)
from django_taskguard.cron import CronSchedule
from django_taskguard.data_firing import LOOKAHEAD, DataSchedules, Due
from django_taskguard.data_schedules import jitter_offset, run_now
from django_taskguard.exceptions import BackendUnavailable
from django_taskguard.ledger import alias
from django_taskguard.ledger import schedules as store
from django_taskguard.missed import sweep_missed
from django_taskguard.models import RunState, ScheduleEvent, TaskRun, TaskSchedule
from django_taskguard.scheduler import Scheduler
from tests.support import data_targets, data_tasks  # noqa: F401  (data_tasks: a target)
from tests.support.redis_server import free_port

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]

TARGET = "tests.support.data_targets.send_report"
MINUTE = timedelta(minutes=1)


def _slots(due: list[Due], name: str) -> list[datetime]:
    return sorted(item.slot for item in due if item.task_name == name)


def _back(task_name: str, by: timedelta) -> None:
    """Make the schedule older (test set-up): created ``by`` ago."""
    TaskSchedule.objects.filter(task_name=task_name).update(
        first_seen=timezone.now() - by, swept_until=None
    )


def _changed_back(task_name: str, by: timedelta) -> None:
    """Make the schedule's newest change older (test set-up): saved ``by`` ago."""
    row = TaskSchedule.objects.get(task_name=task_name)
    at = timezone.now() - by
    TaskSchedule.objects.filter(pk=row.pk).update(changed_at=at)
    ScheduleEvent.objects.filter(task_name=task_name, version=row.version).update(at=at)


def _minute(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


def test_data__a_new_schedule_fires_no_slot_before_it_was_created() -> None:
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1])
    data = DataSchedules()
    now = timezone.now()
    assert _slots(data.load(now, start=True), row.task_name) == []
    next_slot = _minute(now) + MINUTE
    assert data.next_start() == next_slot
    assert data.due(next_slot - timedelta(microseconds=1)) == []
    assert _slots(data.due(next_slot), row.task_name) == [next_slot]
    assert data.next_start() == next_slot + MINUTE


def test_data__at_start_the_latest_slot_since_creation_fires() -> None:
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1])
    _back(row.task_name, timedelta(hours=1))
    data = DataSchedules()
    now = timezone.now()
    assert _slots(data.load(now, start=True), row.task_name) == [_minute(now)]


def test_data__an_edit_of_the_arguments_fires_the_next_slot_with_them() -> None:
    define_schedule("t1", TARGET, every=MINUTE, args=[1])
    data = DataSchedules()
    now = timezone.now()
    data.load(now, start=True)
    edited = define_schedule("t1", TARGET, every=MINUTE, args=[2])
    assert data.apply(edited, now) == []
    next_slot = _minute(now) + MINUTE
    assert data.next_start() == next_slot  # the slots did not move
    (job,) = data.jobs(data.due(next_slot), next_slot)
    assert (job.slot, job.args, job.version) == (next_slot, (2,), 2)


def test_data__an_edit_not_polled_yet_is_honoured_when_the_slot_is_read() -> None:
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1])
    data = DataSchedules()
    now = timezone.now()
    data.load(now, start=True)
    define_schedule("t1", TARGET, every=MINUTE, args=[3])  # not applied: no poll
    next_slot = _minute(now) + MINUTE
    (job,) = data.jobs(data.due(next_slot), next_slot)
    assert (job.args, job.version) == ((3,), 2)
    assert data.states[row.task_name].version == 2


def test_data__an_edit_that_moves_the_slots_fires_the_owed_ones_and_none_early() -> None:
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1])
    _back(row.task_name, timedelta(hours=1))
    data = DataSchedules()
    real = timezone.now()
    earlier = real - 3 * MINUTE  # this copy last fired three minutes ago
    data.load(earlier, start=True)
    edited = define_schedule("t1", TARGET, every=timedelta(hours=1), args=[1])
    owed = _slots(data.apply(edited, real), row.task_name)
    # Never lost: the old schedule's slots due before the edit and not fired yet.
    assert owed == [_minute(earlier) + n * MINUTE for n in (1, 2, 3)]
    assert all(slot <= edited.changed_at for slot in owed)
    # Never early: the new schedule's first slot is after the edit.
    assert edited.changed_at is not None
    start = data.next_start()
    assert start is not None and start > edited.changed_at
    assert start == real.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    assert data.due(start - timedelta(microseconds=1)) == []


def test_data__a_moving_edit_newer_than_the_copys_clock_still_owes_the_slots_before_it() -> None:
    # The copy read its clock, then its poll waited on the database (SQLite's writer: the
    # edit's own transaction) and found the edit, committed after a slot of the old schedule
    # that this copy had not fired yet: that slot is owed, never skipped by the new schedule.
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1])
    _back(row.task_name, timedelta(hours=1))
    data = DataSchedules()
    real = timezone.now()
    data.load(real - 3 * MINUTE, start=True)
    edited = define_schedule("t1", TARGET, every=timedelta(hours=1), args=[1])
    assert edited.changed_at is not None
    last = _minute(edited.changed_at)  # due before the edit
    stale = last - timedelta(milliseconds=5)  # the copy's clock, read before its poll
    owed = _slots(data.apply(edited, stale), row.task_name)
    assert owed[-1] == last
    assert owed == [_minute(real - 3 * MINUTE) + n * MINUTE for n in range(1, len(owed) + 1)]
    start = data.next_start()
    assert start is not None and start > edited.changed_at


def test_data__a_slot_a_moving_edit_took_back_is_not_fired() -> None:
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1])
    data = DataSchedules()
    now = timezone.now()
    data.load(now, start=True)
    next_slot = _minute(now) + MINUTE
    due = data.due(next_slot)  # popped, not read yet: the edit lands now
    define_schedule("t1", TARGET, every=timedelta(hours=1), args=[1])
    hourly = next_slot.minute == 0
    jobs = data.jobs(due, next_slot)
    # A slot after the edit that the new schedule does not have is dropped.
    assert len(jobs) == (1 if hourly else 0)
    assert data.states[row.task_name].version == 2


def test_data__a_slot_popped_before_an_edit_that_took_it_back_is_dropped_once_applied() -> None:
    # The edit applied in between (a poll, or a read the database failed, the slot carried):
    # the slot is judged by the schedule as it is now when it is read, not fired.
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1])
    data = DataSchedules()
    now = timezone.now()
    data.load(now, start=True)
    next_slot = _minute(now) + MINUTE
    due = data.due(next_slot)
    edited = define_schedule("t1", TARGET, every=timedelta(hours=1), args=[1])
    data.apply(edited, next_slot)
    assert data.states[row.task_name].version == edited.version
    jobs = data.jobs(due, next_slot)
    assert len(jobs) == (1 if next_slot.minute == 0 else 0)


def test_data__disabled_fires_nothing_and_enabled_again_only_after() -> None:
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1])
    _back(row.task_name, timedelta(hours=1))
    data = DataSchedules()
    now = timezone.now()
    data.load(now, start=True)
    disabled = define_schedule("t1", TARGET, every=MINUTE, args=[1], enabled=False)
    data.apply(disabled, now)
    assert row.task_name not in data.states
    assert data.due(now + 5 * MINUTE) == []
    enabled = define_schedule("t1", TARGET, every=MINUTE, args=[1], enabled=True)
    assert _slots(data.apply(enabled, now), row.task_name) == []  # none before the enable
    assert data.next_start() == _minute(now) + MINUTE
    deleted = delete_schedule("t1", TARGET)
    assert deleted
    data.apply(store.get(row.task_name), now)  # the tombstone
    assert row.task_name not in data.states
    assert data.due(now + 5 * MINUTE) == []


def test_data__no_slot_before_starts_nor_after_ends() -> None:
    now = timezone.now()
    starts, ends = _minute(now) + 3 * MINUTE, _minute(now) + 5 * MINUTE
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1], starts=starts, ends=ends)
    data = DataSchedules()
    data.load(now, start=True)
    assert data.next_start() == starts
    fired = _slots(data.due(now + 10 * MINUTE), row.task_name)
    assert fired == [ends]  # catch-up "latest": the newest due slot, within the window
    assert data.next_start() is None  # nothing after ends


def test_data__jitter_delays_the_start_not_the_slot() -> None:
    jitter = timedelta(seconds=20)
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1], jitter=jitter)
    offset = jitter_offset(row.task_name, jitter)
    assert timedelta(0) < offset < jitter
    data = DataSchedules()
    now = timezone.now()
    data.load(now, start=True)
    next_slot = _minute(now) + MINUTE
    assert data.next_start() == next_slot + offset
    assert data.due(next_slot + offset - timedelta(microseconds=1)) == []
    assert _slots(data.due(next_slot + offset), row.task_name) == [next_slot]


def test_data__a_tick_reads_nothing_for_schedules_that_are_not_due() -> None:
    for n in range(200):
        define_schedule(f"t{n}", TARGET, every=timedelta(hours=1), args=[n])
    data = DataSchedules()
    now = timezone.now()
    data.load(now, start=True)
    assert len(data.states) == 200
    with CaptureQueriesContext(connections[alias()]) as queries:
        for _ in range(1000):
            assert data.due(now) == []
    assert len(queries) == 0


def test_data__an_unknown_target_is_not_fired_and_does_not_stop_the_others() -> None:
    good = define_schedule("t1", TARGET, every=MINUTE, args=[1])
    bad = define_schedule("t2", TARGET, every=MINUTE, args=[1])
    TaskSchedule.objects.filter(task_name=bad.task_name).update(function="tests.gone.job")
    data = DataSchedules()
    data.load(timezone.now(), start=True)
    assert set(data.states) == {good.task_name}


def test_run_now__a_function_target_waits_pending_for_a_copy() -> None:
    row = define_schedule("t1", TARGET, every=timedelta(hours=1), args=[7])
    data_targets.executed.clear()
    said = run_now(row, by="alice")
    assert "pending" in said and data_targets.executed == []  # never run by the caller
    (pending,) = TaskRun.objects.filter(task_name=row.task_name)
    assert pending.state == RunState.PENDING
    data = DataSchedules()
    now = timezone.now()
    due = data.load(now, start=True)
    assert [(item.slot, item.manual) for item in due] == [(pending.slot, True)]
    (job,) = data.jobs(due, now)
    assert data.pending() == []  # handed to this copy's pool: not picked up twice
    assert data.run(job) == "ran"
    assert data_targets.executed == [(row.task_name, (7,), {"fmt": "pdf"})]
    pending.refresh_from_db()
    assert (pending.state, pending.schedule_version) == (RunState.SUCCEEDED, 1)
    assert data.run(job) != "ran"  # a second copy's call: the guard refuses it


def test_data__a_scheduled_slot_runs_through_the_guard_with_its_version() -> None:
    row = define_schedule("t1", TARGET, every=MINUTE, args=[5], kwargs={"fmt": "csv"})
    _back(row.task_name, timedelta(hours=1))
    data = DataSchedules()
    now = timezone.now()
    (job,) = data.jobs(data.load(now, start=True), now)
    data_targets.executed.clear()
    assert data.run(job) == "ran"
    assert data_targets.executed == [(row.task_name, (5,), {"fmt": "csv"})]
    run = TaskRun.objects.get(task_name=row.task_name, slot=_minute(now))
    assert (run.state, run.schedule_version) == (RunState.SUCCEEDED, 1)


def test_sweep__skips_disabled_data_schedules_and_slots_outside_the_window() -> None:
    now = timezone.now()
    off = define_schedule("off", TARGET, every=MINUTE, args=[1], enabled=False)
    windowed = define_schedule(
        "win", TARGET, every=MINUTE, args=[1], starts=now - 10 * MINUTE, ends=now - 8 * MINUTE
    )
    for row in (off, windowed):
        _back(row.task_name, timedelta(hours=1))
    assert off.task_name not in {row.task_name for row in store.watched(store.stored())}
    sweep_missed()
    assert not TaskRun.objects.filter(task_name=off.task_name).exists()
    missed = sorted(
        TaskRun.objects.filter(task_name=windowed.task_name).values_list("slot", flat=True)
    )
    begun = now - 10 * MINUTE
    starts = _minute(begun) + (MINUTE if begun.second or begun.microsecond else timedelta(0))
    assert missed and missed[0] >= now - 10 * MINUTE and missed[-1] <= now - 8 * MINUTE
    assert missed[0] == starts


def test_sweep__judges_a_data_schedule_by_the_grace_its_target_says_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    following = define_schedule("follows", TARGET, every=MINUTE, args=[1])
    own = define_schedule("own", TARGET, every=MINUTE, args=[1], grace=60)
    for row in (following, own):
        _back(row.task_name, timedelta(minutes=30))
    data_targets.redeploy(monkeypatch, grace=timedelta(hours=1))  # not saved in the rows
    sweep_missed()
    # Its target's grace is an hour now: none of its last 30 minutes is missed yet.
    assert not TaskRun.objects.filter(task_name=following.task_name).exists()
    missed = TaskRun.objects.filter(task_name=own.task_name, state=RunState.MISSED)
    assert missed.count() >= 25  # its own grace, a minute
    assert "within its grace (60s)" in missed.first().error  # type: ignore[union-attr]


def test_data__an_empty_catchup_follows_the_targets_decorator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1])
    _back(row.task_name, timedelta(hours=1))
    data_targets.redeploy(monkeypatch, catchup="all", max_catchup=3)
    now = timezone.now()
    latest = _minute(now)
    due = _slots(DataSchedules().load(now, start=True), row.task_name)
    assert due == [latest - 2 * MINUTE, latest - MINUTE, latest]  # all, at most 3


def test_run_schedules__task_names_a_data_schedule() -> None:
    row = define_schedule("t1", TARGET, every=MINUTE, args=[9])
    _back(row.task_name, timedelta(hours=1))
    define_schedule("t2", TARGET, every=MINUTE, args=[10])
    data_targets.executed.clear()
    call_command("run_schedules", "--once", "--task", row.task_name, verbosity=0)
    assert data_targets.executed == [(row.task_name, (9,), {"fmt": "pdf"})]
    (run,) = TaskRun.objects.filter(task_name__startswith=TARGET, state=RunState.SUCCEEDED)
    assert (run.task_name, run.schedule_version) == (row.task_name, 1)
    with pytest.raises(CommandError, match=r"data schedule .* named nope\[x\]"):
        call_command("run_schedules", "--once", "--task", "nope[x]", verbosity=0)


def test_sweep__ends_a_run_now_slot_nobody_started_within_its_grace() -> None:
    row = define_schedule("t1", TARGET, every=timedelta(hours=1), args=[1])
    run_now(row)
    (pending,) = TaskRun.objects.filter(task_name=row.task_name)
    assert pending.slot.microsecond  # off the schedule's grid
    sweep_missed()
    pending.refresh_from_db()
    assert pending.state == RunState.PENDING  # within its grace: a copy may still start it
    TaskRun.objects.filter(id=pending.id).update(
        created_at=timezone.now() - data_targets.send_report.policy.grace - MINUTE
    )
    sweep_missed()
    pending.refresh_from_db()
    assert pending.state == RunState.MISSED


TASK_TARGET = "tests.support.data_tasks.tenant_job"


@pytest.mark.parametrize("enqueue", [True, False], ids=["enqueue", "in_process"])
def test_run_now__a_django_tasks_target_waits_pending_never_runs_in_the_caller(
    enqueue: bool,
) -> None:
    # The Immediate backend (Django's default) would run an enqueue in the caller's process:
    # run now records the slot pending instead, for a run_schedules copy.
    row = define_schedule("t1", TASK_TARGET, every=timedelta(hours=1), args=["x"])
    assert row.target_kind == "django_tasks"
    said = run_now(row, by="alice")
    assert "pending" in said
    (pending,) = TaskRun.objects.filter(task_name=row.task_name)
    assert pending.state == RunState.PENDING  # nothing ran: the body never claimed it
    data = DataSchedules(enqueue=enqueue)
    now = timezone.now()
    due = data.load(now, start=True)
    assert [(item.slot, item.manual) for item in due] == [(pending.slot, True)]
    (job,) = data.jobs(due, now)
    said = data.run(job)
    assert said.startswith("enqueued (django.tasks result") if enqueue else said == "ran"
    pending.refresh_from_db()
    assert (pending.state, pending.schedule_version) == (RunState.SUCCEEDED, 1)
    assert TaskRun.objects.filter(task_name=row.task_name).count() == 1


def test_data__owed_slots_keep_the_arguments_and_version_that_owed_them() -> None:
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1], kwargs={"fmt": "csv"})
    _back(row.task_name, timedelta(hours=1))
    data = DataSchedules()
    real = timezone.now()
    earlier = real - 2 * MINUTE
    data.load(earlier, start=True)
    # Two edits: the arguments, then the slots (and the arguments again).
    edited = define_schedule("t1", TARGET, every=MINUTE, args=[2], kwargs={"fmt": "csv"})
    assert data.apply(edited, earlier) == []  # slots kept: version 2 owes what follows it
    moved = define_schedule("t1", TARGET, every=timedelta(hours=1), args=[3])
    owed = data.apply(moved, real)
    assert _slots(owed, row.task_name) == [_minute(earlier) + n * MINUTE for n in (1, 2)]
    jobs = data.jobs(owed, real)
    # Both slots came before the first edit: version 1 was in effect at their time.
    assert [(job.args, job.kwargs, job.version) for job in jobs] == [((1,), {"fmt": "csv"}, 1)] * 2
    data_targets.executed.clear()
    assert data.run(jobs[0]) == "ran"
    assert data_targets.executed == [(row.task_name, (1,), {"fmt": "csv"})]
    run = TaskRun.objects.get(task_name=row.task_name, slot=jobs[0].slot)
    assert (run.state, run.schedule_version) == (RunState.SUCCEEDED, 1)
    # The new schedule's slots run with the new definition.
    start = data.next_start()
    assert start is not None
    (job,) = data.jobs(data.due(start), start)
    assert (job.args, job.kwargs, job.version) == ((3,), {}, 3)


UTC = dt_timezone.utc
LEAP_DAY = datetime(2028, 2, 29, tzinfo=UTC)  # the next February 29th after November 2026
SEEN = datetime(2026, 11, 1, 12, tzinfo=UTC)  # more than LOOKAHEAD before it


def test_scheduler__a_code_slot_beyond_the_lookahead_is_planned_again_and_fires() -> None:
    assert LEAP_DAY - SEEN > LOOKAHEAD
    name = "tests.firing.leap_day"
    once_per_schedule(schedule=CronSchedule("0 0 29 2 *", "UTC"), name=name)(lambda: None)
    scheduler = Scheduler([registry.entries()[name]], max_workers=1)
    try:
        scheduler.first_due(SEEN)
        assert scheduler.due(SEEN + timedelta(seconds=1)) == []
        recheck = scheduler.next_wakeup()
        assert recheck is not None and SEEN < recheck < LEAP_DAY  # a re-check, not never
        assert scheduler.due(recheck) == []
        assert scheduler.next_wakeup() == LEAP_DAY
        assert scheduler.due(LEAP_DAY - timedelta(seconds=1)) == []
        fired = [slots for _, slots in scheduler.due(LEAP_DAY + timedelta(seconds=1))]
    finally:
        scheduler.pool.close()
        scheduler.writer.close()
        registry.unregister(name)
    assert fired == [[LEAP_DAY]]


def test_data__a_slot_beyond_the_lookahead_is_planned_again_and_fires() -> None:
    row = define_schedule("leap", TARGET, cron="0 0 29 2 *", time_zone="UTC", args=[1])
    TaskSchedule.objects.filter(task_name=row.task_name).update(
        first_seen=SEEN - MINUTE, swept_until=None
    )
    data = DataSchedules()
    assert data.load(SEEN, start=True) == []
    recheck = data.next_start()
    assert recheck is not None and SEEN < recheck < LEAP_DAY  # a re-check, not never
    assert data.due(recheck) == []
    assert data.next_start() == LEAP_DAY
    assert data.due(LEAP_DAY - timedelta(seconds=1)) == []
    assert _slots(data.due(LEAP_DAY + timedelta(seconds=1)), row.task_name) == [LEAP_DAY]
    assert data.next_start() is not None  # and the next leap day's re-check after it


def test_data__a_poll_reads_no_arguments_and_skips_the_versions_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    big = "x" * 30_000
    define_schedule("t1", TARGET, every=timedelta(hours=1), args=[big], description="d" * 1500)
    define_schedule("t2", TARGET, every=timedelta(hours=1), args=[2])
    data = DataSchedules()
    now = timezone.now()
    data.load(now, start=True)
    one = define_schedule("t1", TARGET, every=timedelta(hours=1), args=[big + "y"])
    applied: list[tuple[str, int]] = []
    real_apply = data.apply

    def apply(row: TaskSchedule, now: datetime, *, start: bool = False) -> list[Due]:
        applied.append((row.task_name, row.version))
        return real_apply(row, now, start=start)

    monkeypatch.setattr(data, "apply", apply)
    data._next_poll = 0.0  # the poll's interval, come
    with CaptureQueriesContext(connections[alias()]) as queries:
        assert data.poll(now) == []
    changed = [q["sql"] for q in queries if "changed_at" in q["sql"]]
    assert len(changed) == 1
    assert '"args"' not in changed[0] and '"description"' not in changed[0]
    # Both rows changed within the poll's overlap: only t1's new version is worked on.
    assert applied == [(one.task_name, 2)]
    assert data.states[one.task_name].version == 2
    data._next_poll = 0.0
    assert data.poll(now) == []
    assert applied == [(one.task_name, 2)]  # nothing new: every row skipped at once


def test_sweep__ends_a_run_now_slot_of_a_schedule_deleted_since() -> None:
    row = define_schedule("t1", TARGET, every=timedelta(hours=1), args=[1])
    run_now(row)
    delete_schedule("t1", TARGET)
    (pending,) = TaskRun.objects.filter(task_name=row.task_name)
    TaskRun.objects.filter(id=pending.id).update(
        created_at=timezone.now() - data_targets.send_report.policy.grace - MINUTE
    )
    sweep_missed()
    pending.refresh_from_db()
    assert pending.state == RunState.MISSED


def test_run_now__an_enqueued_slot_is_not_enqueued_again_while_it_waits() -> None:
    row = define_schedule("t1", TASK_TARGET, every=timedelta(hours=1), args=["x"])
    run_now(row, by="alice")
    (pending,) = TaskRun.objects.filter(task_name=row.task_name)
    data = DataSchedules(enqueue=True)
    now = timezone.now()
    (job,) = data.jobs(data.load(now, start=True), now)
    assert data.run(job).startswith("enqueued")
    # As if the worker had not claimed it yet (the Immediate backend ran it at once):
    TaskRun.objects.filter(id=pending.id).update(state=RunState.PENDING)
    assert data.pending() == []  # this copy handed it out: not again at every poll
    TaskRun.objects.filter(id=pending.id).update(state=RunState.SUCCEEDED)
    assert data.pending() == [] and data.handed == set()  # claimed: forgotten


def test_run_schedules__data_schedules_due_at_one_slot_are_claimed_together_with_versions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three data schedules due at one slot: on PostgreSQL one batch claim (dispatch.py), each
    run recording its own schedule's version; elsewhere one by one, the same outcome."""
    from django_taskguard import dispatch

    batches: list[list[str]] = []
    claim_many = dispatch.claim_many

    def counted(slot: datetime, wanted: list[tuple[str, float]]) -> object:
        batches.append(sorted(name for name, _ in wanted))
        return claim_many(slot, wanted)

    monkeypatch.setattr(dispatch, "claim_many", counted)  # observed, not replaced
    rows = [define_schedule(f"t{n}", TARGET, every=MINUTE, args=[n]) for n in range(3)]
    define_schedule("t1", TARGET, every=MINUTE, args=[10])  # t1 is at version 2
    for row in rows:
        _back(row.task_name, timedelta(hours=1))
    _changed_back(rows[1].task_name, timedelta(minutes=30))  # in effect at the slot fired
    data_targets.executed.clear()
    call_command("run_schedules", "--once", verbosity=0)
    ran = sorted((name, args) for name, args, _ in data_targets.executed)
    assert ran == [(rows[0].task_name, (0,)), (rows[1].task_name, (10,)), (rows[2].task_name, (2,))]
    runs = TaskRun.objects.filter(task_name__startswith=TARGET)
    # (the hour before: recorded missed by the sweep --once runs)
    found = runs.exclude(state=RunState.MISSED).order_by("task_name")
    assert [(run.state, run.schedule_version) for run in found] == [
        (RunState.SUCCEEDED, 1),
        (RunState.SUCCEEDED, 2),
        (RunState.SUCCEEDED, 1),
    ]
    assert len({run.slot for run in found}) == 1  # one slot: the batch's
    if connections[alias()].vendor == "postgresql":  # claimed by one batch statement
        assert batches == [[run.task_name for run in found]]


# -- the database fails between a slot falling due and its claim --------------------------


def _cut_this_connection() -> None:
    """End this thread's PostgreSQL connection from another one (its next query fails)."""
    with connections[alias()].cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()

    def cut() -> None:
        try:
            with connections[alias()].cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
        finally:
            connections[alias()].close()

    thread = threading.Thread(target=cut)
    thread.start()
    thread.join(30)


@contextlib.contextmanager
def _database_away() -> Iterator[None]:
    """This thread's connection refused (a port nobody listens on) until the block ends."""
    connection = connections[alias()]
    port = connection.settings_dict["PORT"]
    connection.close()
    connection.settings_dict["PORT"] = str(free_port())
    try:
        yield
    finally:
        connection.settings_dict["PORT"] = port
        connection.close()


def _postgres_only() -> None:
    if connections[alias()].vendor != "postgresql":
        pytest.skip("pg_terminate_backend: PostgreSQL")


def test_run_schedules__a_due_slot_whose_read_failed_is_fired_when_the_database_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The slot was popped (this copy counts it fired), then reading its schedule failed: it
    # is carried and fired at a later tick, once (it used to be left to the sweep, which
    # never judges a slot that a moving edit took from the schedule).
    _postgres_only()
    monkeypatch.setattr(carried, "RETRY_SECONDS", 0.0)
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1])
    _back(row.task_name, timedelta(hours=1))
    data = DataSchedules()
    scheduler = Scheduler([], max_workers=1, data=data)
    popped: list[Due] = []

    def read_then_cut(now: datetime) -> list[Due]:
        popped.extend(data.load(now, start=True))
        _cut_this_connection()
        return list(popped)

    data_targets.executed.clear()
    try:
        scheduler._fire_data(read_then_cut)
        assert scheduler.pool.drain(30)
        assert data_targets.executed == [] and len(popped) == 1
        assert data.retry_in() is not None
        scheduler._fire_data(lambda now: [])  # the next tick: nothing new is due
        assert scheduler.pool.drain(30)
    finally:
        scheduler._close(True, 30)  # the pool's threads close their connections
    assert [(name, args) for name, args, _ in data_targets.executed] == [(row.task_name, (1,))]
    (run,) = TaskRun.objects.filter(task_name=row.task_name)
    assert (run.slot, run.state) == (popped[0].slot, RunState.SUCCEEDED)
    assert data.retry_in() is None


def test_run_schedules__a_claim_the_database_refused_is_tried_again_within_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _postgres_only()
    monkeypatch.setattr(carried, "RETRY_SECONDS", 0.0)
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1])
    _back(row.task_name, timedelta(hours=1))
    data = DataSchedules()
    now = timezone.now()
    (job,) = data.jobs(data.load(now, start=True), now)
    data_targets.executed.clear()
    with _database_away(), pytest.raises(BackendUnavailable):
        data.run(job)  # the claim failed closed: nothing claimed, nothing ran
    assert not TaskRun.objects.filter(task_name=row.task_name).exists()
    (again,) = data.jobs(data.carried(timezone.now()), timezone.now())
    assert (again.slot, again.args) == (job.slot, job.args)
    assert data.run(again) == "ran"
    assert len(data_targets.executed) == 1
    # Past its grace, a carried slot is left to the sweep (said in the log).
    data.carry([Due(row.task_name, job.slot - data_targets.send_report.policy.grace - MINUTE)])
    assert data.carried(timezone.now()) == []


# -- a copy that learns of several changes at once (stopped, or its polls failed) ---------

SECOND = timedelta(seconds=1)


def _until(moment: datetime) -> None:
    """Sleep until ``moment`` (this process's clock)."""
    left = (moment - timezone.now()).total_seconds()
    if left > 0:
        time.sleep(left)


def _owed_by(history: list[TaskSchedule], after: datetime, until: datetime) -> list[tuple]:
    """``(slot, version, args)`` of each slot in ``(after, until]`` that the version in
    effect at its time (the newest changed before it) had, enabled."""
    found = []
    moment = after.replace(microsecond=0) + SECOND
    while moment <= until:
        row = [row for row in history if row.changed_at < moment][-1]
        if row.enabled and int(moment.timestamp()) % int(row.every.total_seconds()) == 0:
            found.append((moment, row.version, tuple(row.args)))
        moment += SECOND
    return found


def _learn(data: DataSchedules, order: str, now: datetime) -> list[tuple]:
    """What the copy fires when it learns of the changes: at a poll (the loop's order), or
    from the heap first (stopped between its poll and its heap)."""
    if order == "poll":
        jobs = data.jobs(data.poll(now) + data.due(now), now)
    else:
        jobs = data.jobs(data.due(now), now)
        jobs += data.jobs(data.due(now), now)  # the heap, planned again by the versions
    return sorted((job.slot, job.version, job.args) for job in jobs)


@pytest.mark.parametrize("order", ["poll", "heap"])
def test_data__a_copy_that_learns_of_a_disable_and_an_enable_at_once_fires_none_between(
    order: str,
) -> None:
    row = define_schedule("t1", TARGET, every=SECOND, args=[1])
    data = DataSchedules()
    data.load(timezone.now(), start=True)
    fired = data.states[row.task_name].fired
    _until(row.changed_at + 2 * SECOND)
    off = define_schedule("t1", TARGET, every=SECOND, args=[1], enabled=False)
    _until(off.changed_at + 2.5 * SECOND)
    on = define_schedule("t1", TARGET, every=SECOND, args=[3], enabled=True)
    _until(on.changed_at + 2.5 * SECOND)
    now = timezone.now()
    got = _learn(data, order, now)
    expected = _owed_by([row, off, on], fired, now)
    assert sum(off.changed_at < slot <= on.changed_at for slot in _slots_of(fired, now)) >= 2
    assert got == expected
    assert not [slot for slot, *_ in got if off.changed_at < slot <= on.changed_at]
    assert {version for _, version, _ in got} == {1, 3}


def _slots_of(after: datetime, until: datetime) -> list[datetime]:
    first = after.replace(microsecond=0) + SECOND
    return [first + n * SECOND for n in range(int((until - first) / SECOND) + 1)]


@pytest.mark.parametrize("order", ["poll", "heap"])
def test_data__a_copy_that_learns_of_several_interval_edits_at_once_fires_each_versions_slots(
    order: str,
) -> None:
    row = define_schedule("t1", TARGET, every=3 * SECOND, args=[1])
    data = DataSchedules()
    data.load(timezone.now(), start=True)
    fired = data.states[row.task_name].fired
    _until(row.changed_at + 4 * SECOND)
    v2 = define_schedule("t1", TARGET, every=2 * SECOND, args=[2])
    _until(v2.changed_at + 4.5 * SECOND)
    v3 = define_schedule("t1", TARGET, every=4 * SECOND, args=[3])
    _until(v3.changed_at + 4.5 * SECOND)
    now = timezone.now()
    got = _learn(data, order, now)
    assert got == _owed_by([row, v2, v3], fired, now)
    assert {version for _, version, _ in got} == {1, 2, 3}
    # Run through the guard: each recorded with the version that had the slot.
    jobs = data.jobs([Due(row.task_name, slot) for slot, _, _ in got], now)
    for job in jobs:
        assert data.run(job) == "ran"
    runs = TaskRun.objects.filter(task_name=row.task_name).order_by("slot")
    assert [(run.slot, run.schedule_version) for run in runs] == [
        (slot, version) for slot, version, _ in got
    ]


def test_data__a_carried_slot_is_judged_by_the_version_in_effect_at_its_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The database failed for a while: each tick's slots were carried (DataSchedules.carry,
    # what a failed read or claim does), the copy still knowing version 1, while the schedule
    # was disabled and enabled again. Tried again, none of the disabled window's fires.
    monkeypatch.setattr(carried, "RETRY_SECONDS", 0.0)
    row = define_schedule("t1", TARGET, every=SECOND, args=[1])
    data = DataSchedules()
    data.load(timezone.now(), start=True)
    fired = data.states[row.task_name].fired
    _until(row.changed_at + 2 * SECOND)
    off = define_schedule("t1", TARGET, every=SECOND, args=[1], enabled=False)
    _until(off.changed_at + 2.5 * SECOND)
    data.carry(data.due(timezone.now()))
    on = define_schedule("t1", TARGET, every=SECOND, args=[3], enabled=True)
    _until(on.changed_at + SECOND)
    carried_slots = _slots_of(fired, on.changed_at)
    assert sum(off.changed_at < slot <= on.changed_at for slot in carried_slots) >= 2
    now = timezone.now()
    jobs = data.jobs(data.carried(now), now)
    got = sorted((job.slot, job.version, job.args) for job in jobs)
    assert got == _owed_by([row, off, on], fired, off.changed_at)
    assert got and {version for _, version, _ in got} == {1}
