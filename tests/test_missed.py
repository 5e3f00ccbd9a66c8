"""The missed-slot sweep: every due slot without a row is recorded, in bounded batches,
judged by set (not by count) and labelled by the pause state at its own time."""

from __future__ import annotations

import logging
import sqlite3
import threading
from contextlib import nullcontext
from datetime import datetime, timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections
from django.test.utils import CaptureQueriesContext

from django_taskguard import current_run, ledger, missed, once_per_schedule, registry
from django_taskguard.ledger.core import dialect
from django_taskguard.locks import Acquired, get_backend
from django_taskguard.management.backfill_kinds import of_entry
from django_taskguard.management.commands.backfill import Command
from django_taskguard.missed import sweep_missed
from django_taskguard.models import RunState, TaskRun, TaskSchedule
from django_taskguard.scheduler import Scheduler
from django_taskguard.schedules import IntervalSchedule
from django_taskguard.signals import run_missed

from .support.monitoring import finished, schedule
from .support.waiting import wait_for

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]
SECOND = timedelta(seconds=1)
GRACE = 2 * SECOND


def every_second(task: str, seconds_ago: int, every: timedelta = SECOND) -> TaskSchedule:
    """A schedule of ``task`` first seen ``seconds_ago`` (by the database's clock)."""
    first = ledger.database_now().replace(microsecond=0) - seconds_ago * SECOND
    return schedule(task, every=every, grace=GRACE, first_seen=first)


def states(task: str) -> dict[datetime, str]:
    return dict(TaskRun.objects.filter(task_name=task).values_list("slot", "state"))


def swept_after_an_outage(name: str) -> None:
    """``name`` first seen 12 s ago, never fired, then swept: its due slots are missed."""
    first = ledger.database_now().replace(microsecond=0) - 12 * SECOND
    TaskSchedule.objects.filter(task_name=name).update(first_seen=first)
    sweep_missed()


