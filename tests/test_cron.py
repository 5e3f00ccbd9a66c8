"""Cron across DST changes (both passes of a repeated hour), and the kept walks' answers
against a fresh computation and against a minute-by-minute oracle (issue 20, items 9, 11).

Europe/Berlin: springs forward 2026-03-29 01:00 UTC (02:00 CET -> 03:00 CEST), falls back
2026-10-25 01:00 UTC (03:00 CEST -> 02:00 CET: 02:00-02:59 twice). America/New_York: springs
forward 2026-03-08 07:00 UTC, falls back 2026-11-01 06:00 UTC (01:00-01:59 twice).
"""

from __future__ import annotations

import random
import sys
import threading
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from unittest import mock
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter

from django_taskguard import once_per_schedule, registry
from django_taskguard.cron import CronSchedule, _walk, plain_between, plain_latest
from django_taskguard.exceptions import InvalidSchedule
from django_taskguard.scheduler import Scheduler

pytestmark = pytest.mark.pure

UTC = dt_timezone.utc
BERLIN, NEW_YORK = "Europe/Berlin", "America/New_York"
MINUTE = timedelta(minutes=1)
CHANGES = {
    (BERLIN, "spring"): datetime(2026, 3, 29, 1, tzinfo=UTC),
    (BERLIN, "fall"): datetime(2026, 10, 25, 1, tzinfo=UTC),
    (NEW_YORK, "spring"): datetime(2026, 3, 8, 7, tzinfo=UTC),
    (NEW_YORK, "fall"): datetime(2026, 11, 1, 6, tzinfo=UTC),
}


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def minutes(start: datetime, end: datetime, step: int = 1) -> list[datetime]:
    return [start + n * MINUTE for n in range(0, int((end - start) / MINUTE) + 1, step)]


def oracle(cron: CronSchedule, start: datetime, end: datetime) -> list[datetime]:
    """The documented rule, minute by minute of real time in ``(start, end]``: a minute
    fires when its wall time matches (on a repeated hour's second pass only if the hour
    field allows every hour), or when it is a skipped wall time that matches, shifted."""
    zone = ZoneInfo(cron.tz_name or "UTC")
    every_hour = cron.expression.split()[1] in ("*", "0-23")

    def match(wall: datetime) -> bool:
        return bool(croniter.match(cron.expression, wall, day_or=cron.day_or))

    fired = []
    for instant in minutes(start + MINUTE, end):
        local = instant.astimezone(zone)
        if match(local.replace(tzinfo=None)) and (local.fold == 0 or every_hour):
            fired.append(instant)
            continue
        before = (instant - timedelta(hours=3)).astimezone(zone).utcoffset()
        assert before is not None
        wall = (instant + before).replace(tzinfo=None)
        exists = wall.replace(tzinfo=zone).astimezone(UTC).astimezone(zone).replace(tzinfo=None)
        if exists != wall and match(wall):
            fired.append(instant)
    return fired


# -- item 9: what a cron means in a repeated or skipped hour -----------------------------


@pytest.mark.parametrize("zone", [BERLIN, NEW_YORK])
def test_cron__every_minute_fires_on_both_passes_of_the_repeated_hour(zone):
    """Regression: Berlin fired 00:59 UTC and then nothing until 02:00 UTC."""
    change = CHANGES[(zone, "fall")]
    cron = CronSchedule("* * * * *", tz_name=zone)
    every = minutes(change - 5 * MINUTE, change + 65 * MINUTE)
    assert cron.slots_between(every[0] - MINUTE, every[-1], 1000) == every
    assert [cron.latest_slot(m + timedelta(seconds=30)) for m in every] == every


@pytest.mark.parametrize("zone", [BERLIN, NEW_YORK])
@pytest.mark.parametrize("expression", ["*/5 * * * *", "0 * * * *"])
def test_cron__wildcard_hour_repeated_hour_is_two_hours_of_slots(zone, expression):
    change = CHANGES[(zone, "fall")]
    cron = CronSchedule(expression, tz_name=zone)
    step = 5 if expression.startswith("*/5") else 60
    expected = minutes(change - 2 * step * MINUTE, change + 2 * step * MINUTE, step)
    got = cron.slots_between(expected[0] - MINUTE, expected[-1], 1000)
    assert got == expected
    assert len(got) == len(set(got))


