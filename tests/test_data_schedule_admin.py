"""Data schedules in the admin through the test client: created and edited through
define_schedule (validated, each change kept with who, why and what changed), deleted to a
tombstone, run now and backfilled (preview, then confirm) through a runner the test
registers, each behind its own permission; a view-only user changes nothing; the list's
statements do not grow with its rows."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_taskguard import data_schedules, define_schedule, ledger
from django_taskguard.missed import sweep_missed
from django_taskguard.models import (
    RunState,
    ScheduleEvent,
    TaskRun,
    TaskSchedule,
)
from django_taskguard.testing import freeze_now
from tests.support import data_targets  # registers the schedules' targets

from .support.monitoring import finished, schedule

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]

TARGET = "tests.support.data_targets.send_report"
CHANGELIST = reverse("admin:taskguard_taskschedule_changelist")
ADD = reverse("admin:taskguard_taskschedule_add")
MINUTE = timedelta(minutes=1)
NOT_GUARDED = "is not a guarded task"
EDITOR_PERMS = ("view_taskschedule", "add_taskschedule", "change_taskschedule")


def login(username: str, *perms: str) -> Client:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    for codename in perms:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    client = Client()
    client.force_login(user)
    return client


def change_url(row: TaskSchedule) -> str:
    return reverse("admin:taskguard_taskschedule_change", args=[row.pk])


def form_data(**given: str) -> dict[str, str]:
    """An add/change form's POST: every field, empty unless given."""
    data = {
        "entry": "tenant-42",
        "function": TARGET,
        "cron": "0 9 * * *",
        "every": "",
        "time_zone": "America/New_York",
        "args": "[42]",
        "kwargs": '{"fmt": "csv"}',
        "enabled": "on",
        "starts": "",
        "ends": "",
        "catchup": "",
        "grace": "",
        "max_catchup": "",
        "pause_after_failures": "",
        "jitter": "",
        "description": "",
        "reason": "",
        "_save": "Save",
    }
    data.update(given)
    return {name: value for name, value in data.items() if value is not None}


def errors(response: Any) -> dict[str, list[str]]:
    form = response.context["adminform"].form
    return {field: [str(e) for e in found] for field, found in form.errors.items()}


def said(response: Any) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def act(client: Client, action: str, rows: list[TaskSchedule], **extra: str) -> Any:
    data = {"action": action, "index": "0", ACTION_CHECKBOX_NAME: [r.pk for r in rows], **extra}
    return client.post(CHANGELIST, data, follow=True)


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, datetime, str]]:
    """A runner for function targets that keeps what it was handed and records each slot
    as handed out (a pending row), as a real executor's hand-off does."""
    got: list[tuple[str, datetime, str]] = []

    def runner(row: TaskSchedule, slot: datetime, who: str) -> str:
        got.append((row.task_name, slot, who))
        ledger.insert_pending(row.task_name, slot)
        return f"handed out {slot.isoformat()}"

    monkeypatch.setitem(data_schedules.RUNNERS, "function", runner)
    return got


def tenant(**given: Any) -> TaskSchedule:
    values: dict[str, Any] = {"cron": "0 9 * * *", "time_zone": "America/New_York", "args": [42]}
    values.update(given)
    return define_schedule("tenant-42", TARGET, **values)


# -- create and edit -----------------------------------------------------------------------


def test_add__creates_a_data_schedule_with_arguments_and_a_zone() -> None:
    editor = login("eve", *EDITOR_PERMS)
    assert 'list="taskguard-time-zones"' in editor.get(ADD).content.decode()
    assert "Europe/Berlin" in editor.get(ADD).content.decode()  # the zones offered
    response = editor.post(ADD, form_data(reason="tenant 42 signed up", starts="2026-12-01 08:00"))
    assert response.status_code == 302, errors(response)
    row = TaskSchedule.objects.get(task_name=f"{TARGET}[tenant-42]")
    assert (row.source, row.target_kind, row.version) == ("data", "function", 1)
    assert (row.args, row.kwargs) == ([42], {"fmt": "csv"})
    assert (row.cron, row.time_zone) == ("0 9 * * *", "America/New_York")
    # starts typed in the schedule's zone: 08:00 in New York is 13:00 UTC.
    assert row.starts is not None and row.starts.isoformat() == "2026-12-01T13:00:00+00:00"
    event = ScheduleEvent.objects.get(task_name=row.task_name)
    assert (event.kind, event.by, event.origin, event.version) == ("created", "eve", "admin", 1)
    assert event.reason == "tenant 42 signed up"
    assert event.changes["args"] == [None, [42]]


