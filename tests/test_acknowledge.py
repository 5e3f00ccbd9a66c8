"""A slot that did not succeed fails health until a later slot succeeds or an operator
acknowledges it (``manage.py acknowledge``); the acknowledgement is kept (who, when, why)
and a later problem fails health again."""

from __future__ import annotations

import io
import json
from datetime import datetime, timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from django_taskguard.ledger import schedules as store
from django_taskguard.models import (
    RunState,
    ScheduleEventKind,
    ScheduleEventOrigin,
    TaskRun,
    Upkeep,
)

from .support.monitoring import due_slot, finished, run_check, schedule, upkeep_ran
from .support.runs import make_run

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]
EVERY = timedelta(minutes=1)
TASK = "tests.nightly"


@pytest.fixture(autouse=True)
def _upkeep_ran(transactional_db: None) -> None:
    """These tests judge tasks: the upkeep ran (tests/test_upkeep.py judges it)."""
    upkeep_ran()


def verdict_of(task: str) -> dict[str, object]:
    _, out = run_check("--json", "--task", task)
    [found] = json.loads(out.splitlines()[0])["tasks"]
    assert isinstance(found, dict)
    return found


def acknowledge(*args: str) -> str:
    out = io.StringIO()
    call_command("acknowledge", *args, stdout=out)
    return out.getvalue()


def problem_then(task: str, state: str) -> datetime:
    """Every-minute ``task`` whose due slot ended ``state`` after earlier successes."""
    schedule(task, every=EVERY)
    slot = due_slot(EVERY)
    for n in range(1, 4):
        finished(task, slot - n * EVERY)
    finished(task, slot, state, attempt=0 if state == RunState.MISSED else 1)
    TaskRun.objects.filter(task_name=task, slot=slot).update(error="killed mid-run")
    return slot


@pytest.mark.parametrize(
    ("state", "code", "words"),
    [
        (RunState.ABANDONED, "FAILING", "was abandoned: killed mid-run"),
        (RunState.FAILED, "FAILING", "failed: killed mid-run"),
        (RunState.MISSED, "MISSED", "was missed"),
    ],
)
def test_acknowledge__a_problem_slot_fails_health_until_acknowledged(state, code, words):
    slot = problem_then(TASK, state)
    status, out = run_check()
    assert status == 1, out
    assert code in out and f"the {slot.isoformat()} slot {words}" in out, out

    said = acknowledge(TASK, "--reason", "known: the host was rebooted")
    assert f"Acknowledged {TASK} up to " in said and "1 problem slot " in said, said
    status, out = run_check()
    assert status == 0, out
    assert "acknowledged by " in out and "(known: the host was rebooted)" in out, out
    task = verdict_of(TASK)
    assert task["acknowledged_until"] is not None
    ack = task["acknowledgement"]
    assert isinstance(ack, dict)
    assert ack["reason"] == "known: the host was rebooted"
    assert ack["origin"] == ScheduleEventOrigin.COMMAND and "@" in ack["by"] and ack["at"]
    [event] = store.events(TASK)
    assert event.kind == ScheduleEventKind.ACKNOWLEDGED and event.reason.startswith("known")


def test_acknowledge__a_new_problem_after_it_fails_health_again():
    slot = due_slot(EVERY)
    schedule(TASK, every=EVERY)
    finished(TASK, slot - 3 * EVERY)
    finished(TASK, slot - 2 * EVERY, RunState.ABANDONED)
    finished(TASK, slot - EVERY, RunState.SKIPPED, attempt=0)
    make_run(TASK, slot=slot, lease=600.0)  # in flight: not judged yet
    status, out = run_check()
    assert status == 1 and f"the {(slot - 2 * EVERY).isoformat()} slot was abandoned" in out

    until = (slot - EVERY).isoformat()
    said = acknowledge(TASK, "--until", until, "--reason", "nightly killed by the deploy")
    assert "1 problem slot " in said, said
    assert run_check()[0] == 0
    assert verdict_of(TASK)["acknowledged_until"] == (slot - EVERY).isoformat()

    TaskRun.objects.filter(task_name=TASK, slot=slot).update(
        state=RunState.FAILED, lease_until=None, finished_at=timezone.now(), error="boom"
    )
    status, out = run_check()
    assert status == 1, out
    assert f"the {slot.isoformat()} slot failed: boom" in out, out
    said = acknowledge(TASK, "--reason", "boom is known")
    assert "1 problem slot (failed, abandoned or missed) after " in said, said
    assert run_check()[0] == 0
    assert [e.reason for e in store.events(TASK)] == [
        "boom is known",
        "nightly killed by the deploy",
    ]


