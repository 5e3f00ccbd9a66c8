"""What is MariaDB's own: both isolation levels under the race, no deadlocks, the clock
read as UTC, binary comparison of names and keys, the sequence of fences, the check.

Runs with ``TASKGUARD_TEST_DB=mariadb`` (a private server, ``tests/support/mariadb_server.py``);
the check's version rule is tested everywhere.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

import pytest
from django.core import checks
from django.db import OperationalError, connection

from django_taskguard import current_run, ledger, once_per_schedule
from django_taskguard.ledger import backends
from django_taskguard.models import RunState, TaskRun

from .support.children import python
from .support.slots import BASE_SLOT
from .support.waiting import wait_for
from .test_race import race_each_slot_once

pytestmark = pytest.mark.dialect

mariadb_only = pytest.mark.skipif(connection.vendor != "mysql", reason="MariaDB's own SQL")
SLOT = datetime(2030, 1, 1, tzinfo=dt_timezone.utc)


def deadlocks() -> int:
    """The server's count of deadlocks InnoDB detected (and broke) since it started."""
    with connection.cursor() as cursor:
        cursor.execute("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'")
        return int(cursor.fetchone()[1])  # type: ignore[index]


@contextmanager
def locked_elsewhere(run_id: int) -> Iterator[None]:
    """The run's row locked ``FOR UPDATE`` by another connection while the block runs."""
    import MySQLdb

    params = connection.settings_dict
    other = MySQLdb.connect(
        host=params["HOST"], port=int(params["PORT"]), user=params["USER"], db=params["NAME"]
    )
    try:
        cursor = other.cursor()
        cursor.execute("START TRANSACTION")
        cursor.execute("SELECT id FROM taskguard_taskrun WHERE id = %s FOR UPDATE", [run_id])
        yield
        other.rollback()
    finally:
        other.close()


