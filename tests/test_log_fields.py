"""Every taskguard log record carries the stable ``extra`` fields; docs/logging.md shows them.

The JSON lines of docs/logging.md are read here: real code paths (a Redis that stops, a
lease taken over, a stale run cleaned up, a sweep, a duplicate call, ...) are driven and
their records, formatted by python-json-logger, must have the same keys, event names,
levels, loggers and filled fields as the documented line of their event. Every logger
call of the package is also checked statically, whatever its level.
"""

from __future__ import annotations

import ast
import io
import itertools
import json
import logging
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db.models import F
from django.test import override_settings
from django.utils import timezone
from pythonjsonlogger.json import JsonFormatter

from django_taskguard import current_run, ledger, once_per_key, once_per_schedule, registry
from django_taskguard.exceptions import LeaseLost
from django_taskguard.locks.keys import key_digest
from django_taskguard.logfields import EVENTS, FIELDS, log_fields
from django_taskguard.missed import sweep_missed
from django_taskguard.models import TaskRun, TaskSchedule
from django_taskguard.owner import Owner, pid_space
from django_taskguard.signal_handlers import run_startup_cleanup

from .support import ROOT
from .support.checkin_setup import running_checkins
from .support.monitoring import schedule
from .support.proc import BASE_SLOT
from .support.redis_support import redis_backend
from .support.runs import make_run
from .support.waiting import wait_for

pytestmark = pytest.mark.dialect

DOC = ROOT / "docs" / "logging.md"
PACKAGE = ROOT / "django_taskguard"
FORMAT = "%(levelname)s %(name)s %(message)s"  # the docs' formatter (plus the extra fields)
LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical", "log"}
SECOND = timedelta(seconds=1)

Lines = Callable[[], list[dict[str, Any]]]


def documented_lines() -> list[dict[str, Any]]:
    """The JSON lines of docs/logging.md's ```json blocks, one object a line."""
    lines, inside = [], False
    for text in DOC.read_text().splitlines():
        if text.startswith("```"):
            inside = text.strip() == "```json"
            continue
        if inside and text.strip():
            lines.append(json.loads(text))
    return lines


DOCUMENTED = {line["event"]: line for line in documented_lines()}


def documented_events_in_table() -> set[str]:
    """The event names of the docs' event table (the first column of "## Events")."""
    section = DOC.read_text().split("\n## Events\n")[1].split("\n## ")[0]
    return {
        row.split("|")[1].strip().strip("`")
        for row in section.splitlines()
        if row.startswith("| `")
    }


def filled(line: dict[str, Any]) -> set[str]:
    return {name for name in FIELDS if line[name] is not None}


def assert_as_documented(lines: list[dict[str, Any]], event: str) -> dict[str, Any]:
    """The first line of ``event``: same keys, level, logger and filled fields as the docs'."""
    produced = [line for line in lines if line["event"] == event]
    assert produced, f"no {event} record among {[line['event'] for line in lines]}"
    line, doc = produced[0], DOCUMENTED[event]
    assert line.keys() == doc.keys()
    assert (line["levelname"], line["name"]) == (doc["levelname"], doc["name"]), line
    assert filled(line) == filled(doc), (line, doc)
    return line


@pytest.fixture
def json_log() -> Iterator[Lines]:
    """Every taskguard record of the test, at every level, as python-json-logger's lines."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(FORMAT))
    logger = logging.getLogger("taskguard")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield lambda: [json.loads(text) for text in stream.getvalue().splitlines()]
        import os

        if os.environ.get("DUMP"):
            with open(os.environ["DUMP"], "a") as f:
                f.write(stream.getvalue())
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# -- the docs and the code agree ------------------------------------------------------


def test_log_fields__the_docs_show_one_line_per_event_and_table_every_event():
    lines = documented_lines()
    assert [line["event"] for line in lines] == sorted(DOCUMENTED), "one line per event"
    assert set(DOCUMENTED) == EVENTS
    assert documented_events_in_table() == EVENTS
    for line in lines:
        assert list(line) == ["levelname", "name", "message", *FIELDS], line
        assert line["name"].split(".")[0] == "taskguard", line


def test_log_fields__no_field_is_a_log_record_attribute():
    reserved = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
    assert not reserved & set(FIELDS)
    record = logging.getLogger("taskguard.test").makeRecord(
        "taskguard.test", logging.INFO, __file__, 1, "m", (), None,
        extra=log_fields("run.duplicate"),
    )  # fmt: skip
    assert {name: getattr(record, name) for name in FIELDS}["event"] == "run.duplicate"


def test_log_fields__slot_iso_key_digested_reason_bounded():
    fields = log_fields(
        "run.duplicate", slot=BASE_SLOT, key="customer 42", reason="x" * 5000, state="succeeded"
    )
    assert list(fields) == list(FIELDS)
    assert fields["slot"] == BASE_SLOT.isoformat()
    assert fields["key"] != "customer 42" and len(fields["key"]) == 32
    assert len(fields["reason"]) == 2000


def _logger_calls(tree: ast.AST) -> Iterator[ast.Call]:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in LOG_METHODS
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "logger"
        ):
            yield node


def _event_names(node: ast.expr) -> list[str]:
    """The event literal(s) of an ``extra=`` built by ``logfields.log_fields`` or a helper
    named ``*log_fields`` that calls it; [] if it is not one."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return []
    if not node.func.id.endswith("log_fields") or not node.args:
        return []
    first = node.args[0]
    options = [first.body, first.orelse] if isinstance(first, ast.IfExp) else [first]
    names = [o.value for o in options if isinstance(o, ast.Constant)]
    return names if len(names) == len(options) else []


def test_log_fields__every_logger_call_of_the_package_passes_a_declared_event():
    """Static: a logger call at any level (DEBUG ones are never emitted in the suite)."""
    calls, used, wrong = 0, set(), []
    for path in sorted(PACKAGE.rglob("*.py")):
        for call in _logger_calls(ast.parse(path.read_text(), str(path))):
            calls += 1
            extra = [k.value for k in call.keywords if k.arg == "extra"]
            names = _event_names(extra[0]) if extra else []
            used.update(names)
            if not names or not set(names) <= EVENTS:
                wrong.append(f"{path.relative_to(ROOT)}:{call.lineno} {names}")
    assert calls >= 100
    assert wrong == []
    assert used == EVENTS, "an event no call logs any more stays documented"


# -- the real paths ------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_log_fields__duplicate_call(json_log):
    @once_per_schedule(name="tests.logs.duplicate")
    def body() -> int:
        return 1

    assert body.run_for_slot(BASE_SLOT) == 1
    assert body.run_for_slot(BASE_SLOT) is None
    line = assert_as_documented(json_log(), "run.duplicate")
    assert line["task"] == "tests.logs.duplicate" and line["slot"] == BASE_SLOT.isoformat()
    assert line["state"] == "succeeded"


@pytest.mark.django_db(transaction=True)
def test_log_fields__lease_taken_over(json_log):
    """Another process takes the run over (a larger fence, its owner): the finish is
    refused, the attempt learns it lost its lease."""

    @once_per_schedule(name="tests.logs.taken", lease_seconds=30)
    def body() -> int:
        run = current_run()
        TaskRun.objects.filter(pk=run.id).update(
            fence=F("fence") + 1000, owner="otherhost:2:cafe", attempt=2
        )
        return 1

    with pytest.raises(LeaseLost):
        body.run_for_slot(BASE_SLOT)
    run = TaskRun.objects.get()
    line = assert_as_documented(json_log(), "lease.lost")
    assert (line["task"], line["run_id"], line["attempt"]) == ("tests.logs.taken", run.id, 1)
    assert line["fence"] == run.fence - 1000 and line["owner"] != "otherhost:2:cafe"


@pytest.mark.django_db(transaction=True)
def test_log_fields__taken_over_while_raising(json_log):
    """Taken over, then the body raises: its end is not recorded (the new owner's is)."""

    @once_per_schedule(name="tests.logs.taken_raising", lease_seconds=30)
    def body() -> None:
        TaskRun.objects.filter(pk=current_run().id).update(fence=F("fence") + 1000)
        raise ValueError("disk full")

    with pytest.raises(ValueError, match="disk full"):
        body.run_for_slot(BASE_SLOT)
    line = assert_as_documented(json_log(), "run.taken_over")
    assert (line["task"], line["state"]) == ("tests.logs.taken_raising", "failed")


@pytest.mark.django_db(transaction=True)
def test_log_fields__a_keyed_result_that_is_not_json_logs_the_key_digest(json_log):
    @once_per_key(key="customer:{number}", name="tests.logs.keyed", return_result=True)
    def body(number: int) -> object:
        return object()

    body(42)
    line = assert_as_documented(json_log(), "result.not_json")
    assert line["key"] == key_digest("customer:42")
    assert "customer:42" not in {line[name] for name in FIELDS}


@pytest.mark.django_db(transaction=True)
def test_log_fields__paused_after_failures(json_log):
    name = "tests.logs.failing"

    @once_per_schedule(every=SECOND, name=name, pause_after_failures=2)
    def failing() -> None:
        raise RuntimeError("boom")

    try:
        registry.sync()
        for n in range(2):
            with pytest.raises(RuntimeError):
                failing.run_for_slot(BASE_SLOT + n * SECOND)
    finally:
        registry.unregister(name)
    line = assert_as_documented(json_log(), "task.paused")
    assert line["task"] == name and "2 failures in a row" in line["reason"]


