"""OpenTelemetry spans and metrics, read back with the SDK's in-memory exporters.

The providers are the test's own, handed to ``otel.install`` (OpenTelemetry lets a process
set its global providers once): no other test sees them.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.db.models import F
from django.utils import timezone
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from django_taskguard import current_run, once_per_key, once_per_schedule, otel
from django_taskguard.cleanup import cleanup_locks
from django_taskguard.context import ActiveRun
from django_taskguard.exceptions import LeaseLost
from django_taskguard.locks.keys import key_digest
from django_taskguard.missed import sweep_missed
from django_taskguard.models import RunState, TaskRun
from django_taskguard.otel import spans
from django_taskguard.signals import checkin_failed, run_started, run_succeeded

from .support.runs import make_run
from .support.slots import BASE_SLOT
from .test_missed import every_second

pytestmark = pytest.mark.django_db(transaction=True)
SLOT = BASE_SLOT + timedelta(hours=3)
SETTINGS = {"traces": True, "metrics": True, "ledger_metrics": False, "key": "digest"}


@dataclass
class Recorded:
    tracer_provider: TracerProvider
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader

    def finished(self, name_part: str = "") -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if name_part in s.name]

    def points(self, name: str) -> dict[tuple[tuple[str, Any], ...], Any]:
        """The metric's data points by their sorted attributes."""
        data = self.metrics.get_metrics_data()
        found: dict[tuple[tuple[str, Any], ...], Any] = {}
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        for point in metric.data.data_points:
                            found[tuple(sorted(point.attributes.items()))] = point
        return found


def start(settings: dict[str, Any] | None = None) -> Recorded:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    otel.install(
        tracer_provider, MeterProvider(metric_readers=[reader]), {**SETTINGS, **(settings or {})}
    )
    return Recorded(tracer_provider, exporter, reader)


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    try:
        yield start()
    finally:
        otel.uninstall()


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def events(span: ReadableSpan) -> list[str]:
    return [event.name for event in span.events]


def runs_of(recorded: Recorded, task: str) -> dict[str, int]:
    return {
        dict(key)["taskguard.result"]: point.value
        for key, point in recorded.points("taskguard.runs").items()
        if dict(key)["taskguard.task"] == task
    }


def test_span__one_per_attempt_with_its_attributes_events_and_result(recorded):
    @once_per_schedule(name="tests.otel.ok")
    def body() -> str:
        return "done"

    assert body.run_for_slot(SLOT) == "done"
    assert body.run_for_slot(SLOT) is None  # a duplicate: no span, counted
    [span] = recorded.finished()
    row = TaskRun.objects.get()
    assert span.name == "taskguard tests.otel.ok"
    assert attrs(span) == {
        "taskguard.task": "tests.otel.ok",
        "taskguard.slot": SLOT.isoformat(),
        "taskguard.run_id": row.id,
        "taskguard.attempt": 1,
        "taskguard.fence": row.fence,
        "taskguard.owner": row.owner,
        "taskguard.state": "succeeded",
        "taskguard.result": "success",
    }
    assert events(span) == ["taskguard.running", "taskguard.succeeded"]
    assert span.status.status_code == StatusCode.UNSET
    assert span.parent is None  # nothing was current when it started
    assert runs_of(recorded, "tests.otel.ok") == {"success": 1}
    assert [p.value for p in recorded.points("taskguard.duplicates").values()] == [1]
    [duration] = recorded.points("taskguard.run.duration").values()
    assert duration.count == 1 and 0 <= duration.sum < span.end_time - span.start_time
    [lateness] = recorded.points("taskguard.start.lateness").values()
    assert lateness.count == 1 and lateness.sum >= (row.started_at - SLOT).total_seconds() - 1


def test_span__failure_is_an_error_with_the_exception(recorded):
    @once_per_schedule(name="tests.otel.fails")
    def body() -> None:
        raise ValueError("disk full")

    with pytest.raises(ValueError, match="disk full"):
        body.run_for_slot(SLOT)
    [span] = recorded.finished()
    assert attrs(span)["taskguard.result"] == "failure"
    assert attrs(span)["taskguard.state"] == "failed"
    assert attrs(span)["taskguard.reason"] == "ValueError: disk full"
    assert events(span) == ["taskguard.running", "taskguard.failed", "exception"]
    assert span.status.status_code == StatusCode.ERROR
    assert runs_of(recorded, "tests.otel.fails") == {"failure": 1}


