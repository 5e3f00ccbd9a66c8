"""``manage.py backfill`` of a Celery beat entry: one stamped message per slot, run by a real
worker (a private redis-server broker) under ``catchup="none"``.

The entry's schedule row is written here as the beat schedulers register it (source
``celery``, ``task[entry]``); its messages' task, arguments and options come from
``CELERY_BEAT_SCHEDULE`` (the Celery app's ``beat_schedule``) or a django-celery-beat
``PeriodicTask``.
"""

from __future__ import annotations

import json
import re
import socket
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from celery import current_app
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from django_taskguard import guard, ledger
from django_taskguard.contrib.celery import task_identity
from django_taskguard.ledger import schedules as schedule_store
from django_taskguard.models import RunState, ScheduleSource, TaskRun
from django_taskguard.policy import Policy
from django_taskguard.schedules import IntervalSchedule

from .support.children import executions
from .support.waiting import wait_for
from .test_celery_e2e import Cluster, backend, cluster  # noqa: F401 (fixtures)

pytestmark = pytest.mark.dialect

STRICT = "tests.support.celery_tasks.strict"  # @once_per_schedule(catchup="none")
EVERY = timedelta(minutes=1)
SETTINGS = "CELERY_BEAT_SCHEDULE"
DATABASE = "django-celery-beat"
DEFAULT_QUEUE = "celery"  # the broker list a Redis broker keeps the default queue in


def register(entry: str, declared_in: str, task: str = STRICT) -> str:
    """Save the entry's schedule row as a beat registers it; its runs' task name."""
    name = task_identity(task, entry)
    schedule_store.save([schedule_store.Record(
        task_name=name, source=ScheduleSource.CELERY, function=task, cron="",
        cron_day_or=True, every=EVERY, time_zone="", default_zone="UTC", catchup="none",
        grace=timedelta(seconds=30), max_catchup=1, pause_after_failures=None, entry=entry,
        declared_in=declared_in,
    )])  # fmt: skip
    return name


def past_slots(count: int) -> list[datetime]:
    """``count`` minute slots in a row, the newest ten minutes ago (long past any grace)."""
    first = IntervalSchedule(EVERY).latest_slot(timezone.now()) - 10 * EVERY
    return [first + n * EVERY for n in range(count)]


def backfill(task: str, first: datetime, last: datetime, *extra: str) -> str:
    said = StringIO()
    call_command(
        "backfill", task, "--from", first.isoformat(), "--to", last.isoformat(), *extra,
        stdout=said,
    )  # fmt: skip
    return said.getvalue()


@pytest.fixture
def app() -> Iterator[Any]:
    """The test Celery app, current (the command sends with ``celery.current_app``)."""
    from tests.support.celery_app import app

    previous = current_app._get_current_object()
    saved = (app.conf.broker_url, app.conf.beat_schedule)
    app.set_current()
    try:
        yield app
    finally:
        app.conf.broker_url, app.conf.beat_schedule = saved
        previous.set_current()


def queued(running: Cluster) -> int:
    """Messages waiting in the broker's default queue."""
    from redis import Redis

    client = Redis.from_url(running.broker_url)
    try:
        return int(client.llen(DEFAULT_QUEUE))
    finally:
        client.close()


def runs_on_worker(running: Cluster, log: Path, label: str) -> Counter[datetime]:
    """The executions of ``label``'s messages by slot; each must have been on worker w1."""
    found = [line for line in executions(log) if line[0] == f"run:{label}"]
    assert all(running.owner_of(int(line[4])) == "w1" for line in found), found
    return Counter(datetime.fromisoformat(line[2]) for line in found)


def states(name: str) -> dict[datetime, str]:
    return dict(TaskRun.objects.filter(task_name=name).values_list("slot", "state"))


def finished(name: str, slots: list[datetime]) -> bool:
    found = states(name)
    return all(found.get(slot) in (RunState.SUCCEEDED, RunState.MISSED) for slot in slots)


