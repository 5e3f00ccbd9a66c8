"""Beat entries are registered schedules: a dead beat is noticed, a paused entry is skipped.

Real Celery beats (TaskguardScheduler on CELERY_BEAT_SCHEDULE, TaskguardDatabaseScheduler
on django-celery-beat rows) and workers on a private Redis broker. The beats save their
guarded entries in ``TaskSchedule``; once both beats are stopped, the missed-slot sweep
(run here by hand: nothing else runs it in these tests) records the entry's slots
``missed`` and ``check_schedules`` names it.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from celery.schedules import BaseSchedule, crontab
from celery.schedules import schedule as celery_schedule
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import OperationalError
from django.test import Client
from django.urls import reverse

from django_taskguard import health, ledger, missed, once_per_schedule
from django_taskguard.contrib.celery.entries import (
    DJANGO_CELERY_BEAT,
    SETTINGS,
    BeatEntry,
    Registrar,
    Unmonitored,
    record_of,
)
from django_taskguard.ledger import schedules as store
from django_taskguard.ledger.schedules import Record
from django_taskguard.models import (
    RunState,
    ScheduleSource,
    TaskRun,
    TaskRunTransition,
    TaskSchedule,
)

from .support.children import executions
from .support.monitoring import run_check
from .support.waiting import wait_for
from .test_celery_e2e import DATABASE, PERSISTENT, TICK, Cluster, drain, published

pytestmark = pytest.mark.dialect

GRACE = 3  # seconds: the entries' taskguard_grace header (the sweep waits that long)


@pytest.fixture
def beats(child_env, scratch, redis_server) -> Iterator[Cluster]:
    running = Cluster(child_env, scratch, redis_server.url)
    try:
        yield running
    finally:
        running.kill_all()


def slots(task: str, state: str, after: datetime | None = None) -> list[datetime]:
    found = TaskRun.objects.filter(task_name=task, state=state)
    if after is not None:
        found = found.filter(slot__gt=after)
    return sorted(found.values_list("slot", flat=True))


def swept_until(task: str, state: str, count: int, after: datetime) -> list[datetime]:
    """Run the sweep until ``count`` slots of ``task`` after ``after`` are in ``state``."""

    def enough() -> list[datetime]:
        missed.sweep_missed()
        found = slots(task, state, after)
        return found if len(found) >= count else []

    return wait_for(enough, 30, f"{count} {state} slots of {task}", every=0.5)


def succeeded_after(cluster: Cluster, task: str, after: datetime) -> datetime:
    return wait_for(
        lambda: next(iter(slots(task, RunState.SUCCEEDED, after)), None),
        40,
        f"a slot of {task} after {after} to succeed",
        describe=cluster.describe,
    )


def problems(task: str) -> list[str]:
    verdict = health.check(task=task)
    return [problem.code for t in verdict.tasks for problem in t.problems]


def saved(model: object) -> None:
    """``model.save()``, again while SQLite is locked by a beat (its own writes)."""

    def save() -> bool:
        try:
            model.save()  # type: ignore[attr-defined]
        except OperationalError as exc:
            if "locked" not in str(exc):
                raise
            return False
        return True

    wait_for(save, 20, f"{model} to be saved", every=0.2)


def last_sent(cluster: Cluster, entry: str) -> datetime:
    return max(slot for name, slot, _ in published(cluster) if name == entry)


@pytest.mark.processes
@pytest.mark.once
@pytest.mark.timeout(180)
def test_beat_schedules__settings_entry_missed_while_beats_are_down_and_paused_skipped(
    beats, scratch
):
    log = scratch / "executions.log"
    name = f"{TICK}[ping]"
    schedule = {
        "ping": {
            "task": TICK,
            "every": 2,
            "kwargs": {"log": str(log)},
            "options": {"headers": {"taskguard_grace": GRACE}},
        }
    }
    beats.worker("w1")
    beats.worker("w2")
    for beat in ("b1", "b2"):
        beats.beat(beat, PERSISTENT, schedule)
    row = wait_for(
        lambda: TaskSchedule.objects.filter(task_name=name).first(), 40, "the entry's row"
    )
    assert (row.source, row.entry, row.declared_in) == (ScheduleSource.CELERY, "ping", SETTINGS)
    assert (row.function, row.every, row.cron, row.grace) == (
        TICK,
        timedelta(seconds=2),
        "",
        timedelta(seconds=GRACE),
    )
    assert (row.removed_at, row.catchup) == (None, "none")  # the header's grace: late is missed
    first = succeeded_after(beats, name, row.first_seen - timedelta(seconds=4))

    # Both beats die: nothing sends the entry any more, the sweep records its slots missed.
    for beat in ("b1", "b2"):
        beats.stop(beat)
    drain([name])
    stopped = last_sent(beats, "ping")
    assert first <= stopped
    down = swept_until(name, RunState.MISSED, 2, stopped)
    assert all(slot > stopped for slot in down)
    assert all(slot > stopped for slot in slots(name, RunState.MISSED)), "a sent slot missed"
    status, output = run_check()
    assert status == 1 and name in output, output
    assert "missed" in problems(name)

    # Paused while the beats are down: the sweep records its slots skipped, not missed.
    call_command("pause_task", name, reason="beat maintenance", stdout=io.StringIO())
    paused_at = TaskSchedule.objects.get(task_name=name).paused_at
    assert paused_at is not None
    skipped = swept_until(name, RunState.SKIPPED, 2, paused_at)
    assert not slots(name, RunState.MISSED, skipped[0])
    # The beats come back, the entry still paused: they send, the worker records skipped.
    for beat in ("b3", "b4"):
        beats.beat(beat, PERSISTENT, schedule)

    def skipped_by_worker() -> bool:
        found = TaskRunTransition.objects.filter(
            run__task_name=name, to_state=RunState.SKIPPED, reason__startswith="paused: "
        ).exclude(reason__contains="sweep")
        return found.exists()

    wait_for(skipped_by_worker, 40, "the worker to skip a paused slot", describe=beats.describe)

    # Resumed: a slot succeeds, and nothing is late any more.
    call_command("resume_task", name, stdout=io.StringIO())
    resumed_at = TaskSchedule.objects.get(task_name=name).resumed_at
    assert resumed_at is not None
    ran = [datetime.fromisoformat(line[2]) for line in executions(log)]
    assert not [slot for slot in ran if paused_at <= slot < resumed_at], "a paused slot ran"
    succeeded_after(beats, name, resumed_at)
    missed.sweep_missed()
    assert "late" not in problems(name)


@pytest.mark.processes
@pytest.mark.once
@pytest.mark.celery_beat
@pytest.mark.timeout(180)
def test_beat_schedules__django_celery_beat_rows_followed_and_missed(beats, scratch):
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    log = scratch / "executions.log"
    name, later = f"{TICK}[ping-db]", f"{TICK}[later-db]"
    every2, _ = IntervalSchedule.objects.get_or_create(every=2, period=IntervalSchedule.SECONDS)
    every3, _ = IntervalSchedule.objects.get_or_create(every=3, period=IntervalSchedule.SECONDS)
    options = {
        "task": TICK,
        "kwargs": json.dumps({"log": str(log)}),
        "headers": json.dumps({"taskguard_grace": GRACE}),
    }
    ping = PeriodicTask.objects.create(name="ping-db", interval=every2, **options)
    off = PeriodicTask.objects.create(name="later-db", interval=every3, enabled=False, **options)
    beats.worker("w1")
    for beat in ("b1", "b2"):
        beats.beat(beat, DATABASE)

    def row(task: str) -> TaskSchedule | None:
        return TaskSchedule.objects.filter(task_name=task).first()

    found = wait_for(lambda: row(name), 40, "the row's schedule", describe=beats.describe)
    assert (found.source, found.entry, found.declared_in) == (
        ScheduleSource.CELERY,
        "ping-db",
        DJANGO_CELERY_BEAT,
    )
    assert (found.every, found.grace) == (timedelta(seconds=2), timedelta(seconds=GRACE))
    assert row(later) is None, "a disabled row is a schedule"

    # Enabled, edited, disabled while the beats run: the schedule follows.
    off.enabled = True
    saved(off)
    wait_for(
        lambda: (r := row(later)) and r.removed_at is None,
        60,
        "the enabled row",
        describe=beats.describe,
    )
    ping.interval = every3
    saved(ping)
    wait_for(
        lambda: row(name).every == timedelta(seconds=3),
        60,
        "the edited interval",
        describe=beats.describe,
    )
    off.enabled = False
    saved(off)
    gone = wait_for(
        lambda: row(later).removed_at, 60, "the disabled row to be removed", describe=beats.describe
    )
    edited = ledger.database_now()
    succeeded_after(beats, name, edited)

    # Both beats die: the edited entry's slots are missed, the disabled one's are not.
    for beat in ("b1", "b2"):
        beats.stop(beat)
    drain([name, later])
    stopped = last_sent(beats, "ping-db")
    down = swept_until(name, RunState.MISSED, 2, stopped)
    assert all(slot > stopped and slot.timestamp() % 3 == 0 for slot in down)
    assert not slots(later, RunState.MISSED, gone)
    status, output = run_check()
    assert status == 1 and name in output and later not in output, output

    # Back up: a slot succeeds, nothing is late.
    for beat in ("b3", "b4"):
        beats.beat(beat, DATABASE)
    succeeded_after(beats, name, down[-1])
    missed.sweep_missed()
    assert "late" not in problems(name)


# -- what an entry is saved as (in process: no beat needed) ---------------------------------


def entry(name: str, task: str, schedule: object, **headers: object) -> BeatEntry:
    return BeatEntry(name, task, schedule, dict(headers))


def test_beat_schedules__record_of_an_entry():
    from tests.support.celery_app import app

    record = record_of(app, entry("nightly", TICK, crontab(minute=5, hour=2)), SETTINGS)
    assert (record.task_name, record.function, record.entry) == (
        f"{TICK}[nightly]",
        TICK,
        "nightly",
    )
    assert (record.cron, record.cron_day_or, record.time_zone) == (
        "5 2 * * *",
        False,
        "Europe/Paris",
    )
    assert (record.every, record.catchup, record.declared_in) == (None, "latest", SETTINGS)
    graced = record_of(app, entry("e", TICK, celery_schedule(30), taskguard_grace=7), SETTINGS)
    assert (graced.every, graced.grace, graced.catchup) == (
        timedelta(seconds=30),
        timedelta(seconds=7),
        "none",  # what the worker does with a message later than the header's grace
    )


@pytest.mark.parametrize(
    ("task", "schedule", "why"),
    [
        ("tests.support.celery_keyed_tasks.plain", celery_schedule(5), "is not guarded"),
        ("celery.backend_cleanup", celery_schedule(5), "is not guarded"),
        ("no.such.task", celery_schedule(5), "is unknown to this beat"),
        (TICK, BaseSchedule(), "has no slots"),
        (TICK, celery_schedule(0.5), "cannot be stored"),
    ],
    ids=["keyed", "builtin", "unknown", "no-slots", "sub-second"],
)
def test_beat_schedules__unmonitored_entries_say_why(task, schedule, why):
    from tests.support.celery_app import app

    with pytest.raises(Unmonitored, match=why):
        record_of(app, entry("e", task, schedule), SETTINGS)


@pytest.mark.django_db(transaction=True)
def test_beat_schedules__entries_saved_edited_removed_and_back(caplog):
    from tests.support.celery_app import app

    registrar = Registrar(app, SETTINGS)
    dusk = entry("dusk", TICK, BaseSchedule())  # a schedule without slots (as solar)
    registrar.declare([entry("a", TICK, celery_schedule(60)), dusk])
    registrar.declare([entry("a", TICK, celery_schedule(60)), dusk])
    warned = [r.getMessage() for r in caplog.records if "entry dusk" in r.getMessage()]
    assert len(warned) == 1 and "not monitored" in warned[0], warned
    row = TaskSchedule.objects.get(task_name=f"{TICK}[a]")
    assert (row.every, row.swept_until, row.removed_at) == (timedelta(seconds=60), None, None)
    # Edited: the new interval's slots are judged from the edit on, not before it.
    registrar.declare([entry("a", TICK, celery_schedule(120))])
    row.refresh_from_db()
    assert row.every == timedelta(seconds=120) and row.swept_until is not None
    # Gone from the settings: removed; the other scheduler kind's and functions' rows stay.
    other = Registrar(app, DJANGO_CELERY_BEAT)
    other.declare([entry("b", TICK, celery_schedule(60))])
    registrar.declare([])
    assert TaskSchedule.objects.get(task_name=f"{TICK}[a]").removed_at is not None
    assert TaskSchedule.objects.get(task_name=f"{TICK}[b]").removed_at is None
    registrar.declare([entry("a", TICK, celery_schedule(120))])
    assert TaskSchedule.objects.get(task_name=f"{TICK}[a]").removed_at is None


@pytest.mark.django_db(transaction=True)
def test_beat_schedules__removed_and_beat_covered_rows_are_not_swept_nor_judged():
    from tests.support.celery_app import app

    now = ledger.database_now()
    long_ago = now - timedelta(minutes=10)
    own = Record(  # a Celery task's own every= (registry: source celery, no entry)
        task_name=TICK,
        source=ScheduleSource.CELERY,
        function="tests.support.celery_tasks.tick",
        cron="",
        cron_day_or=True,
        every=timedelta(seconds=60),
        time_zone="",
        default_zone="Europe/Paris",
        catchup="latest",
        grace=timedelta(seconds=1),
        max_catchup=100,
        pause_after_failures=None,
    )
    store.save([own], long_ago)
    Registrar(app, SETTINGS).declare([entry("gone", TICK, celery_schedule(60))])
    Registrar(app, SETTINGS).declare([entry("kept", TICK, celery_schedule(60))])
    TaskSchedule.objects.update(first_seen=long_ago)
    result = missed.sweep_missed()
    assert set(result.tasks) == {f"{TICK}[kept]"}
    judged = {t.task: t for t in health.check().tasks}
    assert f"{TICK}[kept]" in judged and not set(judged) & {TICK, f"{TICK}[gone]"}
    kept = judged[f"{TICK}[kept]"]
    assert kept.next_slot is not None and kept.next_slot > now  # the overview's next slot
    assert "missed" in [problem.code for problem in kept.problems]
    # The metrics and the admin's overview show the entry under its run name.
    staff = Client()
    staff.force_login(User.objects.create_superuser("ops", password="pw"))
    metrics = staff.get(reverse("taskguard:metrics")).content.decode()
    assert f'taskguard_task_healthy{{task="{TICK}[kept]"}} 0.0' in metrics
    page = staff.get(reverse("admin:taskguard_taskrun_overview")).content.decode()
    assert f"{TICK}[kept]" in page and "every minute" in page
    assert "no schedule registered" not in page.split(f"{TICK}[kept]", 1)[1].split("</tr>")[0]
    # Without a beat entry for it, the task's own row is judged again.
    Registrar(app, SETTINGS).declare([])
    assert set(missed.sweep_missed().tasks) == {TICK}


def test_beat_schedules__a_named_guarded_task_is_saved_under_its_name():
    from tests.support.celery_app import app

    @app.task(name="tests.beat_schedules.named", bind=True)
    @once_per_schedule(name="tests.beat_schedules.named-run")
    def named(self: object) -> None:
        """name= is the whole identity: its runs are recorded under it, whatever the entry."""

    record = record_of(app, entry("e", "tests.beat_schedules.named", celery_schedule(5)), SETTINGS)
    assert (record.task_name, record.entry) == ("tests.beat_schedules.named-run", "e")


@pytest.mark.django_db(transaction=True)
def test_beat_schedules__an_entry_it_cannot_monitor_now_keeps_its_row_and_alarm(caplog):
    # Review of issue 22: an entry whose task stopped importing (a broken deploy of the
    # beat) was marked removed, which turned its missed-slot alarm off when it mattered.
    from tests.support.celery_app import app

    registrar = Registrar(app, SETTINGS)
    registrar.declare([entry("a", TICK, celery_schedule(60))])
    registrar.declare([entry("a", "tests.nowhere.gone", celery_schedule(60))])
    assert TaskSchedule.objects.get(task_name=f"{TICK}[a]").removed_at is not None  # another task
    registrar.declare([entry("a", TICK, celery_schedule(60))])
    broken = entry("a", TICK, celery_schedule(60))
    registrar.app = _NoTasks()  # the beat can no longer find the task
    registrar.declare([broken])
    assert TaskSchedule.objects.get(task_name=f"{TICK}[a]").removed_at is None


@pytest.mark.django_db(transaction=True)
def test_beat_schedules__entries_of_a_named_task_share_one_row_and_say_so(caplog):
    # Review of issue 22: two entries of a name= task made two records under one name, and
    # PostgreSQL refused the whole save (ON CONFLICT cannot affect a row twice), for ever.
    from tests.support.celery_app import app

    @app.task(name="tests.beat_schedules.shared", bind=True)
    @once_per_schedule(name="tests.beat_schedules.shared-run")
    def shared(self: object) -> None:
        """Two beat entries send it."""

    registrar = Registrar(app, SETTINGS)
    registrar.declare(
        [
            entry("one", "tests.beat_schedules.shared", celery_schedule(5)),
            entry("two", "tests.beat_schedules.shared", celery_schedule(7)),
        ]
    )
    assert registrar.pending is None  # saved
    row = TaskSchedule.objects.get(task_name="tests.beat_schedules.shared-run")
    assert (row.entry, row.every) == ("one", timedelta(seconds=5))
    said = [r.getMessage() for r in caplog.records if "entry two" in r.getMessage()]
    assert said and "like entry one's" in said[0], said


class _NoTasks:
    """A Celery app that knows no task and cannot import any (a broken deploy)."""

    tasks: dict[str, object] = {}

    class loader:
        @staticmethod
        def import_default_modules() -> None:
            raise ImportError("the tasks module is broken")
