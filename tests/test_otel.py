"""OpenTelemetry spans and metrics, read back with the SDK's in-memory exporters.

The providers are the test's own, handed to ``otel.install`` (OpenTelemetry lets a process
set its global providers once): no other test sees them.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections
from django.db.models import F
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.trace import StatusCode

from django_taskguard import current_run, once_per_key, once_per_schedule, otel
from django_taskguard.cleanup import cleanup_locks
from django_taskguard.context import ActiveRun
from django_taskguard.exceptions import LeaseLost
from django_taskguard.locks.keys import key_digest
from django_taskguard.missed import sweep_missed
from django_taskguard.models import RunState, TaskRun
from django_taskguard.otel import spans
from django_taskguard.signals import run_started, run_succeeded

from .support.otel import SETTINGS, Recorded, attrs, events, recording, runs_of
from .support.runs import make_run
from .support.slots import BASE_SLOT
from .test_missed import every_second

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]
SLOT = BASE_SLOT + timedelta(hours=3)


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    with recording() as found:
        yield found


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
        "taskguard.duplicates": 0,  # the duplicate came after the end
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


def test_span__carries_the_rows_duplicates_as_they_stand_at_its_end(recorded):
    """Two calls of the slot made (from other threads) while the winner runs are
    suppressed: the winner's finished span says the row's count at its end, 2.

    Regression (issue 33): the span had no ``taskguard.duplicates``."""
    losers: list[object] = []

    def lose() -> None:
        try:
            losers.append(body.run_for_slot(SLOT))
        finally:
            connections.close_all()

    @once_per_schedule(name="tests.otel.dup")
    def body() -> str:
        for _ in range(2):
            thread = threading.Thread(target=lose)
            thread.start()
            thread.join(timeout=60)
        return "done"

    assert body.run_for_slot(SLOT) == "done"
    assert losers == [None, None]
    [span] = recorded.finished()
    assert TaskRun.objects.get().duplicates == 2
    assert attrs(span)["taskguard.duplicates"] == 2


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
