"""The missed-slot sweep at scale: a schedule with nothing due is not read (its
``sweep_due_at`` is ahead), due schedules are judged together in batches, a long outage
over many schedules is still recorded in full over several sweeps, and every writer of a
schedule's slots or mark leaves ``sweep_due_at`` right."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_taskguard import define_schedule, ledger, missed
from django_taskguard.ledger import schedules as store
from django_taskguard.missed import sweep_missed
from django_taskguard.models import RunState, TaskRun, TaskSchedule
from django_taskguard.schedules import IntervalSchedule
from tests.support import data_targets  # noqa: F401  (registers the schedules' targets)

from .support.monitoring import finished, schedule

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]
SECOND = timedelta(seconds=1)
MINUTE = timedelta(minutes=1)
GRACE = 2 * SECOND
TARGET = "tests.support.data_targets.send_report"


def many(prefix: str, count: int, *, every: timedelta, seconds_ago: int) -> list[TaskSchedule]:
    """``count`` schedules every ``every``, first seen ``seconds_ago`` (database clock)."""
    first = ledger.database_now().replace(microsecond=0) - seconds_ago * SECOND
    rows = [
        TaskSchedule(
            task_name=f"{prefix}.{n:05d}",
            function=f"{prefix}.{n:05d}",
            every=every,
            grace=GRACE,
            max_catchup=10,
            first_seen=first,
        )
        for n in range(count)
    ]
    return TaskSchedule.objects.bulk_create(rows, batch_size=500)


def statements_of_a_sweep(now: datetime) -> tuple[int, list[str]]:
    with CaptureQueriesContext(connections["default"]) as queries:
        sweep_missed(now=now)
    return len(queries), [query["sql"] for query in queries.captured_queries]


def test_sweep__a_schedule_with_nothing_due_is_not_read():
    """Hourly schedules swept once: the next sweeps (within the hour) read none of them,
    and cost the same statements with 20 or 400 of them."""
    counts = {}
    for size in (20, 400):
        TaskSchedule.objects.all().delete()
        many("tests.scale.idle", size, every=timedelta(hours=1), seconds_ago=10)
        now = ledger.database_now()
        sweep_missed(now=now)  # the first look sets each one's next
        due = TaskSchedule.objects.filter(sweep_due_at__isnull=False)
        assert due.count() == size
        assert due.filter(sweep_due_at__lte=now).count() == 0
        later = now + 10 * SECOND
        assert store.sweep_due(later) == [], "none is read"
        counts[size], _ = statements_of_a_sweep(later)
    assert counts[20] == counts[400] <= 3, counts


def test_sweep__due_schedules_are_judged_in_batches_not_one_by_one():
    """300 one-minute schedules each with one slot without a row: every slot missed, in a
    number of statements that does not grow with the schedules."""
    rows = many("tests.scale.batch", 300, every=MINUTE, seconds_ago=90)
    now = ledger.database_now()
    end = now - GRACE
    expected = {
        (row.task_name, slot)
        for row in rows
        for slot in IntervalSchedule(MINUTE).slots_between(row.first_seen, end, 10)
    }
    assert expected
    batched = ledger.core.dialect().writes_in_batches
    with CaptureQueriesContext(connections["default"]) as queries:
        result = sweep_missed(now=now)
    assert result.missed_slots == len(expected)
    found = set(TaskRun.objects.filter(state=RunState.MISSED).values_list("task_name", "slot"))
    assert found == expected
    if batched:  # elsewhere a row and its transition at a time
        assert len(queries) <= 12, [q["sql"][:80] for q in queries.captured_queries]
    # Each one's next look is its next slot plus its grace.
    for row in TaskSchedule.objects.filter(task_name__startswith="tests.scale.batch"):
        next_slot = IntervalSchedule(MINUTE).next_slot(row.swept_until)
        assert row.sweep_due_at == next_slot + GRACE


def test_sweep__a_long_outage_over_many_schedules_is_recorded_in_full(monkeypatch):
    """12 one-second schedules down for 700 s, at most 2 x 100 slots each per sweep: every
    slot is recorded, over several sweeps, none twice, none lost."""
    monkeypatch.setattr(missed, "SWEEP_BATCH", 100)
    monkeypatch.setattr(missed, "MAX_BATCHES", 2)
    rows = many("tests.scale.outage", 12, every=SECOND, seconds_ago=700)
    now = ledger.database_now()
    run_slot = rows[0].first_seen + 350 * SECOND
    finished(rows[0].task_name, run_slot)  # one slot did run
    expected = IntervalSchedule(SECOND).slots_between(rows[0].first_seen, now - GRACE, 10_000)
    totals = []
    for _ in range(10):
        result = sweep_missed(now=now)
        totals.append(result.missed_slots)
        if not result.missed_slots:
            break
    assert totals[0] == 12 * 200, "each schedule's budget per sweep"
    assert totals[-1] == 0 and len(totals) >= 4, totals
    assert sum(totals) == 12 * len(expected) - 1
    for row in rows:
        slots = set(TaskRun.objects.filter(task_name=row.task_name).values_list("slot", flat=True))
        assert slots == set(expected), row.task_name
    assert TaskRun.objects.get(task_name=rows[0].task_name, slot=run_slot).state == "succeeded"


def test_sweep__a_pending_slot_is_ended_though_its_schedule_is_not_due():
    row = schedule("tests.scale.pending", every=timedelta(hours=1), grace=GRACE)
    now = ledger.database_now()
    sweep_missed(now=now)
    row.refresh_from_db()
    assert row.sweep_due_at is not None and row.sweep_due_at > now + 10 * SECOND
    slot = IntervalSchedule(timedelta(hours=1)).latest_slot(now)
    TaskRun.objects.filter(task_name="tests.scale.pending", slot=slot).delete()
    assert ledger.insert_pending("tests.scale.pending", slot) is not None
    result = sweep_missed(now=now + 10 * SECOND)
    assert result.missed_slots == 1
    assert TaskRun.objects.get(task_name="tests.scale.pending", slot=slot).state == "missed"


def test_sweep__data_schedules_disabled_or_out_of_their_range_are_not_judged():
    now = ledger.database_now().replace(microsecond=0)
    first = now - 600 * SECOND
    off = define_schedule("off", TARGET, every=MINUTE, args=[1], enabled=False)
    ranged = define_schedule(
        "ranged",
        TARGET,
        every=MINUTE,
        args=[2],
        grace=GRACE,
        starts=now - 400 * SECOND,
        ends=now - 200 * SECOND,
    )
    TaskSchedule.objects.filter(pk__in=[off.pk, ranged.pk]).update(first_seen=first)
    sweep_missed(now=now)
    assert not TaskRun.objects.filter(task_name=off.task_name).exists()
    slots = set(TaskRun.objects.filter(task_name=ranged.task_name).values_list("slot", flat=True))
    expected = IntervalSchedule(MINUTE).slots_between(now - 400 * SECOND - SECOND, now, 100)
    assert slots == {s for s in expected if now - 400 * SECOND <= s <= now - 200 * SECOND}
    assert len(slots) >= 3
    ranged.refresh_from_db()
    assert ranged.sweep_due_at == store.NEVER, "ended: never looked at again"
    assert ranged.id not in store.sweep_due(now + timedelta(days=3650))


def test_sweep_due__every_writer_of_slots_or_mark_empties_it():
    """Empty is always safe ("look next time"): define's edits, pause, resume, a code save."""
    row = define_schedule("edited", TARGET, every=timedelta(hours=1), args=[1])
    sweep_missed()

    def due() -> datetime | None:
        return TaskSchedule.objects.get(pk=row.pk).sweep_due_at

    assert due() is not None
    define_schedule("edited", TARGET, every=timedelta(minutes=30), args=[1])
    assert due() is None
    sweep_missed()
    assert due() is not None
    store.set_paused(row.task_name, "ops")
    assert due() is None
    sweep_missed()
    store.set_paused(row.task_name, None)
    assert due() is None
    code = schedule("tests.scale.code", every=timedelta(hours=1))
    sweep_missed()
    assert TaskSchedule.objects.get(pk=code.pk).sweep_due_at is not None
    record = store.Record(
        task_name=code.task_name,
        source=code.source,
        function=code.function,
        cron="",
        cron_day_or=True,
        every=timedelta(minutes=10),  # a deploy moved its slots
        time_zone="",
        default_zone="UTC",
        catchup=code.catchup,
        grace=code.grace,
        max_catchup=code.max_catchup,
        pause_after_failures=None,
    )
    store.save([record])
    assert TaskSchedule.objects.get(pk=code.pk).sweep_due_at is None


