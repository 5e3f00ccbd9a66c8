"""check_schedules and the health/ URL: late, missed, failing, paused; exit codes, JSON,
and who may ask."""

from __future__ import annotations

import io
import json
import subprocess
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

from django_taskguard import health
from django_taskguard.models import RunState, TaskRun

from .support import (
    ROOT,
    data_targets,  # noqa: F401  (registers the schedules' targets)
)
from .support.children import python
from .support.monitoring import DAY, due_slot, finished, run_check, schedule, upkeep_ran
from .support.runs import make_run

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]
HEALTH = reverse("taskguard:health")
TOKEN = "probe-token-0123456789"


@pytest.fixture(autouse=True)
def _upkeep_ran(transactional_db: None) -> None:
    """These tests judge tasks: the upkeep ran (tests/test_upkeep.py judges it)."""
    upkeep_ran()


def test_check_schedules__healthy_when_the_latest_due_slot_ran():
    schedule("tests.nightly")
    finished("tests.nightly", due_slot())
    status, out = run_check()
    assert status == 0, out
    assert "OK" in out and "tests.nightly" in out
    assert "every day" in out
    assert "All 1 tasks are healthy." in out or "1 task is healthy." in out


def test_check_schedules__late_when_the_latest_due_slot_has_no_run():
    schedule("tests.nightly")
    finished("tests.nightly", due_slot() - DAY)  # yesterday's ran, today's did not
    status, out = run_check()
    assert status == 1
    assert "LATE" in out
    assert f"slot {due_slot().isoformat()} has no run" in out
    assert "1 task is unhealthy: tests.nightly" in out


def test_check_schedules__a_schedule_first_seen_after_its_due_slot_is_not_late():
    schedule("tests.new", first_seen=due_slot() + timedelta(seconds=1))
    status, out = run_check()
    assert status == 0, out


def test_check_schedules__a_dead_owner_is_late():
    schedule("tests.nightly")
    make_run("tests.nightly", slot=due_slot(), owner="gone:1:0:dead")  # lease expired
    status, out = run_check()
    assert status == 1
    assert "still running but its lease expired" in out


def test_check_schedules__a_missed_slot_says_why_once_and_the_names_line_up():
    """``was missed: no instance claimed it`` (not ``was missed: missed: ...``); a long
    label (LATE/MISSED) does not push its task's name out of the column."""
    every = timedelta(minutes=1)
    schedule("tests.a_missed", every=every)
    slot = due_slot(every)
    missed = finished("tests.a_missed", slot - 3 * every, RunState.MISSED, attempt=0)
    TaskRun.objects.filter(pk=missed.pk).update(
        error="missed: no instance claimed it within its grace (60s)"
    )
    schedule("tests.b_fine", every=every)
    finished("tests.b_fine", slot)
    status, out = run_check()
    assert status == 1
    assert "was missed: no instance claimed it within its grace (60s)" in out, out
    assert "missed: missed" not in out
    lines = {line.split()[1]: line for line in out.splitlines() if " tests." in line[:20]}
    assert lines["tests.a_missed"].split()[0] == "LATE/MISSED", out
    columns = {line.index(name) for name, line in lines.items()}
    assert len(columns) == 1, out


def test_check_schedules__a_missed_latest_slot_fails_until_a_later_success():
    """The latest outcome decides; the slots missed within the window are counted."""
    schedule("tests.every_minute", every=timedelta(minutes=1))
    slot = due_slot(timedelta(minutes=1))
    finished("tests.every_minute", slot - timedelta(minutes=5))
    missed = finished("tests.every_minute", slot, RunState.MISSED, attempt=0)
    status, out = run_check()
    assert status == 1
    assert "MISSED" in out
    assert f"the {slot.isoformat()} slot was missed" in out
    missed.slot = slot - timedelta(minutes=2)
    missed.save()
    finished("tests.every_minute", slot)
    status, out = run_check("--json")
    assert status == 0, out
    [task] = json.loads(out.splitlines()[0])["tasks"]
    assert task["missed_in_window"] == 1
    with override_settings(TASKGUARD={"BACKEND": "database", "MONITOR_WINDOW_HOURS": 1}):
        missed.slot = slot - timedelta(hours=2)
        missed.save()
        [task] = json.loads(run_check("--json")[1].splitlines()[0])["tasks"]
    assert task["missed_in_window"] == 0  # outside the window


