"""Data schedules of Celery tasks fired by taskguard's beat schedulers (no django-celery-beat).

In process against the real database: the entries a beat builds from the rows, how it
follows creations, edits, disables and deletions, what the worker records, "run now" and
``backfill``. Then real beats and workers on a private Redis broker.
"""

from __future__ import annotations

import io
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from pathlib import Path
from typing import Any, TypeVar

import pytest
from celery import Celery
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import DatabaseError, connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_taskguard import define_schedule, delete_schedule
from django_taskguard.contrib.celery import SCHEDULE_HEADER, SLOT_HEADER
from django_taskguard.contrib.celery import data_entries as de
from django_taskguard.contrib.celery.beat import TaskguardScheduler
from django_taskguard.contrib.celery.headers import GRACE_HEADER, VERSION_HEADER, slot_for
from django_taskguard.data_schedules import ScheduleDefinitionError, resolve_target, run_now
from django_taskguard.decorating import guarded_named
from django_taskguard.exceptions import BackendUnavailable, TaskGuardError
from django_taskguard.handoff import data_sender
from django_taskguard.ledger import schedules as store
from django_taskguard.models import RunState, TaskRun, TaskSchedule
from django_taskguard.schedules import IntervalSchedule
from django_taskguard.testing import freeze_now
from tests.support import data_targets  # noqa: F401  (registers the schedules' targets)

from .support import celery_tasks
from .support.celery_app import app
from .support.children import executions
from .support.waiting import wait_for
from .test_celery_e2e import PERSISTENT, Cluster, published

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]

REPORT = "tests.support.celery_tasks.report"
UTC = dt_timezone.utc
T = TypeVar("T")


def defined(name: str, log: Path | str = "unused", **given: Any) -> TaskSchedule:
    given.setdefault("every", timedelta(seconds=2))
    kwargs = {"log": str(log), "tenant": given.pop("tenant", 1)}
    kwargs.update(given.pop("extra", {}))
    return define_schedule(name, REPORT, kwargs=kwargs, **given)


# --- entries ----------------------------------------------------------------------------


def test_entries__built_from_the_rows_with_their_identity_and_version():
    row = defined("t1", tenant=7, cron="30 2 * * *", every=None, time_zone="America/New_York")
    (entry,) = de.DataSchedules(app).apply([row])[0]
    assert entry.name == f"{de.KEY_PREFIX}{REPORT}[t1]"
    assert (entry.task, entry.task_name, entry.schedule_name) == (REPORT, f"{REPORT}[t1]", "t1")
    assert entry.kwargs == {"log": "unused", "tenant": 7}
    assert entry.options["headers"] == {SCHEDULE_HEADER: "t1", VERSION_HEADER: 1}
    # Its own zone: 02:30 in New York, whatever the beat's.
    now = datetime(2026, 7, 1, 12, 0, tzinfo=UTC)
    assert slot_for(entry.schedule, now) == datetime(2026, 7, 1, 6, 30, tzinfo=UTC)
    # No slot before the schedule was created.
    assert entry.last_run_at == row.first_seen
    assert not entry.is_due().is_due


def test_entries__jitter_delays_the_send_and_keeps_the_nominal_slot():
    row = defined("j", every=timedelta(minutes=10), jitter=timedelta(minutes=4))
    (entry,) = de.DataSchedules(app).apply([row])[0]
    offset = entry.schedule.offset
    assert timedelta(0) < offset < timedelta(minutes=4)
    slot = datetime(2026, 7, 1, 12, 0, tzinfo=UTC)
    last = slot - timedelta(minutes=5)
    with freeze_now(slot + offset - timedelta(seconds=1)):
        assert not entry.schedule.is_due(last).is_due  # its start has not come
    with freeze_now(slot + offset + timedelta(seconds=1)):
        assert entry.schedule.is_due(last).is_due
        assert slot_for(entry.schedule, timezone.now()) == slot  # stamped: the nominal slot