def test_span__current_while_the_function_runs_so_user_spans_nest(recorded):
    user = recorded.tracer_provider.get_tracer("user code")

    @once_per_schedule(name="tests.otel.nest")
    def body() -> None:
        with user.start_as_current_span("user work"):
            pass

    @once_per_schedule(name="tests.otel.nest_async")
    async def async_body() -> None:
        with user.start_as_current_span("user async work"):
            await asyncio.sleep(0)

    async def called_from_a_span() -> None:
        with user.start_as_current_span("async caller"):
            await async_body.run_for_slot(SLOT)

    with user.start_as_current_span("caller"):
        body.run_for_slot(SLOT)
    asyncio.run(called_from_a_span())
    spans = {s.name: s for s in recorded.finished()}
    for caller, attempt, work in [
        ("caller", "nest", "user work"),
        ("async caller", "nest_async", "user async work"),
    ]:
        ours = spans[f"taskguard tests.otel.{attempt}"]
        assert ours.parent is not None and ours.parent.span_id == spans[caller].context.span_id
        assert spans[work].parent is not None
        assert spans[work].parent.span_id == ours.context.span_id
    # and nothing is left current after the call
    assert not trace.get_current_span().get_span_context().is_valid


def test_span__interrupted_attempt_is_abandoned(recorded):
    @once_per_schedule(name="tests.otel.interrupted")
    def body() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        body.run_for_slot(SLOT)
    [span] = recorded.finished()
    assert attrs(span)["taskguard.result"] == "abandoned"
    assert attrs(span)["taskguard.reason"] == "interrupted (KeyboardInterrupt)"
    assert span.status.status_code == StatusCode.ERROR


def test_span__lease_lost_when_fenced_out_is_a_timeout(recorded):
    @once_per_schedule(name="tests.otel.fenced")
    def body() -> str:
        # Another owner took the slot over meanwhile: the row's fence moved on.
        TaskRun.objects.filter(pk=current_run().id).update(fence=F("fence") + 1000)
        return "late"

    with pytest.raises(LeaseLost):
        body.run_for_slot(SLOT)
    [span] = recorded.finished()
    assert attrs(span)["taskguard.result"] == "timeout"
    assert attrs(span)["taskguard.state"] == "lease_lost"
    assert events(span) == ["taskguard.running", "taskguard.lease_lost"]
    assert span.status.status_code == StatusCode.ERROR
    assert runs_of(recorded, "tests.otel.fenced") == {"timeout": 1}


def test_span__keyed_run_has_the_key_digest_unless_plain(recorded):
    @once_per_key(name="tests.otel.keyed", key="order:{order}")
    def body(order: str) -> str:
        return order

    body("1")
    otel.install(recorded.tracer_provider, None, {**SETTINGS, "key": "plain"})
    body("2")
    first, second = recorded.finished()
    assert attrs(first)["taskguard.key"] == key_digest("order:1")
    assert attrs(second)["taskguard.key"] == "order:2"


def test_span__a_missed_slot_and_an_abandoned_run_get_a_short_span_each(recorded):
    task = "tests.otel.missed"
    every_second(task, 12)  # first seen 12 s ago, never fired
    sweep_missed()
    missed = recorded.finished("missed")
    slots = TaskRun.objects.filter(state=RunState.MISSED).values_list("slot", flat=True)
    assert sorted(attrs(s)["taskguard.slot"] for s in missed) == sorted(
        s.isoformat() for s in slots
    )
    assert len(slots) >= 5
    assert {attrs(s)["taskguard.result"] for s in missed} == {"missed"}
    assert runs_of(recorded, task) == {"missed": len(slots)}

    stale = make_run("tests.otel.dead")
    assert cleanup_locks().stale_runs == 1
    [abandoned] = recorded.finished("abandoned")
    assert attrs(abandoned)["taskguard.run_id"] == stale.id
    assert attrs(abandoned)["taskguard.result"] == "abandoned"
    assert abandoned.status.status_code == StatusCode.ERROR


def test_metrics__checkin_failures_counted_by_service(recorded):
    checkin_failed.send(sender="sentry", service="sentry", event="start", error="timed out")
    [(key, point)] = recorded.points("taskguard.checkin.failures").items()
    assert dict(key) == {"taskguard.service": "sentry", "taskguard.event": "start"}
    assert point.value == 1


def test_off__traces_off_counts_and_makes_no_span():
    recorded = start({"traces": False})
    try:

        @once_per_schedule(name="tests.otel.untraced")
        def body() -> None:
            return None

        body.run_for_slot(SLOT)
    finally:
        otel.uninstall()
    assert recorded.finished() == []
    assert runs_of(recorded, "tests.otel.untraced") == {"success": 1}
    body.run_for_slot(SLOT + timedelta(hours=1))  # uninstalled: nothing more
    assert runs_of(recorded, "tests.otel.untraced") == {"success": 1}


