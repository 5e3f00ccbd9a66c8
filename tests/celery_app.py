"""The Celery app of the end-to-end tests, configured from the environment.

``celery -A tests.celery_app worker|beat``; the tests set:
TASKGUARD_TEST_BROKER_URL (a private redis-server), TASKGUARD_TEST_VISIBILITY
(the Redis broker's visibility_timeout), TASKGUARD_TEST_BEAT_SCHEDULE (JSON:
{"entry": {"task": ..., "every": seconds, "kwargs": {...}}}) and
TASKGUARD_TEST_PUBLISH_LOG (every message a beat publishes is appended there).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import django
from celery import Celery
from celery.signals import before_task_publish

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

app = Celery("tests", include=["tests.celery_tasks"])
app.conf.update(
    broker_url=os.environ.get("TASKGUARD_TEST_BROKER_URL", "memory://"),
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("TASKGUARD_TEST_VISIBILITY", "3600")),
        # Sweep for messages of dead workers every second (kombu's default: ~100 s).
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    # Worker death => the message goes back to the queue (see docs/celery.md).
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    timezone="Europe/Paris",  # = Django's TIME_ZONE in tests/settings.py
    enable_utc=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    beat_max_loop_interval=1,
)


def _beat_schedule() -> dict[str, dict[str, object]]:
    raw = json.loads(os.environ.get("TASKGUARD_TEST_BEAT_SCHEDULE", "{}"))
    return {
        name: {
            "task": entry["task"],
            "schedule": timedelta(seconds=entry["every"]),
            "kwargs": entry.get("kwargs", {}),
        }
        for name, entry in raw.items()
    }


app.conf.beat_schedule = _beat_schedule()


@before_task_publish.connect
def _log_publish(sender: str | None = None, headers: dict | None = None, **_: object) -> None:
    log = os.environ.get("TASKGUARD_TEST_PUBLISH_LOG")
    if not log or not headers or not headers.get("taskguard_slot"):
        return
    from tests.proc import record

    record(
        log,
        f"{headers.get('taskguard_schedule')} {headers['taskguard_slot']} "
        f"{os.environ.get('TASKGUARD_TEST_ROLE', os.getpid())}",
    )
