"""Every setting is validated where it is read, in the system check's words.

Not every process runs system checks (gunicorn, Celery workers, ``manage.py shell``): a
value ``check`` refuses is refused where it is read too (``ImproperlyConfigured``), never
replaced by a default. One table: an invalid value of every key.
"""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from django_taskguard import once_per_schedule
from django_taskguard.checks import check_settings
from django_taskguard.conf import DEFAULTS, taskguard_settings
from django_taskguard.models import TaskRun

from .support.slots import BASE_SLOT

pytestmark = pytest.mark.pure

LOCMEM = {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}

# (an invalid TASKGUARD, the check's id): every key of DEFAULTS has a line.
INVALID = [
    ({"BACKEND": "memcached"}, "taskguard.E001"),
    ({"BACKEND": "redis"}, "taskguard.E002"),  # CACHES["default"] is locmem here
    ({"REDIS_ALIAS": "nowhere"}, "taskguard.E014"),
    ({"KEY_PREFIX": ""}, "taskguard.E022"),
    ({"LEASE_SECONDS": 0}, "taskguard.E004"),
    ({"ON_REDIS_ERROR": "ignore"}, "taskguard.E005"),
    ({"DATABASE_ALIAS": "nope"}, "taskguard.E006"),
    ({"SLOT_TOLERANCE_SECONDS": -1}, "taskguard.E009"),
    ({"REDIS_SOCKET_TIMEOUT": 0}, "taskguard.E009"),
    ({"STARTUP_CLEANUP": "yes"}, "taskguard.E023"),
    ({"PRUNE_AFTER_DAYS": 1.5}, "taskguard.E009"),
    ({"BEAT_CLAIM": 1}, "taskguard.E023"),
    ({"RETRY_GRACE_SECONDS": 1}, "taskguard.E009"),
    ({"FINISHED_MARKER_SECONDS": -1}, "taskguard.E012"),
    ({"INSTANCE_NAME": ""}, "taskguard.E022"),
    ({"SCHEDULE_MODULES": "reports.jobs"}, "taskguard.E020"),
    ({"HEALTH_FAILURES": 0}, "taskguard.E009"),
    ({"MONITOR_WINDOW_HOURS": 721}, "taskguard.E009"),
    ({"HEALTH_TOKEN": "short"}, "taskguard.E021"),
    ({"METRICS_TOKEN": 1234}, "taskguard.E021"),
    ({"UPKEEP_INTERVAL_SECONDS": 1}, "taskguard.E009"),
    ({"CHECKINS": {"healthchecks": {"ping_url": "hc-ping.com/abc"}}}, "taskguard.E024"),
    ({"CHECKINS": {"sentry": {}, "monitors": {"nightly": 3}}}, "taskguard.E024"),
    ({"CHECKINS": {"timeout": 0}}, "taskguard.E024"),
    ({"CHECKINS": {"pagerduty": {}}}, "taskguard.E024"),
    ({"OPENTELEMETRY": "yes"}, "taskguard.E025"),
    ({"OPENTELEMETRY": {"key": "hash"}}, "taskguard.E025"),
    ({"LATE_START_SECONDS": 0}, "taskguard.E009"),
    ({"LATE_START_RUNS": 0}, "taskguard.E009"),
]
# What a guarded call reads (a worker's first task): refused before anything is recorded.
READ_BY_A_GUARDED_CALL = {"BACKEND", "REDIS_ALIAS", "ON_REDIS_ERROR", "DATABASE_ALIAS"}


def test_invalid__every_setting_has_a_line():
    assert {name for taskguard, _ in INVALID for name in taskguard} == set(DEFAULTS)


def check_words(taskguard: object) -> tuple[str, str]:
    with override_settings(TASKGUARD=taskguard, CACHES={"default": LOCMEM}):
        [message] = check_settings()
    return message.id or "", message.msg.removesuffix(".")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("taskguard", "check_id"), INVALID, ids=lambda v: str(v))
def test_settings__refused_where_read_with_the_checks_words(taskguard, check_id):
    [name] = taskguard
    found_id, words = check_words(taskguard)
    assert found_id == check_id
    with override_settings(TASKGUARD=taskguard, CACHES={"default": LOCMEM}):
        if name in READ_BY_A_GUARDED_CALL or check_id == "taskguard.E002":
            calls: list[int] = []
            job = once_per_schedule(name="tests.settings.job")(lambda: calls.append(1))
            with pytest.raises(ImproperlyConfigured) as raised:
                job.run_for_slot(BASE_SLOT)
            assert calls == []
        else:
            with pytest.raises(ImproperlyConfigured) as raised:
                getattr(taskguard_settings, name)
    assert str(raised.value) == words
    assert not TaskRun.objects.exists()


def test_settings__taskguard_not_a_dict_refused_where_read():
    found_id, words = check_words([("BACKEND", "redis")])
    assert found_id == "taskguard.E008"
    with (
        override_settings(TASKGUARD=[("BACKEND", "redis")]),
        pytest.raises(ImproperlyConfigured) as raised,
    ):
        assert taskguard_settings.BACKEND is None
    assert str(raised.value) == words


NOT_A_DICT = ([("BACKEND", "redis")], "taskguard.E008")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("taskguard", "check_id"), [*INVALID, NOT_A_DICT], ids=lambda v: str(v))
@pytest.mark.parametrize("options", [(), ("--database", "default"), ("--deploy",)], ids=str)
def test_check_command__reports_every_invalid_setting_by_its_id_and_never_raises(
    taskguard, check_id, options
):
    # Every registered check runs (settings, caches, database, deploy): none may raise.
    with (
        override_settings(TASKGUARD=taskguard, CACHES={"default": LOCMEM}),
        pytest.raises(SystemCheckError) as raised,
    ):
        call_command("check", *options, stdout=StringIO(), stderr=StringIO())
    assert f"({check_id})" in str(raised.value), str(raised.value)


def test_for_claim__follows_override_settings():
    """The guard's cached ``(LEASE_SECONDS, retention horizon)`` is read again after a change."""
    before = taskguard_settings.for_claim
    with override_settings(TASKGUARD={"LEASE_SECONDS": 7, "PRUNE_AFTER_DAYS": 3}):
        assert taskguard_settings.for_claim == (7.0, timedelta(days=3))
    assert taskguard_settings.for_claim == before