@pytest.mark.parametrize(
    ("given", "field", "says"),
    [
        ({"cron": "61 * * * *"}, "cron", "61"),
        ({"time_zone": "Mars/Olympus"}, "time_zone", "unknown time zone"),
        ({"function": "tests.support.data_targets.not_guarded"}, "function", NOT_GUARDED),
        ({"function": "no.such.task"}, "function", NOT_GUARDED),
        # A module raising ImproperlyConfigured when imported: a form error, never a 500
        # (and never imported: only the guarded tasks are looked at).
        ({"function": "tests.support.import_refused.job"}, "function", NOT_GUARDED),
        ({"args": "[]"}, "kwargs", "does not take these arguments"),
        ({"kwargs": '{"nope": 1}'}, "kwargs", "does not take these arguments"),
        ({"args": "{not json"}, "args", "valid JSON"),
        ({"args": '{"a": 1}'}, "args", "JSON list"),
        ({"cron": "", "every": ""}, "cron", "cron expression or an interval"),
        ({"cron": "", "every": "60"}, "time_zone", "interval"),
        ({"starts": "soon"}, "starts", "is not a date and time"),
        ({"starts": "2026-12-02 00:00", "ends": "2026-12-01 00:00"}, "ends", "after starts"),
        ({"grace": "30 00:00:00"}, "grace", "grace must be"),
        ({"entry": "x" * 201}, "entry", "at most 200 characters"),
        ({"entry": ""}, "entry", "required"),
    ],
)
def test_add__bad_input_shows_the_fields_message_and_saves_nothing(
    given: dict[str, str], field: str, says: str
) -> None:
    editor = login("eve", *EDITOR_PERMS)
    response = editor.post(ADD, form_data(**given))
    assert response.status_code == 200
    found = errors(response)
    assert field in found, found
    assert any(says in message for message in found[field]), found
    assert not TaskSchedule.objects.exists()
    assert not ScheduleEvent.objects.exists()


def test_add__an_existing_name_is_refused() -> None:
    tenant()
    response = login("eve", *EDITOR_PERMS).post(ADD, form_data(args="[43]"))
    assert "exists already: edit it instead" in errors(response)["entry"][0]
    assert TaskSchedule.objects.get().args == [42]


