"""A database without taskguard's tables (``migrate`` not run) is said to be that, not
"unreachable": the commands say to run ``manage.py migrate``, ``check_schedules`` exits 3
(not 2, "database down"), and ``check --deploy --database`` warns about unapplied migrations."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from django_taskguard import health, ledger
from django_taskguard.exceptions import NotMigrated

from .support import ROOT

pytestmark = pytest.mark.dialect

# An existing database with no taskguard tables: a new SQLite file, or PostgreSQL's own
# maintenance database "postgres" (only read: every query fails before touching anything).
KINDS = {"sqlite": None, "postgres": "postgres"}


def manage(
    kind: str, tmp_path: Path, *args: str, name: str | None = None
) -> subprocess.CompletedProcess[str]:
    name = name or KINDS[kind] or str(tmp_path / "never-migrated.sqlite3")
    env = {
        **os.environ,
        "TASKGUARD_TEST_DB": kind,
        "TASKGUARD_TEST_DB_NAME": name,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
    }
    return subprocess.run(
        [sys.executable, "-m", "django", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.file_and_server
@pytest.mark.processes
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_check_schedules__not_migrated_says_run_migrate_and_exits_3(kind, tmp_path):
    done = manage(kind, tmp_path, "check_schedules")
    assert done.returncode == 3, done.stderr
    assert "unreachable" not in done.stderr
    assert "taskguard's tables are not in database 'default'" in done.stderr, done.stderr
    assert "run: manage.py migrate taskguard --database default" in done.stderr


@pytest.mark.file_and_server
@pytest.mark.processes
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_cleanup_locks__not_migrated_says_run_migrate(kind, tmp_path):
    done = manage(kind, tmp_path, "cleanup_locks")
    assert done.returncode == 1, done.stderr
    assert "run: manage.py migrate taskguard --database default" in done.stderr, done.stderr


@pytest.mark.file_and_server
@pytest.mark.processes
def test_check_deploy__unapplied_migrations_warned_not_by_migrate_itself(tmp_path):
    done = manage("sqlite", tmp_path, "check", "--deploy", "--database", "default")
    assert "taskguard.W014" in done.stderr, done.stderr
    assert "run: manage.py migrate taskguard --database default" in done.stderr
    migrated = manage("sqlite", tmp_path, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    assert "taskguard.W014" not in migrated.stderr + migrated.stdout
    done = manage("sqlite", tmp_path, "check", "--deploy", "--database", "default")
    assert "taskguard" not in done.stderr, done.stderr


KEYED_CALL = """
from django_taskguard import once_per_key

@once_per_key(key="order:{n}", name="tests.old.charge")
def charge(n):
    return n

charge(1)
"""


@pytest.fixture
def old_database(kind: str, tmp_path: Path) -> Iterator[str]:
    """A database migrated to an older taskguard (0007: no ``TaskRun.key`` yet)."""
    if kind == "sqlite":
        yield str(tmp_path / "old.sqlite3")
        return
    import psycopg

    name = f"taskguard_old_{os.getpid()}"
    with psycopg.connect(host="127.0.0.1", user="postgres", dbname="postgres") as admin:
        admin.autocommit = True
        admin.execute(f"DROP DATABASE IF EXISTS {name}")
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield name
    finally:
        with psycopg.connect(host="127.0.0.1", user="postgres", dbname="postgres") as admin:
            admin.autocommit = True
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.mark.file_and_server
@pytest.mark.processes
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_keyed_call__older_migration_says_run_migrate_not_unreachable(kind, tmp_path, old_database):
    migrated = manage(kind, tmp_path, "migrate", "taskguard", "0007", name=old_database)
    assert migrated.returncode == 0, migrated.stderr
    done = manage(kind, tmp_path, "shell", "-c", KEYED_CALL, name=old_database)
    assert done.returncode != 0
    assert "unreachable" not in done.stderr, done.stderr
    said = "NotMigrated: 'tests.old.charge' did not run: taskguard's tables are not in database"
    assert said in done.stderr, done.stderr
    assert "run: manage.py migrate taskguard --database default" in done.stderr


SLOT_CALL = """
from datetime import timedelta
from django.utils import timezone
from django_taskguard import once_per_schedule

@once_per_schedule(name="tests.old.report")
def report():
    return 1