def test_mark_swept_many__a_code_schedule_saved_meanwhile_is_looked_at_next_time():
    row = schedule("tests.scale.saved", every=timedelta(hours=1))
    sweep_missed()
    read = TaskSchedule.objects.get(pk=row.pk)
    assert read.sweep_due_at is not None
    TaskSchedule.objects.filter(pk=row.pk).update(sweep_due_at=None)  # as save() does
    store.mark_swept_many([(read, None, timezone.now() + timedelta(hours=1))])
    assert TaskSchedule.objects.get(pk=row.pk).sweep_due_at is None


def test_mark_swept_many__a_definition_changed_meanwhile_is_looked_at_next_time():
    row = define_schedule("raced", TARGET, every=timedelta(hours=1), args=[1])
    read = TaskSchedule.objects.get(pk=row.pk)
    define_schedule("raced", TARGET, every=MINUTE, args=[1])  # an edit while the sweep ran
    later = timezone.now() + timedelta(hours=1)
    store.mark_swept_many([(read, timezone.now(), later)])
    stored = TaskSchedule.objects.get(pk=row.pk)
    assert stored.sweep_due_at is None, "the old definition's next look is not kept"
    assert stored.swept_until is not None


def test_define_many__bulk_rows_with_their_history_and_existing_names_through_define():
    from django_taskguard.data_schedules import grace_of, validate
    from django_taskguard.models import ScheduleEvent, ScheduleEventOrigin

    existing = define_schedule("t0", TARGET, every=MINUTE, args=[0])
    batch = [validate(f"t{n}", TARGET, every=MINUTE, args=[n]) for n in range(5)]
    created = store.define_many(
        batch, origin=ScheduleEventOrigin.CODE, grace_of=grace_of, by="bulk"
    )
    assert created == 4, "t0 exists: it went through define (an edit)"
    rows = {row.entry: row for row in TaskSchedule.objects.filter(entry__startswith="t")}
    assert set(rows) == {f"t{n}" for n in range(5)}
    assert rows["t3"].args == [3] and rows["t3"].version == 1 and rows["t3"].changed_at
    assert rows["t0"].version == existing.version == 1, "unchanged: no new version"
    events = ScheduleEvent.objects.filter(task_name=rows["t3"].task_name).get()
    assert (events.kind, events.version, events.by) == ("created", 1, "bulk")
    sweep_missed()
    assert (
        TaskSchedule.objects.filter(entry__startswith="t", sweep_due_at__isnull=True).count() == 0
    )
