"""The admin through the test client: columns, panel, actions, permissions, CSRF."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from typing import Any

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone as dj_timezone

from django_taskguard.models import RunState, TaskRun, TaskRunTransition

from .support.runs import make_run

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]
CHANGELIST = reverse("admin:taskguard_taskrun_changelist")


def change_url(run: TaskRun) -> str:
    return reverse("admin:taskguard_taskrun_change", args=[run.pk])


def staff(username: str, *perms: str) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    for codename in perms:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    return user


@pytest.fixture
def operator() -> Client:
    client = Client()
    client.force_login(staff("operator", "view_taskrun", "cleanup_taskrun"))
    return client


@pytest.fixture
def viewer() -> Client:
    client = Client()
    client.force_login(staff("viewer", "view_taskrun"))
    return client


def act(client: Client, action: str, runs: list[TaskRun], **extra: str):  # type: ignore[no-untyped-def]
    data = {"action": action, "index": "0", ACTION_CHECKBOX_NAME: [r.pk for r in runs], **extra}
    return client.post(CHANGELIST, data, follow=True)


@pytest.mark.smoke  # the version matrix's smoke set (scripts/matrix.sh)
def test_changelist__columns_badges_and_lease(operator):
    stale = make_run("tests.stale", 0)
    live = make_run("tests.live", 1, lease=3600)
    make_run("tests.done", 2, state=RunState.SUCCEEDED)
    response = operator.get(CHANGELIST)
    assert response.status_code == 200
    html = response.content.decode()
    assert 'class="taskguard-state"' in html
    assert html.count(">expired<") == 1
    assert html.count(">alive<") == 1
    for run in (stale, live):
        assert run.task_name in html


def listed(response, *runs: TaskRun) -> set[int]:  # type: ignore[no-untyped-def]
    html = response.content.decode()
    return {run.pk for run in runs if change_url(run) in html}


def test_changelist__filters_search_and_date_drilldown(operator):
    a = make_run("tests.a", 0, state=RunState.FAILED)
    b = make_run("tests.b", 0, state=RunState.SUCCEEDED)
    assert listed(operator.get(CHANGELIST, {"state": "failed"}), a, b) == {a.pk}
    assert listed(operator.get(CHANGELIST, {"task_name": "tests.b"}), a, b) == {b.pk}
    assert listed(operator.get(CHANGELIST, {"q": "tests.a"}), a, b) == {a.pk}
    # Both slots are on one day (in TIME_ZONE): the drill-down opens on that month's days.
    day = dj_timezone.localtime(a.slot)
    response = operator.get(CHANGELIST)
    assert re.search(rf"slot__day={day.day}\b", response.content.decode())
    assert listed(operator.get(CHANGELIST, {"slot__year": day.year - 1}), a, b) == set()
    assert listed(operator.get(CHANGELIST, {"slot__year": day.year}), a, b) == {a.pk, b.pk}


def test_changelist__fixed_query_count(operator, django_assert_max_num_queries):
    for minute in range(30):
        make_run(f"tests.q{minute % 3}", minute, state=RunState.SUCCEEDED)
    operator.get(CHANGELIST)
    with django_assert_max_num_queries(12) as few:
        operator.get(CHANGELIST)
    for minute in range(30, 90):
        make_run(f"tests.q{minute % 3}", minute, state=RunState.SUCCEEDED)
    with django_assert_max_num_queries(len(few.captured_queries)):
        operator.get(CHANGELIST, {"state": "succeeded"})


def test_change_page__transitions_inline_and_why_panel(operator):
    run = make_run("tests.stale", 0, owner="otherhost:7:feed", transitions=2)
    html = operator.get(change_url(run)).content.decode()
    assert "Why is this not running?" in html
    assert "presumed dead" in html
    assert "otherhost:7:feed" in html
    assert html.count("claimed ") >= 2  # both transitions inline
    assert "Release lock" in html
    assert 'name="_save"' not in html  # read-only


class Forms(HTMLParser):
    """A page's forms as a browser reads them: each form's action and the inputs it posts
    (an input belongs to the form around it, or to the one its ``form`` attribute names),
    and every form that opened inside another."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[str] = []
        self.nested: list[str] = []
        self.action: dict[str, str] = {}
        self.inputs: dict[str, list[dict[str, str]]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        given = {name: value or "" for name, value in attrs}
        if tag == "form":
            key = given.get("id") or f"form{len(self.action)}"
            if self.open:
                self.nested.append(f"{key} inside {self.open[-1]}")
            self.open.append(key)
            self.action[key] = given.get("action", "")
        elif tag in ("input", "button"):
            owner = given.get("form") or (self.open[-1] if self.open else "")
            self.inputs.setdefault(owner, []).append(given)

    def handle_endtag(self, tag: str) -> None:
        if tag == "form" and self.open:
            self.open.pop()


def test_change_page__release_lock_is_its_own_form_not_one_inside_the_change_form(operator):
    run = make_run("tests.stale", 0, owner="otherhost:7:feed")
    page = Forms()
    page.feed(operator.get(change_url(run)).content.decode())
    assert page.nested == []
    (owner,) = [
        form
        for form, inputs in page.inputs.items()
        if any(i.get("value") == "Release lock…" for i in inputs)
    ]
    assert page.action[owner] == CHANGELIST
    posted = {i["name"]: i.get("value", "") for i in page.inputs[owner] if i.get("name")}
    assert posted["action"] == "release_locks"
    assert posted["_selected_action"] == str(run.pk)
    # What the button posts asks for the confirmation (nothing released yet).
    confirm = operator.post(CHANGELIST, posted).content.decode()
    assert 'name="confirm"' in confirm
    assert TaskRun.objects.get(pk=run.pk).state == RunState.RUNNING


def test_admin__read_only(operator):
    run = make_run("tests.x", 0)
    assert operator.get(reverse("admin:taskguard_taskrun_add")).status_code == 403
    response = operator.post(change_url(run), {"state": "succeeded"})
    assert response.status_code == 403
    assert TaskRun.objects.get(pk=run.pk).state == RunState.RUNNING
    assert operator.get(reverse("admin:taskguard_taskrun_delete", args=[run.pk])).status_code == 403


def test_cleanup_action__nothing_stale_asks_nothing(operator):
    live = make_run("tests.live", 0, lease=3600)
    done = make_run("tests.done", 1, state=RunState.SUCCEEDED)
    page = act(operator, "cleanup_stale_locks", [live, done]).content.decode()
    assert 'name="confirm"' not in page
    assert "None of the 2 selected runs is stale" in page
    assert TaskRun.objects.get(pk=live.pk).state == RunState.RUNNING


def test_cleanup_action__confirmation_then_abandons_only_stale(operator):
    stale = make_run("tests.stale", 0)
    live = make_run("tests.live", 0, lease=3600)
    page = act(operator, "cleanup_stale_locks", [stale, live])
    html = page.content.decode()
    assert "1 of the selected runs is stale" in html
    assert "1 run has a live owner" in html
    assert TaskRun.objects.get(pk=stale.pk).state == RunState.RUNNING  # not yet
    done = act(operator, "cleanup_stale_locks", [stale, live], confirm="yes")
    assert "Abandoned 1 stale run" in done.content.decode()
    assert TaskRun.objects.get(pk=stale.pk).state == RunState.ABANDONED
    assert TaskRun.objects.get(pk=live.pk).state == RunState.RUNNING
    (transition,) = TaskRunTransition.objects.filter(run=stale, to_state=RunState.ABANDONED)
    # Who acted: the user, on the transition and in the run's History page.
    assert transition.reason.endswith("; admin action by operator")
    assert transition.owner.startswith("admin/operator@")
    history = operator.get(reverse("admin:taskguard_taskrun_history", args=[stale.pk]))
    assert "abandoned: lease of otherhost:1:deadbeef expired" in history.content.decode()
    assert "admin action by operator" in history.content.decode()


def test_release_action__refuses_a_live_owner(operator):
    live = make_run("tests.live", 0, lease=3600)
    stale = make_run("tests.stale", 0)
    done = act(operator, "release_locks", [live, stale], confirm="yes")
    html = done.content.decode()
    assert "Released 1 lock." in html
    assert "left alone" in html
    assert TaskRun.objects.get(pk=live.pk).state == RunState.RUNNING
    assert TaskRun.objects.get(pk=stale.pk).state == RunState.ABANDONED
    (transition,) = TaskRunTransition.objects.filter(run=stale, to_state=RunState.ABANDONED)
    assert transition.reason.endswith("; admin action by operator")
    assert transition.owner.startswith("admin/operator@")
    history = operator.get(reverse("admin:taskguard_taskrun_history", args=[stale.pk]))
    assert "lock abandoned: admin action by operator" in history.content.decode()


def test_release_action__handles_every_selected_run_not_one_page(operator):
    # Before: only the first 50 (one page) of the selected runs were handled, silently.
    stale = [make_run("tests.stale.many", minute) for minute in range(60)]
    done = act(operator, "release_locks", stale, confirm="yes")
    assert "Released 60 locks." in done.content.decode()
    assert set(TaskRun.objects.values_list("state", flat=True)) == {RunState.ABANDONED}


def test_admin__anonymous_is_sent_to_login():
    run = make_run("tests.x", 0)
    client = Client()
    data = {"action": "cleanup_stale_locks", "index": "0", ACTION_CHECKBOX_NAME: [run.pk],
            "confirm": "yes"}  # fmt: skip
    for response in (client.get(CHANGELIST), client.post(CHANGELIST, data)):
        assert response.status_code == 302
        assert response["Location"].startswith("/admin/login/")
    assert TaskRun.objects.get(pk=run.pk).state == RunState.RUNNING


def test_admin__staff_without_permission_is_refused(viewer):
    run = make_run("tests.x", 0)
    html = viewer.get(CHANGELIST).content.decode()
    assert "cleanup_stale_locks" not in html
    response = act(viewer, "cleanup_stale_locks", [run], confirm="yes")
    assert "Abandoned" not in response.content.decode()
    assert TaskRun.objects.get(pk=run.pk).state == RunState.RUNNING
    assert "Release lock" not in viewer.get(change_url(run)).content.decode()
    no_view = Client()
    no_view.force_login(staff("nobody"))
    assert no_view.get(CHANGELIST).status_code == 403


def test_admin__actions_need_a_csrf_token():
    run = make_run("tests.x", 0)
    client = Client(enforce_csrf_checks=True)
    client.force_login(staff("operator", "view_taskrun", "cleanup_taskrun"))
    data = {"action": "cleanup_stale_locks", "index": "0", ACTION_CHECKBOX_NAME: [run.pk],
            "confirm": "yes"}  # fmt: skip
    assert client.post(CHANGELIST, data).status_code == 403
    assert TaskRun.objects.get(pk=run.pk).state == RunState.RUNNING
    page = client.get(CHANGELIST)
    data["csrfmiddlewaretoken"] = page.context["csrf_token"]
    assert client.post(CHANGELIST, data).status_code == 302
    assert TaskRun.objects.get(pk=run.pk).state == RunState.ABANDONED


def test_admin__a_filtered_changelist_does_not_count_the_whole_table(viewer):
    """A ledger has millions of rows: a filter must not add a COUNT(*) over all of them."""
    make_run("tests.x", 0)
    with CaptureQueriesContext(connection) as queries:
        response = viewer.get(CHANGELIST, {"state__exact": RunState.RUNNING})
    assert response.status_code == 200
    counts = [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]
    assert counts, "the filtered count itself is expected"
    assert all("WHERE" in sql.upper() for sql in counts), counts


# -- the per-task overview -------------------------------------------------------------

OVERVIEW = reverse("admin:taskguard_taskrun_overview")
PAUSE = reverse("admin:taskguard_taskrun_pause")


def overview_rows(client: Client) -> dict[str, str]:
    """``{task: the row's HTML}`` of the overview page."""
    html = client.get(OVERVIEW).content.decode()
    rows = {}
    for chunk in html.split('<tr class="taskguard-task')[1:]:
        name = chunk.split('data-task="', 1)[1].split('"', 1)[0]
        rows[name] = chunk.split("</tr>", 1)[0]
    return rows


def test_overview__one_row_per_task_with_health_strip_and_links(operator):
    from datetime import timedelta

    from .support.monitoring import due_slot, finished, schedule

    minute = timedelta(minutes=1)
    slot = due_slot(minute)
    schedule("tests.sync", every=minute)
    done = finished("tests.sync", slot - 3 * minute)
    finished("tests.sync", slot - 2 * minute, RunState.FAILED)  # slot - 1 minute: a gap
    missed = finished("tests.sync", slot, RunState.MISSED, attempt=0)
    schedule("tests.nightly")  # its due slot has no run: late
    make_run("tests.unscheduled", 0, state=RunState.SUCCEEDED)
    rows = overview_rows(operator)
    assert list(rows) == ["tests.nightly", "tests.sync", "tests.unscheduled"]  # unhealthy first
    sync = rows["tests.sync"]
    assert 'data-status="unhealthy"' in sync  # its latest slot was missed
    assert "every minute" in sync
    assert sync.count('class="taskguard-cell ') == 30
    assert change_url(done) in sync and change_url(missed) in sync
    assert sync.count('class="taskguard-cell gap"') >= 1
    assert sync.count('class="taskguard-cell succeeded"') == 1
    assert "missed:" in sync
    nightly = rows["tests.nightly"]
    assert "late: slot" in nightly and "has no run" in nightly
    assert "no schedule registered" in rows["tests.unscheduled"]
    assert 'data-status="ok"' in rows["tests.unscheduled"]
    # Times carry their zone and seconds (TIME_ZONE is Europe/Paris), UTC in the title.
    assert " CET" in sync or " CEST" in sync
    assert "UTC" in sync


def test_overview__pause_and_resume_through_the_library_with_the_user(operator):
    from django.contrib.admin.models import LogEntry

    from django_taskguard.models import TaskSchedule

    from .support.monitoring import schedule

    operator_user = User.objects.get(username="operator")
    operator_user.user_permissions.add(Permission.objects.get(codename="pause_taskschedule"))
    schedule("tests.nightly")
    assert 'value="pause"' in overview_rows(operator)["tests.nightly"]
    # Pause asks first (what it does, a reason), like the cleanup action; nothing changes yet.
    asked = operator.post(PAUSE, {"task": "tests.nightly", "do": "pause"})
    assert asked.status_code == 200
    page = asked.content.decode()
    assert "Pause tests.nightly?" in page and 'name="reason"' in page and 'value="yes"' in page
    assert not TaskSchedule.objects.get(task_name="tests.nightly").paused
    response = operator.post(
        PAUSE,
        {"task": "tests.nightly", "do": "pause", "confirm": "yes", "reason": "vendor outage"},
        follow=True,
    )
    assert "Paused tests.nightly." in response.content.decode()
    stored = TaskSchedule.objects.get(task_name="tests.nightly")
    assert stored.paused
    assert stored.paused_reason == "vendor outage"  # the operator's words; who: the event's
    row = overview_rows(operator)["tests.nightly"]
    assert 'data-status="paused"' in row and 'value="resume"' in row
    said = re.search(r'<div class="help taskguard-paused">(.*?)</div>', row)
    assert said is not None, row
    assert re.fullmatch(
        r"Paused by operator from the admin at \S+ \S+ \S+: vendor outage", said.group(1)
    ), said.group(1)
    assert "paused from the admin" not in row
    operator.post(PAUSE, {"task": "tests.nightly", "do": "resume"})
    assert not TaskSchedule.objects.get(task_name="tests.nightly").paused
    entries = LogEntry.objects.filter(object_id=str(stored.pk)).order_by("pk")
    assert [(e.user.username, e.get_change_message()) for e in entries] == [
        ("operator", "paused from the task overview by operator"),
        ("operator", "resumed from the task overview by operator"),
    ]


def test_overview__linked_from_the_app_index_and_the_sidebar(viewer):
    """ "Tasks at a glance" is in the app's index and the admin's sidebar (beside the runs
    and the schedules), for whoever may see the runs; the entry opens the overview."""
    entry = reverse("admin:taskguard_taskoverview_changelist")
    for page in (reverse("admin:app_list", args=["taskguard"]), CHANGELIST):
        html = viewer.get(page).content.decode()
        assert f'<a href="{entry}"' in html and "Tasks at a glance" in html, page
    opened = viewer.get(entry)
    assert (opened.status_code, opened["Location"]) == (302, OVERVIEW)
    nobody = Client()
    nobody.force_login(staff("nobody"))
    assert nobody.get(entry).status_code == 403


def test_overview__pause_needs_its_permission_and_a_post(operator, viewer):
    from django_taskguard.models import TaskSchedule

    from .support.monitoring import schedule

    schedule("tests.nightly")
    assert 'value="pause"' not in overview_rows(operator)["tests.nightly"]  # no permission
    assert operator.post(PAUSE, {"task": "tests.nightly", "do": "pause"}).status_code == 403
    assert viewer.get(OVERVIEW).status_code == 200
    assert Client().get(OVERVIEW).status_code == 302  # to the login page
    assert not TaskSchedule.objects.get(task_name="tests.nightly").paused
    pauser = Client()
    pauser.force_login(staff("pauser", "view_taskrun", "pause_taskschedule"))
    assert pauser.get(PAUSE).status_code == 405


def test_overview__query_count_does_not_grow_with_runs_or_tasks(
    operator, django_assert_max_num_queries
):
    from datetime import timedelta

    from .support.monitoring import due_slot, finished, schedule

    schedule("tests.sync", every=timedelta(minutes=1))
    slot = due_slot(timedelta(minutes=1))
    finished("tests.sync", slot)
    operator.get(OVERVIEW)
    with django_assert_max_num_queries(15) as few:
        operator.get(OVERVIEW)
    for minute in range(1, 200):
        finished("tests.sync", slot - timedelta(minutes=minute))
    for n in range(30):  # more tasks do not mean more queries either
        schedule(f"tests.more{n}", every=timedelta(minutes=1))
        finished(f"tests.more{n}", slot)
    with django_assert_max_num_queries(len(few.captured_queries)):
        operator.get(OVERVIEW)


def test_overview__unhealthy_first_then_a_page_of_healthy_tasks_and_a_link(operator, monkeypatch):
    """Thousands of tasks: a page of rows, the unhealthy first, then "N more healthy
    tasks" with a link to the next page, whose rows are the next healthy ones."""
    from datetime import timedelta

    from django_taskguard import overview

    from .support.monitoring import due_slot, finished, schedule

    monkeypatch.setattr(overview, "OVERVIEW_PAGE", 5)
    minute = timedelta(minutes=1)
    for n in range(3):
        schedule(f"tests.page.late{n}", every=minute)  # no run: late
    for n in range(8):
        schedule(f"tests.page.ok{n}", every=minute)
        finished(f"tests.page.ok{n}", due_slot(minute))
    first = overview_rows(operator)
    assert list(first) == [
        *(f"tests.page.late{n}" for n in range(3)),
        "tests.page.ok0",
        "tests.page.ok1",
    ]
    html = operator.get(OVERVIEW).content.decode()
    assert "6 more healthy tasks" in html and "?page=2" in html
    assert "3 tasks need attention." in html
    html = operator.get(OVERVIEW + "?page=2").content.decode()
    assert [f"tests.page.ok{n}" in html for n in range(8)] == [False] * 2 + [True] * 5 + [False]
    assert "1 more healthy task" in html and "?page=3" in html
    assert list(overview_rows_of(operator.get(OVERVIEW + "?page=3"))) == ["tests.page.ok7"]
    assert list(overview_rows_of(operator.get(OVERVIEW + "?page=x"))) == list(first)


def overview_rows_of(response: Any) -> dict[str, str]:
    html = response.content.decode()
    return {
        chunk.split('data-task="', 1)[1].split('"', 1)[0]: chunk
        for chunk in html.split('<tr class="taskguard-task')[1:]
    }


def test_changelist__links_to_the_overview(viewer):
    assert OVERVIEW in viewer.get(CHANGELIST).content.decode()


def test_change_page__times_with_zone_seconds_and_utc(viewer):
    from datetime import datetime, timezone

    slot = datetime.now(timezone.utc).replace(hour=13, minute=0, second=10, microsecond=0)
    run = make_run("tests.times", slot=slot, state=RunState.SUCCEEDED)
    html = viewer.get(change_url(run)).content.decode()
    local = "14:00:10 CET" if "CET" in html else "15:00:10 CEST"
    assert f"{slot:%Y-%m-%d} {local} (13:00:10 UTC)" in html  # the slot field and the title
    assert f"tests.times @ {slot:%Y-%m-%d} {local} (13:00:10 UTC) (succeeded)" in html
    listing = viewer.get(CHANGELIST).content.decode()
    # The date, then the time with its zone (two lines in a narrow column); UTC on hover.
    assert f'title="{slot:%Y-%m-%d} 13:00:10 UTC"' in listing
    assert f"{slot:%Y-%m-%d}<br>{local}<" in listing


def breadcrumbs_markup(html: str) -> str:
    found = re.search(r'<(ol|div) class="breadcrumbs"', html)
    assert found is not None, "no breadcrumbs"
    return found.group(1)


@pytest.mark.smoke  # the version matrix's smoke set (scripts/matrix.sh)
def test_breadcrumbs__our_pages_draw_them_as_this_djangos_own_pages_do(operator):
    from .support.monitoring import schedule

    User.objects.filter(username="operator").get().user_permissions.add(
        Permission.objects.get(codename="pause_taskschedule")
    )
    schedule("tests.nightly")
    stale = make_run("tests.stale", 0)
    django_own = breadcrumbs_markup(operator.get(change_url(stale)).content.decode())
    pages = {
        "overview": operator.get(OVERVIEW),
        "cleanup confirmation": act(operator, "cleanup_stale_locks", [stale]),
        "pause confirmation": operator.post(PAUSE, {"task": "tests.nightly", "do": "pause"}),
    }
    for page, response in pages.items():
        assert breadcrumbs_markup(response.content.decode()) == django_own, page


def test_change_page__transition_times_have_seconds_zone_and_utc(operator):
    from datetime import timedelta

    from django_taskguard import timefmt

    run = make_run("tests.times", 0, transitions=1)
    moment = run.slot + timedelta(seconds=7)  # a moment no other field of the page shows
    TaskRunTransition.objects.filter(run_id=run.pk).update(at=moment)

    html = operator.get(change_url(run)).content.decode()
    assert timefmt.both(moment) in html  # e.g. 2026-11-26 20:03:07 CET (19:03:07 UTC)


def test_times__shown_once_when_the_zone_is_utc(operator):
    from datetime import datetime, timezone

    from django.test import override_settings

    from django_taskguard import timefmt

    moment = datetime(2026, 11, 26, 19, 3, 7, tzinfo=timezone.utc)
    assert timefmt.both(moment) == "2026-11-26 20:03:07 CET (19:03:07 UTC)"
    with override_settings(TIME_ZONE="UTC"):
        assert timefmt.both(moment) == "2026-11-26 19:03:07 UTC"
        run = make_run("tests.utc", 0, transitions=1)
        TaskRunTransition.objects.filter(run_id=run.pk).update(at=moment)
        html = operator.get(change_url(run)).content.decode()
    assert "2026-11-26 19:03:07 UTC" in html and "(19:03:07 UTC)" not in html


@pytest.mark.django_db
def test_changelist_paginator__big_results_take_the_planners_estimate(monkeypatch):
    from django_taskguard import admin as taskguard_admin
    from django_taskguard import ledger

    for n in range(3):
        make_run("tests.paged", n)
    queryset = TaskRun.objects.all()
    estimate = ledger.estimated_count(queryset)
    if connection.vendor == "postgresql":
        assert isinstance(estimate, int)
    else:  # no cheap estimate: the paginator counts
        assert estimate is None
    monkeypatch.setattr(taskguard_admin, "EXACT_COUNT_BELOW", 0)
    paginator = taskguard_admin.EstimatedCountPaginator(queryset, 100)
    assert paginator.count == (3 if estimate is None else estimate)
    monkeypatch.setattr(taskguard_admin, "EXACT_COUNT_BELOW", 10**9)
    assert taskguard_admin.EstimatedCountPaginator(queryset, 100).count == 3
