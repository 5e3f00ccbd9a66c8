"""Celery glue without processes: slot stamping, identity, and eager task calls."""

from __future__ import annotations

import copy
import os
import sys
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from celery.beat import SchedulingError
from celery.schedules import crontab, schedule
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_taskguard.contrib.celery import (
    GRACE_HEADER,
    SCHEDULE_HEADER,
    SLOT_HEADER,
    EpochInterval,
    TaskguardEntry,
    TaskguardScheduler,
    aligned,
    slot_for,
    task_identity,
)
from django_taskguard.exceptions import TaskGuardError
from django_taskguard.models import RunState, TaskRun
from django_taskguard.testing import freeze_now
from tests.support import celery_tasks
from tests.support.celery_app import app

from .support.children import executions
from .support.slots import BASE_SLOT

pytestmark = pytest.mark.dialect

UTC = timezone.utc
PARIS = ZoneInfo("Europe/Paris")


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


# --- slots ---------------------------------------------------------------------------


def test_slot_for__interval_is_epoch_aligned():
    every = schedule(timedelta(seconds=7))
    now = utc(2026, 3, 1, 12, 0, 0) + timedelta(microseconds=123)
    slot = slot_for(every, now)
    assert slot <= now < slot + timedelta(seconds=7)
    assert (slot - datetime(1970, 1, 1, tzinfo=UTC)) % timedelta(seconds=7) == timedelta(0)
    assert slot == utc(2026, 3, 1, 12, 0, 0)  # 12:00 UTC is a multiple of 7 s since the epoch
    assert slot_for(every, now + timedelta(seconds=3)) == slot
    assert slot_for(every, slot + timedelta(seconds=7, microseconds=-1)) == slot
    assert slot_for(every, slot + timedelta(seconds=7)) == slot + timedelta(seconds=7)


@pytest.mark.celery_beat
def test_slot_for__crontab_uses_the_crontab_time_zone():
    # django-celery-beat is imported where used: the version matrix's smoke set runs this
    # module without it.
    from django_celery_beat.tzcrontab import TzAwareCrontab

    nightly = TzAwareCrontab(minute=0, hour=21, tz=ZoneInfo("America/New_York"))
    assert slot_for(nightly, utc(2026, 7, 2, 3, 0)) == utc(2026, 7, 2, 1, 0)  # 21:00 EDT
    paris = crontab(minute=0, hour=21, app=app)  # celery's timezone: Europe/Paris
    assert slot_for(paris, utc(2026, 7, 2, 3, 0)) == utc(2026, 7, 1, 19, 0)  # 21:00 CEST


def test_slot_for__crontab_day_fields_both_must_match_as_in_celery():
    # The 13th, and a Friday: celery requires both (cron would take either).
    friday_13th = crontab(minute=0, hour=12, day_of_month=13, day_of_week="fri", app=app)
    assert slot_for(friday_13th, utc(2026, 6, 1)) == datetime(2026, 3, 13, 12, tzinfo=PARIS)


def test_slot_for__crontab_on_dst_days_one_slot_per_fire_time():
    at_0230 = crontab(minute=30, hour=2, app=app)
    # Fall back (2026-10-25): 02:30 happens twice; the slot is the first one, both times.
    first = datetime(2026, 10, 25, 2, 30, fold=0, tzinfo=PARIS)
    second = datetime(2026, 10, 25, 2, 30, fold=1, tzinfo=PARIS)
    assert slot_for(at_0230, first) == first.astimezone(UTC)
    assert slot_for(at_0230, second + timedelta(minutes=1)) == first.astimezone(UTC)
    # Spring forward (2026-03-29): 02:30 does not exist; the slot is 03:30 CEST.
    assert slot_for(at_0230, utc(2026, 3, 29, 1, 31)) == utc(2026, 3, 29, 1, 30)
    assert slot_for(at_0230, utc(2026, 3, 29, 1, 29)) == utc(2026, 3, 28, 1, 30)