def test_ledger_metrics__gauges_mirror_the_ledger(recorded):
    otel.uninstall()
    recorded = start({"ledger_metrics": True})
    hour_ago = timezone.now().replace(microsecond=0) - timedelta(hours=1)
    make_run("tests.otel.ledger", state=RunState.SUCCEEDED, slot=hour_ago)
    make_run("tests.otel.ledger", state=RunState.MISSED, slot=hour_ago + timedelta(minutes=1))
    points = recorded.points("taskguard.ledger.runs")
    assert {dict(k)["taskguard.state"]: p.value for k, p in points.items()} == {
        "succeeded": 1,
        "missed": 1,
    }
    [missed] = recorded.points("taskguard.ledger.missed").values()
    assert missed.value == 1
    [window] = recorded.points("taskguard.ledger.window").values()
    assert window.value == 24 * 3600


def orphan(task: str, run_id: int) -> ActiveRun:
    return ActiveRun(run_id, task, SLOT, attempt=1, fence=run_id, owner="h:1:t", lease_seconds=30)


def test_span__an_attempt_whose_end_was_never_signalled_ends_when_it_is_dropped(recorded):
    """The database failed while the end was recorded: no end signal; the span ends as the
    attempt's ``ActiveRun`` goes away, result ``error``."""
    run = orphan("tests.otel.orphan", 41)
    run_started.send(sender=run.task_name, run=run)
    assert recorded.finished() == []
    del run
    gc.collect()
    [span] = recorded.finished()
    assert attrs(span)["taskguard.result"] == "error"
    assert span.status.status_code == StatusCode.ERROR
    assert runs_of(recorded, "tests.otel.orphan") == {"error": 1}


def test_span__open_spans_are_bounded(recorded, monkeypatch, caplog):
    monkeypatch.setattr(spans, "MAX_OPEN", 2)
    runs = [orphan("tests.otel.bounded", n) for n in range(3)]
    for run in runs:
        run_started.send(sender=run.task_name, run=run)
    assert "attempts have an open span; no more" in caplog.text
    for run in runs:
        run_succeeded.send(sender=run.task_name, run=run, result=None)
    assert [attrs(s)["taskguard.run_id"] for s in recorded.finished()] == [0, 1]


def test_span__ended_once_when_a_late_end_follows_the_lease_loss(recorded):
    run = orphan("tests.otel.once", 7)
    run_started.send(sender=run.task_name, run=run)
    run.mark_lost("fenced out")
    run_succeeded.send(sender=run.task_name, run=run, result=None)
    [span] = recorded.finished()
    assert attrs(span)["taskguard.result"] == "timeout"
    assert attrs(span)["taskguard.reason"] == "fenced out"
    assert runs_of(recorded, "tests.otel.once") == {"timeout": 1}


def test_off__nothing_imported_and_nothing_connected():
    """With OPENTELEMETRY off (the test settings), a guarded call imports no opentelemetry."""
    code = (
        "import sys, django; django.setup()\n"
        "import django_taskguard.apps\n"
        "from django_taskguard import signals\n"
        "assert not signals.run_started.has_listeners(), 'a run_started receiver is connected'\n"
        "found = sorted(m for m in sys.modules if m.partition('.')[0] == 'opentelemetry')\n"
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


def test_span__an_attempt_given_back_before_its_function_is_a_skip(recorded):
    def refuse(sender: str, **kwargs: Any) -> None:
        raise RuntimeError("not now")

    ran = []

    @once_per_schedule(name="tests.otel.given_back")
    def body() -> None:
        ran.append(1)

    run_started.connect(refuse, sender="tests.otel.given_back")  # after otel's receiver
    try:
        with pytest.raises(RuntimeError, match="not now"):
            body.run_for_slot(SLOT)
    finally:
        run_started.disconnect(refuse, sender="tests.otel.given_back")
    assert ran == []
    [span] = recorded.finished()
    assert attrs(span)["taskguard.result"] == "skip"
    assert attrs(span)["taskguard.state"] == "pending"  # the row is back where its claim found it
    assert "not now" in attrs(span)["taskguard.reason"]
    assert span.status.status_code == StatusCode.UNSET


class Broken(SpanProcessor):
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        raise RuntimeError("a broken span processor")


def test_span__a_failing_tracer_never_fails_the_task(recorded, caplog):
    recorded.tracer_provider.add_span_processor(Broken())

    @once_per_schedule(name="tests.otel.broken")
    def body() -> str:
        return "ran"

    assert body.run_for_slot(SLOT) == "ran"
    assert TaskRun.objects.get().state == RunState.SUCCEEDED
    assert "OpenTelemetry receiver started failed" in caplog.text