def test_sweep_missed__a_long_outage_records_every_slot_in_batches():
    """~11,000 due one-second slots, the newest already run (the scheduler came back):
    every other slot is recorded missed, in a bounded number of statements."""
    row = every_second("tests.sweep.outage", 11_000)
    now = ledger.database_now()
    end = now - GRACE
    expected = IntervalSchedule(SECOND).slots_between(row.first_seen, end, 20_000)
    assert len(expected) > 10_000
    finished("tests.sweep.outage", expected[-1])
    batched = dialect().writes_in_batches  # elsewhere a row and its transition at a time
    with CaptureQueriesContext(connections["default"]) if batched else nullcontext() as queries:
        result = sweep_missed(now=now)
    found = states("tests.sweep.outage")
    assert len(found) == len(expected)
    assert sum(1 for state in found.values() if state == RunState.MISSED) == len(expected) - 1
    assert result.missed_slots == len(expected) - 1
    assert result.tasks == {"tests.sweep.outage": len(expected) - 1}
    if queries is not None:
        batches = -(-len(expected) // missed.SWEEP_BATCH)
        assert len(queries) <= 4 * batches + 10, "statements bounded per batch, not per slot"
    TaskSchedule.objects.filter(task_name="tests.sweep.outage").get(swept_until=end)


def test_sweep_missed__run_missed_names_every_slot_it_recorded():
    """One ``run_missed`` per task and sweep, with every slot it recorded (oldest first):
    what a check-in sender needs to push one ``missed`` per slot."""
    row = every_second("tests.sweep.signal", 8)
    sent: list[dict[str, object]] = []

    def on_missed(**kwargs: object) -> None:
        sent.append(kwargs)

    run_missed.connect(on_missed, weak=False)
    try:
        result = sweep_missed()
    finally:
        run_missed.disconnect(on_missed)
    recorded = sorted(s for s, state in states(row.task_name).items() if state == "missed")
    assert len(recorded) == result.missed_slots >= 5
    assert len(sent) == 1 and sent[0]["sender"] == row.task_name
    assert sent[0]["slots"] == recorded and sent[0]["slot"] == recorded[-1]
    assert sent[0]["count"] == len(recorded)


def test_sweep_missed__swept_until_moves_only_over_what_was_judged(monkeypatch):
    row = every_second("tests.sweep.budget", 3_000)
    monkeypatch.setattr(missed, "MAX_BATCHES", 2)
    monkeypatch.setattr(missed, "SWEEP_BATCH", 500)
    now = ledger.database_now()
    first = sweep_missed(now=now)
    assert first.missed_slots == 1_000
    stored = TaskSchedule.objects.get(task_name="tests.sweep.budget")
    assert stored.swept_until == row.first_seen + 1_000 * SECOND
    assert max(states("tests.sweep.budget")) == stored.swept_until
    second = sweep_missed(now=now)
    assert second.missed_slots == 1_000, "the next sweep goes on where this one stopped"


def test_sweep_missed__rows_off_the_grid_do_not_hide_missing_slots():
    """every=1s for 12 s, a 12 s gap, then every=3s with three slots never run: the
    twelve one-second rows outnumber the gap, yet each 3 s slot without a row is missed."""
    row = every_second("tests.sweep.grid", 60, every=3 * SECOND)
    start = row.first_seen
    for n in range(1, 13):  # the old every=1s schedule
        finished("tests.sweep.grid", start + n * SECOND)
    now = ledger.database_now()
    grid = IntervalSchedule(3 * SECOND).slots_between(start + 24 * SECOND, now - GRACE, 100)
    never = set(grid[1:4])
    for slot in grid:
        if slot not in never:
            finished("tests.sweep.grid", slot)
    in_gap = IntervalSchedule(3 * SECOND).slots_between(start + 12 * SECOND, start + 24 * SECOND, 9)
    sweep_missed(now=now)
    found = states("tests.sweep.grid")
    missed_slots = {slot for slot, state in found.items() if state == RunState.MISSED}
    assert missed_slots == never | set(in_gap)


def test_sweep_missed__each_slot_labelled_by_the_pause_at_its_time():
    row = every_second("tests.sweep.pause", 20)
    paused_at = row.first_seen + 10 * SECOND
    TaskSchedule.objects.filter(pk=row.pk).update(
        paused=True, paused_at=paused_at, paused_reason="ops"
    )
    now = ledger.database_now()
    result = sweep_missed(now=now)
    found = states("tests.sweep.pause")
    assert found and result.missed_slots and result.paused_slots
    for slot, state in found.items():
        assert state == (RunState.SKIPPED if slot >= paused_at else RunState.MISSED), slot


def test_sweep_missed__slots_while_paused_stay_skipped_after_resume():
    row = every_second("tests.sweep.resumed", 20)
    paused_at = row.first_seen + 5 * SECOND
    resumed_at = row.first_seen + 10 * SECOND
    TaskSchedule.objects.filter(pk=row.pk).update(paused_at=paused_at, resumed_at=resumed_at)
    sweep_missed(now=ledger.database_now())
    found = states("tests.sweep.resumed")
    assert len(found) >= 15
    for slot, state in found.items():
        paused = paused_at <= slot < resumed_at
        assert state == (RunState.SKIPPED if paused else RunState.MISSED), slot
        if paused:
            assert TaskRun.objects.get(task_name="tests.sweep.resumed", slot=slot).error.startswith(
                "paused"
            )


# -- one schedule's trouble stops no other ------------------------------------------------


def test_sweep_missed__binds_no_more_parameters_than_the_database_allows():
    """SQLite built with the older limit of 999 bound variables: a batch of 1,000 slots
    is read in parts that fit."""
    connection = connections["default"]
    if connection.vendor != "sqlite":
        pytest.skip("SQLITE_LIMIT_VARIABLE_NUMBER: SQLite")
    every_second("tests.sweep.limit", 1_200)
    connection.ensure_connection()
    raw = connection.connection
    before = raw.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    raw.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
    try:
        result = sweep_missed(now=ledger.database_now())
    finally:
        raw.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, before)
    assert result.missed_slots >= 1_100


def test_sweep_missed__a_schedule_that_raises_is_logged_and_the_others_swept(caplog):
    """A stored zone this copy's tzdata lacks: that schedule is logged and left (its mark
    stays), every other schedule is swept."""
    broken = every_second("tests.sweep.a_broken", 20)
    TaskSchedule.objects.filter(pk=broken.pk).update(
        every=None, cron="* * * * *", time_zone="Nowhere/Atlantis"
    )
    every_second("tests.sweep.b_fine", 20)
    with caplog.at_level(logging.ERROR, logger="taskguard.missed"):
        result = sweep_missed(now=ledger.database_now())
    assert result.tasks.get("tests.sweep.b_fine", 0) >= 15
    assert "tests.sweep.a_broken" not in result.tasks
    assert TaskSchedule.objects.get(pk=broken.pk).swept_until is None
    [record] = [r for r in caplog.records if "tests.sweep.a_broken" in r.getMessage()]
    assert record.exc_info is not None and "Nowhere/Atlantis" in str(record.exc_info[1])


# -- a dropped connection ----------------------------------------------------------------


def terminate_other_backends() -> int:
    """End every other connection to this test database (PostgreSQL), as a failover or an
    idle-session killer would; returns how many."""
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return len(cursor.fetchall())


