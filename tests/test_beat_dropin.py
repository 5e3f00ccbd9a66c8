"""The drop-in schedulers against the schedulers they replace: what a beat that runs them
(``setup_schedule``, ticks, ``close``) sees, with a real Celery app (in-memory broker).

Where taskguard's scheduler differs from Celery's or django-celery-beat's on purpose (slot
boundaries, its wake-ups), docs/celery.md says so; these tests hold what must not differ.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.test import override_settings

from django_taskguard import upkeep
from django_taskguard.contrib.celery import TaskguardScheduler
from tests.support.celery_app import app

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]


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
