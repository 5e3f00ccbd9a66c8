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

import django
import pytest
from django.db import connections

from django_taskguard.logfields import EVENTS, FIELDS

from .support import ROOT
from .support.redis_server import RedisServer


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``celery_beat`` tests only where django-celery-beat cannot be installed.

    Its releases (2.9) require Django below 6.1; on older Django a missing
    django-celery-beat is a setup error, and those tests fail at import.
    """
    if find_spec("django_celery_beat") or django.VERSION < (6, 1):
        return
    skip = pytest.mark.skip(reason="django-celery-beat 2.9 requires Django < 6.1")
    for item in items:
        if "celery_beat" in item.keywords:
            item.add_marker(skip)


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


@pytest.fixture(params=["database", "redis"])
def lock_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Run the test with each lock backend: the database alone, and a private Redis.

    Yields the backend's name. Under "redis", TASKGUARD points at a fresh
    redis-server (with the default lease) for the whole test.
    """
    if request.param == "database":
        yield "database"
        return
    from .support.redis_support import redis_backend

    server = RedisServer(tmp_path / "lock-redis")
    server.start()
    try:
        with redis_backend(server, LEASE_SECONDS=30):
            yield "redis"
    finally:
        server.stop()
