"""manage.py backfill of data schedules (TASK = target[name]): function targets run in the
command's process with the row's arguments and version; django.tasks targets with
--enqueue go to their backend carrying the slot and the schedule; Celery targets go to the
sender registered for data schedules, or the command says what is missing."""

from __future__ import annotations

from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from django_taskguard import define_schedule, delete_schedule, handoff
from django_taskguard.models import RunState, TaskRun
from django_taskguard.schedules import IntervalSchedule
from tests.support import data_targets

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]

TARGET = "tests.support.data_targets.send_report"
MINUTE = timedelta(minutes=1)


@pytest.fixture(autouse=True)
def _clean() -> None:
    data_targets.executed.clear()


def span(slots: int = 4) -> tuple[datetime, datetime, list[str]]:
    """A range of ``slots`` whole minutes ending ten minutes ago."""
    end = IntervalSchedule(MINUTE).latest_slot(timezone.now()) - 10 * MINUTE
    start = end - (slots - 1) * MINUTE
    return start, end, ["--from", start.isoformat(), "--to", end.isoformat()]


def backfill(task: str, *args: str) -> str:
    out = StringIO()
    call_command("backfill", task, *args, stdout=out)
    return out.getvalue()


def test_data_backfill__runs_each_slot_with_the_rows_arguments_and_version() -> None:
    define_schedule("t42", TARGET, every=MINUTE, args=[42])
    row = define_schedule("t42", TARGET, every=MINUTE, args=[42], kwargs={"fmt": "csv"})
    assert row.version == 2
    start, _, given = span()
    out = backfill(row.task_name, *given)
    assert "Ran 4 slots" in out
    assert data_targets.executed == [(row.task_name, (42,), {"fmt": "csv"})] * 4
    runs = TaskRun.objects.filter(task_name=row.task_name).order_by("slot")
    assert [run.slot for run in runs] == [start + n * MINUTE for n in range(4)]
    assert {(run.state, run.schedule_version) for run in runs} == {(RunState.SUCCEEDED, 2)}
    again = backfill(row.task_name, *given)
    assert "Running 0 slots" in again and "(4 already have a row)" in again
    assert len(data_targets.executed) == 4


def test_data_backfill__dry_run_runs_nothing() -> None:
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1])
    start, _, given = span(3)
    out = backfill(row.task_name, *given, "--dry-run")
    assert "Would run 3 slots" in out and start.isoformat() in out
    assert not data_targets.executed and not TaskRun.objects.exists()


def test_data_backfill__only_the_slots_between_starts_and_ends() -> None:
    start, end, given = span(6)
    row = define_schedule(
        "t1", TARGET, every=MINUTE, args=[1], starts=start + 2 * MINUTE, ends=end - MINUTE
    )
    backfill(row.task_name, *given)
    slots = list(TaskRun.objects.filter(task_name=row.task_name).values_list("slot", flat=True))
    assert sorted(slots) == [start + n * MINUTE for n in (2, 3, 4)]


def test_data_backfill__a_disabled_schedule_is_run_and_said_so() -> None:
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1], enabled=False)
    _, _, given = span(2)
    out = backfill(row.task_name, *given)
    assert "is disabled: backfill runs its slots all the same" in out and "Ran 2 slots" in out


def test_data_backfill__a_failing_target_is_recorded_failed() -> None:
    row = define_schedule("f", "tests.support.data_targets.failing", every=MINUTE)
    _, _, given = span(2)
    with pytest.raises(CommandError, match=r"2 slots of .* raised"):
        backfill(row.task_name, *given)
    states = set(TaskRun.objects.filter(task_name=row.task_name).values_list("state", flat=True))
    assert states == {RunState.FAILED}


def test_data_backfill__refusals() -> None:
    row = define_schedule("t1", TARGET, every=MINUTE, args=[1])
    _, _, given = span(2)
    with pytest.raises(CommandError, match=r"not a django\.tasks task"):
        backfill(row.task_name, *given, "--enqueue")
    delete_schedule("t1", TARGET)
    with pytest.raises(CommandError, match="was deleted"):
        backfill(row.task_name, *given)
    with pytest.raises(CommandError, match="t2"):
        backfill(f"{TARGET}[t2]", *given)
    assert not data_targets.executed


@pytest.mark.parametrize("catchup", ["latest", "none"])
def test_data_backfill__enqueue_hands_django_tasks_slots_with_slot_and_schedule(
    catchup: str,
) -> None:
    """With catchup="none" too: backfill asks for past slots, and they run (as they do
    without --enqueue), none recorded missed for being late."""
    from tests.support import backfill_tasks

    backfill_tasks.executed.clear()
    target = "tests.support.backfill_tasks.report"
    row = define_schedule(
        "t7", target, every=MINUTE, args=[7], kwargs={"fmt": "csv"}, catchup=catchup,
        grace=timedelta(seconds=30),  # the slots are ten minutes old: late
    )  # fmt: skip
    assert row.target_kind == "django_tasks"
    start, _, given = span(3)
    out = backfill(row.task_name, *given, "--enqueue")
    assert "Enqueued 3 slots" in out
    # The Immediate backend ran each at once: under the schedule's identity, its slot.
    assert backfill_tasks.executed == [
        (row.task_name, start + n * MINUTE, 7, "csv") for n in range(3)
    ]
    runs = TaskRun.objects.filter(task_name=row.task_name)
    assert {(run.state, run.schedule_version) for run in runs} == {(RunState.SUCCEEDED, 1)}
    again = backfill(row.task_name, *given, "--enqueue")
    assert "Enqueueing 0 slots" in again and len(backfill_tasks.executed) == 3


def test_data_backfill__celery_target_needs_the_data_sender(monkeypatch) -> None:
    from tests.support import celery_app, celery_tasks  # noqa: F401 (the task registered)

    row = define_schedule("c1", "tests.support.celery_tasks.tick", every=MINUTE, args=["/dev/null"])
    start, _, given = span(2)
    monkeypatch.delitem(handoff.SENDERS, "data", raising=False)
    with pytest.raises(CommandError, match="no sender is registered for 'data'"):
        backfill(row.task_name, *given)
    monkeypatch.setitem(handoff.SENDERS, "data", handoff.data_sender)
    monkeypatch.setattr(handoff, "DATA_SENDERS", {})  # no Celery glue for data schedules
    with pytest.raises(CommandError, match="nothing here can send its slots"):
        backfill(row.task_name, *given)

    sent: list[tuple[str, datetime, bool]] = []

    class Sender:
        def __init__(self, row: Any, by: str) -> None:
            self.row = row

        def __enter__(self) -> Sender:
            return self

        def __exit__(self, *exc_info: object) -> None:
            pass

        def hand_out(self, slot: datetime, *, missed: bool) -> str:
            sent.append((self.row.task_name, slot, missed))
            return "enqueued (test)"

    monkeypatch.setitem(handoff.SENDERS, "data", Sender)
    out = backfill(row.task_name, *given)
    assert "Enqueued 2 slots" in out
    assert sent == [(row.task_name, start + n * MINUTE, False) for n in range(2)]
