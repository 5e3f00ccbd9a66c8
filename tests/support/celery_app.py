"""The Celery app of the end-to-end tests, configured from the environment.

``celery -A tests.support.celery_app worker|beat``; the tests set:
TASKGUARD_TEST_BROKER_URL (a private redis-server, or an amqp:// URL with a
private RabbitMQ vhost), TASKGUARD_TEST_VISIBILITY (the Redis broker's
visibility_timeout), TASKGUARD_TEST_BEAT_SCHEDULE (JSON: {"entry": {"task":
..., "every": seconds, "kwargs": {...}, "options": {...}}}), TASKGUARD_TEST_PUBLISH_LOG (set
for beats: every message published is appended there) and TASKGUARD_TEST_EVENT_LOG
(workers append a line there for every message taskguard puts back and every
duplicate it suppresses).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

import django
from celery import Celery
from celery._state import get_current_task
from celery.signals import before_task_publish, task_retry
from django.dispatch import receiver

from django_taskguard.signals import duplicate_suppressed
from tests.support.proc import record

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

from django_taskguard.contrib.celery import (  # noqa: E402 (needs the app registry)
    DEFERRED_HEADER,
    SLOT_HEADER,
    message_headers,
)

BROKER_URL = os.environ.get("TASKGUARD_TEST_BROKER_URL", "memory://")
REDIS_TRANSPORT_OPTIONS = {
    "visibility_timeout": float(os.environ.get("TASKGUARD_TEST_VISIBILITY", "3600")),
    # Sweep for messages of dead workers every second (kombu's default: ~100 s).
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
}

app = Celery(
    "tests",
    include=[
        "tests.support.celery_tasks",
        "tests.support.celery_keyed_tasks",
        "tests.support.celery_checkin_tasks",
    ],
)
app.conf.update(
    broker_url=BROKER_URL,
    broker_transport_options=REDIS_TRANSPORT_OPTIONS if BROKER_URL.startswith("redis") else {},
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
            "options": entry.get("options", {}),
        }
        for name, entry in raw.items()
    }


app.conf.beat_schedule = _beat_schedule()


PUBLISH_LOG = os.environ.get("TASKGUARD_TEST_PUBLISH_LOG")
EVENT_LOG = os.environ.get("TASKGUARD_TEST_EVENT_LOG")


@before_task_publish.connect
def _log_publish(sender: str | None = None, headers: dict | None = None, **_: object) -> None:
    if not PUBLISH_LOG or not headers or not headers.get(SLOT_HEADER):
        return
    record(
        PUBLISH_LOG,
        f"{headers.get('taskguard_schedule')} {headers[SLOT_HEADER]} "
        f"{os.environ.get('TASKGUARD_TEST_ROLE', os.getpid())}",
    )


def _message_line(event: str, request: Any, detail: str) -> str:
    """``EVENT TASK_ID SLOT REDELIVERED DEFERRED PID DETAIL``."""
    headers = message_headers(request)
    redelivered = bool((request.delivery_info or {}).get("redelivered"))
    return (
        f"{event} {request.id} {headers.get(SLOT_HEADER)} {int(redelivered)} "
        f"{int(headers.get(DEFERRED_HEADER) or 0)} {os.getpid()} {detail}"
    )


@task_retry.connect
def _log_put_back(request: Any = None, reason: object = None, **_: object) -> None:
    if EVENT_LOG and "held by a live attempt" in str(reason):
        record(EVENT_LOG, _message_line("put-back", request, "-"))


@receiver(duplicate_suppressed)
def _log_duplicate(sender: str, state: str, **_: object) -> None:
    task = get_current_task()
    if EVENT_LOG and task is not None and task.request.id is not None:
        record(EVENT_LOG, _message_line("duplicate", task.request, state))