def test_edit__keeps_the_history_with_what_changed_newest_first() -> None:
    row = tenant()
    editor = login("eve", *EDITOR_PERMS)
    page = editor.get(change_url(row)).content.decode()
    assert 'name="entry"' not in page and 'name="function"' not in page  # fixed
    assert "fixed once created: another name or target is another schedule" in page
    response = editor.post(
        change_url(row),
        form_data(
            cron="30 10 * * *", args="[43]", kwargs="{}", entry="renamed", reason="moved to 10:30"
        ),
    )
    assert response.status_code == 302, errors(response)
    stored = TaskSchedule.objects.get(pk=row.pk)
    assert (stored.cron, stored.args, stored.version, stored.entry) == (
        "30 10 * * *", [43], 2, "tenant-42",
    )  # fmt: skip
    edited = ScheduleEvent.objects.get(task_name=row.task_name, kind="edited")
    assert edited.changes == {"cron": ["0 9 * * *", "30 10 * * *"], "args": [[42], [43]]}
    assert (edited.by, edited.origin, edited.version, edited.reason) == (
        "eve", "admin", 2, "moved to 10:30",
    )  # fmt: skip
    unchanged = form_data(cron="30 10 * * *", args="[43]", kwargs="{}", enabled=None)
    pauser = login("pam", *EDITOR_PERMS, "pause_taskschedule")  # enabled needs it
    disabled = pauser.post(change_url(row), unchanged)
    assert disabled.status_code == 302
    html = editor.get(change_url(row)).content.decode()
    history = html.split('class="module taskguard-history"', 1)[1]
    kinds = re.findall(r'<tr class="taskguard-event" data-kind="(\w+)">', history)
    assert kinds == ["disabled", "edited", "created"]
    versions = re.findall(r'class="taskguard-event-version">(\d+)<', history)
    assert versions == ["3", "2", "1"]
    assert "<strong>cron</strong>: 0 9 * * * → 30 10 * * *" in history
    assert "<strong>positional arguments</strong>: [42] → [43]" in history
    assert "moved to 10:30" in history and "eve" in history and "pam" in history
    # The form's labels, not the columns' names (entry, function, cron_day_or, target_kind).
    shown = set(re.findall(r"<strong>([^<]+)</strong>:", history))
    assert {"name", "target", "cron", "time zone", "positional arguments"} <= shown, shown
    assert not {"entry", "function", "cron_day_or", "target_kind", "args"} & shown, shown
    assert "none: disabled" in html  # no next slot while disabled


def test_add_and_edit__empty_policy_fields_stay_empty_and_say_what_they_follow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    editor = login("eve", *EDITOR_PERMS)
    assert editor.get(ADD).context["adminform"].form["catchup"].value() == ""
    response = editor.post(ADD, form_data())
    assert response.status_code == 302, errors(response)
    row = TaskSchedule.objects.get(task_name=f"{TARGET}[tenant-42]")
    assert (row.catchup, row.grace, row.max_catchup) == ("", None, None)
    page = editor.get(change_url(row))
    form = page.context["adminform"].form
    shown = [form[name].value() for name in ("catchup", "grace", "max_catchup")]
    assert shown == ["", None, None]
    html = page.content.decode()
    assert re.search(r'<input type="text" name="grace"(?![^>]*value=)[^>]*>', html)
    assert "Empty: the target's (300 s), followed if it changes." in html
    assert "Empty: the target's (100), followed if it changes." in html
    assert '<option value="" selected>the target&#x27;s (latest)</option>' in html
    # A deploy changes the decorator: the page says what the schedule follows now.
    data_targets.redeploy(monkeypatch, catchup="none", grace=timedelta(minutes=20))
    html = editor.get(change_url(row)).content.decode()
    assert "Empty: the target's (1200 s), followed if it changes." in html
    assert "the target&#x27;s (none)" in html
    # Saved again with the fields empty: nothing changed, nothing written.
    assert editor.post(change_url(row), form_data()).status_code == 302
    assert TaskSchedule.objects.get(pk=row.pk).version == 1


@freeze_now(datetime(2026, 12, 7, 15, 0, tzinfo=UTC))  # the next five 09:00s are all in EST
def test_change_page__next_slots_in_its_zone_and_in_utc_and_its_runs() -> None:
    row = tenant()
    TaskRun.objects.create(
        task_name=row.task_name, slot=timezone.now() - MINUTE, state="succeeded",
        schedule_version=1,
    )  # fmt: skip
    viewer = login("vic", "view_taskschedule", "view_taskrun")
    html = viewer.get(change_url(row)).content.decode()
    slots = re.findall(r'<li data-slot="([^"]+)">([^<]+)<span class="quiet">\(([^)]+)\)', html)
    assert len(slots) == 5
    first = datetime.fromisoformat(slots[0][0])
    assert first > timezone.now()
    for _iso, here, utc in slots:
        assert here.strip().endswith("09:00:00 EST") and utc.endswith("14:00:00 UTC"), (here, utc)
    runs = viewer.get(f"/admin/taskguard/taskrun/?task_name={row.task_name}").content.decode()
    assert f"?task_name={row.task_name.replace('[', '%5B').replace(']', '%5D')}" in html
    assert 'class="taskguard-version quiet" title="schedule version">v1<' in runs
    run = TaskRun.objects.get()
    detail = viewer.get(reverse("admin:taskguard_taskrun_change", args=[run.pk])).content.decode()
    assert re.search(r"field-schedule_version.*?<div class=\"readonly\">1</div>", detail, re.S)