@pytest.mark.celery_beat
def test_slot_for__clocked_is_the_clocked_time():
    from django_celery_beat.clockedschedule import clocked

    when = utc(2026, 5, 1, 8, 15)
    assert slot_for(clocked(when), when + timedelta(seconds=2)) == when


def test_epoch_interval__every_beat_is_due_on_the_same_boundaries():
    now = [utc(2026, 1, 1, 0, 0, 5)]
    every = aligned(schedule(timedelta(seconds=10), nowfun=lambda: now[0], app=app))
    assert isinstance(every, EpochInterval)
    assert every == schedule(timedelta(seconds=10))
    # A beat that last sent at 00:00:00.2 and one that started at 00:00:03 agree.
    for last in (utc(2026, 1, 1, 0, 0, 0) + timedelta(milliseconds=200), utc(2026, 1, 1, 0, 0, 3)):
        due, wait = every.is_due(last)
        assert (due, wait) == (False, 5.0)
    now[0] = utc(2026, 1, 1, 0, 0, 10) + timedelta(milliseconds=1)
    due, wait = every.is_due(utc(2026, 1, 1, 0, 0, 3))
    assert due and wait == pytest.approx(9.999)
    # Sent for this slot already (a restarted beat reading its schedule file): not due.
    assert every.is_due(now[0])[0] is False


def test_task_identity__schedule_name_in_brackets_and_bounded():
    assert task_identity("app.report", None) == "app.report"
    assert task_identity("app.report", "app.report") == "app.report"
    assert task_identity("app.report", "nightly-eu") == "app.report[nightly-eu]"
    long_a = task_identity("app.report", "x" * 300 + "a")
    long_b = task_identity("app.report", "x" * 300 + "b")
    assert len(long_a) == len(long_b) == 255
    assert long_a != long_b


@pytest.mark.smoke  # the version matrix's smoke set (scripts/matrix.sh)
def test_scheduler_stamp__headers_carry_slot_and_entry_name(tmp_path):
    beat = TaskguardScheduler(app=app, schedule_filename=str(tmp_path / "beat"), lazy=True)
    entry = TaskguardEntry(
        name="tick-2s",
        task="tests.support.celery_tasks.tick",
        schedule=timedelta(seconds=2),
        app=app,
        options={"headers": {"mine": 1}},
    )
    now = utc(2026, 1, 1, 0, 0, 3)
    stamped = beat.stamp(entry, now)
    assert stamped.options["headers"] == {
        "mine": 1,
        SLOT_HEADER: "2026-01-01T00:00:02+00:00",
        SCHEDULE_HEADER: "tick-2s",
    }
    assert entry.options == {"headers": {"mine": 1}}  # the schedule's own entry is untouched
    assert copy.copy(entry) == entry


@pytest.mark.smoke  # the version matrix's smoke set (scripts/matrix.sh)
def test_database_scheduler__without_django_celery_beat_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "django_taskguard.contrib.celery.beat_db", raising=False)
    for name in [name for name in sys.modules if name.startswith("django_celery_beat.")]:
        monkeypatch.delitem(sys.modules, name)  # a submodule an earlier test imported
    monkeypatch.setitem(sys.modules, "django_celery_beat", None)  # as if not installed
    import django_taskguard.contrib.celery as contrib

    # A submodule imported earlier is an attribute of its package: `from . import beat_db`
    # would find it there without importing anything.
    monkeypatch.delattr(contrib, "beat_db", raising=False)

    with pytest.raises(ImportError, match=r"pip install \"django-taskguard\[celery-beat\]\""):
        contrib.TaskguardDatabaseScheduler  # noqa: B018


# --- eager task calls ----------------------------------------------------------------


@pytest.fixture
def eager():
    app.conf.task_always_eager = True
    try:
        yield app
    finally:
        app.conf.task_always_eager = False


def slot_headers(slot: datetime, name: str = "entry") -> dict[str, str]:
    return {SLOT_HEADER: slot.isoformat(), SCHEDULE_HEADER: name}