@pytest.mark.parametrize(
    ("zone", "expression", "first"),
    [
        (BERLIN, "30 2 * * *", utc(2026, 10, 25, 0, 30)),
        (NEW_YORK, "30 1 * * *", utc(2026, 11, 1, 5, 30)),
    ],
)
def test_cron__fixed_hour_fires_once_on_the_first_pass(zone, expression, first):
    cron = CronSchedule(expression, tz_name=zone)
    assert cron.slots_between(first - timedelta(hours=12), first + timedelta(hours=12), 10) == [
        first
    ]
    assert cron.latest_slot(first + timedelta(hours=1, minutes=5)) == first
    assert (
        CronSchedule("* 2 * * *", tz_name=BERLIN).count_between(
            utc(2026, 10, 24, 23), utc(2026, 10, 25, 3), 1000
        )
        == 60
    )


@pytest.mark.parametrize(("zone", "when"), list(CHANGES))
@pytest.mark.parametrize(
    "expression", ["* * * * *", "*/5 * * * *", "0 * * * *", "30 2 * * *", "30 1 * * *", "* 2 * * *"]
)
def test_cron__slots_match_the_minute_by_minute_oracle(zone, when, expression):
    change = CHANGES[(zone, when)]
    cron = CronSchedule(expression, tz_name=zone)
    start, end = change - timedelta(hours=4), change + timedelta(hours=4)
    expected = oracle(cron, start, end)
    assert cron.slots_between(start, end, 10_000) == expected
    assert plain_between(cron, start, end, 10_000) == expected
    for now in minutes(start + 61 * MINUTE, end, 7):
        probe = now + timedelta(seconds=11)
        fired = [slot for slot in expected if slot <= probe]
        if fired:
            assert cron.latest_slot(probe) == fired[-1], probe


@pytest.mark.parametrize("zone", [BERLIN, NEW_YORK])
def test_next_slot__after_the_spring_change_before_the_shifted_slot(zone):
    """Between 03:00 and 03:30 on the spring-forward day the next '30 2 * * *' slot is
    03:30 that day (02:30 shifted), not 02:30 the next day."""
    change = CHANGES[(zone, "spring")]
    cron = CronSchedule("30 2 * * *", tz_name=zone)
    shifted = change + timedelta(minutes=30)
    for now in (change - timedelta(hours=1), change, change + timedelta(minutes=10)):
        assert cron.next_slot(now) == shifted, now
    # 02:30 the next day, 23 hours later in real time
    assert cron.next_slot(shifted) == shifted + timedelta(hours=23)


@pytest.mark.dialect  # the scheduler reads its rows: the ledger's SQL
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("zone", [BERLIN, NEW_YORK])
def test_scheduler_due__fires_every_minute_of_the_repeated_hour(zone):
    """run_schedules' loop, woken each minute through the fall-back: one slot a minute."""
    change = CHANGES[(zone, "fall")]

    @once_per_schedule(schedule=CronSchedule("* * * * *", tz_name=zone), name=f"tests.cron.{zone}")
    def job() -> None:
        pass

    entry = registry.entries()[f"tests.cron.{zone}"]
    scheduler = Scheduler([entry], max_workers=1)
    try:
        scheduler.first_due(change - 3 * MINUTE)
        fired = []
        for now in minutes(change - 2 * MINUTE, change + 62 * MINUTE):
            for _, slots in scheduler.due(now + timedelta(seconds=1)):
                fired.extend(slots)
    finally:
        scheduler.pool.close()
        scheduler.writer.close()
        registry.unregister(f"tests.cron.{zone}")
    assert fired == minutes(change - 2 * MINUTE, change + 62 * MINUTE)


# -- item 11: the kept walks answer as a fresh computation does ------------------------

