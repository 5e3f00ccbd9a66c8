"""Moments and arguments out of bounds are refused where they are given (issue 33): a data
schedule's starts and ends, a backfill's range (the command and the admin's form), an
acknowledgement's until, and arguments nested deeper than JSON_MAX_DEPTH; none of them may
leave a row that makes a page raise for everyone."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse

from django_taskguard import acknowledgements, define_schedule
from django_taskguard.data_schedules import ScheduleDefinitionError
from django_taskguard.exceptions import TaskGuardError
from django_taskguard.models import ScheduleEvent, TaskSchedule
from tests.support import data_targets  # noqa: F401  (registers the schedules' targets)

from .test_data_schedule_admin import form_data

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]

TARGET = "tests.support.data_targets.send_report"
CHANGELIST = reverse("admin:taskguard_taskschedule_changelist")
ADD = reverse("admin:taskguard_taskschedule_add")
FAR = datetime(9999, 12, 31, 23, 0, tzinfo=UTC)
FIRST = datetime(1, 1, 1, tzinfo=UTC)
JSON_MAX_DEPTH = 24  # data_schedules.JSON_MAX_DEPTH, as the docs say it


def superuser() -> Client:
    user = User.objects.create_superuser("root", password="pw")
    client = Client(raise_request_exception=False)
    client.force_login(user)
    return client


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def add_form(**given: str) -> dict[str, str]:
    """The add form's POST (test_data_schedule_admin's), in UTC, with ``given``."""
    return form_data(**{"time_zone": "", "kwargs": "{}", **given})


@pytest.mark.parametrize("field", ["starts", "ends"])
@pytest.mark.parametrize("moment", [FAR, FIRST], ids=["9999", "0001"])
def test_define__moments_out_of_bounds_are_refused(field: str, moment: datetime) -> None:
    with pytest.raises(ScheduleDefinitionError, match=f"{field} must be from 1970") as caught:
        define_schedule("t1", TARGET, cron="0 9 * * *", args=[1], **{field: moment})
    assert caught.value.field == field
    assert not TaskSchedule.objects.exists()


def test_admin__starts_in_year_9999_is_a_form_error_and_every_page_still_answers() -> None:
    client = superuser()
    response = client.post(ADD, add_form(starts="9999-12-31 23:00+00:00"))
    assert response.status_code == 200
    form = response.context["adminform"].form
    assert any("must be from 1970" in str(e) for e in form.errors["starts"]), form.errors
    assert not TaskSchedule.objects.exists()
    assert client.get(CHANGELIST).status_code == 200


def test_admin__a_row_stored_before_the_bounds_does_not_break_the_pages() -> None:
    """A row saved by an older version (or by SQL): the pages show it, with no next slot."""
    row = define_schedule("t1", TARGET, cron="0 9 * * *", args=[1])
    TaskSchedule.objects.filter(pk=row.pk).update(starts=FAR)
    client = superuser()
    change = reverse("admin:taskguard_taskschedule_change", args=[row.pk])
    for url in (CHANGELIST, change, reverse("admin:taskguard_taskrun_overview")):
        assert client.get(url).status_code == 200, url


@pytest.mark.parametrize("kind", ["args", "kwargs"])
def test_define__arguments_nested_too_deep_are_refused(kind: str) -> None:
    given: dict[str, Any] = {"args": [1]}
    if kind == "args":
        given["args"] = [nested(5_000)]
    else:
        given["kwargs"] = {"fmt": nested(5_000)}
    with pytest.raises(ScheduleDefinitionError, match=f"nested deeper than {JSON_MAX_DEPTH}"):
        define_schedule("t1", TARGET, cron="0 9 * * *", **given)
    define_schedule("t1", TARGET, cron="0 9 * * *", args=[nested(JSON_MAX_DEPTH - 1)])


def test_admin__kwargs_nested_5000_deep_are_a_form_error() -> None:
    deep = '{"fmt": ' + "[" * 5_000 + "]" * 5_000 + "}"
    response = superuser().post(ADD, add_form(kwargs=deep))
    assert response.status_code == 200
    form = response.context["adminform"].form
    assert any(f"deeper than {JSON_MAX_DEPTH}" in str(e) for e in form.errors["kwargs"])
    assert not TaskSchedule.objects.exists()


@pytest.mark.parametrize(
    "span",
    [
        ["--from", "0001-01-01T00:00:00+00:00", "--to", "2026-01-01T00:00:00+00:00"],
        ["--from", "2026-01-01T00:00:00+00:00", "--to", "9999-12-31T23:00:00+00:00"],
    ],
    ids=["0001", "9999"],
)
def test_backfill_command__a_range_out_of_bounds_is_a_command_error(span: list[str]) -> None:
    row = define_schedule("t1", TARGET, every=timedelta(hours=1), args=[1])
    with pytest.raises(CommandError, match="must be from 1970"):
        call_command("backfill", row.task_name, *span, stdout=io.StringIO())


@pytest.mark.parametrize("start", ["0001-01-01 00:00", "9999-12-31 23:00"])
def test_admin_backfill__a_range_out_of_bounds_is_said_not_a_500(start: str) -> None:
    row = define_schedule("t1", TARGET, every=timedelta(hours=1), args=[1])
    data = {
        "action": "backfill_schedules",
        "index": "0",
        ACTION_CHECKBOX_NAME: [row.pk],
        "from": start,
        "to": "2026-01-01 00:00",
        "confirm": "yes",
    }
    response = superuser().post(CHANGELIST, data, follow=True)
    assert response.status_code == 200
    page = response.content.decode()
    assert 'class="errornote"' in page and "must be from 1970" in page
    assert not ScheduleEvent.objects.filter(kind="backfill").exists()


def test_acknowledge__until_out_of_bounds_is_refused_everywhere() -> None:
    row = define_schedule("t1", TARGET, every=timedelta(hours=1), args=[1])
    with pytest.raises(TaskGuardError, match="must be from 1970"):
        acknowledgements.acknowledge(row.task_name, "known", until=FIRST)
    with pytest.raises(CommandError, match="must be from 1970"):
        call_command(
            "acknowledge", row.task_name, "--reason", "known",
            "--until", "0001-01-01T00:00:00+00:00", stdout=io.StringIO(),
        )  # fmt: skip
    data = {
        "action": "acknowledge_schedules",
        "index": "0",
        ACTION_CHECKBOX_NAME: [row.pk],
        "reason": "known",
        "until": "0001-01-01 00:00",
        "confirm": "yes",
    }
    response = superuser().post(CHANGELIST, data, follow=True)
    assert response.status_code == 200
    assert "must be from 1970" in response.content.decode()
    assert not ScheduleEvent.objects.filter(kind="acknowledged").exists()