def test_eager__a_fast_beats_message_does_not_take_the_slot_from_the_on_time_one(
    eager, transactional_db, tmp_path
):
    # A beat whose clock is 10 minutes fast stamps a slot the worker refuses and records;
    # before, that `skipped` row answered the on-time beat's message: the slot never ran.
    log = tmp_path / "log"
    slot = (datetime.now(UTC) + timedelta(minutes=10)).replace(microsecond=0)
    kwargs = {"log": str(log), "seconds": 0}
    early = celery_tasks.tick.apply_async(kwargs=kwargs, headers=slot_headers(slot, "fast"))
    assert "in the future" in str(early.result)
    assert TaskRun.objects.get().state == RunState.SKIPPED
    with freeze_now(slot):  # the on-time beat's message, on a worker whose clock is right
        celery_tasks.tick.apply_async(kwargs=kwargs, headers=slot_headers(slot, "fast"))
    run = TaskRun.objects.get()
    assert (run.state, run.attempt, run.slot) == (RunState.SUCCEEDED, 1, slot)
    assert len(executions(log)) == 1


@pytest.mark.smoke  # the version matrix's smoke set (scripts/matrix.sh)
def test_eager__slot_from_header_and_identity_with_schedule_name(eager, transactional_db, tmp_path):
    log = tmp_path / "log"
    slot = BASE_SLOT + timedelta(hours=9)
    for _ in range(2):
        celery_tasks.tick.apply_async(
            kwargs={"log": str(log), "seconds": 0}, headers=slot_headers(slot, "nine")
        )
    run = TaskRun.objects.get()
    assert (run.task_name, run.slot, run.state) == (
        "tests.support.celery_tasks.tick[nine]",
        slot,
        RunState.SUCCEEDED,
    )
    assert run.duplicates == 1
    assert len(executions(log)) == 1


def test_eager__beat_entry_grace_header_records_a_late_message_missed(
    eager, transactional_db, tmp_path
):
    """A beat entry's options={"headers": {"taskguard_grace": 60}}: a message later than
    60 s after its slot is recorded missed and not run; one in time runs."""
    log = tmp_path / "log"
    late = BASE_SLOT + timedelta(hours=9)
    in_time = datetime.now(timezone.utc).replace(microsecond=0)
    for slot in (late, in_time):
        headers = {**slot_headers(slot, "graced"), GRACE_HEADER: 60}
        celery_tasks.tick.apply_async(kwargs={"log": str(log), "seconds": 0}, headers=headers)
    missed = TaskRun.objects.get(slot=late)
    assert missed.state == RunState.MISSED and "grace (60s)" in missed.error
    assert TaskRun.objects.get(slot=in_time).state == RunState.SUCCEEDED
    assert len(executions(log)) == 1


def test_eager__no_slot_and_no_schedule_is_recorded_and_raised(eager, transactional_db, tmp_path):
    with pytest.raises(TaskGuardError, match="no slot"):
        celery_tasks.unscheduled.delay(log=str(tmp_path / "log")).get()
    run = TaskRun.objects.get()
    assert run.task_name == "tests.support.celery_tasks.unscheduled"
    assert run.state == RunState.SKIPPED
    assert "no slot" in run.error
    assert run.transitions.last().to_state == RunState.SKIPPED
    assert not (tmp_path / "log").exists()


def test_eager__autoretry_failures_are_attempts_on_one_row(eager, transactional_db, tmp_path):
    log = tmp_path / "log"
    slot = BASE_SLOT + timedelta(hours=9)
    result = celery_tasks.flaky.apply_async(kwargs={"log": str(log)}, headers=slot_headers(slot))
    assert result.get() == "finally"
    run = TaskRun.objects.get()
    assert (run.state, run.attempt, run.slot) == (RunState.SUCCEEDED, 3, slot)
    states = list(run.transitions.order_by("id").values_list("to_state", flat=True))
    assert states == ["running", "retrying", "running", "retrying", "running", "succeeded"]
    assert [e[3] for e in executions(log)] == ["1", "2", "3"]


