"""Data schedules in their own time zones across the 2027 DST changes: the slots a stored
schedule yields and what the missed-slot sweep records are the ones docs/schedules.md's
table says (the table is read from the page, so page and code cannot drift apart)."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.utils import timezone

from django_taskguard import define_schedule
from django_taskguard.data_schedules import grace_of
from django_taskguard.ledger import schedules as store
from django_taskguard.missed import sweep_missed
from django_taskguard.models import TaskRun
from django_taskguard.schedules import UTC, StoredSchedule, rebuild
from django_taskguard.states import RunState
from tests.support import (
    ROOT,
    data_targets,  # noqa: F401  (registers the schedules' targets)
)

pytestmark = pytest.mark.dialect

TARGET = "tests.support.data_targets.send_report"
PAGE = ROOT / "docs/schedules.md"
ROW = re.compile(r"^\| (Europe/Berlin|America/New_York) \|.*\|$", re.MULTILINE)
SLOT = re.compile(r"(\d\d:\d\d) UTC \((\d\d:\d\d) ([A-Z]{3,4})\)")


@dataclass(frozen=True)
class Row:
    """One line of the docs' table: a zone's change day and a cron, and the slots (UTC
    time, local time and zone abbreviation) on the day before, the day of and the day after."""

    zone: str
    day: date
    cron: str
    slots: tuple[tuple[tuple[str, str, str], ...], ...]

    @property
    def id(self) -> str:
        return f"{self.zone}-{self.day}-{self.cron.replace(' ', '_')}"

    def bounds(self) -> tuple[datetime, datetime]:
        """Local midnight before the day before, and after the day after (in UTC)."""
        zone = ZoneInfo(self.zone)
        start = datetime.combine(self.day - timedelta(days=1), time(), zone)
        end = datetime.combine(self.day + timedelta(days=2), time(), zone)
        return start.astimezone(UTC), end.astimezone(UTC)


def table() -> list[Row]:
    rows = []
    for line in ROW.finditer(PAGE.read_text()):
        cells = [cell.strip() for cell in line[0].strip("|").split("|")]
        found = re.search(r"\d{4}-\d\d-\d\d", cells[1])
        assert found, f"no date in {line[0]!r}"
        slots = tuple(tuple(SLOT.findall(cell)) for cell in cells[3:6])
        rows.append(Row(cells[0], date.fromisoformat(found[0]), cells[2].strip("`"), slots))
    return rows


ROWS = table()
# The change days of 2027 (tzdata), which the table must use.
CHANGES = {
    "Europe/Berlin": {date(2027, 3, 28), date(2027, 10, 31)},
    "America/New_York": {date(2027, 3, 14), date(2027, 11, 7)},
}


def as_table(zone: str, slots: list[datetime]) -> list[tuple[str, str, str]]:
    local = [slot.astimezone(ZoneInfo(zone)) for slot in slots]
    return [
        (slot.strftime("%H:%M"), at.strftime("%H:%M"), at.strftime("%Z"))
        for slot, at in zip(slots, local, strict=True)
    ]


def by_day(row: Row, slots: list[datetime]) -> tuple[tuple[tuple[str, str, str], ...], ...]:
    """The slots grouped by their local day: the day before, the day of, the day after."""
    zone = ZoneInfo(row.zone)
    days = [row.day + timedelta(days=offset) for offset in (-1, 0, 1)]
    return tuple(
        tuple(as_table(row.zone, [slot for slot in slots if slot.astimezone(zone).date() == day]))
        for day in days
    )


def stored(row: Row) -> tuple[str, StoredSchedule]:
    """Define the row's data schedule; return its task name and the schedule its row stores."""
    name = f"dst-{row.id}"
    saved = define_schedule(name, TARGET, cron=row.cron, time_zone=row.zone, args=[7])
    schedule = rebuild(saved.cron, saved.cron_day_or, saved.time_zone, saved.every)
    return saved.task_name, schedule