# -- delete --------------------------------------------------------------------------------


def test_delete__leaves_a_tombstone_its_runs_and_history_then_retire_deletes_it() -> None:
    row = tenant()
    run = finished(row.task_name, timezone.now() - MINUTE)
    deleter = login("dee", "view_taskschedule", "change_taskschedule", "delete_taskschedule")
    delete_url = reverse("admin:taskguard_taskschedule_delete", args=[row.pk])
    confirm = deleter.get(delete_url)
    assert confirm.status_code == 200
    # Regression (issue 33): Django's stock "will be deleted", then both "its row stays"
    # and "was deleted successfully". It says what happens, and one thing after.
    page = confirm.content.decode()
    assert "will be deleted" not in page and "deleted-objects" not in page
    assert "It stops firing" in page and "marked removed, until you retire it" in page
    response = deleter.post(delete_url, {"post": "yes"}, follow=True)
    (message,) = said(response)
    assert message.startswith(f"The schedule “{row}” was removed: nothing fires it any more")
    assert "deleted" not in message
    stored = TaskSchedule.objects.get(pk=row.pk)
    assert stored.removed_at is not None and not stored.enabled and stored.version == 2
    assert TaskRun.objects.filter(pk=run.pk).exists()
    deleted = ScheduleEvent.objects.get(task_name=row.task_name, kind="deleted")
    assert (deleted.by, deleted.origin) == ("dee", "admin")
    page = deleter.get(change_url(stored)).content.decode()
    assert 'name="_save"' not in page and "none: deleted" in page  # a tombstone is history
    assert deleter.get(delete_url).status_code == 403  # deleted already
    assert act(deleter, "retire_schedules", [stored], confirm="yes").status_code == 200
    assert not TaskSchedule.objects.filter(pk=row.pk).exists()
    assert TaskRun.objects.filter(pk=run.pk).exists()


def test_retire__waits_for_the_slots_a_deletion_left_owed_and_says_until_when() -> None:
    row = define_schedule("tenant-7", TARGET, every=MINUTE, args=[7])
    TaskSchedule.objects.filter(pk=row.pk).update(
        first_seen=timezone.now() - timedelta(hours=1), swept_until=None
    )
    assert data_schedules.delete_schedule("tenant-7", TARGET)
    stored = TaskSchedule.objects.get(pk=row.pk)
    assert stored.owed_due_at is not None  # the hour's slots, judged after their grace
    admin = login("rita", "view_taskschedule", "change_taskschedule", "delete_taskschedule")
    response = act(admin, "retire_schedules", [stored], confirm="yes")
    assert any(m.startswith("Not retired yet: ") for m in said(response)), said(response)
    assert TaskSchedule.objects.filter(pk=row.pk).exists()
    sweep_missed(now=stored.owed_due_at + MINUTE)
    assert TaskRun.objects.filter(task_name=row.task_name, state=RunState.MISSED).exists()
    response = act(admin, "retire_schedules", [stored], confirm="yes")
    assert not TaskSchedule.objects.filter(pk=row.pk).exists()


# -- run now -------------------------------------------------------------------------------