def test_check_schedules__failing_when_the_last_n_runs_failed():
    slot = due_slot()
    schedule("tests.flaky")
    for days in range(3):
        finished("tests.flaky", slot - days * DAY, RunState.FAILED)
    status, out = run_check()
    assert status == 1
    assert "FAILING" in out
    assert f"the {slot.isoformat()} slot failed (its last 3 runs failed)" in out


def test_check_schedules__the_latest_outcome_decides_not_the_streak():
    """A schedule's latest failure fails health at once (one is enough); a failure before
    the latest success does not."""
    slot = due_slot()
    schedule("tests.flaky")
    finished("tests.flaky", slot, RunState.FAILED)
    finished("tests.flaky", slot - DAY, RunState.SUCCEEDED)
    finished("tests.flaky", slot - 2 * DAY, RunState.FAILED)
    status, out = run_check()
    assert status == 1
    assert f"the {slot.isoformat()} slot failed" in out and "its last" not in out
    TaskRun.objects.filter(task_name="tests.flaky", slot=slot).update(state=RunState.SUCCEEDED)
    assert run_check()[0] == 0


def test_check_schedules__a_paused_task_is_healthy_and_says_so():
    schedule("tests.paused", paused=True)  # its due slot has no run, and no alarm
    status, out = run_check()
    assert status == 0, out
    assert "PAUSED" in out
    assert "paused by admin ops" in out
    assert "no alarms while paused" in out


def test_check_schedules__tasks_seen_only_in_the_ledger_are_judged_on_failures():
    for minute in range(3):
        make_run("tests.unscheduled", minute, state=RunState.FAILED)
    status, out = run_check("--json")
    assert status == 1
    verdict = json.loads(out.splitlines()[0])
    (task,) = verdict["tasks"]
    assert task["task"] == "tests.unscheduled"
    assert task["schedule"] is None
    assert [p["code"] for p in task["problems"]] == ["failing"]


def test_check_schedules__json_names_each_task_and_why():
    schedule("tests.nightly")
    schedule("tests.paused", paused=True)
    schedule("tests.fine")
    finished("tests.fine", due_slot())
    status, out = run_check("--json")
    assert status == 1
    verdict = json.loads(out.splitlines()[0])
    assert verdict["healthy"] is False
    assert verdict["unhealthy"] == ["tests.nightly"]
    by_name = {task["task"]: task for task in verdict["tasks"]}
    assert by_name["tests.nightly"]["problems"][0]["code"] == "late"
    assert by_name["tests.paused"]["status"] == "paused"
    assert by_name["tests.paused"]["healthy"] is True
    assert by_name["tests.fine"]["status"] == "ok"
    assert by_name["tests.fine"]["last_success_slot"] == due_slot().isoformat()
    assert by_name["tests.fine"]["next_slot"] == (due_slot() + DAY).isoformat()