def test_sweeper__survives_a_terminated_connection():
    if connections["default"].vendor != "postgresql":
        pytest.skip("pg_terminate_backend: PostgreSQL")
    every_second("tests.sweep.dropped", 10)
    scheduler = Scheduler([], max_workers=1, sweep_every=0.3)
    stop = threading.Event()
    loop = threading.Thread(target=scheduler.run, args=(stop, 5.0), daemon=True)
    loop.start()
    try:
        rows = TaskRun.objects.filter(task_name="tests.sweep.dropped", state=RunState.MISSED)
        wait_for(rows.exists, what="the first sweep")
        assert terminate_other_backends() >= 1, "the sweeper's connection was ended"
        killed = ledger.database_now()
        wait_for(
            lambda: rows.filter(slot__gt=killed).exists(),
            timeout=30,
            what="a sweep after the connection was terminated",
        )
    finally:
        stop.set()
        loop.join(30)


# -- backfill runs what the sweep recorded missed -----------------------------------------


@pytest.mark.parametrize("catchup", ["latest", "none"])
def test_backfill__runs_slots_the_sweep_recorded_missed_once(catchup, lock_backend):
    """An outage the sweep recorded is what backfill is for: each missed slot runs once,
    a compare-and-set from missed, however many backfills run at once."""
    name = f"tests.backfill.outage.{catchup}.{lock_backend}"
    calls: list[datetime] = []
    runners: set[int] = set()
    other_ran = threading.Event()
    oldest: list[datetime] = []

    @once_per_schedule(every=SECOND, name=name, catchup=catchup, grace=GRACE)
    def job() -> None:
        calls.append(current_run().slot)
        runners.add(threading.get_ident())
        if current_run().slot == oldest[0]:
            # Hold the first slot until the other backfill has run a later one: both
            # really contend (the other meets this slot running, and goes on).
            assert other_ran.wait(60), "the other backfill ran no slot"
        else:
            other_ran.set()

    try:
        registry.sync()
        swept_after_an_outage(name)
        missed_slots = sorted(states(name))
        assert len(missed_slots) >= 8 and set(states(name).values()) == {RunState.MISSED}
        oldest.append(missed_slots[0])
        span = ["--from", missed_slots[0].isoformat(), "--to", missed_slots[-1].isoformat()]
        args = ["backfill", name, *span]
        out = StringIO()
        call_command(*args, "--dry-run", stdout=out)
        assert f"Would run {len(missed_slots)} slots of {name}" in out.getvalue()
        assert f"{len(missed_slots)} of them were recorded missed" in out.getvalue()
        errors: list[str] = []
        both = threading.Barrier(2, timeout=60)

        def backfill() -> None:
            said = StringIO()
            try:
                both.wait()  # both backfills start together, so they contend for each slot
                call_command(*args, stdout=said)
            except BaseException as exc:  # reported below
                errors.append(f"{exc!r}: {said.getvalue()}")
            finally:
                connections.close_all()

        threads = [threading.Thread(target=backfill) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors
        assert not both.broken, "both backfills were started together"
        assert sorted(calls) == missed_slots, "each missed slot ran once"
        assert len(runners) == 2, "each backfill ran slots: they contended"
        assert set(states(name).values()) == {RunState.SUCCEEDED}
        run = TaskRun.objects.get(task_name=name, slot=missed_slots[0])
        steps = [(t.from_state, t.to_state) for t in run.transitions.order_by("id")]
        assert steps == [("pending", "missed"), ("missed", "running"), ("running", "succeeded")]
    finally:
        registry.unregister(name)


def late_call_then_backfill(name: str, **options: object) -> tuple[list[datetime], datetime]:
    """A catchup="none" task's sweep-recorded missed slot, called late once (refused),
    then backfilled; returns the slots the body ran and the slot."""
    calls: list[datetime] = []

    @once_per_schedule(every=SECOND, name=name, catchup="none", grace=GRACE, **options)
    def job() -> None:
        calls.append(current_run().slot)

    registry.sync()
    swept_after_an_outage(name)
    target = min(states(name))
    # a second copy (or a second beat message) calls the slot late: catchup="none" refuses
    assert registry.entries()[name].fire(target) is False
    call_command("backfill", name, "--from", target.isoformat(), "--to", target.isoformat())
    return calls, target


def test_backfill__a_late_refused_call_leaves_the_missed_slot_to_backfill(lock_backend):
    """The late call met the missed row and won the Redis key: it leaves no finished
    marker (the row can still be taken), so backfill runs the slot."""
    name = f"tests.backfill.late.{lock_backend}"
    try:
        calls, target = late_call_then_backfill(name)
        assert calls == [target]
        assert TaskRun.objects.get(task_name=name, slot=target).state == RunState.SUCCEEDED
    finally:
        registry.unregister(name)


def test_backfill__a_slot_left_missed_is_not_run_and_fails_the_command(lock_backend):
    """A slot still missed after the guard returned (another call holds its key) is
    reported not run, and the command exits non-zero."""
    if lock_backend == "database":
        pytest.skip("a key held by another call: Redis (on the database the row is the lock)")
    name = f"tests.backfill.held.{lock_backend}"

    @once_per_schedule(every=SECOND, name=name, catchup="latest", grace=GRACE)
    def job() -> None:
        pass

    try:
        registry.sync()
        swept_after_an_outage(name)
        target = min(states(name))
        lock = get_backend()
        key = lock.key_for(name, target, None)
        assert lock.acquire(key, "held-elsewhere", 60, name) is Acquired.WON
        out = StringIO()
        span = ["--from", target.isoformat(), "--to", target.isoformat()]
        with pytest.raises(CommandError, match=r"1 slots of .* were not run"):
            call_command("backfill", name, *span, stdout=out)
        assert "not run" in out.getvalue()
        assert states(name)[target] == RunState.MISSED
    finally:
        registry.unregister(name)


def test_backfill__a_lost_compare_and_set_under_raise_is_run_elsewhere():
    """on_duplicate="raise": the backfill that finds the slot taken reports it run
    elsewhere, not raised."""
    name = "tests.backfill.raise"

    @once_per_schedule(every=SECOND, name=name, grace=GRACE, on_duplicate="raise")
    def job() -> None:
        pass

    try:
        registry.sync()
        swept_after_an_outage(name)
        target = min(states(name))
        row = ledger.read(name, target)
        assert row is not None
        # another backfill took the slot after this one planned it
        TaskRun.objects.filter(pk=row.id).update(state=RunState.SUCCEEDED)
        out = StringIO()
        command = Command(stdout=out)
        assert command._run(of_entry(registry.entries()[name], False), target) == "ran"
        assert "run elsewhere" in out.getvalue()
    finally:
        registry.unregister(name)


def test_sweep_missed__an_enqueued_slot_is_labelled_by_the_pause_at_hand_out():
    """A pending slot no worker started: handed out before the pause, it was missed;
    handed out while paused, it is skipped (paused)."""
    row = every_second("tests.sweep.pending", 60)
    paused_at = row.first_seen + 20 * SECOND
    TaskSchedule.objects.filter(pk=row.pk).update(
        paused=True, paused_at=paused_at, paused_reason="ops", swept_until=paused_at + 30 * SECOND
    )
    before, during = row.first_seen + 10 * SECOND, row.first_seen + 25 * SECOND
    for slot in (before, during):
        ledger.insert_pending("tests.sweep.pending", slot)
        TaskRun.objects.filter(task_name="tests.sweep.pending", slot=slot).update(created_at=slot)
    sweep_missed(now=ledger.database_now())
    found = states("tests.sweep.pending")
    assert found[before] == RunState.MISSED
    assert found[during] == RunState.SKIPPED


def test_sweep_missed__slots_in_an_earlier_pause_are_skipped_too():
    """Two pauses, each kept in the schedule's history (pause_task, resume_task); the row
    keeps only the latest: a slot inside either is skipped (paused), the rest missed."""
    from django_taskguard.ledger import schedules as store
    from django_taskguard.models import ScheduleEventKind, ScheduleEventOrigin

    row = every_second("tests.sweep.twice", 30)
    first = (row.first_seen + 4 * SECOND, row.first_seen + 9 * SECOND)
    latest = (row.first_seen + 15 * SECOND, row.first_seen + 20 * SECOND)
    for start, end in (first, latest):
        for kind, at in ((ScheduleEventKind.PAUSED, start), (ScheduleEventKind.RESUMED, end)):
            store.record_event(row.task_name, kind, origin=ScheduleEventOrigin.COMMAND, at=at)
    TaskSchedule.objects.filter(pk=row.pk).update(paused_at=latest[0], resumed_at=latest[1])
    sweep_missed(now=ledger.database_now())
    found = states("tests.sweep.twice")
    assert len(found) >= 25
    for slot, state in found.items():
        paused = any(start <= slot < end for start, end in (first, latest))
        assert state == (RunState.SKIPPED if paused else RunState.MISSED), slot
    earlier = TaskRun.objects.get(task_name="tests.sweep.twice", slot=first[0])
    assert earlier.error.startswith(f"paused: due while the task was paused from {first[0]:%Y}")


def test_sweep_missed__one_missed_slot_is_said_in_the_singular(caplog):
    now = ledger.database_now()
    every = timedelta(hours=1)
    slot = IntervalSchedule(every).latest_slot(now - GRACE)  # the next one is not due yet
    schedule("tests.sweep.one", every=every, grace=GRACE, first_seen=slot - SECOND)
    with caplog.at_level(logging.WARNING, logger="taskguard.missed"):
        assert sweep_missed(now=now).tasks == {"tests.sweep.one": 1}
    said = [r.getMessage() for r in caplog.records if "tests.sweep.one" in r.getMessage()]
    assert said == ["taskguard tests.sweep.one: 1 due slot was missed"]
