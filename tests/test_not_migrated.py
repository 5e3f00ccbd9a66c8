"""A database without taskguard's tables (``migrate`` not run) is said to be that, not
"unreachable": the commands say to run ``manage.py migrate``, ``check_schedules`` exits 3
(not 2, "database down"), and ``check --deploy --database`` warns about unapplied migrations."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

# An existing database with no taskguard tables: a new SQLite file, or PostgreSQL's own
# maintenance database "postgres" (only read: every query fails before touching anything).
KINDS = {"sqlite": None, "postgres": "postgres"}


def manage(kind: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    name = KINDS[kind] or str(tmp_path / "never-migrated.sqlite3")
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


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_check_schedules__not_migrated_says_run_migrate_and_exits_3(kind, tmp_path):
    done = manage(kind, tmp_path, "check_schedules")
    assert done.returncode == 3, done.stderr
    assert "unreachable" not in done.stderr
    assert "taskguard's tables are not in database 'default'" in done.stderr, done.stderr
    assert "run: manage.py migrate taskguard --database default" in done.stderr


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_cleanup_locks__not_migrated_says_run_migrate(kind, tmp_path):
    done = manage(kind, tmp_path, "cleanup_locks")
    assert done.returncode == 1, done.stderr
    assert "run: manage.py migrate taskguard --database default" in done.stderr, done.stderr


def test_check_deploy__unapplied_migrations_warned_not_by_migrate_itself(tmp_path):
    done = manage("sqlite", tmp_path, "check", "--deploy", "--database", "default")
    assert "taskguard.W014" in done.stderr, done.stderr
    assert "run: manage.py migrate taskguard --database default" in done.stderr
    migrated = manage("sqlite", tmp_path, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    assert "taskguard.W014" not in migrated.stderr + migrated.stdout
    done = manage("sqlite", tmp_path, "check", "--deploy", "--database", "default")
    assert "taskguard" not in done.stderr, done.stderr