def test_entries__starts_and_ends_bound_the_slots():
    begin = datetime(2026, 7, 1, 12, 0, tzinfo=UTC)
    row = defined("w", every=timedelta(minutes=1), starts=begin, ends=begin + timedelta(minutes=2))
    schedule = de.schedule_of(row)
    long_ago = begin - timedelta(days=1)
    with freeze_now(begin - timedelta(seconds=30)):
        assert not schedule.is_due(long_ago).is_due
    with freeze_now(begin + timedelta(seconds=90)):
        assert schedule.is_due(long_ago).is_due
        assert slot_for(schedule, timezone.now()) == begin + timedelta(minutes=1)
    with freeze_now(begin + timedelta(hours=1)):  # after ends: the last slot, once
        assert slot_for(schedule, timezone.now()) == begin + timedelta(minutes=2)
        assert not schedule.is_due(begin + timedelta(minutes=2)).is_due


def test_entries__catchup_none_sends_its_grace():
    row = defined("n", catchup="none", grace=timedelta(seconds=30))
    (entry,) = de.DataSchedules(app).apply([row])[0]
    assert entry.options["headers"][GRACE_HEADER] == 30.0


def test_entries__an_empty_catchup_and_grace_follow_the_tasks_decorator(monkeypatch):
    row = defined("f")  # catch-up and grace left empty: the decorator's (latest, 300 s)
    (entry,) = de.DataSchedules(app).apply([row])[0]
    assert GRACE_HEADER not in entry.options["headers"]
    body = guarded_named("tests.celery.report")  # the task's body, as decorated
    assert resolve_target(REPORT).policy is body.policy
    strict = replace(body.policy, catchup="none", grace=timedelta(seconds=40))
    monkeypatch.setattr(body, "policy", strict)  # a deploy changes the decorator
    (entry,) = de.DataSchedules(app).apply([store.get(row.task_name)])[0]  # not saved again
    assert entry.options["headers"][GRACE_HEADER] == 40.0
    monkeypatch.setattr(body, "policy", replace(strict, catchup="all"))
    with pytest.raises(ScheduleDefinitionError, match=r"catch-up all \(the target's"):
        defined("g")  # all is run_schedules': refused, as when given
    assert defined("g", catchup="latest").catchup == "latest"


def test_entries__a_schedule_that_cannot_be_read_is_left_out_and_said(caplog):
    row = defined("bad")
    row.every = None
    row.cron = "not a cron"
    assert de.DataSchedules(app).apply([row]) == ([], [])
    assert "cannot be read here" in caplog.text


# --- polling ----------------------------------------------------------------------------


def refreshed(data: de.DataSchedules) -> tuple[list[de.DataEntry], list[str]]:
    data.next_poll = 0.0
    found = data.refresh()
    assert found is not None
    return found


def test_poll__created_edited_disabled_deleted():
    data = de.DataSchedules(app)
    defined("a", tenant=1)
    put, gone = refreshed(data)  # the first read: every live one
    assert [e.schedule_name for e in put] == ["a"] and gone == []
    assert refreshed(data) == ([], [])  # nothing changed: nothing to do
    (first,) = data.entries.values()

    # Sent once: an edit of the arguments keeps the slots and where the entry is.
    sent_at = timezone.now()
    data.sent(first.next(sent_at))
    defined("a", tenant=2)
    (edited,), _ = refreshed(data)
    assert edited.kwargs["tenant"] == 2 and edited.version == 2
    assert edited.last_run_at == sent_at

    # Moved: only the new schedule's slots after the edit.
    before = timezone.now()
    defined("a", tenant=2, every=timedelta(seconds=3))
    (moved,), _ = refreshed(data)
    assert moved.last_run_at >= before and moved.version == 3
    assert not moved.is_due().is_due

    defined("b", tenant=3)
    defined("a", tenant=2, every=timedelta(seconds=3), enabled=False)
    put, gone = refreshed(data)
    assert [e.schedule_name for e in put] == ["b"]
    assert gone == [f"{de.KEY_PREFIX}{REPORT}[a]"]

    delete_schedule("b", REPORT)
    assert refreshed(data) == ([], [f"{de.KEY_PREFIX}{REPORT}[b]"])
    assert data.entries == {}

    # Enabled again: no slot of the disabled time.
    again = defined("a", tenant=2, every=timedelta(seconds=3))
    (back,), _ = refreshed(data)
    assert back.last_run_at == again.swept_until