ZONES = [BERLIN, NEW_YORK, "UTC", "Australia/Lord_Howe", "America/Santiago", "Asia/Kolkata"]
FIELDS = [
    ["*", "*/5", "0", "30", "15,45", "*/7", "59"],
    ["*", "*", "2", "1", "*/2", "0-23", "1-3", "23"],
    ["*", "*", "*", "1", "15", "L", "28-31"],
    ["*", "*", "*", "3", "10,11", "*/4"],
    ["*", "*", "*", "0", "1-5", "sun"],
]


# Seconds between a test's queries: mostly forward, as a scheduler asks; sometimes back,
# sometimes far ahead (the kept walk starts again).
STEPS = [-7200, -61, 1, 30, 59, 60, 300, 3600, 86_400, 40 * 86_400]


def random_cron(rng: random.Random) -> CronSchedule:
    expression = " ".join(rng.choice(choices) for choices in FIELDS)
    return CronSchedule(expression, tz_name=rng.choice(ZONES), day_or=rng.random() < 0.5)


def dst_day(rng: random.Random, zone: ZoneInfo) -> datetime:
    """A random instant, most of them within hours of one of the zone's changes."""
    at = utc(2021, 1, 1) + timedelta(seconds=rng.randrange(10 * 365 * 86_400))
    if rng.random() < 0.7:
        day = at.replace(hour=12, minute=0, second=0)
        while (
            day.astimezone(zone).utcoffset()
            == (day + timedelta(days=1)).astimezone(zone).utcoffset()
        ):
            day += timedelta(days=1)
            if day > at + timedelta(days=370):
                return at
        at = day + timedelta(seconds=rng.randrange(2 * 86_400))
    return at


@pytest.mark.once  # computation alone, no database: the PostgreSQL pass runs it
def test_cron__kept_walks_agree_with_a_fresh_computation():
    rng = random.Random(20)
    for _ in range(150):
        cron = random_cron(rng)
        zone = ZoneInfo(cron.tz_name or "UTC")
        now = dst_day(rng, zone)
        for _ in range(25):
            now += timedelta(seconds=rng.choice(STEPS))
            assert cron.latest_slot(now) == plain_latest(cron, zone, now), (cron, now)
            span = timedelta(seconds=rng.choice([60, 3600, 4 * 3600, 2 * 86_400]))
            start, limit = now - span, rng.choice([1, 3, 50, 10**7])
            fresh = plain_between(cron, start, now, limit)
            assert cron.slots_between(start, now, limit) == fresh, (cron, start, now)
            assert cron.count_between(start, now, limit) == len(fresh)
            ahead = plain_between(cron, now, now + timedelta(days=400), 1)
            assert cron.slots_between(now, now + timedelta(days=400), 1) == ahead


def test_cron__a_walk_moved_past_the_start_by_another_question_still_gives_every_slot():
    """Regression: a question took the kept walk (its times began before its start), then
    another question moved that walk past the start before the first one stepped it (the
    main loop's latest_slot against the sweeper's slots_between): the first got the slots
    after the walk's new beginning only (1 of 80) and the sweep took the short list as done."""
    cron = CronSchedule("* * * * *", tz_name="UTC")
    now = utc(2031, 5, 17, 9, 0)
    cron.latest_slot(now - timedelta(minutes=100))  # the kept walk begins 100 minutes back
    walk = _walk(cron, now - timedelta(minutes=80))  # the sweeper's question takes it...
    assert cron.latest_slot(now) == now  # ...the main loop's moves it past the start...
    found = walk.between(now - timedelta(minutes=80), now, 1000)  # ...then the sweeper asks
    assert found == plain_between(cron, now - timedelta(minutes=80), now, 1000)
    assert len(found) == 80
    assert walk.latest(now - timedelta(minutes=90)) == now - timedelta(minutes=90)