@pytest.mark.processes
def test_check_schedules__unknown_task_and_unreachable_database():
    with pytest.raises(CommandError, match="no schedule and no run of a task named 'nope'"):
        call_command("check_schedules", "--task", "nope", stdout=io.StringIO())
    # A real manage.py run (its exit status) against a database nobody listens on.
    child = subprocess.run(
        [python(), "-c", DOWN], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert child.returncode == 2, child.stderr
    assert "check_schedules failed: the taskguard database is unreachable" in child.stderr


DOWN = """
import django, os, sys
os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
django.setup()
from django.conf import settings
settings.TASKGUARD = {"BACKEND": "database", "DATABASE_ALIAS": "down"}
from django.core.management import execute_from_command_line
execute_from_command_line(["manage.py", "check_schedules"])
"""


def test_next_slot__cron_and_interval():
    from datetime import datetime, timezone

    from django_taskguard.schedules import CronSchedule, IntervalSchedule

    now = datetime(2026, 3, 29, 0, 30, tzinfo=timezone.utc)  # Paris springs forward at 01:00 UTC
    assert IntervalSchedule(timedelta(minutes=5)).next_slot(now) == now.replace(minute=35)
    nightly = CronSchedule("0 21 * * *", "Europe/Paris")
    assert nightly.next_slot(now) == datetime(2026, 3, 29, 19, tzinfo=timezone.utc)
    skipped = CronSchedule("30 2 * * *", "Europe/Paris")  # 02:30 does not exist that night
    found = skipped.next_slot(now)
    assert found is not None and skipped.latest_slot(found) == found > now


# -- the health/ URL -----------------------------------------------------------------


def staff_client(is_staff: bool = True, *, can_view: bool = True) -> Client:
    """A signed-in user; staff with the admin's view permission on runs unless told."""
    client = Client()
    name = "ops" if is_staff else "user"
    user = User.objects.create_user(name, password="pw", is_staff=is_staff)
    if can_view:
        user.user_permissions.add(Permission.objects.get(codename="view_taskrun"))
    client.force_login(user)
    return client


def test_health_view__200_when_healthy_503_when_not():
    client = staff_client()
    schedule("tests.nightly")
    finished("tests.nightly", due_slot())
    response = client.get(HEALTH)
    assert response.status_code == 200
    assert response.json()["healthy"] is True
    assert response["Cache-Control"].startswith("max-age=0")
    schedule("tests.late")
    response = client.get(HEALTH)
    assert response.status_code == 503
    assert response.json()["unhealthy"] == ["tests.late"]
    assert client.post(HEALTH).status_code == 405


def test_health_view__staff_only_without_a_token():
    response = Client().get(HEALTH)
    assert response.status_code == 403
    assert "HEALTH_TOKEN" in response.json()["error"]
    assert staff_client(is_staff=False).get(HEALTH).status_code == 403
    # Staff the admin refuses (no view_taskrun) are refused here too.
    refused = staff_client(can_view=False).get(HEALTH)
    assert refused.status_code == 403
    assert "view_taskrun" in refused.json()["error"]
    assert Client().get(HEALTH, headers={"authorization": f"Bearer {TOKEN}"}).status_code == 403


def test_health_view__a_bearer_token_when_set():
    with override_settings(TASKGUARD={"BACKEND": "database", "HEALTH_TOKEN": TOKEN}):
        probe = Client()
        assert probe.get(HEALTH, headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200
        wrong = probe.get(HEALTH, headers={"authorization": f"Bearer {TOKEN}x"})
        assert wrong.status_code == 401
        assert wrong["WWW-Authenticate"] == 'Bearer realm="taskguard"'
        assert probe.get(HEALTH).status_code == 401
        assert staff_client().get(HEALTH).status_code == 200  # staff still may


def test_check_schedules__judges_every_task_past_the_200th():
    """201 tasks: the last by name has missed slots and must fail every verdict."""
    slot = due_slot()
    names = [f"tests.many.{n:03d}" for n in range(201)]
    for name in names:
        schedule(name)
        finished(name, slot)
    TaskRun.objects.filter(task_name=names[-1]).update(state=RunState.MISSED, attempt=0)
    status, out = run_check()
    assert status == 1, out
    assert "tests.many.200" in out and "MISSED" in out
    status, out = run_check("--task", "tests.many.200")
    assert status == 1 and f"the {slot.isoformat()} slot was missed" in out, out
    verdict = json.loads(run_check("--json")[1].splitlines()[0])
    assert len(verdict["tasks"]) == 201
    assert verdict["unhealthy"] == ["tests.many.200"]
    assert staff_client().get(HEALTH).status_code == 503


def test_check_schedules__no_success_for_n_slots_whatever_the_reason():
    """Every later slot skipped, and no run alive behind them: no success is a problem."""
    every = timedelta(minutes=1)
    slot = due_slot(every)
    schedule("tests.hung", every=every)
    finished("tests.hung", slot - 19 * every)
    for n in range(19):
        finished("tests.hung", slot - n * every, RunState.SKIPPED, attempt=0)
    status, out = run_check()
    assert status == 1, out
    assert "no success in its last 3 due slots" in out
    finished("tests.hung", slot - 20 * every)  # an old success does not help
    assert run_check()[0] == 1
    with override_settings(TASKGUARD={"BACKEND": "database", "HEALTH_FAILURES": 21}):
        assert run_check()[0] == 0, "a success within the last 21 due slots"


def long_run_behind_skipped_slots(task: str, running_for: timedelta) -> None:
    """every=1min under overlap="skip": one run alive (renewing its lease) started
    ``running_for`` ago, every slot due since then skipped behind it."""
    every = timedelta(minutes=1)
    slot = due_slot(every)
    schedule(task, every=every)
    behind = int(running_for / every)
    run = make_run(task, slot=slot - behind * every, lease=600.0)
    TaskRun.objects.filter(pk=run.pk).update(started_at=timezone.now() - running_for)
    for n in range(min(behind, 30)):
        finished(task, slot - n * every, RunState.SKIPPED, attempt=0)


def test_check_schedules__a_long_run_under_overlap_skip_is_healthy():
    """every=1min, a 5-minute body, HEALTH_FAILURES=3: the slots skipped behind a run
    whose lease is alive are not counted against it."""
    long_run_behind_skipped_slots("tests.long", timedelta(minutes=5))
    status, out = run_check()
    assert status == 0, out


def test_check_schedules__slots_skipped_behind_the_latest_success_are_not_counted():
    """Between two runs of a 5-minute body at every=1min: no run is alive, and the slots
    due while the latest success ran were skipped behind it; not failing."""
    every = timedelta(minutes=1)
    slot = due_slot(every)
    schedule("tests.between", every=every)
    finished("tests.between", slot - 5 * every, seconds=5 * 60 + 10)  # ended after `slot`
    for n in range(5):
        finished("tests.between", slot - n * every, RunState.SKIPPED, attempt=0)
    status, out = run_check()
    assert status == 0, out


def test_check_schedules__a_run_alive_past_the_bound_is_reported_hung():
    """A body hung under overlap="skip" (its lease renewed, every later slot skipped)
    still fails health once it has run longer than the bound."""
    long_run_behind_skipped_slots("tests.hung", health.HUNG_AFTER + timedelta(minutes=10))
    status, out = run_check()
    assert status == 1, out
    assert "RUNNING" in out and "running for 70m: hung?" in out, out


def test_check_schedules__summary_counts_read_right():
    schedule("tests.words.late")
    schedule("tests.words.fine")
    finished("tests.words.fine", due_slot())
    out = io.StringIO()
    with pytest.raises(CommandError):
        call_command("check_schedules", stdout=out)
    assert "1 of 2 tasks is unhealthy." in out.getvalue(), out.getvalue()


def test_check_schedules_json__the_judged_slot_is_named_for_what_it_is():
    schedule("tests.words.named")
    out = io.StringIO()
    with pytest.raises(CommandError):
        call_command("check_schedules", "--json", stdout=out)
    [task] = json.loads(out.getvalue())["tasks"]
    # The latest slot whose grace has passed (a slot due within its grace is not judged yet).
    assert "latest_due_slot" not in task
    assert task["latest_slot_past_grace"] == due_slot().isoformat()


def test_check_schedules__a_data_schedule_whose_slots_moved_is_not_late_for_the_new_ones():
    """An edit that moves the slots counts them from the edit: the new definition's slot
    before the edit never fires (by design), and is not waited for."""
    from django_taskguard import define_schedule
    from django_taskguard.models import TaskSchedule

    target = "tests.support.data_targets.send_report"
    row = define_schedule("t1", target, every=timedelta(minutes=10), args=[1])
    TaskSchedule.objects.filter(pk=row.pk).update(first_seen=timezone.now() - DAY)
    now = timezone.now()
    ran = now - timedelta(seconds=(now.timestamp() % 600))  # the 10-minute grid's latest
    finished(row.task_name, ran)
    moved = define_schedule("t1", target, every=timedelta(minutes=7), args=[1])
    status, out = run_check()
    assert status == 0, out
    assert moved.task_name in out and "LATE" not in out