def test_poll__a_creation_owes_its_slots_since_then():
    data = de.DataSchedules(app)
    assert refreshed(data) == ([], [])
    first_seen = defined("o", every=timedelta(seconds=1)).first_seen
    with freeze_now(first_seen + timedelta(seconds=3.5)):
        (entry,), _ = refreshed(data)
        latest = entry.schedule.latest_slot(timezone.now())
    owed = data.take_owed()
    # Every slot since the creation: the latest is the entry's own (it is due).
    expected = IntervalSchedule(timedelta(seconds=1)).slots_between(first_seen, latest, 10)
    assert [slot for _, slot in owed] == expected[:-1] and len(owed) >= 2
    assert {e.key for e, _ in owed} == {entry.key}
    with freeze_now(first_seen):  # at the creation itself: no slot since then (the real
        assert not entry.is_due().is_due  # clock could pass a one-second slot on a slow run)


def test_poll__a_moved_schedule_owes_the_old_slots_due_by_the_edit():
    data = de.DataSchedules(app)
    row = defined("m", every=timedelta(seconds=1))
    refreshed(data)
    (first,) = data.entries.values()
    sent_at = row.first_seen - timedelta(seconds=3)
    data.sent(first.next(sent_at))  # the beat last sent a slot 3 s before
    moved = defined("m", every=timedelta(seconds=2))
    (entry,), _ = refreshed(data)
    owed = data.take_owed()
    assert owed and {e.version for e, _ in owed} == {1}  # the old schedule's, as it was
    slots = [slot for _, slot in owed]
    assert slots == IntervalSchedule(timedelta(seconds=1)).slots_between(
        sent_at,
        moved.changed_at,
        10,
    )
    assert entry.version == 2 and entry.last_run_at == moved.swept_until


def test_poll__a_beat_that_learns_of_several_edits_at_once_owes_each_versions_own_slots():
    # The beat did not poll (stopped, or its reads failed) while every 3 s became every 2 s,
    # then every 4 s: each slot it owes is one the version in effect at its time had, sent
    # with that version's arguments and version.
    data = de.DataSchedules(app)
    row = defined("m", every=timedelta(seconds=3), tenant=1)
    refreshed(data)
    (first,) = data.entries.values()
    sent_at = row.first_seen - timedelta(seconds=7)
    data.sent(first.next(sent_at))  # the beat last sent a slot 7 s before
    v2 = defined("m", every=timedelta(seconds=2), tenant=2)
    time.sleep(max((v2.changed_at + timedelta(seconds=4.5) - timezone.now()).total_seconds(), 0))
    v3 = defined("m", every=timedelta(seconds=4), tenant=3)
    (entry,), _ = refreshed(data)
    owed = [(slot, e.version, e.kwargs["tenant"]) for e, slot in data.take_owed()]
    expected = [
        (slot, 1, 1)
        for slot in IntervalSchedule(timedelta(seconds=3)).slots_between(sent_at, v2.changed_at, 10)
    ] + [
        (slot, 2, 2)
        for slot in IntervalSchedule(timedelta(seconds=2)).slots_between(
            v2.changed_at, v3.changed_at, 10
        )
    ]
    assert owed == expected and {version for _, version, _ in owed} == {1, 2}
    assert entry.version == 3 and entry.last_run_at == v3.changed_at