@pytest.mark.once  # computation alone, no database: the PostgreSQL pass runs it
def test_cron__two_threads_sharing_a_walk_get_the_fresh_answers():
    """The main loop (latest_slot, moving forward in jumps) and the sweeper (slots_between
    over long windows behind it) ask the same kept walk at once; every answer is the fresh
    computation's."""
    cron = CronSchedule("*/2 * * * *", tz_name=BERLIN)
    zone = ZoneInfo(BERLIN)
    base = CHANGES[(BERLIN, "fall")] - timedelta(hours=6)
    wrong: list[tuple[str, datetime, object, object]] = []
    ready = threading.Barrier(2)

    def main_loop() -> None:
        rng = random.Random(1)
        ready.wait()
        for _ in range(400):
            now = base + timedelta(minutes=rng.randrange(12 * 60))
            if (got := cron.latest_slot(now)) != (want := plain_latest(cron, zone, now)):
                wrong.append(("latest", now, got, want))

    def sweeper() -> None:
        rng = random.Random(2)
        ready.wait()
        for _ in range(150):
            start = base + timedelta(minutes=rng.randrange(12 * 60))
            end = start + timedelta(minutes=rng.choice([30, 200, 400]))
            got = cron.slots_between(start, end, 10_000)
            if got != (want := plain_between(cron, start, end, 10_000)):
                wrong.append(("between", start, len(got), len(want)))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: the window is a few bytecodes
    try:
        threads = [threading.Thread(target=main_loop), threading.Thread(target=sweeper)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert wrong == [], wrong[:5]


@pytest.mark.once  # computation alone, no database: the PostgreSQL pass runs it
def test_cron__fresh_computation_matches_the_oracle_on_random_dst_days():
    rng = random.Random(9)
    for _ in range(40):
        cron = random_cron(rng)
        zone = ZoneInfo(cron.tz_name or "UTC")
        start = dst_day(rng, zone).replace(second=0, microsecond=0)
        end = start + timedelta(hours=6)
        assert plain_between(cron, start, end, 10_000) == oracle(cron, start, end), cron


@pytest.mark.dialect  # the scheduler reads its rows: the ledger's SQL
@pytest.mark.django_db(transaction=True)
def test_scheduler_due__a_cron_slot_costs_a_few_croniter_steps_not_a_walk():
    """Regression (cost): each slot of each cron walked croniter from 3 hours back, three
    times (about 540 steps per schedule and slot for '* * * * *'). Counted, not timed."""
    zones = [BERLIN, NEW_YORK, "UTC", "Asia/Kolkata", "Australia/Lord_Howe"]
    for zone in zones:
        once_per_schedule(schedule=CronSchedule("* * * * *", zone), name=f"tests.cost.{zone}")(
            lambda: None
        )
    entries = [registry.entries()[f"tests.cost.{zone}"] for zone in zones]
    scheduler = Scheduler(entries, max_workers=1)
    steps = {"n": 0}
    real_next, real_prev = croniter.get_next, croniter.get_prev

    def counted(real):  # type: ignore[no-untyped-def]
        def step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            steps["n"] += 1
            return real(self, *args, **kwargs)

        return step

    now = utc(2026, 6, 1, 12, 0, 30)
    try:
        scheduler.first_due(now)
        with (
            mock.patch.object(croniter, "get_next", counted(real_next)),
            mock.patch.object(croniter, "get_prev", counted(real_prev)),
        ):
            fired = 0
            for _ in range(10 * 60):
                now += timedelta(seconds=1)
                fired += sum(len(slots) for _, slots in scheduler.due(now))
    finally:
        scheduler.pool.close()
        scheduler.writer.close()
        for zone in zones:
            registry.unregister(f"tests.cost.{zone}")
    assert fired == 10 * len(zones)
    assert steps["n"] <= 3 * fired, steps


@pytest.mark.parametrize(
    ("expression", "said"),
    [
        ("@daily", "cron aliases such as @daily are not supported; write 0 0 * * *"),
        ("@hourly", "cron aliases such as @hourly are not supported; write 0 * * * *"),
        ("@reboot", "cron aliases such as @reboot are not supported: write five fields"),
        ("0", "cron expression '0' has 1 field; it needs 5"),
        ("0 9 * *", "cron expression '0 9 * *' has 4 fields; it needs 5"),
    ],
)
def test_cron__aliases_and_a_wrong_field_count_are_said_plainly(expression, said):
    with pytest.raises(InvalidSchedule) as raised:
        CronSchedule(expression)
    assert str(raised.value).startswith(said)
