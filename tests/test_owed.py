"""Owed windows: the slots of a data schedule's definition that a change ended (an edit of its
slots, a disable, a deletion) before the sweep had judged them are judged after their grace,
by the definition that owed them (G3: a slot due that nobody fired is recorded, whatever
changed since)."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from django_taskguard import define_schedule, delete_schedule
from django_taskguard.ledger import owed as owed_store
from django_taskguard.ledger import schedules as store
from django_taskguard.missed import sweep_missed
from django_taskguard.models import RunState, TaskRun, TaskSchedule
from django_taskguard.pauses import pause
from django_taskguard.signals import run_missed
from tests.support import data_targets  # noqa: F401  (registers the schedules' targets)

from .support.runs import make_run

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]

TARGET = "tests.support.data_targets.send_report"
MINUTE = timedelta(minutes=1)
GRACE = timedelta(minutes=2)


def _minute(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


def _every_minute(name: str = "t1", grace: timedelta = GRACE) -> TaskSchedule:
    """A one-minute schedule created an hour ago and swept up to its grace ago."""
    row = define_schedule(name, TARGET, every=MINUTE, args=[1], grace=grace)
    TaskSchedule.objects.filter(task_name=row.task_name).update(
        first_seen=timezone.now() - timedelta(hours=1), swept_until=None
    )
    sweep_missed()  # the hour before: judged now, as the sweep does every minute
    return TaskSchedule.objects.get(task_name=row.task_name)


def _state(task_name: str, slot: datetime) -> str | None:
    run = TaskRun.objects.filter(task_name=task_name, slot=slot).first()
    return None if run is None else run.state


def _owed_slots(row: TaskSchedule, until: datetime) -> list[datetime]:
    """The one-minute slots the sweep had not judged before the change at ``until``."""
    assert row.swept_until is not None
    first = _minute(row.swept_until) + MINUTE
    return [first + n * MINUTE for n in range(int((until - first) / MINUTE) + 1)]


def test_owed__an_edit_of_the_slots_leaves_the_old_ones_judged_after_their_grace() -> None:
    row = _every_minute()
    fired = _minute(timezone.now()) - MINUTE  # one slot ran before the edit
    make_run(row.task_name, slot=fired, state=RunState.SUCCEEDED)
    edited = define_schedule("t1", TARGET, every=timedelta(hours=1), args=[1], grace=GRACE)
    assert edited.changed_at is not None
    stored = TaskSchedule.objects.get(task_name=row.task_name)
    (window,) = stored.owed
    assert window["version"] == row.version and window["every"] == 60
    owed = [slot for slot in _owed_slots(row, stored.swept_until) if slot != fired]
    assert owed, "the slots since the last sweep, that nobody fired"

    signalled: list[list[datetime]] = []

    def heard(sender: str, slots: list[datetime], **kwargs: object) -> None:
        signalled.append(slots)

    run_missed.connect(heard)
    try:
        sweep_missed()  # within their grace: a copy may still fire them
        assert [_state(row.task_name, slot) for slot in owed] == [None] * len(owed)
        later = edited.changed_at + GRACE + MINUTE
        sweep_missed(now=later)
    finally:
        run_missed.disconnect(heard)
    assert [_state(row.task_name, slot) for slot in owed] == [RunState.MISSED] * len(owed)
    assert _state(row.task_name, fired) == RunState.SUCCEEDED  # what ran keeps its row
    run = TaskRun.objects.get(task_name=row.task_name, slot=owed[0])
    reason = run.transitions.get().reason
    assert f"version {row.version}" in reason and "changed since" in reason
    assert signalled == [owed]  # once: a missed check-in per slot
    stored = TaskSchedule.objects.get(task_name=row.task_name)
    assert (stored.owed, stored.owed_due_at) == ([], None)
    # The new definition owes nothing before the edit; a second sweep writes nothing.
    assert not TaskRun.objects.filter(
        task_name=row.task_name, slot__gt=max(owed), state=RunState.MISSED
    ).exists()
    assert sweep_missed(now=later).missed_slots == 0


@pytest.mark.parametrize("change", ["disabled", "deleted"])
def test_owed__a_disable_or_a_deletion_leaves_the_slots_before_it_judged(change: str) -> None:
    row = _every_minute()
    if change == "disabled":
        ended = define_schedule("t1", TARGET, every=MINUTE, args=[1], grace=GRACE, enabled=False)
        at = ended.changed_at
    else:
        assert delete_schedule("t1", TARGET)
        at = TaskSchedule.objects.get(task_name=row.task_name).changed_at
    assert at is not None
    stored = TaskSchedule.objects.get(task_name=row.task_name)
    owed = _owed_slots(row, stored.owed and owed_store.Owed.of(stored.owed[0]).until)
    sweep_missed(now=at + GRACE + MINUTE)
    assert {_state(row.task_name, slot) for slot in owed} == {RunState.MISSED}
    stored = TaskSchedule.objects.get(task_name=row.task_name)
    assert stored.owed == []


def test_owed__slots_due_while_paused_are_recorded_skipped() -> None:
    grace = timedelta(minutes=6)  # the window holds about six slots
    row = _every_minute(grace=grace)
    assert pause(row.task_name, "maintenance")
    edited = define_schedule("t1", TARGET, every=timedelta(hours=1), args=[1], grace=grace)
    assert edited.changed_at is not None
    stored = TaskSchedule.objects.get(task_name=row.task_name)
    owed = _owed_slots(row, owed_store.Owed.of(stored.owed[0]).until)
    assert len(owed) >= 4
    paused_at = owed[2]  # the pause began at the third owed slot
    TaskSchedule.objects.filter(task_name=row.task_name).update(paused_at=paused_at)
    sweep_missed(now=edited.changed_at + grace + MINUTE)
    states = [_state(row.task_name, slot) for slot in owed]
    assert states == [RunState.MISSED] * 2 + [RunState.SKIPPED] * (len(owed) - 2)


def test_owed__an_edit_of_the_arguments_owes_nothing_and_a_disabled_schedule_owes_nothing() -> None:
    row = _every_minute()
    define_schedule("t1", TARGET, every=MINUTE, args=[2], grace=GRACE)  # the arguments
    assert TaskSchedule.objects.get(task_name=row.task_name).owed == []
    define_schedule("t1", TARGET, every=MINUTE, args=[2], grace=GRACE, enabled=False)
    assert len(TaskSchedule.objects.get(task_name=row.task_name).owed) == 1
    # Edited while disabled: it owed nothing more (nothing was judged, nothing fired).
    define_schedule("t1", TARGET, every=MINUTE * 5, args=[2], grace=GRACE, enabled=False)
    assert len(TaskSchedule.objects.get(task_name=row.task_name).owed) == 1


def test_owed__a_change_between_the_sweeps_read_and_its_write_keeps_the_window() -> None:
    row = _every_minute()
    edited = define_schedule("t1", TARGET, every=timedelta(hours=1), args=[1], grace=GRACE)
    assert edited.changed_at is not None
    stale = TaskSchedule.objects.get(task_name=row.task_name)
    define_schedule("t1", TARGET, every=timedelta(hours=1), args=[9], grace=GRACE)  # version +1
    assert owed_store.settle([(stale, [])]) == 0  # read before the change: not settled
    assert len(TaskSchedule.objects.get(task_name=row.task_name).owed) == 1


def test_owed__at_most_owed_limit_windows_are_kept_and_the_dropped_one_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    row = _every_minute()
    hour_ago = timezone.now() - timedelta(hours=1)
    for n in range(owed_store.OWED_LIMIT + 1):  # each moves the slots: each leaves a window
        # (of the last hour's slots: as if no sweep had run since)
        TaskSchedule.objects.filter(task_name=row.task_name).update(swept_until=hour_ago)
        define_schedule("t1", TARGET, every=MINUTE * (2 + n % 2), args=[1], grace=GRACE)
    stored = TaskSchedule.objects.get(task_name=row.task_name)
    assert len(stored.owed) == owed_store.OWED_LIMIT
    assert stored.owed[0]["version"] == row.version + 1  # the oldest went
    assert "are not judged by the sweep" in caplog.text


def test_owed__a_deleted_schedule_is_not_retired_before_its_owed_slots_are_judged() -> None:
    row = _every_minute()
    assert delete_schedule("t1", TARGET)
    stored = TaskSchedule.objects.get(task_name=row.task_name)
    assert stored.owed_due_at is not None
    assert not store.retire(row.task_name)  # its owed window would go with the row
    sweep_missed(now=stored.owed_due_at + MINUTE)
    assert store.retire(row.task_name)


def test_owed__a_definition_before_a_deletion_and_a_new_creation_keeps_its_arguments() -> None:
    # The schedule's name defined again after a deletion: its history's "created" says
    # nothing of the arguments before it; they are the ones known (not a TypeError).
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1])
    assert delete_schedule("t1", TARGET)
    again = define_schedule("t1", TARGET, every=timedelta(hours=1), args=[2], kwargs={"fmt": "csv"})
    assert again.version == row.version + 2
    assert store.arguments_at(again, row.version) == ([2], {"fmt": "csv"})


def test_owed__a_change_between_two_sweeps_that_ends_no_slot_owes_nothing() -> None:
    # A daily report edited a minute after its last sweep: no slot in between, no window
    # (nothing waits for its grace, a deleted one is retired at once).
    row = define_schedule("t1", TARGET, cron="0 9 * * *", args=[1], grace=GRACE)
    define_schedule("t1", TARGET, cron="30 9 * * *", args=[1], grace=GRACE)
    stored = TaskSchedule.objects.get(task_name=row.task_name)
    assert (stored.owed, stored.owed_due_at) == ([], None)
    assert delete_schedule("t1", TARGET)
    assert store.retire(row.task_name)