def test_poll__a_beat_that_learns_of_a_disable_and_an_enable_at_once_owes_none_between():
    data = de.DataSchedules(app)
    row = defined("d", every=timedelta(seconds=1), tenant=1)
    refreshed(data)
    (first,) = data.entries.values()
    sent_at = row.first_seen - timedelta(seconds=3)
    data.sent(first.next(sent_at))
    off = defined("d", every=timedelta(seconds=1), tenant=1, enabled=False)
    time.sleep(max((off.changed_at + timedelta(seconds=2.5) - timezone.now()).total_seconds(), 0))
    on = defined("d", every=timedelta(seconds=1), tenant=3)
    (entry,), _ = refreshed(data)
    owed = [(slot, e.version) for e, slot in data.take_owed()]
    before_off = IntervalSchedule(timedelta(seconds=1)).slots_between(sent_at, off.changed_at, 10)
    assert owed == [(slot, 1) for slot in before_off]
    assert entry.version == 3 and entry.last_run_at == on.changed_at


def test_poll__the_cursor_is_the_databases_clock_not_the_beats():
    data = de.DataSchedules(app)
    defined("a", tenant=1)
    with freeze_now(timezone.now() + timedelta(minutes=5)):  # the beat's clock runs ahead
        refreshed(data)
        assert data.cursor is not None and data.cursor < timezone.now() - timedelta(minutes=4)
        defined("a", tenant=2)
        (edited,), _ = refreshed(data)  # a poll, not the reload: it sees the edit
    assert edited.kwargs["tenant"] == 2 and edited.version == 2


def test_poll__only_celery_targets():
    define_schedule("f", "tests.support.data_targets.send_report", every=timedelta(5), args=[1])
    defined("c")
    put, _ = refreshed(de.DataSchedules(app))
    assert [e.schedule_name for e in put] == ["c"]


def test_poll__a_database_error_is_logged_and_tried_again(caplog, monkeypatch):
    data = de.DataSchedules(app)
    defined("a")

    def broken(*args: object, **kwargs: object) -> None:
        raise DatabaseError("the database is away")

    monkeypatch.setattr(de.store, "data_schedules", broken)
    data.next_poll = 0.0
    assert data.refresh() is None
    assert "could not read the data schedules" in caplog.text
    assert data.due_in() > de.POLL_SECONDS  # tried again after RETRY_SECONDS
    monkeypatch.undo()
    put, _ = refreshed(data)
    assert [e.schedule_name for e in put] == ["a"]


def test_scheduler__data_entries_beside_settings_entries_of_the_same_name(tmp_path):
    # A settings entry named like a data schedule is another entry; the registrar leaves
    # the data schedule's row alone.
    app.conf.beat_schedule = {
        "t1": {"task": celery_tasks.tick.name, "schedule": 60.0, "kwargs": {"log": "x"}}
    }
    try:
        defined("t1", tenant=4)
        beat = TaskguardScheduler(app=app, schedule_filename=str(tmp_path / "s"), lazy=False)
        try:
            keys = set(beat.schedule)
            assert keys >= {"t1", f"{de.KEY_PREFIX}{REPORT}[t1]"}
            data_row = store.get(f"{REPORT}[t1]")
            assert data_row is not None and data_row.removed_at is None
            assert store.get(f"{celery_tasks.tick.name}[t1]") is not None
            stamped = beat.stamp(beat.schedule[f"{de.KEY_PREFIX}{REPORT}[t1]"], timezone.now())
            assert stamped.options["headers"][SCHEDULE_HEADER] == "t1"
            assert stamped.options["headers"][VERSION_HEADER] == 1
            delete_schedule("t1", REPORT)
            beat.data_schedules().next_poll = 0.0
            beat.refresh_data_schedules()
            assert f"{de.KEY_PREFIX}{REPORT}[t1]" not in beat.schedule
            defined("t2", tenant=5)
            beat.data_schedules().next_poll = 0.0
            beat.refresh_data_schedules()
        finally:
            beat.close()  # its schedule file keeps the data entries too (pickled)
        # Started again on the same file: the saved data entries are read back, then
        # replaced by the rows as they are now.
        again = TaskguardScheduler(app=app, schedule_filename=str(tmp_path / "s"), lazy=False)
        try:
            data_keys = {key for key in again.schedule if key.startswith(de.KEY_PREFIX)}
            assert data_keys == {f"{de.KEY_PREFIX}{REPORT}[t2]"}
        finally:
            again.close()
    finally:
        app.conf.beat_schedule = {}