@pytest.mark.processes
@pytest.mark.once
@pytest.mark.parametrize("backend", ["database", "redis"])  # the workers' lock backend
def test_backfill_beat__settings_entry_runs_each_slot_once_on_the_worker(
    cluster,  # noqa: F811
    scratch,
    app,
    backend,  # noqa: F811
):
    from tests.support import celery_tasks

    log = scratch / "executions.log"
    name = register("nightly", SETTINGS)
    app.conf.broker_url = cluster.broker_url
    app.conf.beat_schedule = {
        "nightly": {
            "task": STRICT,
            "schedule": EVERY,
            "args": [str(log)],
            "kwargs": {"label": "nightly"},
            "options": {"expires": 1},  # the beat's, for a due slot: not a backfill's
        }
    }
    late, s0, s1, s2, s3 = past_slots(5)
    ran: list[datetime] = []
    guard.execute(name, s0, Policy(), lambda: ran.append(s0), (), {})  # succeeded already
    reason = "missed: no instance claimed it within its grace (30s)"
    ledger.insert_missed(name, s1, reason=reason, actor="tests")  # the sweep's record

    said = backfill(name, s0, s3, "--dry-run")
    assert f"Would enqueue 3 slots of {name} (1 already have a row)." in said
    assert "1 of them were recorded missed by the sweep" in said
    assert f"  {s1.isoformat()} (missed)\n  {s2.isoformat()}\n  {s3.isoformat()}\n" in said
    assert queued(cluster) == 0, "the dry run sent a message"
    assert states(name) == {s0: RunState.SUCCEEDED, s1: RunState.MISSED}

    said = backfill(name, s0, s3)
    assert f"Enqueued 3 slots of {name}; 0 had a row meanwhile." in said, said
    assert queued(cluster) == 3
    assert states(name) == {
        s0: RunState.SUCCEEDED, s1: RunState.MISSED, s2: RunState.PENDING, s3: RunState.PENDING,
    }  # fmt: skip
    # What a beat sends: the same entry, stamped, without the backfill header. Late under
    # catchup="none": recorded missed by the worker, not run.
    cluster.publish(celery_tasks.strict, late, "nightly", log=str(log), label="beat")
    cluster.worker("w1")
    wait_for(
        lambda: finished(name, [late, s1, s2, s3]), 90, "the worker", describe=cluster.describe
    )

    assert runs_on_worker(cluster, log, "nightly") == Counter([s1, s2, s3])
    assert runs_on_worker(cluster, log, "beat") == Counter()
    assert ran == [s0]
    rows = {run.slot: run for run in TaskRun.objects.filter(task_name=name)}
    assert rows[late].state == RunState.MISSED and "late" in rows[late].error
    for slot in (s1, s2, s3):
        assert (rows[slot].state, rows[slot].attempt, rows[slot].duplicates) == (
            RunState.SUCCEEDED, 1, 0,
        ), slot  # fmt: skip
    moves = {
        slot: [(t.from_state, t.to_state) for t in rows[slot].transitions.order_by("id")]
        for slot in (s1, s2)
    }
    assert (RunState.MISSED, RunState.RUNNING) in moves[s1], moves  # taken over once
    assert moves[s2][0] == (RunState.PENDING, RunState.RUNNING), moves

    # Again: every slot has run; nothing is sent (the worker is stopped: the queue shows it).
    cluster.stop("w1")
    said = backfill(name, s0, s3)
    assert f"Enqueueing 0 slots of {name} (4 already have a row)." in said
    assert queued(cluster) == 0


@pytest.mark.processes
@pytest.mark.once
@pytest.mark.celery_beat
def test_backfill_beat__django_celery_beat_row_runs_each_slot_once(
    cluster,  # noqa: F811
    scratch,
    app,
):
    from django_celery_beat.models import IntervalSchedule as Every
    from django_celery_beat.models import PeriodicTask

    log = scratch / "executions.log"
    every = Every.objects.create(every=60, period=Every.SECONDS)
    PeriodicTask.objects.create(
        name="db-nightly",
        task=STRICT,
        interval=every,
        args=json.dumps([str(log)]),
        kwargs=json.dumps({"label": "db"}),
        headers=json.dumps({"origin": "tests"}),
    )
    name = register("db-nightly", DATABASE)
    app.conf.broker_url = cluster.broker_url
    s0, s1 = past_slots(2)
    said = backfill(name, s0, s1)
    assert f"Enqueued 2 slots of {name}; 0 had a row meanwhile." in said, said
    cluster.worker("w1")
    wait_for(lambda: finished(name, [s0, s1]), 90, "the worker", describe=cluster.describe)
    assert runs_on_worker(cluster, log, "db") == Counter([s0, s1])
    assert states(name) == {s0: RunState.SUCCEEDED, s1: RunState.SUCCEEDED}