def test_eager__autoretry_exhausted_ends_failed_with_last_error(eager, transactional_db, tmp_path):
    log = tmp_path / "log"
    with pytest.raises(OSError, match="attempt 3"):
        celery_tasks.hopeless.apply_async(
            kwargs={"log": str(log)}, headers=slot_headers(BASE_SLOT)
        ).get()
    run = TaskRun.objects.get()
    assert (run.state, run.attempt) == (RunState.FAILED, 3)
    assert "attempt 3" in run.error
    assert len(executions(log)) == 3


def test_eager__explicit_retry_is_an_attempt(eager, transactional_db, tmp_path):
    log = tmp_path / "log"
    result = celery_tasks.explicit_retry.apply_async(
        kwargs={"log": str(log)}, headers=slot_headers(BASE_SLOT)
    )
    assert result.get() == "retried"
    run = TaskRun.objects.get()
    assert (run.state, run.attempt) == (RunState.SUCCEEDED, 2)


def test_eager__guarded_function_called_from_a_task_keeps_its_own_identity(
    eager, transactional_db, tmp_path
):
    log = tmp_path / "log"
    celery_tasks.outer.apply_async(kwargs={"log": str(log)}, headers=slot_headers(BASE_SLOT))
    names = dict(TaskRun.objects.values_list("task_name", "state"))
    assert names == {
        "tests.support.celery_tasks.outer[entry]": "succeeded",
        "tests.inner": "succeeded",
    }


def test_eager__beat_claim_lets_one_beat_publish_a_slot(
    eager, transactional_db, tmp_path, redis_server
):
    caches = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "redis": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": redis_server.url},
    }
    log = tmp_path / "log"
    entry_options = {
        "name": "tick-hourly",
        "task": "tests.support.celery_tasks.tick",
        # Hourly: the three beats stamp one slot however slow the machine is (with a
        # 2-second interval, a loaded machine's three sends could straddle two slots).
        "schedule": timedelta(hours=1),
        "kwargs": {"log": str(log), "seconds": 0},
        "app": app,
    }
    beats = [
        TaskguardScheduler(app=app, schedule_filename=str(tmp_path / f"beat{i}"), lazy=True)
        for i in range(3)
    ]
    with override_settings(
        CACHES=caches, TASKGUARD={"BACKEND": "database", "REDIS_ALIAS": "redis", "BEAT_CLAIM": True}
    ):
        sent = [beat.apply_async(TaskguardEntry(**entry_options), advance=False) for beat in beats]
    assert sum(result is not None for result in sent) == 1
    assert len(redis_server.client().keys("taskguard:*:beat:*")) == 1
    run = TaskRun.objects.get()
    assert (run.state, run.duplicates) == (RunState.SUCCEEDED, 0)


def test_beat_claim__owner_and_key_are_the_ones_the_package_builds(transactional_db, redis_server):
    """The beat names itself as every attempt does (``owner.new_owner``, with its pid space)
    and keys its claim with the key builder (``locks.keys.beat_key``), not by hand."""
    from django_taskguard.contrib.celery.beat import beat_claim
    from django_taskguard.locks import redis_key_prefix
    from django_taskguard.locks.keys import beat_key
    from django_taskguard.owner import Owner

    caches = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "redis": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": redis_server.url},
    }
    taskguard = {"BACKEND": "database", "REDIS_ALIAS": "redis", "BEAT_CLAIM": True}
    with override_settings(CACHES=caches, TASKGUARD=taskguard):
        claim = beat_claim("tests.support.celery_tasks.tick", "tick-2s", BASE_SLOT)
        assert claim is not None and claim.key is not None
        identity = task_identity("tests.support.celery_tasks.tick", "tick-2s")
        assert claim.key == beat_key(redis_key_prefix(), identity, BASE_SLOT)
        owner = Owner.parse(claim.owner)
        assert owner is not None and owner.pid == os.getpid() and owner.same_pid_space()
        claim.release()
    assert redis_server.client().keys("taskguard:*:beat:*") == [], "given back by its owner"