class CountingScheduler(TaskguardScheduler):
    """Counts its heap's builds (Celery rebuilds it when the schedule changed)."""

    built = 0

    def populate_heap(self, *args: Any, **kwargs: Any) -> None:
        self.built += 1
        super().populate_heap(*args, **kwargs)


def test_scheduler__the_heap_is_rebuilt_when_an_entry_changes_not_on_an_idle_tick(tmp_path):
    hourly = {"every": timedelta(hours=1)}  # nothing falls due during the test
    defined("h1", **hourly)
    beat = CountingScheduler(app=app, schedule_filename=str(tmp_path / "s"), lazy=False)
    try:
        beat.tick()
        assert beat.built == 1  # the first tick builds it
        for _ in range(3):
            beat.tick()
        assert beat.built == 1  # idle: not compared entry by entry, not rebuilt
        defined("h2", **hourly)
        beat.data_schedules().next_poll = 0.0
        beat.tick()
        assert beat.built == 2 and f"{de.KEY_PREFIX}{REPORT}[h2]" in beat.schedule
        defined("h1", tenant=9, **hourly)  # an edit of the arguments
        beat.data_schedules().next_poll = 0.0
        beat.tick()
        assert beat.built == 3
        assert beat.schedule[f"{de.KEY_PREFIX}{REPORT}[h1]"].kwargs["tenant"] == 9
        beat.data_schedules().next_poll = 0.0
        beat.tick()  # polled, nothing changed
        assert beat.built == 3
    finally:
        beat.close()


def test_send__each_due_entry_is_checked_against_its_row_in_one_read(tmp_path):
    hourly = {"every": timedelta(hours=1)}
    for name in ("a", "b", "c"):
        defined(name, **hourly)
    beat = CountingScheduler(app=app, schedule_filename=str(tmp_path / "s"), lazy=False)
    try:
        beat.tick()  # the heap: every entry due within the hour
        key = {name: f"{de.KEY_PREFIX}{REPORT}[{name}]" for name in ("a", "b", "c")}
        entries = {name: beat.schedule[key[name]] for name in key}
        # Between two polls: b deleted and retired (no tombstone left), c edited.
        delete_schedule("b", REPORT)
        assert store.retire(f"{REPORT}[b]")
        defined("c", tenant=5, **hourly)
        with freeze_now(timezone.now() + timedelta(hours=2)):  # all three due now
            with CaptureQueriesContext(connection) as read:
                assert beat.still_scheduled(entries["a"])  # reads the three rows at once
                assert not beat.still_scheduled(entries["b"])
                assert not beat.still_scheduled(entries["c"])
            assert len(read) == 1
            assert key["b"] not in beat.schedule and key["b"] not in beat.data_entries()
            edited = beat.schedule[key["c"]]
            assert edited.version == 2 and edited.kwargs["tenant"] == 5
            assert edited.is_due().is_due  # its slot is sent with the new arguments
            with CaptureQueriesContext(connection) as read:
                assert beat.still_scheduled(edited)
            assert len(read) == 0  # read once until the next poll
        built = beat.built
        beat.tick()  # the schedule changed: the heap is built again (nothing due now)
        assert beat.built == built + 1
        assert {e.key for e in beat.data_entries().values()} == {key["a"], key["c"]}
    finally:
        beat.close()