report.run_for_slot(timezone.now().replace(second=0, microsecond=0) - timedelta(hours=1))
"""


@pytest.mark.file_and_server
@pytest.mark.processes
@pytest.mark.parametrize("kind", ["postgres"])
def test_call__database_before_the_functions_says_run_migrate(kind, tmp_path, old_database):
    """PostgreSQL migrated to 0012: no ``taskguard_claim_v1`` (ledger/functions.py) yet."""
    migrated = manage(kind, tmp_path, "migrate", "taskguard", "0012", name=old_database)
    assert migrated.returncode == 0, migrated.stderr
    done = manage(kind, tmp_path, "shell", "-c", SLOT_CALL, name=old_database)
    assert done.returncode != 0
    said = "NotMigrated: 'tests.old.report' did not run: taskguard's tables are not in database"
    assert said in done.stderr, done.stderr


@pytest.mark.django_db
@pytest.mark.parametrize(
    "statement",
    [
        "SELECT 1 FROM taskguard_nowhere",
        "SELECT nowhere FROM taskguard_taskrun",
        "SELECT r.nowhere FROM taskguard_taskrun r",
        "INSERT INTO taskguard_taskrun (nowhere) VALUES (1)",
    ],
)
def test_not_migrated__by_the_drivers_error_code_on_this_database(statement):
    """The test database's own driver (``TASKGUARD_TEST_DB``: SQLite, PostgreSQL, MariaDB)."""
    with pytest.raises(DatabaseError) as raised, connection.cursor() as cursor:
        cursor.execute(statement)
    assert ledger.core.not_migrated(raised.value), raised.value
    assert isinstance(ledger.unreachable(raised.value), NotMigrated)


@pytest.mark.django_db
def test_not_migrated__other_errors_are_not():
    with pytest.raises(DatabaseError) as raised, connection.cursor() as cursor:
        cursor.execute("SELECT * FROM taskguard_taskrun WHERE")  # a syntax error
    assert not ledger.core.not_migrated(raised.value)


def _ledger_tables_away() -> None:
    """The runs and transitions tables renamed inside the caller's savepoint, put back by
    its rollback."""
    with connection.cursor() as cursor:
        for table in ("taskguard_taskrun", "taskguard_taskruntransition"):
            cursor.execute(f"ALTER TABLE {table} RENAME TO {table}_away")


# Maintenance reads and writes (and the overlap check before an attempt's function starts)
# that once let the driver's DatabaseError through.
MAINTENANCE = {
    "earlier_slot_running": lambda: ledger.earlier_slot_running("t", timezone.now()),
    "health.check": lambda: health.check(),
    "last_transition": lambda: ledger.last_transition(1),
    "count_prunable": lambda: ledger.count_prunable(timezone.now()),
    "prunable_ids": lambda: ledger.prunable_ids(timezone.now(), 0, 10),
    "delete_finished": lambda: ledger.delete_finished([1], timezone.now()),
    "task_names": lambda: ledger.task_names(None),
}


@pytest.mark.django_db
@pytest.mark.parametrize("call", sorted(MAINTENANCE))
def test_maintenance__a_database_error_comes_out_as_ours(call):
    """A real failure (the ledger's tables gone, in a savepoint rolled back after): the
    maintenance function raises NotMigrated (a BackendUnavailable), not the driver's error."""
    if connection.vendor == "mysql":
        pytest.skip("MariaDB commits DDL: the table could not be put back by a rollback")
    with pytest.raises(NotMigrated) as raised, transaction.atomic():
        _ledger_tables_away()
        MAINTENANCE[call]()
    assert isinstance(raised.value.__cause__, DatabaseError)
    assert ledger.task_names(None) == []  # the table is back


@pytest.mark.django_db
def test_prune_runs__a_database_error_is_said_once_with_what_to_do():
    if connection.vendor == "mysql":
        pytest.skip("MariaDB commits DDL: the table could not be put back by a rollback")
    with pytest.raises(CommandError) as raised, transaction.atomic():
        _ledger_tables_away()
        call_command("prune_runs", stdout=StringIO())
    assert "run: manage.py migrate taskguard --database default" in str(raised.value)
    assert isinstance(raised.value.__cause__, NotMigrated)