def test_eager__beat_claim_sends_anyway_when_redis_is_down(
    eager, transactional_db, tmp_path, redis_server
):
    caches = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "redis": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": redis_server.url},
    }
    redis_server.stop()
    log = tmp_path / "log"
    beats = [
        TaskguardScheduler(app=app, schedule_filename=str(tmp_path / f"beat{i}"), lazy=True)
        for i in range(2)
    ]
    entry = TaskguardEntry(
        name="tick-60s-down",
        task="tests.support.celery_tasks.tick",
        schedule=timedelta(seconds=60),
        kwargs={"log": str(log), "seconds": 0},
        app=app,
    )
    # Both sends fall in one slot: the clock the beats stamp with stands mid-minute.
    mid_minute = datetime.now(UTC).replace(second=30, microsecond=0)
    with (
        freeze_now(mid_minute),
        override_settings(
            CACHES=caches,
            TASKGUARD={"BACKEND": "database", "REDIS_ALIAS": "redis", "BEAT_CLAIM": True},
        ),
    ):
        sent = [beat.apply_async(entry, advance=False) for beat in beats]
    assert all(result is not None for result in sent)
    # Both beats sent (no claim without Redis); the slot ran once, the other copy is counted.
    (run,) = TaskRun.objects.all()
    assert (run.state, run.duplicates) == (RunState.SUCCEEDED, 1)
    assert len(executions(log)) == 1


def test_eager__beat_claim_is_given_back_when_the_publish_fails(
    eager, transactional_db, tmp_path, redis_server
):
    # Before: the claim was kept when the publish raised (broker down), so every other
    # beat skipped that entry and slot, and nothing recorded it.
    caches = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "redis": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": redis_server.url},
    }
    log = tmp_path / "log"
    entry = TaskguardEntry(
        name="tick-2s-broker-down",
        task="tests.support.celery_tasks.tick",
        schedule=timedelta(seconds=2),
        kwargs={"log": str(log), "seconds": 0},
        app=app,
    )
    first = TaskguardScheduler(app=app, schedule_filename=str(tmp_path / "beat1"), lazy=True)
    second = TaskguardScheduler(app=app, schedule_filename=str(tmp_path / "beat2"), lazy=True)
    settings = {"BACKEND": "database", "REDIS_ALIAS": "redis", "BEAT_CLAIM": True}

    def broken_publish(*args: object, **kwargs: object) -> None:
        raise ConnectionError("broker down")

    task = app.tasks["tests.support.celery_tasks.tick"]
    with override_settings(CACHES=caches, TASKGUARD=settings):
        task.apply_async = broken_publish  # an instance attribute: the publish fails
        try:
            with pytest.raises(SchedulingError, match="broker down"):
                first.apply_async(entry, advance=False)
        finally:
            del task.apply_async
        assert redis_server.client().keys("taskguard:*:beat:*") == [], "the claim was given back"
        assert second.apply_async(entry, advance=False) is not None
    assert len(executions(log)) == 1


@pytest.mark.parametrize(
    ("zone", "every", "now", "slot"),
    [
        # Daily, relative, in New York: local midnight (05:00 UTC in winter), not 00:00 UTC.
        ("America/New_York", timedelta(days=1), utc(2026, 1, 10, 12, 0), utc(2026, 1, 10, 5, 0)),
        # Hourly, relative, in Kolkata (UTC+05:30): the top of the local hour, :30 UTC.
        ("Asia/Kolkata", timedelta(hours=1), utc(2026, 1, 10, 12, 45), utc(2026, 1, 10, 12, 30)),
        ("Asia/Kolkata", timedelta(minutes=15), utc(2026, 1, 10, 12, 44), utc(2026, 1, 10, 12, 30)),
    ],
)
def test_aligned__relative_interval_is_aligned_in_the_apps_time_zone(zone, every, now, slot):
    # Before: relative=True was ignored and the interval aligned to UTC: a daily entry
    # in New York fired at 19:00 EST instead of midnight, silently.
    from celery import Celery

    local = Celery("tests.relative", set_as_current=False)
    local.conf.timezone = zone
    entry = aligned(schedule(every, relative=True, app=local))
    assert slot_for(entry, now) == slot