@pytest.mark.celery_beat
def test_database_scheduler__keeps_data_entries_across_its_reads_of_the_rows():
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    from django_taskguard.contrib.celery.beat_db import TaskguardDatabaseScheduler

    defined("d1", tenant=8)
    beat = TaskguardDatabaseScheduler(app=app, lazy=False)
    key = f"{de.KEY_PREFIX}{REPORT}[d1]"
    assert key in beat.schedule
    entry = beat.schedule[key]
    sent = beat.reserve(entry)  # the beat sent a slot: its entry moves on
    assert beat.schedule[key].last_run_at == sent.last_run_at > entry.last_run_at
    # A periodic task added: the scheduler reads its rows again, the data entry stays as sent.
    every, _ = IntervalSchedule.objects.get_or_create(every=60, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(name="p1", task=celery_tasks.tick.name, interval=every)
    reread = beat.all_as_schedule()
    assert "p1" in reread and reread[key].last_run_at == sent.last_run_at
    beat.sync()  # the sent data entry is in its dirty set: saving it is a no-op


# --- worker, run now, backfill ---------------------------------------------------------


def recent() -> datetime:
    """A whole hour of yesterday (within the retention horizon)."""
    return (timezone.now() - timedelta(days=1)).replace(minute=0, second=0, microsecond=0)


@pytest.fixture
def eager():
    app.conf.task_always_eager = True
    try:
        yield app
    finally:
        app.conf.task_always_eager = False


def test_worker__a_data_schedules_message_records_its_identity_and_version(eager, tmp_path):
    log = tmp_path / "log"
    slot = recent()
    headers = {SLOT_HEADER: slot.isoformat(), SCHEDULE_HEADER: "t9", VERSION_HEADER: 4}
    celery_tasks.report.apply_async(kwargs={"log": str(log), "tenant": 9}, headers=headers)
    run = TaskRun.objects.get()
    # name= on the task is not the identity of a data schedule's run.
    assert (run.task_name, run.slot, run.schedule_version) == (f"{REPORT}[t9]", slot, 4)
    # Without the header, the task's name= wins as before.
    celery_tasks.report.apply_async(
        kwargs={"log": str(log), "tenant": 9},
        headers={SLOT_HEADER: slot.isoformat(), SCHEDULE_HEADER: "t9"},
    )
    assert TaskRun.objects.filter(task_name="tests.celery.report").exists()


def test_run_now__hands_a_manual_slot_to_the_worker(eager, tmp_path):
    log = tmp_path / "log"
    row = defined("now", log, tenant=5)
    said = run_now(row, by="alice")
    assert said.startswith("enqueued (celery message")
    run = TaskRun.objects.get()
    assert (run.task_name, run.state, run.schedule_version) == (
        f"{REPORT}[now]",
        RunState.SUCCEEDED,
        1,
    )
    assert run.slot.microsecond != 0  # a manual slot: never one of the schedule's
    assert [line[0] for line in executions(log)] == ["report:5:pdf"]


def test_run_now__says_where_the_message_went_not_that_it_ran(tmp_path):
    row = defined("where", tmp_path / "log")
    said = run_now(row, by="alice")
    # Sent, not run: the broker and app it went through, and that no worker took it yet.
    assert said.startswith("enqueued (celery message ")
    assert "sent to broker memory://" in said and "by Celery app 'tests'" in said
    assert said.endswith("no worker has taken it yet)")
    assert TaskRun.objects.get().state == RunState.PENDING


def test_run_now__refused_when_the_app_here_is_celerys_fallback(tmp_path):
    """A web thread that sees no app of the project's: Celery makes its fallback app
    (``Celery("default", fixups=[])``), whose broker is not the workers'."""
    row = defined("fallback", tmp_path / "log")
    fallback = Celery("default", fixups=[], set_as_current=False, broker="memory://")
    outcome: list[object] = []

    def web_request() -> None:
        fallback.set_current()  # as Celery does for a thread with no app of its own
        try:
            outcome.append(run_now(row, by="alice"))
        except TaskGuardError as exc:
            outcome.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=web_request)
    thread.start()
    thread.join()
    (refused,) = outcome
    assert isinstance(refused, TaskGuardError), refused
    assert "Celery's fallback app (broker memory://" in str(refused)
    assert not TaskRun.objects.exists()  # the pending row was given back