def test_table__covers_both_zones_both_changes_and_both_crons() -> None:
    seen = {(row.zone, row.day, row.cron) for row in ROWS}
    for zone, days in CHANGES.items():
        for day in days:
            for cron in ("30 2 * * *", "0 9 * * *"):
                assert (zone, day, cron) in seen, f"the docs' table lacks {zone} {day} {cron}"
    assert {(row.zone, row.day) for row in ROWS} <= {
        (zone, day) for zone, days in CHANGES.items() for day in days
    }
    for row in ROWS:
        assert all(len(day) == 1 for day in row.slots), f"{row.id}: one slot a day"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.id)
def test_slots__are_the_docs_table(row: Row) -> None:
    _, schedule = stored(row)
    start, end = row.bounds()
    slots = schedule.slots_between(start, end, 100)
    assert by_day(row, slots) == row.slots
    assert len(slots) == 3  # one a day: no skipped day, no doubled slot


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.id)
def test_latest_slot__steps_from_one_slot_to_the_next(row: Row) -> None:
    _, schedule = stored(row)
    start, end = row.bounds()
    slots = schedule.slots_between(start, end, 100)
    for earlier, later in itertools.pairwise(slots):
        assert schedule.latest_slot(later - timedelta(microseconds=1)) == earlier
        assert schedule.latest_slot(later) == later
    # Every hour of the change day, in real time, has the slot the table says as its latest.
    hour = slots[0]
    while hour < slots[-1]:
        expected = max(slot for slot in slots if slot <= hour)
        assert schedule.latest_slot(hour) == expected, hour
        hour += timedelta(minutes=30)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.id)
def test_sweep__records_the_docs_slots_missed_when_nothing_fired_them(row: Row) -> None:
    task_name, _ = stored(row)
    start, end = row.bounds()
    store.mark_swept(task_name, start)
    saved = store.get(task_name)
    assert saved is not None
    result = sweep_missed(task=task_name, now=end + grace_of(saved))
    missed = list(
        TaskRun.objects.filter(task_name=task_name, state=RunState.MISSED)
        .order_by("slot")
        .values_list("slot", flat=True)
    )
    assert by_day(row, missed) == row.slots
    assert result.missed_slots == len(missed) == 3
    assert TaskRun.objects.filter(task_name=task_name).count() == 3  # nothing else recorded


@pytest.mark.django_db(transaction=True)
def test_fall_back__the_repeated_0230_in_berlin_is_one_slot() -> None:
    """Named hours fire on the first pass of a repeated hour: 02:30 CEST, never 02:30 CET."""
    define_schedule("berlin", TARGET, cron="30 2 * * *", time_zone="Europe/Berlin", args=[1])
    saved = store.get(f"{TARGET}[berlin]")
    assert saved is not None and saved.time_zone == "Europe/Berlin"
    schedule = rebuild(saved.cron, saved.cron_day_or, saved.time_zone, saved.every)
    first_pass = datetime(2027, 10, 31, 0, 30, tzinfo=UTC)  # 02:30 CEST
    second_pass = datetime(2027, 10, 31, 1, 30, tzinfo=UTC)  # 02:30 CET, an hour later
    assert schedule.latest_slot(second_pass) == first_pass
    assert schedule.slots_between(first_pass, second_pass + timedelta(hours=20), 5) == []


@pytest.mark.django_db(transaction=True)
def test_spring_forward__nothing_fires_at_the_change_in_new_york() -> None:
    """02:30 does not exist on 2027-03-14 in New York: the slot is 03:30 EDT, not 03:00."""
    define_schedule("ny", TARGET, cron="30 2 * * *", time_zone="America/New_York", args=[1])
    saved = store.get(f"{TARGET}[ny]")
    assert saved is not None
    schedule = rebuild(saved.cron, saved.cron_day_or, saved.time_zone, saved.every)
    change = datetime(2027, 3, 14, 7, 0, tzinfo=UTC)  # 02:00 EST becomes 03:00 EDT
    assert schedule.latest_slot(change) == datetime(2027, 3, 13, 7, 30, tzinfo=UTC)
    assert schedule.slots_between(change, change + timedelta(hours=1), 5) == [
        datetime(2027, 3, 14, 7, 30, tzinfo=UTC)
    ]