def child_isolation(env: dict[str, str]) -> str:
    """The isolation level a child process's connection runs at, asked of the server."""
    code = (
        "import django; django.setup(); from django.db import connection\n"
        "with connection.cursor() as c:\n"
        "    c.execute('SELECT @@session.tx_isolation'); print(c.fetchone()[0])"
    )
    done = subprocess.run([python(), "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@mariadb_only
@pytest.mark.processes
@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_race__each_slot_once_and_no_deadlock_at_either_isolation_level(
    child_env, scratch, isolation
):
    """Django's READ COMMITTED and InnoDB's own REPEATABLE READ (gap locks): the claim's
    upsert locks the row it finds exclusively at once, so racers queue on it instead of
    deadlocking; InnoDB's count of deadlocks does not move."""
    env = {**child_env, "TASKGUARD_TEST_MARIADB_ISOLATION": isolation}
    assert child_isolation(env) == isolation.upper().replace(" ", "-")
    before = deadlocks()
    race_each_slot_once(env, scratch / "executions.log", f"tests.mariadb.{isolation[:6]}")
    assert deadlocks() == before


@mariadb_only
@pytest.mark.django_db(transaction=True)
def test_clock__leases_are_judged_in_utc_whatever_the_session_time_zone():
    """The test server's zone is +05:30: a lease read on ``NOW()`` would be 5.5 h off."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT TIMESTAMPDIFF(MINUTE, UTC_TIMESTAMP(), NOW())")
        assert cursor.fetchone()[0] == 330  # type: ignore[index]
    skew = abs((ledger.database_now() - datetime.now(dt_timezone.utc)).total_seconds())
    assert skew < 60
    row = ledger.claim("tests.mariadb.clock", SLOT, "h:1:a", 30, abandon_is_final=True)
    assert row.lease_left is not None and 25 <= row.lease_left <= 30.5
    assert TaskRun.objects.live().filter(pk=row.id).exists()
    TaskRun.objects.filter(pk=row.id).update(
        lease_until=datetime.now(dt_timezone.utc) - timedelta(seconds=5)
    )
    assert TaskRun.objects.stale().filter(pk=row.id).exists()
    assert ledger.read("tests.mariadb.clock", SLOT).expired  # type: ignore[union-attr]


@mariadb_only
@pytest.mark.django_db(transaction=True)
def test_collation__names_and_keys_that_differ_in_case_or_trailing_space_are_distinct():
    """The database's collation is case-insensitive (utf8mb4_unicode_ci); the ledger's
    tables compare bytes, as PostgreSQL does."""
    owners = iter(f"h:1:{n}" for n in range(10))
    for name in ("tests.mariadb.Case", "tests.mariadb.case", "tests.mariadb.case "):
        won = ledger.claim(name, SLOT, owner := next(owners), 30, abandon_is_final=True)
        assert won.owner == owner, name
    for key in ("k", "K", "k "):
        won = ledger.claim(
            "tests.mariadb.keys", SLOT, owner := next(owners), 30, abandon_is_final=True, key=key
        )
        assert won.owner == owner, repr(key)
    assert TaskRun.objects.filter(task_name__startswith="tests.mariadb.").count() == 6


@mariadb_only
@pytest.mark.django_db(transaction=True)
def test_charset__keys_and_names_outside_latin1_on_a_latin1_database():
    """Many servers default to latin1: the tables are utf8mb4 (migration 0009), and the
    compound statement's variables must say so too, or such a key fails to be read."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT @@character_set_database, DATABASE()")
        charset, name = cursor.fetchone()
        cursor.execute(f"ALTER DATABASE `{name}` CHARACTER SET latin1")
    connection.close()  # the next statements see the database's new default
    try:
        for n, key in enumerate(("order:日本", "emoji:🎉", "é")):
            won = ledger.claim(
                "tests.mariadb.日本", SLOT, f"h:1:{n}", 30, abandon_is_final=True, key=key
            )
            assert won.owner == f"h:1:{n}"
            assert (
                ledger.claim(
                    "tests.mariadb.日本", SLOT, f"h:2:{n}", 30, abandon_is_final=True, key=key
                ).owner
                == f"h:1:{n}"
            )  # the second claim finds the first one's row
        keys = TaskRun.objects.filter(task_name="tests.mariadb.日本").values_list("key", flat=True)
        assert sorted(keys) == sorted(["order:日本", "emoji:🎉", "é"])
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER DATABASE `{name}` CHARACTER SET {charset}")
        connection.close()


@mariadb_only
@pytest.mark.django_db(transaction=True)
def test_fences__come_from_a_sequence_that_never_goes_back():
    first = ledger.claim("tests.mariadb.fence", SLOT, "h:1:a", 30, abandon_is_final=True)
    assert first.fence is not None
    ledger.fence_at_least(first.fence + 1000)
    second = ledger.claim(
        "tests.mariadb.fence", SLOT + timedelta(minutes=1), "h:1:b", 30, abandon_is_final=True
    )
    assert second.fence is not None and second.fence > first.fence + 1000
    ledger.fence_at_least(1)  # lower: ignored
    TaskRun.objects.all().delete()  # retention deletes the newest rows: no matter
    third = ledger.claim(
        "tests.mariadb.fence", SLOT + timedelta(minutes=2), "h:1:c", 30, abandon_is_final=True
    )
    assert third.fence is not None and third.fence > second.fence


@mariadb_only
@pytest.mark.django_db(transaction=True)
def test_claim__one_compound_statement_commits_the_row_and_its_transition_or_neither():
    """In autocommit the claim is one ``BEGIN NOT ATOMIC`` statement with a transaction of
    its own: a transition the database refuses takes the run row back with it, and the
    connection is left in autocommit, in no transaction."""
    refuse = (
        "CREATE TRIGGER taskguard_test_refuse BEFORE INSERT ON taskguard_taskruntransition "
        "FOR EACH ROW SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by test trigger'"
    )
    with connection.cursor() as cursor:
        cursor.execute(refuse)
    try:
        with pytest.raises(OperationalError, match="refused by test trigger"):
            ledger.claim("tests.mariadb.block", SLOT, "h:1:a", 30, abandon_is_final=True)
        with connection.cursor() as cursor:
            cursor.execute("SELECT @@autocommit, @@in_transaction")
            assert cursor.fetchone() == (1, 0)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER IF EXISTS taskguard_test_refuse")
    assert not TaskRun.objects.filter(task_name="tests.mariadb.block").exists()
    row = ledger.claim("tests.mariadb.block", SLOT, "h:1:a", 30, abandon_is_final=True)
    assert row.owner == "h:1:a"
    assert TaskRun.objects.get(pk=row.id).transitions.count() == 1


@mariadb_only
@pytest.mark.timeout(30)  # unbounded, InnoDB's own lock wait (50 s) would end it
@pytest.mark.django_db(transaction=True)
def test_renew__a_bounded_renewal_gives_up_on_a_row_locked_elsewhere():
    """``SET STATEMENT max_statement_time=...`` bounds the renewal's wait for a lock held
    by another connection: the database's error comes back, the row is left as it was."""
    row = ledger.claim("tests.mariadb.renew", SLOT, "h:1:a", 30, abandon_is_final=True)
    with locked_elsewhere(row.id):
        with pytest.raises(OperationalError) as raised:
            ledger.renew(row.id, row.fence, 600, timeout_seconds=0.5)  # type: ignore[arg-type]
        # 1969: max_statement_time exceeded; 1205: the lock wait timeout (1 s) came first.
        assert raised.value.args[0] in (1969, 1205), raised.value
    assert ledger.renew(row.id, row.fence, 600, timeout_seconds=0.5) is not None  # type: ignore[arg-type]


@mariadb_only
@pytest.mark.django_db(transaction=True)
def test_database_lost_mid_run__every_connection_killed_the_run_is_still_recorded():
    """``KILL CONNECTION`` of every connection of the run while its body runs (its own,
    the heartbeat's): the renewals reconnect, and the finish, whose compound statement
    meets this thread's dead connection, settles it and records the result once."""
    import MySQLdb

    @once_per_schedule(name="tests.mariadb.lost", lease_seconds=3)
    def body() -> str:
        run = current_run()
        first = lease_until(run.id)
        wait_for(lambda: lease_until(run.id) > first, 10, "a first renewal")
        params = connection.settings_dict
        killer = MySQLdb.connect(
            host=params["HOST"],
            port=int(params["PORT"]),
            user=params["USER"],
            db=params["NAME"],
            autocommit=True,
        )
        try:
            cursor = killer.cursor()
            cursor.execute(
                "SELECT id FROM information_schema.PROCESSLIST "
                "WHERE db = DATABASE() AND id <> CONNECTION_ID()"
            )
            victims = [victim for (victim,) in cursor.fetchall()]
            assert len(victims) >= 2, victims  # this thread's and the heartbeat's
            for victim in victims:
                cursor.execute("KILL CONNECTION %s", [victim])

            def lease() -> datetime:  # read here: this thread's own connection is dead
                cursor.execute("SELECT lease_until FROM taskguard_taskrun WHERE id = %s", [run.id])
                return cursor.fetchone()[0]  # type: ignore[no-any-return,index]

            killed_at = lease()
            wait_for(lambda: lease() > killed_at, 10, "a renewal after the kill")
        finally:
            killer.close()
        run.check()
        return "ran"

    assert body.run_for_slot(BASE_SLOT) == "ran"
    run = TaskRun.objects.get(task_name="tests.mariadb.lost")
    assert (run.state, run.attempt) == (RunState.SUCCEEDED, 1)
    assert [t.to_state for t in run.transitions.order_by("id")] == ["running", "succeeded"]


def lease_until(run_id: int) -> datetime:
    value = TaskRun.objects.filter(pk=run_id).values_list("lease_until", flat=True).get()
    assert value is not None
    return value


@mariadb_only
@pytest.mark.timeout(60)
@pytest.mark.django_db(transaction=True)
def test_claim__a_lock_wait_timeout_is_a_clear_error_not_a_contention_retry():
    """MariaDB's driver raises OperationalError for a lock wait timeout too: the caller
    gets the server's error, not three rounds of read-backs and a wrong verdict."""
    from django_taskguard.exceptions import BackendUnavailable

    ran = []

    @once_per_schedule(name="tests.mariadb.locked")
    def locked() -> None:
        ran.append(1)

    row = ledger.claim("tests.mariadb.locked", BASE_SLOT, "h:1:a", 30, abandon_is_final=True)
    with locked_elsewhere(row.id):
        with connection.cursor() as ours:  # InnoDB's wait is 50 s by default
            ours.execute("SET SESSION innodb_lock_wait_timeout = 1")
        with pytest.raises(BackendUnavailable, match="Lock wait timeout"):
            locked.run_for_slot(BASE_SLOT)
    assert not ran
    assert TaskRun.objects.get(id=row.id).owner == "h:1:a"


@mariadb_only
@pytest.mark.django_db
def test_check__the_private_server_passes_the_database_check():
    found = checks.run_checks(databases=["default"], tags=[checks.Tags.database])
    assert [m.id for m in found if m.id and m.id.startswith("taskguard.")] == []


@pytest.mark.parametrize(
    ("is_mariadb", "version", "problem"),
    [
        (True, (10, 11, 19), None),
        (True, (11, 4, 2), None),
        (True, (10, 6, 18), "MariaDB 10.6.18 is too old"),
        (False, (8, 0, 36), "MySQL 8.0.36 is not supported"),
    ],
)
def test_mysql_problem__mariadb_10_11_or_later_only(is_mariadb, version, problem):
    found = backends.mysql_problem(is_mariadb, version)
    if problem is None:
        assert found is None
    else:
        assert found is not None and found.startswith(problem)
