"""manage.py import_celery_beat: django-celery-beat's PeriodicTask rows (real models in the
test database) become data schedules."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import shared_task
from celery.schedules import schedule as celery_interval
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import modify_settings
from django.utils import timezone

from django_taskguard import guard, ledger
from django_taskguard.contrib.celery.entries import DJANGO_CELERY_BEAT, BeatEntry, record_of
from django_taskguard.ledger import schedules as store
from django_taskguard.models import (
    RunState,
    ScheduleEvent,
    ScheduleSource,
    TargetKind,
    TaskRun,
    TaskSchedule,
)
from django_taskguard.schedules import rebuild
from django_taskguard.testing import freeze_now
from tests.support import celery_tasks
from tests.support.celery_app import app

pytestmark = [pytest.mark.dialect, pytest.mark.celery_beat, pytest.mark.django_db(transaction=True)]

TICK = "tests.support.celery_tasks.tick"
MINUTE = timedelta(minutes=1)
UNGUARDED = "tests.import.unguarded"


@shared_task(name=UNGUARDED)
def unguarded() -> None:
    """A Celery task with no guard: not a valid target."""


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("import_celery_beat", *args, stdout=out)
    return out.getvalue()


def periodic(name: str, **fields: Any) -> Any:
    from django_celery_beat.models import PeriodicTask

    fields.setdefault("task", TICK)
    fields.setdefault("kwargs", json.dumps({"log": "/dev/null"}))
    return PeriodicTask.objects.create(name=name, **fields)


def crontab(**fields: Any) -> Any:
    from django_celery_beat.models import CrontabSchedule

    return CrontabSchedule.objects.create(**fields)


def interval(every: int, period: str) -> Any:
    from django_celery_beat.models import IntervalSchedule

    return IntervalSchedule.objects.create(every=every, period=period)


def schedule(name: str, task: str = TICK) -> TaskSchedule:
    return TaskSchedule.objects.get(task_name=f"{task}[{name}]")


def test_import__the_celery_app_is_current() -> None:
    from celery import current_app

    assert current_app.tasks[TICK].name == celery_tasks.tick.name == TICK


def test_import__crontab_keeps_its_zone_and_celerys_day_rule() -> None:
    # Friday the 13th at 09:30 in New York: celery needs both day fields; cron either.
    periodic(
        "friday-13th",
        crontab=crontab(
            minute="30",
            hour="9",
            day_of_month="13",
            day_of_week="fri",
            timezone="America/New_York",
        ),
    )
    out = run()
    row = schedule("friday-13th")
    assert (row.source, row.target_kind) == (ScheduleSource.DATA, TargetKind.CELERY)
    assert (row.cron, row.cron_day_or, row.time_zone) == (
        "30 9 13 * fri",
        False,
        "America/New_York",
    )
    slots = rebuild(row.cron, row.cron_day_or, row.time_zone, row.every).slots_between(
        datetime(2026, 1, 1, tzinfo=UTC), datetime(2028, 1, 1, tzinfo=UTC), 100
    )
    assert slots, "a Friday the 13th falls in any two years"
    for slot in slots:
        wall = slot.astimezone(ZoneInfo("America/New_York"))
        assert (wall.day, wall.weekday(), wall.hour, wall.minute) == (13, 4, 9, 30)
    assert len(slots) < 10  # cron's either-day rule would give ~120 (every Friday, every 13th)
    assert "Imported 'friday-13th'" in out and "day of month and day of week both" in out
    event = ScheduleEvent.objects.get(task_name=row.task_name)
    assert (event.kind, event.origin, event.reason) == (
        "created",
        "command",
        "imported from django-celery-beat",
    )
    assert "@" in event.by  # user@host of the operator


def test_import__interval_disabled_arguments_description_and_window() -> None:
    starts = datetime(2026, 1, 1, 8, tzinfo=UTC)
    ends = datetime(2027, 1, 1, 8, tzinfo=UTC)
    periodic(
        "every-90s",
        interval=interval(90, "seconds"),
        args=json.dumps(["/tmp/log"]),
        kwargs=json.dumps({"seconds": 0.5}),
        enabled=False,
        description="the tick, every minute and a half",
        start_time=starts,
        expires=ends,
    )
    periodic("every-2h", interval=interval(2, "hours"))
    out = run()
    row = schedule("every-90s")
    assert (row.every, row.cron, row.time_zone) == (timedelta(seconds=90), "", "")
    assert (row.args, row.kwargs, row.enabled) == (["/tmp/log"], {"seconds": 0.5}, False)
    assert row.description == "the tick, every minute and a half"
    assert (row.starts, row.ends) == (starts, ends)
    assert schedule("every-2h").every == timedelta(hours=2)
    assert "[disabled]" in out
    assert out.strip().endswith(
        "Imported 2, updated 0, unchanged 0, refused 0 (of 2 periodic tasks)."
    )


def test_import__clocked_solar_one_off_and_unguarded_are_refused_with_reasons() -> None:
    from django_celery_beat.models import ClockedSchedule, SolarSchedule

    clocked = ClockedSchedule.objects.create(clocked_time=timezone.now() + timedelta(days=1))
    solar = SolarSchedule.objects.create(event="sunrise", latitude=48.85, longitude=2.35)
    periodic("at-noon", clocked=clocked, one_off=True)
    periodic("at-sunrise", solar=solar)
    periodic("once", interval=interval(1, "hours"), one_off=True)
    periodic("plain", interval=interval(1, "hours"), task=UNGUARDED, kwargs="{}")
    periodic("bad-args", interval=interval(1, "hours"), kwargs=json.dumps({"nope": 1}))
    periodic("ok", interval=interval(1, "hours"))
    out = run()  # refusals are listed; the command succeeds (no CommandError)
    refused = {line.split("'")[1]: line for line in out.splitlines() if line.startswith("Refused")}
    assert set(refused) == {"at-noon", "at-sunrise", "once", "plain", "bad-args"}
    assert "one-off" in refused["at-noon"] or "clocked" in refused["at-noon"]
    assert "solar schedule" in refused["at-sunrise"]
    assert "one-off" in refused["once"]
    assert "put @once_per_schedule() under @shared_task" in refused["plain"]
    assert "does not take these arguments" in refused["bad-args"]
    assert list(store.data_schedules().values_list("entry", flat=True)) == ["ok"]
    assert "refused 5 (of 6 periodic tasks)" in out


def test_import__dry_run_writes_nothing() -> None:
    periodic("hourly", interval=interval(1, "hours"), queue="reports")
    out = run("--dry-run")
    assert "Would import 'hourly' as tests.support.celery_tasks.tick[hourly]" in out
    assert "nothing written" in out
    assert not TaskSchedule.objects.exists() and not ScheduleEvent.objects.exists()
    run()
    assert schedule("hourly").version == 1


def test_import__twice_is_harmless_and_a_change_is_an_edit() -> None:
    task = periodic("hourly", interval=interval(1, "hours"))
    periodic("daily", crontab=crontab(minute="0", hour="6", timezone="Europe/Berlin"))
    run()
    events = ScheduleEvent.objects.count()
    out = run()
    assert "Imported 0, updated 0, unchanged 2, refused 0" in out
    assert ScheduleEvent.objects.count() == events
    assert schedule("hourly").version == 1
    task.kwargs = json.dumps({"log": "/dev/null", "seconds": 2})
    task.enabled = True
    task.save()
    dry = run("--dry-run")
    assert "Would update 'hourly'" in dry and "changed: kwargs" in dry
    assert schedule("hourly").version == 1
    out = run()
    assert "Imported 0, updated 1, unchanged 1, refused 0" in out
    row = schedule("hourly")
    assert (row.version, row.kwargs["seconds"]) == (2, 2)
    edit = ScheduleEvent.objects.filter(task_name=row.task_name).latest("id")
    assert (edit.kind, list(edit.changes)) == ("edited", ["kwargs"])


def test_import__first_seen_is_just_after_the_last_run() -> None:
    last_run = datetime(2026, 11, 26, 9, 0, 2, 345000, tzinfo=UTC)
    periodic("hourly", interval=interval(1, "hours"), last_run_at=last_run)
    periodic("new", interval=interval(1, "hours"))
    before = timezone.now()
    out = run()
    assert schedule("hourly").first_seen == last_run + timedelta(microseconds=1)
    assert schedule("new").first_seen >= before  # never ran: from the import on
    assert "no slot at or before its last run (2026-11-26T09:00:02.345000+00:00)" in out


def test_import__a_taskguard_database_scheduler_entry_is_converted_in_place() -> None:
    """The beat entry TaskguardDatabaseScheduler saved has the identity the data schedule
    takes (task[name]): the row and its runs stay, and a slot that ran is refused."""
    task = periodic("ping", interval=interval(60, "seconds"))
    entry = BeatEntry(task.name, TICK, celery_interval(timedelta(seconds=60)), {})
    store.save([record_of(app, entry, DJANGO_CELERY_BEAT)])
    beat_row = schedule("ping")
    assert (beat_row.source, beat_row.declared_in) == (ScheduleSource.CELERY, DJANGO_CELERY_BEAT)
    slot = datetime(2026, 11, 26, 9, 0, tzinfo=UTC)
    body = app.tasks[TICK].__wrapped__
    ran: list[datetime] = []
    # The worker's clock at the slot: a slot older than the retention horizon is never run
    # (this one would be from 2026-12-26 on).
    with freeze_now(slot):
        guard.execute(beat_row.task_name, slot, body.policy, lambda: ran.append(slot), (), {})
    assert ran == [slot]

    dry = run("--dry-run")
    assert "Would convert 'ping'" in dry and schedule("ping").source == ScheduleSource.CELERY
    out = run()
    assert "Converted 'ping'" in out and "its runs kept" in out
    row = schedule("ping")
    assert (row.pk, row.task_name) == (beat_row.pk, beat_row.task_name)
    assert (row.source, row.declared_in, row.version) == (ScheduleSource.DATA, "", 1)
    assert row.first_seen == beat_row.first_seen
    assert TaskRun.objects.filter(task_name=row.task_name, state=RunState.SUCCEEDED).count() == 1
    again = guard.execute(row.task_name, slot, body.policy, lambda: ran.append(slot), (), {})
    assert again is None and ran == [slot]  # the ledger refuses the slot that ran
    assert ledger.states_at(row.task_name, [slot]) == {slot: RunState.SUCCEEDED}


def test_import__an_old_beat_still_running_does_not_take_the_schedule_back(caplog) -> None:
    """A TaskguardDatabaseScheduler beat not stopped yet saves its entry again (at its start,
    or when the rows change): the data schedule is left as it is, and the beat is told."""
    task = periodic("ping", interval=interval(60, "seconds"))
    entry = BeatEntry(task.name, TICK, celery_interval(timedelta(seconds=60)), {})
    store.save([record_of(app, entry, DJANGO_CELERY_BEAT)])
    run()
    assert store.save([record_of(app, entry, DJANGO_CELERY_BEAT)]) == 0
    row = schedule("ping")
    assert (row.source, row.declared_in, row.every) == (ScheduleSource.DATA, "", MINUTE)
    assert "are data schedules" in caplog.text and row.task_name in caplog.text


def test_import__a_code_schedule_of_that_name_is_not_taken() -> None:
    periodic("ping", interval=interval(60, "seconds"))
    entry = BeatEntry("ping", TICK, celery_interval(timedelta(seconds=60)), {})
    store.save([record_of(app, entry, "CELERY_BEAT_SCHEDULE")])  # a settings entry
    out = run()
    assert "Refused 'ping'" in out and "already a celery schedule" in out
    assert schedule("ping").source == ScheduleSource.CELERY


def test_import__options_not_carried_are_listed() -> None:
    periodic("routed", interval=interval(1, "hours"), queue="reports", priority=3)
    periodic("plain", interval=interval(1, "hours"))
    periodic("headed", interval=interval(1, "hours"), headers=json.dumps({"x": 1}))
    out = run()
    (line,) = [line for line in out.splitlines() if line.startswith("Not carried")]
    assert "headed (headers)" in line and "routed (queue, priority)" in line
    assert "plain" not in line


def test_import__without_django_celery_beat_says_so() -> None:
    without = modify_settings(INSTALLED_APPS={"remove": ["django_celery_beat"]})
    with without, pytest.raises(CommandError, match="django-celery-beat is not installed"):
        run()


def test_import__an_admin_edit_keeps_celerys_day_rule() -> None:
    from .test_data_schedule_admin import EDITOR_PERMS, change_url, errors, form_data, login

    periodic(
        "friday-13th",
        crontab=crontab(minute="30", hour="9", day_of_month="13", day_of_week="5"),
    )
    run()
    row = schedule("friday-13th")
    editor = login("eve", *EDITOR_PERMS)
    edit = form_data(
        cron="45 9 13 * 5", time_zone=row.time_zone, args="[]", kwargs='{"log": "/dev/null"}'
    )
    response = editor.post(change_url(row), edit)
    assert response.status_code == 302, errors(response)
    edited = schedule("friday-13th")
    assert (edited.cron, edited.cron_day_or, edited.version) == ("45 9 13 * 5", False, 2)


def test_import__crontab_keeps_the_fields_as_written_and_names_the_day_rule_only_when_it_counts():
    periodic("every-5-min", crontab=crontab(minute="*/5", timezone="UTC"))
    periodic(
        "weekdays-odd-days",
        crontab=crontab(minute="0", hour="9", day_of_month="1-31/2", day_of_week="mon-fri"),
    )
    periodic("sundays", crontab=crontab(minute="0", hour="6", day_of_week="0"))
    out = run()
    assert schedule("every-5-min").cron == "*/5 * * * *"
    assert schedule("weekdays-odd-days").cron == "0 9 1-31/2 * mon-fri"
    assert schedule("sundays").cron == "0 6 * * 0"
    lines = {line.split("'")[1]: line for line in out.splitlines() if line.startswith("Imported '")}
    assert lines["every-5-min"].endswith('cron "*/5 * * * *" in UTC'), out
    assert "day of month and day of week both" not in lines["sundays"]
    assert lines["weekdays-odd-days"].endswith("day of month and day of week both"), out
    slots = rebuild("*/5 * * * *", False, "UTC", None).slots_between(
        datetime(2025, 12, 31, 23, 59, tzinfo=UTC), datetime(2026, 1, 1, 0, 59, tzinfo=UTC), 100
    )
    assert [slot.minute for slot in slots] == list(range(0, 60, 5))
