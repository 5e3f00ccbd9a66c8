"""OpenTelemetry metrics (the live ones and the ledger's gauges), what is installed at
startup, and that nothing is imported when it is off."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.apps import apps as django_apps
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_taskguard import figures, once_per_schedule, otel
from django_taskguard.models import RunState
from django_taskguard.signals import checkin_failed

from .support.otel import Recorded, recording, runs_of
from .support.runs import make_run
from .test_otel import SLOT

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    with recording() as found:
        yield found


def test_metrics__checkin_failures_counted_by_service(recorded):
    checkin_failed.send(sender="sentry", service="sentry", event="start", error="timed out")
    [(key, point)] = recorded.points("taskguard.checkin.failures").items()
    assert dict(key) == {"taskguard.service": "sentry", "taskguard.event": "start"}
    assert point.value == 1


def test_off__traces_off_counts_and_makes_no_span():
    @once_per_schedule(name="tests.otel.untraced")
    def body() -> None:
        return None

    with recording({"traces": False}) as recorded:
        body.run_for_slot(SLOT)
    assert recorded.finished() == []
    assert runs_of(recorded, "tests.otel.untraced") == {"success": 1}
    body.run_for_slot(SLOT + timedelta(hours=1))  # uninstalled: nothing more
    assert runs_of(recorded, "tests.otel.untraced") == {"success": 1}


def test_ledger_metrics__gauges_mirror_the_ledger():
    hour_ago = timezone.now().replace(microsecond=0) - timedelta(hours=1)
    make_run("tests.otel.ledger", state=RunState.SUCCEEDED, slot=hour_ago)
    make_run("tests.otel.ledger", state=RunState.MISSED, slot=hour_ago + timedelta(minutes=1))
    with recording({"ledger_metrics": True}) as recorded, CaptureQueriesContext(connection) as read:
        points = recorded.points("taskguard.ledger.runs")
        missed = recorded.points("taskguard.ledger.missed")
        window = recorded.points("taskguard.ledger.window")
    assert {dict(k)["taskguard.state"]: p.value for k, p in points.items()} == {
        "succeeded": 1,
        "missed": 1,
    }
    assert [p.value for p in missed.values()] == [1]
    assert [p.value for p in window.values()] == [24 * 3600]
    # Three collections of nine gauges, within the reuse time: the ledger was read once
    # (the Prometheus collector's statements, not one reading per gauge).
    with CaptureQueriesContext(connection) as once:
        figures.read()
    assert 0 < len(read.captured_queries) == len(once.captured_queries)


@pytest.mark.file_and_server
@pytest.mark.processes
def test_off__nothing_imported():
    """With OPENTELEMETRY off (the test settings): Django's setup, the core's modules and a
    decorated function import no opentelemetry, and not ``django_taskguard.otel``. Judged by
    who imports: redis-py 8 imports the OpenTelemetry SDK itself when it is installed."""
    code = (
        "import builtins, sys\n"
        "ours = []\n"
        "real = builtins.__import__\n"
        "def watched(name, globals=None, *args, **kwargs):\n"
        "    module = (globals or {}).get('__name__') or ''\n"
        "    mine = module.startswith('django_taskguard')\n"
        "    if mine and name.partition('.')[0] == 'opentelemetry':\n"
        "        ours.append((module, name))\n"
        "    return real(name, globals, *args, **kwargs)\n"
        "builtins.__import__ = watched\n"
        "import django; django.setup()\n"
        "from django_taskguard import coroutines, figures, guard, keyed, once_per_schedule\n"
        "from django_taskguard.contrib.celery import worker\n"
        "once_per_schedule(name='tests.otel.off')(lambda: None)\n"
        "found = ours + [m for m in sys.modules if m.startswith('django_taskguard.otel')]\n"
        "assert found == [], found\n"
        "print('clean')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.strip() == "clean", done.stderr


def test_startup__ready_installs_what_the_setting_asks():
    """``AppConfig.ready`` installs the receivers when ``OPENTELEMETRY`` turns something on
    (the global providers: the API's no-op ones here), and not when it is off or invalid."""
    config = django_apps.get_app_config("taskguard")
    try:
        for value, installed in [(False, False), ("yes", False), ({"traces": False}, True)]:
            otel.uninstall()
            with override_settings(TASKGUARD={"OPENTELEMETRY": value}):
                config.ready()
            assert (otel.installed() is not None) is installed, value
    finally:
        otel.uninstall()


def test_startup__without_opentelemetry_api_names_the_extra(monkeypatch):
    from django_taskguard import apps as taskguard_apps

    real = taskguard_apps.find_spec
    monkeypatch.setattr(
        taskguard_apps, "find_spec", lambda name: None if name == "opentelemetry" else real(name)
    )
    missing = pytest.raises(ImproperlyConfigured, match=r"django-taskguard\[otel\]")
    with override_settings(TASKGUARD={"OPENTELEMETRY": True}), missing:
        taskguard_apps._opentelemetry_wanted()
    with override_settings(TASKGUARD={"OPENTELEMETRY": False}):
        assert taskguard_apps._opentelemetry_wanted() is False
