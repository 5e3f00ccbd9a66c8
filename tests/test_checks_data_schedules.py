"""W021: a data schedule whose target this process cannot find is reported by
``manage.py check --database``, in one grouped query whatever the schedules. W037: data
schedules following a value of their target's policy that their definition could not have."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.checks import CheckMessage, run_checks
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_taskguard import define_schedule, delete_schedule
from django_taskguard.checks import check_data_targets
from django_taskguard.models import TaskSchedule
from tests.support import data_targets  # registers the schedules' targets

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]

TARGET = "tests.support.data_targets.send_report"


def w021() -> list[CheckMessage]:
    return [found for found in run_checks(databases=["default"]) if found.id == "taskguard.W021"]


def rename(task_name: str, target: str) -> None:
    """What a deploy that renamed the function leaves: rows naming a target gone."""
    TaskSchedule.objects.filter(task_name=task_name).update(function=target)


def test_check_data_targets__targets_found_here_are_clean() -> None:
    for tenant in range(3):
        define_schedule(f"t{tenant}", TARGET, every=timedelta(minutes=5), args=[tenant])
    assert w021() == []


def test_check_data_targets__a_target_gone_is_one_warning_with_its_count() -> None:
    rows = [
        define_schedule(f"t{tenant}", TARGET, every=timedelta(minutes=5), args=[tenant])
        for tenant in range(3)
    ]
    for row in rows[:2]:
        rename(row.task_name, "tests.support.data_targets.send_report_renamed")
    rename(rows[2].task_name, "tests.support.data_targets.not_guarded")
    found = w021()
    assert len(found) == 2
    gone = next(m for m in found if "send_report_renamed" in m.msg)
    assert gone.msg.startswith("2 data schedules (t0, t1) run ")
    assert "is not a guarded task" in gone.msg
    assert "records them missed" in gone.msg and gone.hint
    unguarded = next(m for m in found if "not_guarded" in m.msg)
    assert unguarded.msg.startswith("1 data schedule (t2) runs ")
    assert "is not a guarded task" in unguarded.msg


def test_check_data_targets__names_five_schedules_then_how_many_more() -> None:
    for tenant in range(8):
        define_schedule(f"t{tenant}", TARGET, every=timedelta(minutes=5), args=[tenant])
    TaskSchedule.objects.filter(function=TARGET).update(function="tests.nowhere.job")
    (found,) = w021()
    assert found.msg.startswith("8 data schedules (t0, t1, t2, t3, t4 and 3 more) run ")


def test_check_data_targets__deleted_and_disabled_schedules_are_not_reported() -> None:
    deleted = define_schedule("gone", TARGET, every=timedelta(minutes=5), args=[1])
    disabled = define_schedule("off", TARGET, every=timedelta(minutes=5), args=[2], enabled=False)
    assert delete_schedule("gone", TARGET)
    rename(deleted.task_name, "tests.nowhere.job")
    rename(disabled.task_name, "tests.nowhere.job")
    assert w021() == []
    TaskSchedule.objects.filter(task_name=disabled.task_name).update(enabled=True)
    assert len(w021()) == 1  # the same row enabled: reported


def test_check_data_targets__one_query_whatever_the_schedules() -> None:
    for tenant in range(30):
        define_schedule(f"t{tenant}", TARGET, every=timedelta(minutes=5), args=[tenant])
    with CaptureQueriesContext(connection) as queries:
        assert check_data_targets(databases=["default"]) == []
    assert len(queries) == 1


def test_check_data_targets__only_with_the_ledgers_database() -> None:
    row = define_schedule("t", TARGET, every=timedelta(minutes=5), args=[1])
    rename(row.task_name, "tests.nowhere.job")
    assert check_data_targets(databases=None) == []
    assert len(check_data_targets(databases=["default"])) == 1


def test_check_data_targets__a_jitter_the_targets_new_grace_no_longer_covers_is_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, grace in (("follows", None), ("own", 120)):
        define_schedule(name, TARGET, every=timedelta(hours=1), args=[1], jitter=60, grace=grace)
    assert [m for m in run_checks(databases=["default"]) if m.id == "taskguard.W037"] == []
    data_targets.redeploy(monkeypatch, grace=timedelta(seconds=30))
    (found,) = [m for m in run_checks(databases=["default"]) if m.id == "taskguard.W037"]
    assert found.msg.startswith(f"1 data schedule (follows) of {TARGET!r} follows ")
    assert "grace 30 s" in found.msg and found.hint