def test_run_now__asks_then_hands_a_manual_slot_to_the_runner_with_who_asked(handed) -> None:
    row = tenant()
    runner = login("rita", "view_taskschedule", "run_taskschedule")
    asked = act(runner, "run_now_schedules", [row])
    assert "not in this web request" in asked.content.decode() and not handed
    done = act(runner, "run_now_schedules", [row], confirm="yes")
    ((task, slot, who),) = handed
    assert (task, who) == (row.task_name, "rita")
    assert slot.microsecond != 0  # a manual slot never takes one of the schedule's
    assert said(done) == [f"Run now of {row.task_name}: handed out {slot.isoformat()}"]
    # The admin capitalises a message's first letter: a dotted path does not start it.
    shown = done.content.decode()
    assert f"Run now of {row.task_name}" in shown and row.task_name.capitalize() not in shown
    event = ScheduleEvent.objects.get(task_name=row.task_name, kind="run_now")
    assert (event.by, event.origin) == ("rita", "admin")
    # the change page's button posts the same action
    assert 'value="run_now_schedules"' in runner.get(change_url(row)).content.decode()


def test_run_now__without_a_runner_is_an_error_message_not_a_500(monkeypatch) -> None:
    row = tenant()
    monkeypatch.delitem(data_schedules.RUNNERS, "function", raising=False)
    done = act(login("rita", "view_taskschedule", "run_taskschedule"), "run_now_schedules",
               [row], confirm="yes")  # fmt: skip
    assert done.status_code == 200
    assert any("nothing here can hand out a function slot" in m for m in said(done))
    assert not ScheduleEvent.objects.filter(kind="run_now").exists()


def test_run_now_and_backfill__refused_without_their_permission(handed) -> None:
    row = tenant()
    viewer = login("vic", "view_taskschedule", "backfill_taskschedule")
    assert act(viewer, "run_now_schedules", [row], confirm="yes").status_code == 403
    other = login("ron", "view_taskschedule", "run_taskschedule")
    backfill = {"from": "2026-11-01 00:00", "to": "2026-11-02 00:00", "confirm": "yes"}
    assert act(other, "backfill_schedules", [row], **backfill).status_code == 403
    assert not handed
    assert not ScheduleEvent.objects.exclude(kind="created").exists()
    page = other.get(change_url(row)).content.decode()
    assert 'value="run_now_schedules"' in page and 'value="backfill_schedules"' not in page


def test_run_now__code_schedules_are_told_to_use_manage_py_backfill(handed) -> None:
    code = schedule("jobs.sync", every=MINUTE)
    done = act(login("rita", "view_taskschedule", "run_taskschedule"), "run_now_schedules",
               [code], confirm="yes")  # fmt: skip
    assert any("are for data schedules" in m and "manage.py backfill" in m for m in said(done))
    assert not handed


# -- backfill ------------------------------------------------------------------------------


def test_backfill__previews_then_hands_out_each_slot_without_a_row(handed) -> None:
    row = define_schedule("every-minute", TARGET, every=MINUTE, args=[7])
    base = timezone.now().replace(second=0, microsecond=0) - 10 * MINUTE
    finished(row.task_name, base + 3 * MINUTE)  # ran: left alone
    finished(row.task_name, base + 2 * MINUTE, RunState.MISSED)  # listed apart
    local = timezone.localtime  # the schedule has no zone: TIME_ZONE (Europe/Paris)
    start, end = f"{local(base):%Y-%m-%d %H:%M}", f"{local(base + 4 * MINUTE):%Y-%m-%d %H:%M}"
    user = login("bea", "view_taskschedule", "backfill_taskschedule")
    asked = act(user, "backfill_schedules", [row]).content.decode()
    assert "a date and time in Europe/Paris" in asked and 'name="from"' in asked
    preview = act(user, "backfill_schedules", [row], **{"from": start, "to": end})
    page = preview.content.decode()
    assert "3 slots would be handed out; 1 already have a row." in page
    listed = re.findall(r"<li>([^<]+ UTC\))</li>", page.split("taskguard-backfill-slots")[1])
    assert len(listed) == 4  # three to hand out, one missed (listed apart)
    assert "Recorded missed by the sweep" in page and not handed
    done = act(user, "backfill_schedules", [row], **{"from": start, "to": end, "confirm": "yes"})
    expected = [base, base + MINUTE, base + 4 * MINUTE]
    assert [slot for _task, slot, _who in handed] == expected
    assert {who for _task, _slot, who in handed} == {"bea"}
    assert said(done) == [f"Backfill of {row.task_name}: 3 slots handed out."]
    event = ScheduleEvent.objects.get(task_name=row.task_name, kind="backfill")
    assert event.by == "bea" and "3 slots handed out" in event.reason
    assert base.isoformat()[:16] in event.reason or start[:10] in event.reason
    again = act(user, "backfill_schedules", [row], **{"from": start, "to": end})
    assert "0 slots would be handed out; 4 already have a row." in again.content.decode()