@pytest.mark.parametrize("state", [RunState.FAILED, RunState.ABANDONED, RunState.MISSED])
def test_verdict__a_later_success_clears_without_acknowledging(state):
    slot = due_slot(EVERY)
    schedule(TASK, every=EVERY)
    finished(TASK, slot - 2 * EVERY)
    finished(TASK, slot - EVERY, state, attempt=0 if state == RunState.MISSED else 1)
    run = make_run(TASK, slot=slot, lease=600.0)
    status, out = run_check()
    assert status == 1 and f"the {(slot - EVERY).isoformat()} slot" in out, out
    TaskRun.objects.filter(pk=run.pk).update(
        state=RunState.SUCCEEDED, lease_until=None, finished_at=timezone.now()
    )
    status, out = run_check()
    assert status == 0, out
    assert verdict_of(TASK)["acknowledged_until"] is None


def test_verdict__acknowledged_slots_are_not_late():
    schedule(TASK, every=EVERY)
    slot = due_slot(EVERY)
    finished(TASK, slot - EVERY)
    assert "LATE" in run_check()[1]
    acknowledge(TASK, "--reason", "the host is being replaced")
    assert run_check()[0] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([TASK], "--reason"),
        ([TASK, "--reason", "  "], "needs a reason"),
        ([TASK, "--reason", "x", "--until", "2999-01-01T00:00:00Z"], "in the future"),
        ([TASK, "--reason", "x", "--until", "yesterday"], "is not an ISO-8601 time"),
        ([TASK, "--reason", "x", "--until", "2024-01-01T00:00:00"], "has no UTC offset"),
        (["tests.nightlx", "--reason", "x"], "did you mean tests.nightly"),
    ],
)
def test_acknowledge_command__bad_input_is_a_clear_error(args, message):
    schedule(TASK, every=EVERY)
    with pytest.raises(CommandError, match=message.replace("?", r"\?")):
        acknowledge(*args)
    assert store.events(TASK) == []


def admin_client(name: str, *perms: str) -> Client:
    user = User.objects.create_user(name, password="pw", is_staff=True)
    for codename in ("view_taskrun", *perms):
        user.user_permissions.add(Permission.objects.get(codename=codename))
    client = Client()
    client.force_login(user)
    return client