def test_backfill__sends_the_slots_of_a_celery_data_schedule(eager, tmp_path):
    log = tmp_path / "log"
    defined("bf", log, every=timedelta(minutes=1), tenant=6)
    start = recent()
    out = io.StringIO()
    call_command(
        "backfill",
        f"{REPORT}[bf]",
        "--from",
        start.isoformat(),
        "--to",
        (start + timedelta(minutes=2)).isoformat(),
        stdout=out,
    )
    assert "Enqueued 3 slots" in out.getvalue()
    runs = TaskRun.objects.filter(task_name=f"{REPORT}[bf]").order_by("slot")
    assert [r.slot for r in runs] == [start + timedelta(minutes=n) for n in range(3)]
    assert {r.state for r in runs} == {RunState.SUCCEEDED}
    assert {r.schedule_version for r in runs} == {1}


def test_backfill__a_data_schedule_of_another_kind_says_what_is_missing(monkeypatch):
    from django_taskguard import handoff

    row = define_schedule(
        "f", "tests.support.data_targets.send_report", every=timedelta(minutes=1), args=[1]
    )
    monkeypatch.setattr(handoff, "DATA_SENDERS", {})
    with pytest.raises(TaskGuardError, match="nothing here can send its slots"):
        data_sender(row, "op")
    # backfill runs a function target's slots itself (tests/test_data_backfill.py); a Celery
    # target's need the sender of its kind
    celery_row = defined("c")
    with pytest.raises(CommandError, match="nothing here can send its slots"):
        call_command(
            "backfill",
            celery_row.task_name,  # type: ignore[attr-defined]
            "--from",
            "2026-01-05T09:00:00+00:00",
            "--to",
            "2026-01-05T09:01:00+00:00",
            stdout=io.StringIO(),
        )


# --- real beats and workers --------------------------------------------------------------


@pytest.fixture
def beats(child_env, scratch, redis_server) -> Iterator[Cluster]:
    running = Cluster(child_env, scratch, redis_server.url)
    try:
        yield running
    finally:
        running.kill_all()