def test_backfill__too_many_slots_and_bad_ranges_are_refused(handed) -> None:
    row = define_schedule("every-second", TARGET, every=timedelta(seconds=1), args=[7])
    user = login("bea", "view_taskschedule", "backfill_taskschedule")
    for given, says in (
        ({"from": "2026-11-01 00:00", "to": "2026-11-02 00:00"}, "more than 10,000 slots"),
        ({"from": "yesterday", "to": "2026-11-02 00:00"}, "is not a date and time"),
        ({"from": "2026-11-02 00:00", "to": "2026-11-01 00:00"}, "ends before it starts"),
    ):
        page = act(user, "backfill_schedules", [row], confirm="yes", **given).content.decode()
        assert 'class="errornote"' in page and says in page, given
    assert not handed
    assert not ScheduleEvent.objects.filter(kind="backfill").exists()


# -- who may do what -----------------------------------------------------------------------


def test_view_only__sees_everything_and_changes_nothing(handed) -> None:
    row = tenant()
    viewer = login("vic", "view_taskschedule")
    listing = viewer.get(CHANGELIST).content.decode()
    assert "send_<wbr>report<wbr>[tenant-42]" in listing  # it may wrap between its words
    assert "run_now_schedules" not in listing and "backfill_schedules" not in listing
    assert ADD not in listing
    page = viewer.get(change_url(row)).content.decode()
    assert "taskguard-history" in page and 'data-kind="created"' in page
    assert page.count("<li data-slot=") == 5
    for control in ('name="_save"', "deletelink", "run_now_schedules", "backfill_schedules",
                    'name="cron"'):  # fmt: skip
        assert control not in page, control
    assert viewer.get(ADD).status_code == 403
    assert viewer.post(ADD, form_data(entry="other")).status_code == 403
    assert viewer.post(change_url(row), form_data(cron="0 10 * * *")).status_code == 403
    delete_url = reverse("admin:taskguard_taskschedule_delete", args=[row.pk])
    assert viewer.post(delete_url, {"post": "yes"}).status_code == 403
    backfill = {"from": "2026-11-01 00:00", "to": "2026-11-02 00:00", "confirm": "yes"}
    assert act(viewer, "run_now_schedules", [row], confirm="yes").status_code == 403
    assert act(viewer, "backfill_schedules", [row], **backfill).status_code == 403
    stored = TaskSchedule.objects.get()
    assert (stored.version, stored.cron, stored.removed_at) == (1, "0 9 * * *", None)
    assert ScheduleEvent.objects.count() == 1 and not handed


def test_code_schedules__stay_read_only_for_an_editor() -> None:
    code = schedule("jobs.sync", every=MINUTE)
    editor = login("eve", *EDITOR_PERMS, "delete_taskschedule")
    page = editor.get(change_url(code)).content.decode()
    assert 'name="_save"' not in page and 'name="cron"' not in page
    assert editor.post(change_url(code), form_data()).status_code == 403
    delete_url = reverse("admin:taskguard_taskschedule_delete", args=[code.pk])
    assert editor.post(delete_url, {"post": "yes"}).status_code == 403
    assert "delete_selected" not in editor.get(CHANGELIST).content.decode()
    assert TaskSchedule.objects.get().removed_at is None