@pytest.mark.django_db(transaction=True)
def test_same_cron_in_two_zones__two_schedules_two_sets_of_slots() -> None:
    """The kept walks are per zone: a Berlin and a New York '0 9 * * *' never share slots."""
    berlin = define_schedule("a", TARGET, cron="0 9 * * *", time_zone="Europe/Berlin", args=[1])
    new_york = define_schedule(
        "b", TARGET, cron="0 9 * * *", time_zone="America/New_York", args=[2]
    )
    start = datetime(2027, 3, 13, tzinfo=UTC)
    end = start + timedelta(days=3)
    found = {
        row.time_zone: rebuild(row.cron, row.cron_day_or, row.time_zone, row.every).slots_between(
            start, end, 10
        )
        for row in (berlin, new_york)
    }
    assert [slot.hour for slot in found["Europe/Berlin"]] == [8, 8, 8]
    assert [slot.hour for slot in found["America/New_York"]] == [14, 13, 13]


@pytest.mark.django_db(transaction=True)
def test_sweep__a_disabled_schedule_and_slots_outside_starts_ends_are_not_missed() -> None:
    """What the docs say of enabled, starts and ends: nothing fires those slots, so the
    sweep records none of them missed (a slot at ``starts`` or ``ends`` is in)."""
    zone = ZoneInfo("Europe/Berlin")
    starts = datetime(2027, 3, 28, 3, 30, tzinfo=zone)  # the shifted slot itself
    ends = datetime(2027, 3, 30, 2, 30, tzinfo=zone)
    bounded = define_schedule(
        "bounded",
        TARGET,
        cron="30 2 * * *",
        time_zone="Europe/Berlin",
        args=[1],
        starts=starts,
        ends=ends,
    )
    off = define_schedule(
        "off", TARGET, cron="30 2 * * *", time_zone="Europe/Berlin", args=[2], enabled=False
    )
    since = datetime(2027, 3, 25, tzinfo=UTC)
    for row in (bounded, off):
        store.mark_swept(row.task_name, since)
    sweep_missed(now=datetime(2027, 4, 2, tzinfo=UTC))
    missed = list(
        TaskRun.objects.filter(task_name=bounded.task_name, state=RunState.MISSED)
        .order_by("slot")
        .values_list("slot", flat=True)
    )
    assert missed == [
        datetime(2027, 3, 28, 1, 30, tzinfo=UTC),
        datetime(2027, 3, 29, 0, 30, tzinfo=UTC),
        datetime(2027, 3, 30, 0, 30, tzinfo=UTC),
    ]
    assert not TaskRun.objects.filter(task_name=off.task_name).exists()


@pytest.mark.django_db(transaction=True)
def test_health__a_schedule_before_its_start_or_after_its_end_is_not_late() -> None:
    """Slots before ``starts`` or after ``ends`` fire nowhere: health expects no run there.
    Disabled: not judged at all."""
    from django_taskguard import health
    from django_taskguard.models import TaskSchedule
    from tests.support.runs import make_run

    now = timezone.now()
    later = define_schedule(
        "later", TARGET, cron="0 * * * *", args=[1], starts=now + timedelta(days=1)
    )
    over = define_schedule("over", TARGET, cron="0 * * * *", args=[2], ends=now - timedelta(days=2))
    off = define_schedule("off", TARGET, cron="0 * * * *", args=[3], enabled=False)
    three_days_ago = now - timedelta(days=3)
    TaskSchedule.objects.filter(
        task_name__in=[later.task_name, over.task_name, off.task_name]
    ).update(first_seen=three_days_ago, swept_until=three_days_ago)
    schedule = rebuild(over.cron, over.cron_day_or, over.time_zone, over.every)
    last = schedule.latest_slot(now - timedelta(days=2))  # its last slot ran
    make_run(over.task_name, slot=last, state=RunState.SUCCEEDED)
    verdict = health.check()
    judged = {task.task: task for task in verdict.tasks}
    assert judged[later.task_name].problems == []
    assert judged[later.task_name].next_slot == schedule.next_slot(now + timedelta(days=1))
    assert judged[over.task_name].problems == []
    assert judged[over.task_name].latest_due == last
    assert judged[over.task_name].next_slot is None
    assert off.task_name not in judged
