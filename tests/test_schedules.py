"""Schedule slots: cron in Django's TIME_ZONE across DST changes, epoch-aligned intervals.

``latest_slot(now)`` takes ``now``, so most of this needs no clock at all; the
end-to-end DST test patches ``django.utils.timezone.now`` for the slot
computation only (the ledger's deadlines use the database's clock).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from unittest import mock
from zoneinfo import ZoneInfo

import pytest
from celery.schedules import crontab
from celery.schedules import schedule as celery_schedule
from croniter import croniter
from django.test import override_settings

from django_taskguard import once_per_schedule
from django_taskguard.models import RunState, TaskRun
from django_taskguard.schedules import CronSchedule, IntervalSchedule, build, wall_to_utc

pytestmark = pytest.mark.pure

UTC = dt_timezone.utc
NEW_YORK = "America/New_York"
PARIS = "Europe/Paris"


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def test_cron__fall_back_new_york_both_0130s_are_one_slot():
    """2026-11-01 01:30 happens at 05:30 UTC (EDT) and again at 06:30 UTC (EST)."""
    cron = CronSchedule("30 1 * * *", tz_name=NEW_YORK)
    first, second = utc(2026, 11, 1, 5, 30), utc(2026, 11, 1, 6, 30)
    assert first.astimezone(ZoneInfo(NEW_YORK)).strftime("%H:%M %Z") == "01:30 EDT"
    assert second.astimezone(ZoneInfo(NEW_YORK)).strftime("%H:%M %Z") == "01:30 EST"
    assert cron.latest_slot(first) == first
    assert cron.latest_slot(second) == first
    assert cron.latest_slot(second + timedelta(minutes=20)) == first
    assert cron.latest_slot(first - timedelta(seconds=1)) == utc(2026, 10, 31, 5, 30)


def test_cron__fall_back_paris_both_0230s_are_one_slot():
    """2026-10-25 02:30 happens at 00:30 UTC (CEST) and again at 01:30 UTC (CET)."""
    with override_settings(TIME_ZONE=PARIS):
        cron = CronSchedule("30 2 * * *")
        assert cron.latest_slot(utc(2026, 10, 25, 0, 30)) == utc(2026, 10, 25, 0, 30)
        assert cron.latest_slot(utc(2026, 10, 25, 1, 30)) == utc(2026, 10, 25, 0, 30)
        assert cron.latest_slot(utc(2026, 10, 25, 1, 31)) == utc(2026, 10, 25, 0, 30)


@pytest.mark.dialect  # the slots go through the ledger: its SQL
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("zone", "expression", "first", "second"),
    [
        (NEW_YORK, "30 1 * * *", utc(2026, 11, 1, 5, 30, 0), utc(2026, 11, 1, 6, 30, 0)),
        (PARIS, "30 2 * * *", utc(2026, 10, 25, 0, 30, 0), utc(2026, 10, 25, 1, 30, 0)),
    ],
)
def test_cron__fall_back_hour_runs_once_end_to_end(zone, expression, first, second):
    """Calls at both occurrences of the repeated wall time resolve to one slot: one run."""
    runs: list[datetime] = []
    with override_settings(TIME_ZONE=zone):

        @once_per_schedule(cron=expression, name=f"tests.dst.{zone}")
        def nightly() -> str:
            runs.append(first)
            return "ran"

        for now, expected in ((first, "ran"), (second + timedelta(seconds=5), None)):
            with mock.patch("django.utils.timezone.now", return_value=now):
                assert nightly() == expected
        assert nightly.run_for_slot(first) is None
    assert len(runs) == 1
    run = TaskRun.objects.get()
    assert (run.slot, run.state, run.duplicates) == (first, RunState.SUCCEEDED, 2)


def test_cron__spring_forward_gap_time_shifts_forward_by_the_gap():
    """2026-03-08 02:30 does not exist in New York; it fires at 03:30 EDT (07:30 UTC)."""
    cron = CronSchedule("30 2 * * *", tz_name=NEW_YORK)
    assert cron.latest_slot(utc(2026, 3, 8, 7, 29)) == utc(2026, 3, 7, 7, 30)
    assert cron.latest_slot(utc(2026, 3, 8, 7, 30)) == utc(2026, 3, 8, 7, 30)
    assert cron.latest_slot(utc(2026, 3, 9, 6, 29)) == utc(2026, 3, 8, 7, 30)


def test_cron__spring_forward_cron_that_only_fires_in_the_gap_has_a_slot():
    """Every fire of '* 2 * * *' on 2026-03-08 is in the skipped hour (regression: crashed)."""
    cron = CronSchedule("* 2 * * *", tz_name=NEW_YORK)
    assert cron.latest_slot(utc(2026, 3, 8, 7, 10)) == utc(2026, 3, 8, 7, 10)
    assert cron.latest_slot(utc(2026, 3, 8, 6, 59)) == utc(2026, 3, 7, 7, 59)


def test_cron__repeated_hour_gives_the_latest_fire_of_the_second_pass():
    """At 01:05 EST (second pass) the latest '*/10' fire is 01:00 EST (06:00 UTC): an
    every-hour cron fires on both passes (it was 01:50 EDT, the first pass's last)."""
    cron = CronSchedule("*/10 * * * *", tz_name=NEW_YORK)
    assert cron.latest_slot(utc(2026, 11, 1, 6, 5)) == utc(2026, 11, 1, 6, 0)
    assert cron.latest_slot(utc(2026, 11, 1, 5, 59)) == utc(2026, 11, 1, 5, 50)


def brute_latest(expression: str, zone: ZoneInfo, now: datetime) -> datetime:
    """Every fire time from a day before to hours after, mapped like the real thing (a
    skipped wall time shifted forward; both passes of a repeated one for an every-hour cron)."""
    wall = now.astimezone(zone).replace(tzinfo=None)
    fires = croniter(expression, wall - timedelta(hours=26))
    both = expression.split()[1] == "*"  # every hour: a repeated wall time fires twice
    best = None
    while (fire := fires.get_next(datetime)) <= wall + timedelta(hours=4):
        second = fire.replace(tzinfo=zone, fold=1).astimezone(UTC)
        for mapped in (wall_to_utc(fire, zone), second if both else None):
            if mapped is not None and mapped <= now and (best is None or mapped > best):
                best = mapped
    assert best is not None
    return best


@pytest.mark.parametrize("expression", ["*/10 * * * *", "30 1 * * *", "30 2 * * *", "* 2 * * *"])
@pytest.mark.parametrize(
    ("zone", "change"),
    [
        (NEW_YORK, utc(2026, 3, 8, 7)),
        (NEW_YORK, utc(2026, 11, 1, 6)),
        (PARIS, utc(2026, 10, 25, 1)),
    ],
)
def test_cron__latest_slot_matches_brute_force_around_dst_changes(expression, zone, change):
    cron = CronSchedule(expression, tz_name=zone)
    tz = ZoneInfo(zone)
    previous = None
    for step in range(-36, 37):
        now = change + timedelta(minutes=10 * step, seconds=7)
        slot = cron.latest_slot(now)
        assert slot == brute_latest(expression, tz, now), now
        assert slot <= now and slot.tzinfo is UTC
        assert previous is None or slot >= previous, "slots went backwards"
        previous = slot


def test_cron__slot_is_stored_in_utc_whatever_time_zone():
    with override_settings(TIME_ZONE="Asia/Kolkata"):
        slot = CronSchedule("0 21 * * *").latest_slot(utc(2026, 11, 21, 16, 0))
    assert slot == utc(2026, 11, 21, 15, 30) and slot.utcoffset() == timedelta(0)


def test_cron__follows_time_zone_at_evaluation_time():
    cron = CronSchedule("0 9 * * *")
    now = utc(2026, 6, 1, 20, 0)
    with override_settings(TIME_ZONE=PARIS):
        assert cron.latest_slot(now) == utc(2026, 6, 1, 7, 0)
    with override_settings(TIME_ZONE=NEW_YORK):
        assert cron.latest_slot(now) == utc(2026, 6, 1, 13, 0)


def test_once_per_schedule__time_zone_reads_the_cron_in_that_zone_whatever_time_zone():
    @once_per_schedule(cron="0 9 * * *", time_zone="Asia/Kolkata", name="tests.zoned")
    def zoned() -> None: ...

    now = utc(2026, 6, 1, 20, 0)
    for zone in (PARIS, NEW_YORK):
        with override_settings(TIME_ZONE=zone):
            assert zoned.schedule.latest_slot(now) == utc(2026, 6, 1, 3, 30)
    assert zoned.schedule == CronSchedule("0 9 * * *", "Asia/Kolkata")  # saved with its zone
    also = build(None, None, "0 9 * * *", "Asia/Kolkata")  # schedule= a cron string
    assert also == zoned.schedule


@pytest.mark.parametrize(
    ("every", "now", "slot"),
    [
        (timedelta(minutes=5), utc(2026, 11, 21, 12, 7, 30), utc(2026, 11, 21, 12, 5)),
        (timedelta(minutes=5), utc(2026, 11, 21, 12, 5), utc(2026, 11, 21, 12, 5)),
        (timedelta(hours=1), utc(2026, 11, 21, 12, 59, 59), utc(2026, 11, 21, 12)),
        (timedelta(days=1), utc(2026, 11, 21, 23, 0), utc(2026, 11, 21)),
        (timedelta(seconds=1), utc(2026, 11, 21, 1, 2, 3, 999999), utc(2026, 11, 21, 1, 2, 3)),
    ],
)
def test_every__slots_are_aligned_to_the_epoch(every, now, slot):
    assert IntervalSchedule(every).latest_slot(now) == slot


def test_every__alignment_ignores_time_zone_and_start_time():
    every = IntervalSchedule(timedelta(minutes=7))
    now = utc(2026, 11, 21, 12, 0, 0)
    slots = set()
    for zone in (PARIS, NEW_YORK, "UTC"):
        with override_settings(TIME_ZONE=zone):
            slots.add(every.latest_slot(now))
    (slot,) = slots
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    assert (slot - epoch) % timedelta(minutes=7) == timedelta(0)
    assert timedelta(0) <= now - slot < timedelta(minutes=7)


@pytest.mark.parametrize(
    ("celery", "ours"),
    [
        (crontab(minute="*/15"), "*/15 * * * *"),
        (crontab(minute=0, hour=21), "0 21 * * *"),
        (crontab(minute=30, hour=8, day_of_week="mon-fri"), "30 8 * * 1-5"),
        (crontab(minute=0, hour=0, day_of_month=1, month_of_year="1,7"), "0 0 1 1,7 *"),
    ],
)
def test_schedule__celery_crontab_is_accepted(celery, ours):
    built = build(None, None, celery)
    assert isinstance(built, CronSchedule)
    guarded = once_per_schedule(schedule=celery, name="tests.celery.crontab")(lambda: None)
    with override_settings(TIME_ZONE=PARIS):
        for now in (utc(2026, 11, 21, 14, 3), utc(2027, 1, 1, 0, 0), utc(2026, 3, 29, 1, 30)):
            assert guarded.schedule.latest_slot(now) == CronSchedule(ours).latest_slot(now)


def test_schedule__celery_interval_schedule_is_accepted():
    built = build(None, None, celery_schedule(run_every=timedelta(seconds=30)))
    assert built == IntervalSchedule(timedelta(seconds=30))
    assert built.latest_slot(utc(2026, 1, 1, 0, 0, 45)) == utc(2026, 1, 1, 0, 0, 30)


def test_schedule__strings_and_timedeltas_and_own_schedules_are_accepted():
    assert build(None, None, "0 21 * * *") == CronSchedule("0 21 * * *")
    assert build(None, None, timedelta(minutes=5)) == IntervalSchedule(timedelta(minutes=5))
    mine = IntervalSchedule(timedelta(hours=2))
    assert build(None, None, mine) is mine
    assert build(None, None, None) is None


def test_normalize_slot__naive_datetime_error_says_how_to_make_it_aware():
    from django_taskguard.exceptions import InvalidSchedule
    from django_taskguard.schedules import normalize_slot

    with pytest.raises(InvalidSchedule) as raised:
        normalize_slot(datetime(2026, 11, 26, 21, 0))
    message = str(raised.value)
    assert "got naive 2026-11-26T21:00:00" in message
    assert "django.utils.timezone.make_aware(slot)" in message
    assert "slot.replace(tzinfo=datetime.timezone.utc)" in message


def test_rebuild__one_built_schedule_per_stored_value():
    """Health, metrics and the overview rebuild every stored row on every call: a cron
    is built once per distinct (cron, day_or, zone, every), not once per row and call."""
    from django_taskguard.schedules import rebuild

    cron = rebuild("*/5 * * * *", True, "Europe/Berlin", None)
    assert rebuild("*/5 * * * *", True, "Europe/Berlin", None) is cron
    assert rebuild("*/5 * * * *", True, "UTC", None) is not cron
    assert rebuild("", True, "", timedelta(minutes=5)) is rebuild(
        "", True, "", timedelta(minutes=5)
    )