def test_changelist__same_statements_at_5_and_at_200_data_schedules() -> None:
    viewer = login("vic", "view_taskschedule")

    def statements() -> int:
        viewer.get(CHANGELIST)  # sessions and caches warm
        with CaptureQueriesContext(connection) as captured:
            assert viewer.get(CHANGELIST).status_code == 200
        return len(captured.captured_queries)

    for n in range(5):
        define_schedule(f"t{n}", TARGET, cron="0 9 * * *", time_zone="Europe/Berlin", args=[n])
    few = statements()
    for n in range(5, 200):
        define_schedule(f"t{n}", TARGET, every=timedelta(minutes=n), args=[n])
    assert statements() == few


def test_edit__enabled_is_changed_only_with_the_pause_permission() -> None:
    """Unticking enabled stops the slots as a pause does (one that health does not show):
    an editor without the pause permission sees it read-only, and a POST cannot change it."""
    row = tenant()
    editor = login("eve", *EDITOR_PERMS)
    page = editor.get(change_url(row)).content.decode()
    (enabled,) = re.findall(r'<input[^>]*name="enabled"[^>]*>', page)
    assert "disabled" in enabled
    response = editor.post(change_url(row), form_data(cron="15 9 * * *", enabled=None))
    assert response.status_code == 302, errors(response)
    stored = TaskSchedule.objects.get(pk=row.pk)
    assert stored.enabled and stored.cron == "15 9 * * *"  # the rest of the edit is saved
    assert not ScheduleEvent.objects.filter(kind="disabled").exists()
    pauser = login("pam", *EDITOR_PERMS, "pause_taskschedule")
    page = pauser.get(change_url(row)).content.decode()
    (enabled,) = re.findall(r'<input[^>]*name="enabled"[^>]*>', page)
    assert "disabled" not in enabled
    response = pauser.post(change_url(row), form_data(cron="15 9 * * *", enabled=None))
    assert response.status_code == 302, errors(response)
    assert not TaskSchedule.objects.get(pk=row.pk).enabled
    assert ScheduleEvent.objects.filter(kind="disabled", by="pam").exists()


def test_add_and_edit__an_interval_under_a_minute_needs_the_run_permission() -> None:
    """every=1 s fires a slot now and every second: run now by another name."""
    editor = login("eve", *EDITOR_PERMS)
    fast = form_data(cron="", every="1", time_zone="")
    response = editor.post(ADD, fast)
    assert response.status_code == 200
    assert "taskguard.run_taskschedule" in " ".join(errors(response)["every"])
    assert not TaskSchedule.objects.exists()
    assert editor.post(ADD, form_data(cron="", every="60", time_zone="")).status_code == 302
    row = TaskSchedule.objects.get()
    response = editor.post(change_url(row), form_data(cron="", every="59", time_zone=""))
    assert response.status_code == 200
    assert "every" in errors(response)
    assert TaskSchedule.objects.get().every == MINUTE
    runner = login("rita", *EDITOR_PERMS, "run_taskschedule")
    response = runner.post(change_url(row), form_data(cron="", every="1", time_zone=""))
    assert response.status_code == 302, errors(response)
    assert TaskSchedule.objects.get().every == timedelta(seconds=1)
    # Its other fields stay editable without the run permission once it is that fast.
    response = editor.post(change_url(row), form_data(cron="", every="1", time_zone="", args="[7]"))
    assert response.status_code == 302, errors(response)


def test_edit__posts_only_what_the_change_page_shows() -> None:
    """The change page renders no name or target input (both fixed): a browser posts
    neither, and the edit is saved."""
    row = tenant()
    editor = login("eve", *EDITOR_PERMS)
    posted = form_data(cron="15 9 * * *", args="[42]", kwargs="{}")
    posted.pop("entry", None)
    posted.pop("function", None)
    response = editor.post(change_url(row), posted)
    assert response.status_code == 302, errors(response)
    stored = TaskSchedule.objects.get(pk=row.pk)
    assert (stored.cron, stored.version, stored.entry) == ("15 9 * * *", 2, "tenant-42")