# -- refusals (no worker) --------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_backfill_beat__an_entry_no_longer_declared_is_an_error_naming_it(app):
    name = register("gone", SETTINGS)
    app.conf.beat_schedule = {"other": {"task": STRICT, "schedule": EVERY}}
    s0, s1 = past_slots(2)
    with pytest.raises(CommandError, match=r"beat entry 'gone' is not in CELERY_BEAT_SCHEDULE"):
        backfill(name, s0, s1, "--dry-run")
    with pytest.raises(CommandError, match=r"no schedule named 'tests\.nothing\[gone\]'"):
        backfill("tests.nothing[gone]", s0, s1)
    assert states(name) == {}


@pytest.mark.django_db(transaction=True)
def test_backfill_beat__an_entry_that_sends_another_task_is_refused(app):
    name = register("moved", SETTINGS)
    other = "tests.support.celery_tasks.tick"
    app.conf.beat_schedule = {"moved": {"task": other, "schedule": EVERY}}
    s0, s1 = past_slots(2)
    with pytest.raises(CommandError, match=rf"now sends {other}.*backfill {other}\[moved\]"):
        backfill(name, s0, s1)
    assert states(name) == {}


@pytest.mark.celery_beat
@pytest.mark.django_db(transaction=True)
def test_backfill_beat__a_periodic_task_gone_or_unreadable_is_an_error(app):
    from django_celery_beat.models import IntervalSchedule as Every
    from django_celery_beat.models import PeriodicTask

    s0, s1 = past_slots(2)
    name = register("db-gone", DATABASE)
    with pytest.raises(CommandError, match="'db-gone' is not a django-celery-beat periodic task"):
        backfill(name, s0, s1)
    every = Every.objects.create(every=60, period=Every.SECONDS)
    PeriodicTask.objects.create(name="db-bad", task=STRICT, interval=every, args="[oops")
    name = register("db-bad", DATABASE)
    with pytest.raises(CommandError, match="periodic task 'db-bad': its args are not JSON"):
        backfill(name, s0, s1)
    assert states(name) == {}


@pytest.mark.django_db(transaction=True)
def test_backfill_beat__a_broker_that_is_down_stops_it_and_records_the_slot(app):
    name = register("nightly", SETTINGS)
    app.conf.beat_schedule = {"nightly": {"task": STRICT, "schedule": EVERY, "args": ["-"]}}
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app.conf.broker_url = f"redis://127.0.0.1:{port}/0"
    s0, s1 = past_slots(2)
    with pytest.raises(CommandError, match=rf"stopped at {re.escape(s0.isoformat())}.*1 later"):
        backfill(name, s0, s1)
    # The pending row is given back; past its grace (the sweep will not judge it again) it
    # is recorded missed with the reason, so the next backfill takes it over.
    run = TaskRun.objects.get(task_name=name, slot=s0)
    assert run.state == RunState.MISSED and run.error.startswith("missed: enqueue failed")
    assert states(name) == {s0: RunState.MISSED}


@pytest.mark.django_db(transaction=True)
def test_backfill_beat__a_paused_entry_is_said(app):
    name = register("nightly", SETTINGS)
    app.conf.beat_schedule = {"nightly": {"task": STRICT, "schedule": EVERY}}
    schedule_store.set_paused(name, "maintenance")
    s0, s1 = past_slots(2)
    said = backfill(name, s0, s1, "--dry-run")
    assert f"{name} is paused (maintenance): the worker records each slot skipped" in said
