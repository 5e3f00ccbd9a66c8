"""Which test runs where: one marker per test says on which databases it runs.

Every test carries exactly one of the *where* markers (a module's ``pytestmark`` or the test's
own; the test's own wins):

- ``pure``: the database cannot change its outcome (slot arithmetic, settings, text, imports):
  SQLite alone.
- ``dialect``: it runs the ledger's SQL, which differs per database: SQLite, PostgreSQL and
  MariaDB.
- ``server``: it needs a server database's concurrency (SQLite has one writer): PostgreSQL and
  MariaDB.
- ``file_and_server``: real processes whose outcome depends on how the database lets writers
  through (SQLite's one writer, a server's row locks), not on SQL that differs between the two
  servers (the in-process ``dialect`` tests prove MariaDB's SQL, test_mariadb.py its races):
  SQLite and PostgreSQL.
- ``once``: it barely depends on the database, or on PostgreSQL's own SQL (a Celery cluster,
  the browser, PL/pgSQL functions): PostgreSQL alone.

And the *how* markers say what must not run beside the in-process tests (``scripts/test.sh``
runs them after the rest, two at a time, one per core): ``processes`` (real processes,
signals), ``browser`` (a headless Chromium). Both make a test ``serial``. A test that starts a
process without one of them fails (:mod:`tests.support.spawning`).

A test without a *where* marker, or with two at one level, fails the collection with a
message naming it. ``docs/development.md`` says how to choose.
"""

from __future__ import annotations

import os

import pytest

WHERE: dict[str, frozenset[str]] = {
    "pure": frozenset({"sqlite"}),
    "dialect": frozenset({"sqlite", "postgres", "mariadb"}),
    "server": frozenset({"postgres", "mariadb"}),
    "file_and_server": frozenset({"sqlite", "postgres"}),
    "once": frozenset({"postgres"}),
}
SERIAL = ("processes", "browser")


def database() -> str:
    return os.environ.get("TASKGUARD_TEST_DB", "sqlite")


def where(item: pytest.Item) -> str:
    """The closest *where* marker of ``item`` (raises ValueError if none or two at a level)."""
    for node in item.listchain()[::-1]:
        found = {mark.name for mark in node.own_markers if mark.name in WHERE}
        if len(found) > 1:
            raise ValueError(f"{item.nodeid}: two where markers at one level: {sorted(found)}")
        if found:
            return found.pop()
    raise ValueError(
        f"{item.nodeid}: no where marker; give it (or its module's pytestmark) one of "
        f"{', '.join(WHERE)} (tests/support/selection.py; docs/development.md, 'Markers')"
    )


def select(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the tests meant for this database; mark the serial ones ``serial``."""
    kind = database()
    everywhere = os.environ.get("TASKGUARD_TEST_ANY_DATABASE") == "1"
    problems: list[str] = []
    kept: list[pytest.Item] = []
    left: list[pytest.Item] = []
    for item in items:
        try:
            name = where(item)
        except ValueError as error:
            problems.append(str(error))
            continue
        if any(item.get_closest_marker(m) for m in SERIAL):
            item.add_marker(pytest.mark.serial)
        (kept if everywhere or kind in WHERE[name] else left).append(item)
    if problems:
        raise pytest.UsageError("test selection:\n  " + "\n  ".join(problems))
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept
