"""Shared fixtures: the test database for child processes, and private Redis servers.

Every Redis the suite talks to is started on a free port (``support/redis_server.py``),
so a developer's own Redis (or the machine's shared one) is never touched. What the
tests import (servers, children, job modules, ``wait_for``) lives in ``tests/support/``.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import django
import pytest
from django.db import connections

from django_taskguard.logfields import EVENTS, FIELDS

from .support import ROOT, emptying, selection, spawning
from .support import browser as browsers
from .support.redis_server import RedisServer


def pytest_configure(config: pytest.Config) -> None:
    emptying.install()  # empty the tables between transactional tests, not Django's flush
    spawning.install()  # a test that starts a process carries the marker "processes"


@pytest.hookimpl(tryfirst=True)  # before -m reads the markers: select adds "serial"
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the tests meant for this database (tests/support/selection.py), and skip
    ``celery_beat`` tests only where django-celery-beat cannot be installed.

    Its releases (2.9) require Django below 6.1; on older Django a missing
    django-celery-beat is a setup error, and those tests fail at import.
    """
    selection.select(config, items)
    if find_spec("django_celery_beat") or django.VERSION < (6, 1):
        return
    skip = pytest.mark.skip(reason="django-celery-beat 2.9 requires Django < 6.1")
    for item in items:
        if "celery_beat" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``TASKGUARD_TEST_TIMES=FILE``: each phase's seconds appended as it ends (where a
    pass's time goes, even for a run stopped half-way; docs/development.md, "CI time")."""
    path = os.environ.get("TASKGUARD_TEST_TIMES")
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):  # xdist's controller writes it
        with open(path, "a") as out:
            out.write(f"{report.duration:.2f}\t{report.when}\t{report.nodeid}\n")


def pytest_runtest_setup(item: pytest.Item) -> None:
    spawning.begin(item)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    problem = spawning.end(item)
    if problem is None:
        return
    report = os.environ.get("TASKGUARD_TEST_SPAWN_REPORT")
    if report:  # a survey of which tests start processes, not a verdict
        with open(report, "a") as out:
            out.write(item.nodeid + "\n")
        return
    pytest.fail(problem, pytrace=False)


@pytest.fixture(autouse=True, scope="session")
def _no_automatic_upkeep() -> None:
    """No upkeep thread in the test process (tests that override TASKGUARD get the
    default interval): tests/test_upkeep.py turns it on where it tests it."""
    from django_taskguard import upkeep

    upkeep.forget(off=True)


class FieldsGuard(logging.Handler):
    """Notes each ``taskguard`` record that lacks a field of ``logfields.FIELDS`` or whose
    ``event`` is not one of ``logfields.EVENTS`` (what docs/logging.md promises)."""

    def __init__(self) -> None:
        super().__init__()
        self.lacking: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        missing = [name for name in FIELDS if name not in record.__dict__]
        event = record.__dict__.get("event")
        if missing or event not in EVENTS:
            where = f"{record.name} at {record.pathname}:{record.lineno}"
            self.lacking.append(f"{where} {record.msg!r}: missing {missing}, event {event!r}")


FIELDS_GUARD = FieldsGuard()


@pytest.fixture(autouse=True)
def _log_fields_guard() -> Iterator[None]:
    """Fail the test during which a taskguard record without the stable fields was logged.

    It sees the records the suite's logging levels let through (WARNING and up, the
    scheduler's INFO, and what a test's ``caplog`` turns on); tests/test_log_fields.py
    checks every logger call of the package statically, whatever its level.
    """
    logger = logging.getLogger("taskguard")
    if FIELDS_GUARD not in logger.handlers:  # a LOGGING dictConfig replaces handlers
        logger.addHandler(FIELDS_GUARD)
    FIELDS_GUARD.lacking.clear()
    yield
    lacking, FIELDS_GUARD.lacking = FIELDS_GUARD.lacking, []
    if lacking:
        pytest.fail("taskguard records without their extra fields:\n" + "\n".join(lacking))


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh private Redis for one test."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def child_env(transactional_db: None) -> dict[str, str]:
    """Environment for real child processes that must use this test's database."""
    env = dict(os.environ)
    env["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["TASKGUARD_TEST_DB_NAME"] = str(connections["default"].settings_dict["NAME"])
    env["TASKGUARD_TEST_LEDGER_DB_NAME"] = str(connections["ledger"].settings_dict["NAME"])
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="taskguard-") as directory:
        yield Path(directory)


@pytest.fixture(scope="session")
def shared_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One private Redis for the session (each xdist worker has its own), for tests that
    never stop, kill or pause it: emptied (``FLUSHALL``) before each test that takes it."""
    server = RedisServer(tmp_path_factory.mktemp("shared-redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["database", "redis"])
def lock_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test with each lock backend: the database alone, and a private Redis.

    Yields the backend's name. Under "redis", TASKGUARD points at the session's private
    redis-server (emptied first, with the default lease) for the whole test: no test given
    only the backend's name can stop or kill it.
    """
    if request.param == "database":
        yield "database"
        return
    from .support.redis_support import redis_backend

    server: RedisServer = request.getfixturevalue("shared_redis")
    server.client().flushall()
    with redis_backend(server, LEASE_SECONDS=30):
        yield "redis"


@pytest.fixture(scope="session")
def chromium() -> Iterator[object]:
    """One headless Chromium for the session (each start took seconds)."""
    yield from browsers.chromium()


@pytest.fixture
def browser(chromium: Any) -> Iterator[object]:
    """The session's Chromium as a new one would be: signed out, at its first size."""
    yield from browsers.browser(chromium)
