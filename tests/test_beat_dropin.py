"""The drop-in schedulers against the schedulers they replace: what a beat that runs them
(``setup_schedule``, ticks, ``close``) sees, with a real Celery app (in-memory broker).

Where taskguard's scheduler differs from Celery's or django-celery-beat's on purpose (slot
boundaries, its wake-ups), docs/celery.md says so; these tests hold what must not differ.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from celery.beat import PersistentScheduler
from celery.schedules import crontab
from django.test import override_settings

from django_taskguard import upkeep
from django_taskguard.contrib.celery import TaskguardScheduler
from django_taskguard.contrib.celery.data_entries import POLL_SECONDS
from tests.support.celery_app import app

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]


SECOND = timedelta(seconds=1)


@contextmanager
def celery_app(**conf: Any) -> Iterator[Celery]:
    """A Celery app of one test, with Celery's defaults (the suite's app ticks every second)."""
    own = Celery("dropin", broker="memory://", set_as_current=False)
    own.conf.update(timezone="UTC", **conf)
    try:
        yield own
    finally:
        own.close()


class Recording(TaskguardScheduler):
    """Notes the task names it publishes instead of sending them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sent: list[str] = []
        super().__init__(*args, **kwargs)

    def send_task(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.sent.append(name)


def upkeep_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "taskguard-upkeep" and t.is_alive()]


@pytest.fixture
def slow_upkeep(monkeypatch):
    """The automatic upkeep on, its one part taking 2 s; set once the part has started."""
    started = threading.Event()

    def slow() -> dict[str, Any]:
        started.set()
        time.sleep(2)  # the upkeep still at work when the beat closes
        return {}

    monkeypatch.setattr(upkeep, "PARTS", [("slow", slow)])
    upkeep.forget()
    try:
        with override_settings(TASKGUARD={"BACKEND": "database", "UPKEEP_INTERVAL_SECONDS": 60}):
            yield started
    finally:
        upkeep.join(timeout=60)
        upkeep.forget(off=True)


def close_leaves_no_thread(beat: Any, started: threading.Event) -> None:
    beat.tick()  # starts the upkeep: this process is due for it
    assert started.wait(timeout=30), "the upkeep did not start"
    assert upkeep_threads()
    beat.close()
    assert upkeep_threads() == []


def test_close__waits_for_the_upkeep_thread_it_started(slow_upkeep, tmp_path):
    beat = TaskguardScheduler(app=app, schedule_filename=str(tmp_path / "beat"))
    close_leaves_no_thread(beat, slow_upkeep)


@pytest.mark.celery_beat
def test_database_close__waits_for_the_upkeep_thread_it_started(slow_upkeep):
    from django_taskguard.contrib.celery import TaskguardDatabaseScheduler

    beat = TaskguardDatabaseScheduler(app=app)
    close_leaves_no_thread(beat, slow_upkeep)


# --- what differs on purpose (docs/celery.md, "Where they differ") ------------------

DOWN_UNTIL = datetime(2026, 3, 1, 1, 11, 20, tzinfo=UTC)  # the beat restarts at 01:11:20


def restart_clock() -> datetime:
    """The schedules' clock (module level: a beat's shelf pickles its entries)."""
    return DOWN_UNTIL


def test_restart__sends_each_entry_due_while_down_once_then_wakes_for_the_poll(tmp_path):
    # Down from 01:09:20: every ten minutes (01:10) and every minute (01:11) came due, every
    # 13 minutes (next 01:13) did not.
    every = {"ten": "*/10", "one": "*/1", "thirteen": "*/13"}
    entries = {
        name: {"task": f"tests.dropin.{name}", "schedule": crontab(minute=m, nowfun=restart_clock)}
        for name, m in every.items()
    }
    path = str(tmp_path / "beat")
    with celery_app(beat_schedule=entries) as own:
        before = PersistentScheduler(app=own, schedule_filename=path)
        for entry in before.schedule.values():
            entry.last_run_at = DOWN_UNTIL - timedelta(minutes=2)
        before.close()
        beat = Recording(app=own, schedule_filename=path, max_interval=300)
        try:
            delays = [beat.tick() for _ in range(4)]
        finally:
            beat.close()
    assert sorted(beat.sent) == ["tests.dropin.one", "tests.dropin.ten"]
    assert delays[:2] == [0, 0]  # one entry sent a tick, as Celery does
    assert 0 < delays[2] <= POLL_SECONDS  # then up to the next data schedule poll


@pytest.mark.celery_beat
def test_model_entry__a_due_interval_is_next_checked_at_its_next_boundary():
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    from django_taskguard.contrib.celery import TaskguardModelEntry

    now = datetime(2026, 3, 1, 12, 0, 3, 500_000, tzinfo=UTC)  # 3.5 s into a 10 s slot
    every = IntervalSchedule.objects.create(every=10, period=IntervalSchedule.SECONDS)
    row = PeriodicTask.objects.create(
        name="every-10s", task="tests.dropin.ten", interval=every, last_run_at=now - SECOND * 11
    )
    entry = TaskguardModelEntry(row, app=app)
    entry.schedule.nowfun = lambda: now
    assert tuple(entry.is_due()) == (True, 6.5)  # django-celery-beat's: (True, 10)
