"""The attempt's span is a child of a real Celery task's span (opentelemetry-instrumentation-
celery's ``CeleryInstrumentor``): eagerly, and in a worker consuming a private Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.exceptions import Ignore
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from django_taskguard import once_per_schedule, otel
from django_taskguard.contrib.celery import SCHEDULE_HEADER, SLOT_HEADER
from django_taskguard.models import RunState, TaskRun
from tests.support import celery_tasks
from tests.support.celery_app import app

from .support.otel import Recorded, attrs, runs_of, start
from .support.slots import BASE_SLOT
from .support.waiting import wait_for

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]
SLOT = BASE_SLOT + timedelta(hours=5)
HEADERS = {SLOT_HEADER: SLOT.isoformat(), SCHEDULE_HEADER: "otel"}


@pytest.fixture
def instrumented() -> Iterator[Recorded]:
    recorded = start()
    CeleryInstrumentor().instrument(tracer_provider=recorded.tracer_provider)
    try:
        yield recorded
    finally:
        CeleryInstrumentor().uninstrument()
        otel.uninstall()


def by_kind(recorded: Recorded) -> tuple[list[ReadableSpan], dict[int, ReadableSpan]]:
    """taskguard's spans (in order), and Celery's worker-side spans by span id."""
    spans = recorded.finished()
    ours = [s for s in spans if s.name.startswith("taskguard ")]
    runs = {s.context.span_id: s for s in spans if s.kind == SpanKind.CONSUMER}
    return ours, runs


def assert_children_of_celery_runs(recorded: Recorded, task: str) -> list[dict[str, Any]]:
    ours, runs = by_kind(recorded)
    for span in ours:
        assert span.parent is not None, f"{span.name} has no parent"
        carrier = runs[span.parent.span_id]
        assert carrier.name == f"run/{task}"
        assert carrier.context.trace_id == span.context.trace_id
        assert carrier.start_time <= span.start_time <= span.end_time <= carrier.end_time
    return [attrs(span) for span in ours]


def test_celery_eager__retries_are_one_span_each_under_their_task_span(instrumented, tmp_path):
    app.conf.task_always_eager = True
    try:
        result = celery_tasks.flaky.apply_async(
            kwargs={"log": str(tmp_path / "log")}, headers=HEADERS
        )
    finally:
        app.conf.task_always_eager = False
    assert result.get() == "finally"
    found = assert_children_of_celery_runs(instrumented, "tests.support.celery_tasks.flaky")
    assert [
        (a["taskguard.attempt"], a["taskguard.state"], a["taskguard.result"]) for a in found
    ] == [
        (1, "retrying", "failure"),
        (2, "retrying", "failure"),
        (3, "succeeded", "success"),
    ]
    assert {a["taskguard.run_id"] for a in found} == {TaskRun.objects.get().id}
    assert runs_of(instrumented, "tests.support.celery_tasks.flaky[otel]") == {
        "failure": 2,
        "success": 1,
    }
    # The lateness of a run is its first attempt's only.
    [lateness] = instrumented.points("taskguard.start.lateness").values()
    assert lateness.count == 1


@pytest.fixture
def worker_app(redis_server) -> Iterator[Celery]:
    """A Celery app on a private Redis, with a worker thread consuming it (the tests' shared
    tasks are registered on it too)."""
    redis_app = Celery(
        "tests-otel", broker=redis_server.url, include=["tests.support.celery_tasks"]
    )
    redis_app.conf.update(task_ignore_result=True, worker_hijack_root_logger=False)
    try:
        with start_worker(redis_app, pool="solo", perform_ping_check=False, shutdown_timeout=30):
            yield redis_app
    finally:
        # start_worker made its app the current and default one: the tests' app is again.
        app.set_current()
        app.set_default()


def test_celery_worker__the_span_is_a_child_of_the_worker_task_span(
    instrumented, worker_app, tmp_path
):
    flaky = worker_app.tasks["tests.support.celery_tasks.flaky"]
    flaky.apply_async(kwargs={"log": str(tmp_path / "log"), "failures": 1}, headers=HEADERS)
    wait_for(
        lambda: TaskRun.objects.filter(state=RunState.SUCCEEDED).exists(),
        timeout=60,
        what="the retried task to succeed in the worker",
    )
    wait_for(lambda: len(by_kind(instrumented)[0]) == 2, what="both attempts' spans")
    found = assert_children_of_celery_runs(instrumented, "tests.support.celery_tasks.flaky")
    assert [(a["taskguard.attempt"], a["taskguard.result"]) for a in found] == [
        (1, "failure"),
        (2, "success"),
    ]
    ours, _ = by_kind(instrumented)
    assert ours[0].status.status_code == StatusCode.ERROR
    assert [e.name for e in ours[0].events] == [
        "taskguard.running",
        "taskguard.retrying",
        "exception",
    ]


@app.task(bind=True, name="tests.otel.ignored")
@once_per_schedule()
def ignored(self: Any) -> None:
    raise Ignore()


def test_celery_eager__an_ignored_attempt_is_a_skip(instrumented):
    app.conf.task_always_eager = True
    try:
        ignored.apply_async(headers=HEADERS)
    finally:
        app.conf.task_always_eager = False
    [found] = assert_children_of_celery_runs(instrumented, "tests.otel.ignored")
    assert (found["taskguard.state"], found["taskguard.result"]) == ("skipped", "skip")
    assert "celery Ignore" in found["taskguard.reason"]
    assert TaskRun.objects.get().state == RunState.SKIPPED


@pytest.mark.file_and_server
@pytest.mark.processes
def test_celery_worker_process__the_span_is_a_child_of_the_worker_task_span(
    child_env, scratch, redis_server
):
    """A real prefork worker (its own processes): its spans are read from the line log."""
    span_log = scratch / "spans.jsonl"
    env = {
        **child_env,
        "TASKGUARD_TEST_BROKER_URL": redis_server.url,
        "TASKGUARD_TEST_SPAN_LOG": str(span_log),
    }
    worker = start_worker_process(env, scratch)
    try:
        previous, app.conf.broker_url = app.conf.broker_url, redis_server.url
        try:
            with app.connection_for_write() as connection:
                celery_tasks.flaky.apply_async(
                    kwargs={"log": str(scratch / "log"), "failures": 1},
                    headers=HEADERS,
                    connection=connection,
                )
        finally:
            app.conf.broker_url = previous

        def ours() -> list[dict[str, Any]]:
            lines = span_log.read_text().splitlines() if span_log.exists() else []
            return [json.loads(line) for line in lines]

        describe = lambda: (scratch / "worker.out").read_text(errors="replace")[-6000:]  # noqa: E731

        def both_with_carriers() -> bool:
            # A parent span ends (and is written) after its child: wait for the carriers too.
            spans = ours()
            ended = {s["context"]["span_id"] for s in spans}
            found = [s for s in spans if s["name"].startswith("taskguard ")]
            return len(found) == 2 and all(s["parent_id"] in ended for s in found)

        wait_for(
            both_with_carriers,
            timeout=90,
            what="both attempts' spans from the worker, and the worker task spans carrying them",
            describe=describe,
        )
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(30)
    spans = ours()
    runs = {s["context"]["span_id"]: s for s in spans if s["kind"] == "SpanKind.CONSUMER"}
    found = [s for s in spans if s["name"].startswith("taskguard ")]
    for span in found:
        carrier = runs[span["parent_id"]]
        assert carrier["name"] == "run/tests.support.celery_tasks.flaky"
        assert carrier["context"]["trace_id"] == span["context"]["trace_id"]
    said = [
        (s["attributes"]["taskguard.attempt"], s["attributes"]["taskguard.result"]) for s in found
    ]
    assert said == [(1, "failure"), (2, "success")]
    assert TaskRun.objects.get().state == RunState.SUCCEEDED


WORKER = [
    "worker",
    "-P",
    "prefork",
    "-c",
    "1",
    "--loglevel",
    "INFO",
    "--without-gossip",
    "--without-mingle",
]


def start_worker_process(env: dict[str, str], scratch: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "celery", "-A", "tests.support.otel_celery_app", *WORKER]
    with open(scratch / "worker.out", "ab") as out:
        return subprocess.Popen(
            [*command, "--without-heartbeat"],
            env=env,
            cwd=scratch,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