@pytest.mark.django_db(transaction=True)
def test_log_fields__stale_run_abandoned_by_cleanup_locks(json_log):
    stale = make_run("tests.logs.stale", owner="otherhost:9:dead")
    call_command("cleanup_locks", stdout=io.StringIO())
    line = assert_as_documented(json_log(), "run.abandoned")
    assert (line["run_id"], line["state"], line["owner"]) == (
        stale.pk,
        "abandoned",
        "otherhost:9:dead",
    )
    assert line["slot"] == stale.slot.isoformat() and "expired" in line["reason"]


@pytest.mark.file_and_server
@pytest.mark.processes
@pytest.mark.django_db(transaction=True)
def test_log_fields__startup_cleanup_of_a_dead_process(json_log):
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = Owner(socket.gethostname(), int(gone.stdout), pid_space(), "aa").format()
    make_run("tests.logs.dead", owner=dead, lease=3600)
    with override_settings(TASKGUARD={**settings.TASKGUARD, "STARTUP_CLEANUP": True}):
        run_startup_cleanup()
    lines = json_log()
    assert_as_documented(lines, "cleanup.startup")
    assert assert_as_documented(lines, "run.abandoned")["owner"] == dead


@pytest.mark.django_db(transaction=True)
def test_log_fields__missed_slots_swept(json_log):
    first = ledger.database_now().replace(microsecond=0) - 12 * SECOND
    schedule("tests.logs.sweep", every=SECOND, grace=2 * SECOND, first_seen=first)
    sweep_missed()
    line = assert_as_documented(json_log(), "sweep.missed")
    assert (line["task"], line["state"]) == ("tests.logs.sweep", "missed")


@pytest.mark.django_db(transaction=True)
def test_log_fields__redis_outage_and_return(json_log, redis_server):
    """A private redis-server stopped: calls decide on the database (ON_REDIS_ERROR
    "database"), the outage logged once; started again, the next probe says so."""
    slots = (BASE_SLOT + n * SECOND for n in itertools.count())

    @once_per_schedule(name="tests.logs.redis")
    def body() -> int:
        return 1

    def events() -> set[str]:
        return {line["event"] for line in json_log()}

    with redis_backend(redis_server):
        assert body.run_for_slot(next(slots)) == 1
        redis_server.stop()
        assert body.run_for_slot(next(slots)) == 1
        assert "redis.unavailable" in events()
        redis_server.start()
        wait_for(lambda: body.run_for_slot(next(slots)) and "redis.available" in events())
    lines = json_log()
    assert_as_documented(lines, "redis.unavailable")
    assert_as_documented(lines, "redis.available")


@pytest.mark.django_db(transaction=True)
def test_log_fields__run_schedules_once(json_log):
    name = "tests.logs.fired"

    @once_per_schedule(name=name, every=SECOND)
    def tick() -> int:
        return 1

    try:
        registry.sync()
        TaskSchedule.objects.filter(task_name=name).update(
            first_seen=timezone.now() - timedelta(minutes=2), swept_until=None
        )
        call_command("run_schedules", "--once", "--task", name, verbosity=0)
    finally:
        registry.unregister(name)
    lines = json_log()
    for event in ("scheduler.started", "scheduler.once_done"):
        assert_as_documented(lines, event)
    assert assert_as_documented(lines, "scheduler.fired")["task"] == name
    registry.sync(mark_removed=True)  # the schedule is no longer declared by the code
    assert assert_as_documented(json_log(), "schedule.removed")["task"] == name


@pytest.mark.django_db(transaction=True)
def test_log_fields__a_check_in_the_service_refuses(json_log):
    """A local webhook endpoint answers 500: the check-in fails after its tries, logged with
    the run it was about."""
    with running_checkins() as kit:
        kit.receiver.set_mode("webhook", "500")

        @once_per_schedule(every=timedelta(hours=1), name="tests.logs.checkin")
        def refused() -> str:
            return "done"

        assert refused.run_for_slot(BASE_SLOT) == "done"
        kit.settle()
    failed = [line for line in json_log() if line["event"] == "checkin.failed"]
    line = assert_as_documented(failed, "checkin.failed")
    assert (line["task"], line["slot"]) == ("tests.logs.checkin", BASE_SLOT.isoformat())
    assert {row["state"] for row in failed} == {"running", "succeeded"}
    assert line["run_id"] == TaskRun.objects.get().pk and "HTTP 500" in line["reason"]