def test_aligned__relative_interval_with_no_aligned_equivalent_is_refused():
    with pytest.raises(ImproperlyConfigured, match="a relative=True interval of 0:07:00 has no"):
        aligned(schedule(timedelta(minutes=7), relative=True, app=app))


# --- DST: a beat is due at, and stamps, the slots run_schedules fires ------------------


@pytest.mark.parametrize(
    ("zone", "change"),
    [
        ("Europe/Berlin", utc(2026, 3, 29, 1)),
        ("Europe/Berlin", utc(2026, 10, 25, 1)),
        ("America/New_York", utc(2026, 3, 8, 7)),
        ("America/New_York", utc(2026, 11, 1, 6)),
    ],
)
@pytest.mark.parametrize(("minute", "hour"), [("*/5", "*"), ("30", "2"), ("30", "1")])
@pytest.mark.parametrize(
    "kind", ["crontab", pytest.param("django-celery-beat", marks=pytest.mark.celery_beat)]
)
def test_beat__crontab_is_due_at_the_slots_run_schedules_fires_across_dst(
    zone, change, minute, hour, kind
):
    """Regression: celery's own crontab is not due in the second pass of a repeated hour,
    so a beat published nothing for an hour that run_schedules fires every 5 minutes of."""
    from celery import Celery

    from django_taskguard.contrib.celery.beat import aligned
    from django_taskguard.schedules import CronSchedule

    clock = [change - timedelta(hours=3)]
    if kind == "crontab":
        local = Celery("tests.dst", set_as_current=False)
        local.conf.timezone = zone
        plain = crontab(minute=minute, hour=hour, app=local, nowfun=lambda: clock[0])
        beat = aligned(plain)
    else:  # django-celery-beat is imported only here: Django 6.1's pass has none
        from django_celery_beat.tzcrontab import TzAwareCrontab

        from django_taskguard.contrib.celery.beat_db import aligned_db

        plain = TzAwareCrontab(minute=minute, hour=hour, tz=ZoneInfo(zone), app=app)
        plain.nowfun = lambda: clock[0].astimezone(ZoneInfo(zone))
        beat = aligned_db(plain)
    last, stamped = clock[0], []
    while clock[0] < change + timedelta(hours=3):
        clock[0] += timedelta(seconds=60)
        if beat.is_due(last).is_due:
            stamped.append(slot_for(beat, clock[0]))
            last = clock[0]
    cron = CronSchedule(f"{minute} {hour} * * *", tz_name=zone, day_or=False)
    fired = cron.slots_between(change - timedelta(hours=3), clock[0], 1000)
    assert stamped == fired
    assert len(fired) == (72 if minute == "*/5" else len(set(fired)))


def test_classify_raise__a_retry_names_its_message_by_task_id_and_retry_count():
    # Before (review of issue 19): retry_by was the task id alone, so a stale copy of the
    # same message (a put-back of the original, a redelivery) started the next attempt
    # early and began a second retry chain. Celery's retry keeps the id and adds one to
    # ``retries``; a requeued message (Reject(requeue=True)) keeps both.
    from celery.app.task import Context
    from celery.exceptions import Reject, Retry

    from django_taskguard.contrib.celery.worker import _message_id, classify_raise

    request = Context(id="abc", retries=2, called_directly=False)
    assert _message_id(request) == "abc/2"
    task = celery_tasks.always_fails
    assert classify_raise(task, request, Retry("again", when=5)).retry_by == "abc/3"
    assert classify_raise(task, request, Reject("back", requeue=True)).retry_by == "abc/2"
    first = Context(id="abc", retries=0, called_directly=False)
    assert classify_raise(task, first, OSError("down")).retry_by == "abc/1"
