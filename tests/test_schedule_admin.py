"""The schedules' admin page through the test client: every source, its columns and
filters, the pause/resume/acknowledge/retire actions with their permissions and history,
and a query count that does not grow with the rows shown."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from django_taskguard import pauses
from django_taskguard.models import (
    RunState,
    ScheduleEvent,
    ScheduleEventKind,
    ScheduleEventOrigin,
    ScheduleSource,
    TaskRun,
    TaskSchedule,
)

from .support.monitoring import due_slot, finished, schedule

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]
CHANGELIST = reverse("admin:taskguard_taskschedule_changelist")
MINUTE = timedelta(minutes=1)


def change_url(row: TaskSchedule) -> str:
    return reverse("admin:taskguard_taskschedule_change", args=[row.pk])


def login(username: str, *perms: str) -> Client:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    for codename in perms:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def viewer() -> Client:
    return login("viewer", "view_taskschedule")


@pytest.fixture
def pauser() -> Client:
    return login("pauser", "view_taskschedule", "pause_taskschedule")


@pytest.fixture
def acknowledger() -> Client:
    return login("acker", "view_taskschedule", "acknowledge_taskschedule")


@pytest.fixture
def operator() -> Client:
    return login("ops", "view_taskschedule", "pause_taskschedule", "delete_taskschedule")


def act(client: Client, action: str, rows: list[TaskSchedule], **extra: str) -> Any:
    data = {"action": action, "index": "0", ACTION_CHECKBOX_NAME: [r.pk for r in rows], **extra}
    return client.post(CHANGELIST, data, follow=True)


def said(response: Any) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def rows_of(html: str) -> dict[str, str]:
    """``{task: its row's HTML}`` of the changelist."""
    found = {}
    for chunk in html.split("<tr")[1:]:
        match = re.search(
            r'class="field-task_display"[^>]*><a [^>]*><span[^>]*>(.+?)</span>', chunk
        )
        if match:
            found[match.group(1).replace("<wbr>", "")] = chunk.split("</tr>", 1)[0]
    return found


def beat_entry(task: str, entry: str, **fields: Any) -> TaskSchedule:
    row = schedule(task, every=MINUTE)
    for name, value in {"source": ScheduleSource.CELERY, "entry": entry, **fields}.items():
        setattr(row, name, value)
    row.save()
    return row


def seed() -> dict[str, TaskSchedule]:
    """A schedule of each source and state an operator meets."""
    fn = schedule("jobs.sync", every=MINUTE)
    TaskSchedule.objects.filter(pk=fn.pk).update(declared_in="jobs")
    finished("jobs.sync", due_slot(MINUTE))
    nightly = schedule("jobs.nightly", cron="0 21 * * *")
    TaskSchedule.objects.filter(pk=nightly.pk).update(time_zone="Europe/Berlin")
    ping = beat_entry("reports.ping[ping-10s]", "ping-10s", declared_in="CELERY_BEAT_SCHEDULE")
    paused = schedule("mail.digest", every=MINUTE)
    pauses.pause("mail.digest", "vendor outage", by="alice", origin=ScheduleEventOrigin.COMMAND)
    gone = schedule("jobs.old", every=MINUTE)
    TaskSchedule.objects.filter(pk=gone.pk).update(removed_at=timezone.now())
    return {"fn": fn, "nightly": nightly, "ping": ping, "paused": paused, "gone": gone}


def test_changelist__every_source_with_its_columns(viewer):
    seed()
    response = viewer.get(CHANGELIST)
    assert response.status_code == 200
    rows = rows_of(response.content.decode())
    assert set(rows) == {"jobs.sync", "jobs.nightly", "reports.ping[ping-10s]", "mail.digest",
                         "jobs.old"}  # fmt: skip
    sync = rows["jobs.sync"]
    assert "function" in sync and 'class="quiet">jobs</span>' in sync  # declared in
    assert "every minute" in sync
    assert 'data-status="ok"' in sync
    assert len(re.findall(r"\d{4}-\d\d-\d\d<br>\d\d:\d\d:\d\d CES?T", sync)) == 2  # next, last
    assert "cron 0 21 * * * (Europe/Berlin)" in rows["jobs.nightly"]
    ping = rows["reports.ping[ping-10s]"]
    assert "celery" in ping and "CELERY_<wbr>BEAT_<wbr>SCHEDULE · ping-10s" in ping
    assert 'data-status="unhealthy"' in ping  # no run of its due slot: late
    digest = rows["mail.digest"]
    assert "vendor outage" in digest and "by alice from a management command" in digest
    assert 'data-status="paused"' in digest and re.search(r"since <span[^>]*>\d{4}-", digest)
    old = rows["jobs.old"]
    assert 'class="taskguard-removed quiet"' in old and "not judged" in old
    assert "removed 20" in old and "taskguard-removed" not in sync


def test_changelist__filters_and_search(viewer):
    seed()

    def listed(**query: str) -> set[str]:
        return set(rows_of(viewer.get(CHANGELIST, query).content.decode()))

    assert listed(source__exact="celery") == {"reports.ping[ping-10s]"}
    assert listed(paused__exact="1") == {"mail.digest"}
    assert listed(removed="yes") == {"jobs.old"}
    assert "jobs.old" not in listed(removed="no") and "jobs.sync" in listed(removed="no")
    assert listed(q="nightly") == {"jobs.nightly"}


def test_admin__read_only_and_delete_only_through_retire(operator):
    row = seed()["gone"]
    assert operator.get(reverse("admin:taskguard_taskschedule_add")).status_code == 403
    assert operator.post(change_url(row), {"task_name": "x"}).status_code == 403
    delete = reverse("admin:taskguard_taskschedule_delete", args=[row.pk])
    assert operator.get(delete).status_code == 403
    html = operator.get(CHANGELIST).content.decode()
    assert "delete_selected" not in html and "retire_schedules" in html
    assert TaskSchedule.objects.filter(pk=row.pk).exists()


def test_actions__refused_with_403_without_their_permission(viewer, pauser):
    rows = seed()
    html = viewer.get(CHANGELIST).content.decode()
    assert "pause_schedules" not in html
    for action in ("pause_schedules", "resume_schedules", "acknowledge_schedules"):
        response = act(viewer, action, [rows["paused"]], confirm="yes", reason="x")
        assert response.status_code == 403, action
    assert act(pauser, "retire_schedules", [rows["gone"]], confirm="yes").status_code == 403
    assert TaskSchedule.objects.get(task_name="mail.digest").paused
    assert TaskSchedule.objects.filter(task_name="jobs.old").exists()
    assert not ScheduleEvent.objects.exclude(kind=ScheduleEventKind.PAUSED).exists()
    anonymous = Client().post(CHANGELIST, {"action": "resume_schedules", "index": "0"})
    assert anonymous.status_code == 302


def test_pause_action__asks_a_reason_then_pauses_with_who_and_from_where(pauser):
    row = seed()["fn"]
    asked = act(pauser, "pause_schedules", [row])
    page = asked.content.decode()
    assert 'name="reason"' in page and 'value="yes"' in page and "jobs.sync" in page
    assert not TaskSchedule.objects.get(pk=row.pk).paused
    done = act(pauser, "pause_schedules", [row], confirm="yes", reason="vendor outage")
    assert said(done) == ["Paused jobs.sync."]
    stored = TaskSchedule.objects.get(pk=row.pk)
    assert stored.paused
    # The operator's words, once: who and from where are the event's, said beside them.
    assert stored.paused_reason == "vendor outage"
    event = ScheduleEvent.objects.get(task_name="jobs.sync")
    assert (event.kind, event.by, event.origin, event.reason) == (
        "paused",
        "pauser",
        "admin",
        "vendor outage",
    )
    listed = rows_of(pauser.get(CHANGELIST).content.decode())["jobs.sync"]
    assert listed.count("vendor outage") == 1 and listed.count("pauser") == 1, listed
    assert "by pauser from the admin" in listed
    again = act(pauser, "pause_schedules", [row], confirm="yes", reason="twice")
    assert said(again) == ["Already paused: jobs.sync."]
    resumed = act(pauser, "resume_schedules", [row])
    assert said(resumed) == ["Resumed jobs.sync."]
    assert not TaskSchedule.objects.get(pk=row.pk).paused
    kinds = list(ScheduleEvent.objects.filter(task_name="jobs.sync").values_list("kind", "by"))
    assert kinds == [("resumed", "pauser"), ("paused", "pauser")]


def test_acknowledge_action__needs_its_own_permission_not_the_pause_one(pauser, acknowledger):
    row = seed()["ping"]
    response = act(pauser, "acknowledge_schedules", [row], confirm="yes", reason="known")
    assert response.status_code == 403
    page = pauser.get(change_url(row)).content.decode()
    assert 'value="pause_schedules"' in page and 'value="acknowledge_schedules"' not in page
    assert not ScheduleEvent.objects.filter(kind=ScheduleEventKind.ACKNOWLEDGED).exists()
    response = act(acknowledger, "pause_schedules", [row], confirm="yes", reason="no")
    assert response.status_code == 403
    assert not TaskSchedule.objects.get(pk=row.pk).paused
    page = acknowledger.get(change_url(row)).content.decode()
    assert 'value="acknowledge_schedules"' in page and 'value="pause_schedules"' not in page
    done = act(acknowledger, "acknowledge_schedules", [row], confirm="yes", reason="known")
    assert said(done) == ["Acknowledged reports.ping[ping-10s]."]


def test_acknowledge_action__needs_a_reason_refuses_the_future_keeps_until(acknowledger):
    pauser = acknowledger
    row = seed()["ping"]
    asked = act(pauser, "acknowledge_schedules", [row])
    assert 'name="until"' in asked.content.decode()
    for extra, error in (
        ({"reason": " "}, "needs a reason"),
        ({"reason": "known", "until": "tomorrow"}, "is not a date and time"),
        ({"reason": "known", "until": "2999-01-01 00:00"}, "is in the future"),
    ):
        response = act(pauser, "acknowledge_schedules", [row], confirm="yes", **extra)
        assert error in response.content.decode(), extra
        assert 'class="errornote"' in response.content.decode()
    assert not ScheduleEvent.objects.filter(kind=ScheduleEventKind.ACKNOWLEDGED).exists()
    done = act(
        pauser, "acknowledge_schedules", [row], confirm="yes", reason="beat redeployed",
        until="2026-11-20 21:00",
    )  # fmt: skip
    assert said(done) == ["Acknowledged reports.ping[ping-10s]."]
    event = ScheduleEvent.objects.get(kind=ScheduleEventKind.ACKNOWLEDGED)
    assert (event.by, event.origin, event.reason) == ("acker", "admin", "beat redeployed")
    assert event.until is not None
    assert timezone.localtime(event.until).strftime("%Y-%m-%d %H:%M %Z") == "2026-11-20 21:00 CET"
    assert TaskSchedule.objects.get(pk=row.pk).acknowledged_until == event.until


def test_retire_action__refused_for_a_declared_schedule(operator):
    rows = seed()
    asked = act(operator, "retire_schedules", [rows["fn"]])
    assert "Still declared, so not retired: jobs.sync." in asked.content.decode()
    done = act(operator, "retire_schedules", [rows["fn"]], confirm="yes")
    assert said(done) == ["Not retired, still declared by the code or a beat: jobs.sync."]
    assert TaskSchedule.objects.filter(pk=rows["fn"].pk).exists()
    assert not ScheduleEvent.objects.filter(kind=ScheduleEventKind.RETIRED).exists()


def test_retire_action__deletes_the_row_keeps_its_runs_and_history(operator):
    rows = seed()
    run = finished("jobs.old", due_slot(MINUTE) - 5 * MINUTE, RunState.FAILED)
    pauses.pause("jobs.old", "before its removal", by="alice")
    done = act(operator, "retire_schedules", [rows["gone"], rows["fn"]], confirm="yes")
    assert said(done) == [
        "Retired jobs.old (their runs stay).",
        "Not retired, still declared by the code or a beat: jobs.sync.",
    ]
    assert not TaskSchedule.objects.filter(task_name="jobs.old").exists()
    assert TaskRun.objects.filter(pk=run.pk).exists()
    kept = list(ScheduleEvent.objects.filter(task_name="jobs.old").values_list("kind", "by"))
    assert kept == [("retired", "ops"), ("paused", "alice")]


def test_change_page__history_newest_first_runs_link_and_buttons(operator, viewer):
    rows = seed()
    pauses.resume("mail.digest", by="bob", origin=ScheduleEventOrigin.ADMIN, reason="vendor back")
    pauses.pause("mail.digest", "again", by="carol", origin=ScheduleEventOrigin.POLICY)
    html = operator.get(change_url(rows["paused"])).content.decode()
    history = html.split('class="module taskguard-history"', 1)[1]
    events = re.findall(r'<tr class="taskguard-event" data-kind="(\w+)">', history)
    assert events == ["paused", "resumed", "paused"]
    assert "carol" in history and "vendor back" in history and "a management command" in history
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d CES?T \(", history)
    assert "/admin/taskguard/taskrun/?task_name=mail.digest" in html
    assert 'value="resume_schedules"' in html and 'value="pause_schedules"' not in html
    assert 'value="retire_schedules"' not in html  # still declared
    assert 'value="retire_schedules"' in operator.get(change_url(rows["gone"])).content.decode()
    assert 'name="_save"' not in html
    plain = viewer.get(change_url(rows["paused"])).content.decode()
    assert "taskguard-history" in plain and "resume_schedules" not in plain


def test_history_button__opens_the_schedules_own_history(viewer):
    """One history: the HISTORY button shows the pauses, resumes and acknowledgements (the
    schedule's events), not Django's admin log, which has none of them."""
    rows = seed()
    pauses.resume("mail.digest", by="bob", origin=ScheduleEventOrigin.ADMIN, reason="back")
    history_url = reverse("admin:taskguard_taskschedule_history", args=[rows["paused"].pk])
    response = viewer.get(history_url)
    assert response.status_code == 302
    assert response["Location"] == f"{change_url(rows['paused'])}#taskguard-history"
    html = viewer.get(response["Location"]).content.decode()
    history = html.split('id="taskguard-history"', 1)[1]
    events = re.findall(r'<tr class="taskguard-event" data-kind="(\w+)">', history)
    assert events == ["resumed", "paused"]
    missing = reverse("admin:taskguard_taskschedule_history", args=[987654])
    assert viewer.get(missing, follow=True).redirect_chain[-1][0] == reverse("admin:index")


def test_confirmation_pages__the_breadcrumbs_name_the_schedule(pauser):
    rows = seed()
    html = act(pauser, "pause_schedules", [rows["fn"]]).content.decode()
    crumbs = re.search(r'class="breadcrumbs">(.+?)</(ol|div)>', html, re.S)
    assert crumbs is not None
    link = f'<a href="{change_url(rows["fn"])}">jobs.sync</a>'
    assert link in crumbs.group(1) and "Pause these schedules?" in crumbs.group(1)
    several = act(pauser, "pause_schedules", [rows["fn"], rows["nightly"]]).content.decode()
    assert change_url(rows["fn"]) not in several.split('class="breadcrumbs"', 1)[1][:800]


def test_admin__run_viewers_see_schedules_too():
    seed()
    assert login("runs", "view_taskrun").get(CHANGELIST).status_code == 200
    assert login("nobody").get(CHANGELIST).status_code == 403


def test_changelist__query_count_does_not_grow_with_rows(viewer, django_assert_max_num_queries):
    seed()
    viewer.get(CHANGELIST)
    with django_assert_max_num_queries(20) as few:
        assert viewer.get(CHANGELIST).status_code == 200
    for n in range(40):
        schedule(f"more.job{n}", every=MINUTE)
        finished(f"more.job{n}", due_slot(MINUTE))
        pauses.pause(f"more.job{n}", "paused", by="ops")
        pauses.resume(f"more.job{n}", by="ops")
        pauses.pause(f"more.job{n}", "paused again", by="ops")
    with django_assert_max_num_queries(len(few.captured_queries)):
        response = viewer.get(CHANGELIST)
    assert response.content.decode().count("paused again") == 40