def busy(write: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``write(...)``, again while SQLite is locked by the beats and workers' writes."""
    done: list[T] = []

    def attempt() -> bool:
        try:
            done.append(write(*args, **kwargs))
        except BackendUnavailable as exc:
            if "locked" not in str(exc):
                raise
            return False
        return True

    wait_for(attempt, 20, f"{write.__name__} to be saved", every=0.2)
    return done[0]


def report_runs(log: Path) -> list[tuple[str, datetime, str, int]]:
    """(task, slot, event, pid) of every execution, counted outside the ledger."""
    return [
        (name, datetime.fromisoformat(slot), event, int(pid))
        for event, name, slot, _, pid, *_ in executions(log)
    ]


@pytest.mark.processes
@pytest.mark.once
@pytest.mark.timeout(120)
def test_beats__two_beats_two_workers_follow_created_edited_disabled_deleted(beats, scratch):
    log = scratch / "reports.log"
    one = f"{REPORT}[one]"
    two = f"{REPORT}[two]"
    busy(defined, "one", log, tenant=1, every=timedelta(seconds=1))
    for name in ("w1", "w2"):
        beats.worker(name)
    for name in ("b1", "b2"):
        beats.beat(name, PERSISTENT)

    def ran(task: str, event: str | None = None, after: datetime | None = None) -> list[datetime]:
        return sorted(
            slot
            for name, slot, what, _ in report_runs(log)
            if name == task and (event is None or what == event) and (after is None or slot > after)
        )

    wait_for(lambda: len(ran(one)) >= 3, 40, "three slots of one", describe=beats.describe)

    # Created while the beats run: picked up, no slot before its creation.
    created = busy(defined, "two", log, tenant=2, every=timedelta(seconds=1)).first_seen
    first_two = IntervalSchedule(timedelta(seconds=1)).next_slot(created)
    wait_for(lambda: len(ran(two)) >= 3, 20, "slots of two", describe=beats.describe)
    assert min(ran(two)) == first_two  # none before its creation, none lost after it

    # Edited (arguments): the next slots send the new ones.
    csv = {"fmt": "csv"}
    edited = busy(defined, "one", log, tenant=1, every=timedelta(seconds=1), extra=csv).changed_at
    wait_for(lambda: ran(one, "report:1:csv"), 20, "the new arguments", describe=beats.describe)
    assert not ran(one, "report:1:pdf", after=edited + timedelta(seconds=de.POLL_SECONDS + 2))

    # Edited (interval 1 s -> 2 s): no slot of the new schedule before the edit.
    moved_at = busy(defined, "two", log, tenant=2, every=timedelta(seconds=2)).swept_until
    seen_by = moved_at + timedelta(seconds=de.POLL_SECONDS + 2)  # both beats polled
    later = wait_for(
        lambda: (found := ran(two, after=seen_by)) and len(found) >= 2 and found,
        30,
        "two's new slots",
        describe=beats.describe,
    )
    assert all(slot.second % 2 == 0 for slot in later), later

    # Disabled and deleted: nothing more sent.
    busy(defined, "one", log, tenant=1, every=timedelta(seconds=1), extra=csv, enabled=False)
    busy(delete_schedule, "two", REPORT)
    stopped = timezone.now() + timedelta(seconds=de.POLL_SECONDS + 2)
    time.sleep(de.POLL_SECONDS * 2 + 4)
    assert not ran(one, after=stopped) and not ran(two, after=stopped)

    # Every slot executed once, by the workers; every run records the version that sent it.
    wait_for(
        lambda: not TaskRun.objects.filter(state__in=(RunState.PENDING, RunState.RUNNING)).exists(),
        20,
        "the runs to end",
    )
    executed = Counter((name, slot) for name, slot, _, _ in report_runs(log))
    assert executed and max(executed.values()) == 1, executed.most_common(3)
    sent = {(f"{REPORT}[{entry}]", slot) for entry, slot, _ in published(beats)}
    assert set(executed) == sent, "a sent slot did not run, or a run was never sent"
    pids = {pid for *_, pid in report_runs(log)}
    assert {beats.owner_of(pid) for pid in pids} <= {"w1", "w2"}
    runs = {(r.task_name, r.slot): r for r in TaskRun.objects.filter(task_name__in=(one, two))}
    assert set(executed) <= set(runs)
    versions = Counter((r.task_name, r.schedule_version) for r in runs.values())
    assert versions[(one, 1)] and versions[(one, 2)] and versions[(two, 2)], versions
    for (task, slot), run in runs.items():
        if (task, slot) in executed:
            assert run.state == RunState.SUCCEEDED, (task, slot, run.state, run.error)
    # Slots of one before the disable: none lost between the first and the last sent.
    slots_of_one = ran(one)
    gaps = [b for a, b in itertools.pairwise(slots_of_one) if b - a != timedelta(seconds=1)]
    assert not gaps, f"slots of one missing before {gaps}"
    before_move = [slot for slot in ran(two) if slot <= moved_at]
    gaps = [b for a, b in itertools.pairwise(before_move) if b - a != timedelta(seconds=1)]
    assert not gaps, f"slots of two missing before {gaps}"


def test_scheduler__says_loaded_at_its_first_read_and_what_changed_after(tmp_path, caplog):
    caplog.set_level("INFO", logger="taskguard.celery")
    for name in ("a", "b", "c"):
        defined(name)
    beat = TaskguardScheduler(app=app, schedule_filename=str(tmp_path / "s"), lazy=False)
    try:
        said = [r.getMessage() for r in caplog.records if "data schedule" in r.getMessage()]
        assert said == ["taskguard beat: 3 data schedules loaded"]
        caplog.clear()
        defined("a", tenant=9)
        defined("d")
        delete_schedule("b", REPORT)
        beat.data_schedules().next_poll = 0.0
        beat.refresh_data_schedules()
        said = [r.getMessage() for r in caplog.records if "data schedule" in r.getMessage()]
        assert said == ["taskguard beat: data schedules: 1 added, 1 changed, 1 removed"]
    finally:
        beat.close()