def test_overview_acknowledge__needs_the_permission_a_post_and_a_reason():
    slot = problem_then(TASK, RunState.ABANDONED)
    url = reverse("admin:taskguard_taskrun_pause")
    overview = reverse("admin:taskguard_taskrun_overview")
    viewer = admin_client("viewer")
    assert 'value="acknowledge"' not in viewer.get(overview).content.decode()
    assert viewer.post(url, {"task": TASK, "do": "acknowledge"}).status_code == 403

    pauser = admin_client("pauser", "pause_taskschedule")  # acknowledging is not pausing
    assert 'value="acknowledge"' not in pauser.get(overview).content.decode()
    assert pauser.post(url, {"task": TASK, "do": "acknowledge"}).status_code == 403
    confirmed = {"task": TASK, "do": "acknowledge", "confirm": "yes", "reason": "known"}
    assert pauser.post(url, confirmed).status_code == 403
    assert store.events(TASK) == []

    operator = admin_client("ops", "acknowledge_taskschedule")
    assert 'value="acknowledge"' in operator.get(overview).content.decode()
    assert operator.post(url, {"task": TASK, "do": "pause", "confirm": "yes"}).status_code == 403
    assert operator.get(url).status_code == 405
    asked = operator.post(url, {"task": TASK, "do": "acknowledge"})
    assert f"Acknowledge {TASK}?" in asked.content.decode()
    again = operator.post(url, {"task": TASK, "do": "acknowledge", "confirm": "yes"})
    assert "needs a reason" in again.content.decode()
    assert store.events(TASK) == [] and run_check()[0] == 1

    done = operator.post(
        url, {"task": TASK, "do": "acknowledge", "confirm": "yes", "reason": "known"}, follow=True
    )
    page = done.content.decode()
    assert f"Acknowledged the problems of {TASK}." in page
    assert "acknowledged by ops from the admin" in page and ": known" in page
    assert page.count('class="taskguard-event"') == 1  # its history: the acknowledgement
    assert run_check()[0] == 0
    [event] = store.events(TASK)
    assert (event.by, event.origin, event.reason) == ("ops", ScheduleEventOrigin.ADMIN, "known")
    assert event.until is not None and event.until >= slot


def test_histories__each_tasks_latest_events_newest_first():
    now = timezone.now()
    for n, kind in enumerate([ScheduleEventKind.PAUSED, ScheduleEventKind.RESUMED] * 2):
        at = now - timedelta(minutes=10 - n)
        store.record_event(TASK, kind, origin=ScheduleEventOrigin.COMMAND, reason=f"{n}", at=at)
    store.record_event("tests.other", ScheduleEventKind.PAUSED, origin=ScheduleEventOrigin.ADMIN)
    found = store.histories([TASK, "tests.other", "tests.none"], 3)
    assert [event.reason for event in found[TASK]] == ["3", "2", "1"]
    assert [event.kind for event in found["tests.other"]] == [ScheduleEventKind.PAUSED]
    assert found["tests.none"] == []


def test_acknowledge__covers_no_slot_still_in_flight():
    # Review of issue 22: "until" defaulted to now, so a run in flight when the operator
    # acknowledged, failing later, was acknowledged before it happened.
    slot = due_slot(EVERY)
    schedule(TASK, every=EVERY)
    finished(TASK, slot - 2 * EVERY, RunState.ABANDONED)
    make_run(TASK, slot=slot - EVERY, lease=600.0)  # running now
    acknowledge(TASK, "--reason", "the abandoned one is known")
    assert verdict_of(TASK)["acknowledged_until"] < (slot - EVERY).isoformat()
    TaskRun.objects.filter(task_name=TASK, slot=slot - EVERY).update(
        state=RunState.FAILED, lease_until=None, finished_at=timezone.now(), error="late boom"
    )
    status, out = run_check()
    assert status == 1 and "failed: late boom" in out, out


def test_upkeep_verdict__a_failed_part_is_a_problem_and_the_limit_follows_the_slots():
    from django_taskguard import health
    from django_taskguard.ledger import upkeep as upkeep_store

    schedule(TASK, every=timedelta(hours=1))
    now = timezone.now()
    # An hourly schedule whose calls start the upkeep: an upkeep 10 minutes ago is in time
    # (the limit is two of its gaps, not three minutes).
    assert upkeep_store.take("tests#1", timedelta(seconds=60), timedelta(0))
    assert upkeep_store.finish("tests#1", {}, "")
    Upkeep.objects.filter(id=1).update(finished_at=now - timedelta(minutes=10))
    kept = health.check().upkeep
    assert kept is not None and not kept.problem, kept
    assert kept.limit >= timedelta(hours=2)
    assert upkeep_store.take("tests#2", timedelta(seconds=60), timedelta(0))
    assert upkeep_store.finish("tests#2", {}, "lock: ConnectionError: Redis is down")
    kept = health.check().upkeep
    assert kept is not None and "failed in part" in kept.problem and "Redis is down" in kept.problem
    assert kept.ran_by == "tests"  # the holder's token is not shown
