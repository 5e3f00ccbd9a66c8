"""The ledger on MariaDB (Django's vendor "mysql").

No ``UPDATE ... RETURNING`` and no data-modifying CTEs: a change is an ``UPDATE`` and a
read of the row it changed under its lock, a claim ``INSERT ... ON DUPLICATE KEY
UPDATE``; with their transitions they are one compound statement with a transaction of
its own (:data:`BLOCK`), or, inside the caller's transaction, separate statements. Its
clock is ``UTC_TIMESTAMP(6)`` (Django stores UTC there, whatever the session's time zone).
Fences come from a MariaDB SEQUENCE (migration 0009).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property, lru_cache
from typing import Any

from django.db import IntegrityError, InterfaceError, transaction

from .base import Backend, Values, one, placeholders
from .fragments import (
    CLAIM_STATES,
    CLAIMED_COLUMNS,
    CLAIMED_VALUES,
    FENCE_SEQUENCE,
    FIRST_START,
    RUN,
    TRANSITION_ROW,
    Sets,
    counts_duplicate,
)

# The oldest MariaDB the ledger runs on (INSERT/DELETE ... RETURNING, sequences: 10.5 and
# 10.3; 10.11 is the oldest long-term release still maintained, and the one tested).
MARIADB_MINIMUM = (10, 11)

# MariaDB errors after which a write's outcome is unknown or was rolled back whole, so
# reading the row back decides: server gone (2006), connection lost mid-query (2013,
# 2055), connection killed (1927), cannot connect (2002, 2003), deadlock (1213: InnoDB
# rolled the transaction back).
MARIADB_CUT_OFF = frozenset({2002, 2003, 2006, 2013, 2055, 1927, 1213})


def mysql_problem(is_mariadb: bool, version: tuple[int, ...]) -> str | None:
    """MariaDB older than :data:`MARIADB_MINIMUM`, or MySQL (no sequences, no RETURNING)."""
    found, minimum = ".".join(map(str, version)), ".".join(map(str, MARIADB_MINIMUM))
    if not is_mariadb:
        return (
            f"MySQL {found} is not supported: the ledger needs MariaDB {minimum} or later "
            f"(sequences, INSERT ... RETURNING)"
        )
    if tuple(version[:2]) < MARIADB_MINIMUM:
        return f"MariaDB {found} is too old: the ledger needs MariaDB {minimum} or later"
    return None


def upsert(keyed: bool) -> str:
    """The claim: ON DUPLICATE KEY UPDATE (its bare column names are the existing row's),
    with the claim's parameters. It takes the row's lock (exclusive) at once when it finds
    the row: no shared lock to upgrade, so no deadlock between claimers.

    Keyed: ON DUPLICATE KEY UPDATE meets any unique key, so a (task, slot) collision finds
    another key's row: it is left as it is (the CASE asks for this key) and returned with
    its key, which :meth:`MariaDBBackend.refuse_another_keys_row` compares (and then the
    claim takes the next microsecond).
    """
    key_column, key_value = ("{key}, ", "%(key)s, ") if keyed else ("", "")
    mine = "{key} <=> VALUES({key})" if keyed else "TRUE"
    return (
        f"INSERT INTO {{run}} (task_name, slot, {key_column}{CLAIMED_COLUMNS}) "
        f"VALUES (%(task)s, %(slot)s, {key_value}{CLAIMED_VALUES}) ON DUPLICATE KEY UPDATE "
        f"duplicates = duplicates + CASE WHEN ({mine}) AND ({counts_duplicate(row='')}) "
        "THEN 1 ELSE 0 END"
    )


# MariaDB in one round trip, as PostgreSQL's data-modifying CTEs are: an anonymous
# compound statement that runs a write and its transitions in a transaction of its own,
# rolls back and re-raises on any error, and only then returns the row (read into
# variables under the row's lock; all NULL when nothing was written). Only on a
# connection in autocommit: START TRANSACTION inside the caller's transaction would
# commit it.
BLOCK = (
    "BEGIN NOT ATOMIC "
    # The text variables say their character set: undeclared, they take the database's
    # default (latin1 on many servers), and a key outside it would fail to be read.
    "DECLARE v_id, v_attempt, v_fence BIGINT; "
    "DECLARE v_state VARCHAR(16) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin; "
    "DECLARE v_owner, v_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin; "
    "DECLARE v_lease DATETIME(6); "
    "DECLARE v_left DECIMAL(30, 6); "
    "DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END; "
    "START TRANSACTION; {body} COMMIT; "
    "SELECT v_id, v_state, v_attempt, v_fence, v_owner, v_lease, v_left, v_key; END"
)
INTO = "INTO v_id, v_state, v_attempt, v_fence, v_owner, v_lease, v_left, v_key"
# After an upsert: the row it inserted or found (ON DUPLICATE KEY UPDATE ... id =
# LAST_INSERT_ID(id) makes LAST_INSERT_ID() name it either way), and its ``claimed``
# transition when this call made it (the row's owner is the claim's).
CLAIMED_ROW = (
    "; SELECT {row}, {left}, {key} " + INTO + " FROM {run} WHERE id = LAST_INSERT_ID(); "
    "IF v_owner = %(owner)s THEN INSERT INTO {transition} ({columns}) "
    "VALUES (v_id, %(pending)s, %(running)s, {now}, 'claimed', v_owner); END IF;"
)


def block(body: str) -> str:
    return BLOCK.format(body=body)


def block_values(values: Values | None) -> Values | None:
    """The row a compound statement returned (all NULL: it wrote nothing), as a claim or
    change returns it."""
    return None if values is None or values[0] is None else values[:7]


class MariaDBBackend(Backend):
    vendor = "mysql"
    returns_from_update = False
    has_compound_statements = True
    checks_foreign_keys_per_statement = True
    upsert_meets_any_unique_key = True

    now = "UTC_TIMESTAMP(6)"
    lease_after = "UTC_TIMESTAMP(6) + INTERVAL CAST({seconds} AS DECIMAL(20, 6)) SECOND"
    seconds_ago = "UTC_TIMESTAMP(6) - INTERVAL CAST(%s AS DECIMAL(20, 6)) SECOND"
    lease_left = "TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), lease_until) / 1000000"
    # A MariaDB SEQUENCE (migration 0009): not transactional, never goes back.
    next_fence = f"NEXTVAL({FENCE_SEQUENCE})"
    duration = "TIMESTAMPDIFF(MICROSECOND, started_at, finished_at) / 1000000"
    lateness = "TIMESTAMPDIFF(MICROSECOND, slot, started_at) / 1000000"
    key = "`key`"
    min_slot = "'1000-01-01'"
    # Probe (task_name, state, slot) for a task's latest run in a state. Left to itself it
    # scans the task's (task_name, slot) range backwards for that state, every run of the
    # task when none is in it (178 ms against 1 ms for 100 tasks of 2,000 runs).
    task_state_hint = "FORCE INDEX (taskguard_run_task_state) "
    # INSERT IGNORE returns no row for a row it left alone. It would also turn a bad value
    # into a warning; these rows' values are all checked before.
    insert_new = "INSERT IGNORE INTO "
    # MariaDB's SETVAL ignores a value below the sequence's: it never goes back.
    fence_at_least_statement = f"SELECT SETVAL({FENCE_SEQUENCE}, %s)"

    def unless_there(self, target: str) -> str:
        return ""

    def server_problem(self, connection: Any) -> str | None:
        """Django's "mysql" is MariaDB or MySQL: the server says which (it connects, once
        per connection object)."""
        return mysql_problem(bool(connection.mysql_is_mariadb), tuple(connection.mysql_version))

    def connection_lost(self, exc: Exception) -> bool:
        """Only the errors of :data:`MARIADB_CUT_OFF`: its driver raises
        ``OperationalError`` for real errors too (a value the column refuses, a lock wait
        or statement timeout)."""
        number = exc.args[0] if exc.args else None
        return isinstance(exc, InterfaceError) or number in MARIADB_CUT_OFF

    def in_autocommit(self, connection: Any) -> bool:
        """In no transaction: a compound statement may open and commit one of its own."""
        return not connection.in_atomic_block and connection.get_autocommit()

    # -- claiming ----------------------------------------------------------------------

    @cached_property
    def claim_statement(self) -> str:
        return self.format(upsert(keyed=False) + " RETURNING {row}, {left}")

    @cached_property
    def claim_key_statement(self) -> str:
        return self.format(upsert(keyed=True) + " RETURNING {row}, {left}, {key}")

    @lru_cache  # noqa: B019 (one backend per database, for the process's life)
    def claim_block(self, keyed: bool) -> str:
        """The claim and its ``claimed`` transition in one round trip (the claim's
        parameters). Returns the row and its key (another key's row when the slot
        collided)."""
        claimed = upsert(keyed) + ", id = LAST_INSERT_ID(id)"
        return self.format(block(claimed + CLAIMED_ROW))

    def claim(self, connection: Any, params: Mapping[str, Any]) -> Values | None:
        if self.in_autocommit(connection):
            found = one(connection, self.claim_block(False), {**params, **CLAIM_STATES})
            return block_values(found)
        return super().claim(connection, params)

    def claim_key(self, connection: Any, params: Mapping[str, Any]) -> Values | None:
        if self.in_autocommit(connection):
            found = one(connection, self.claim_block(True), {**params, **CLAIM_STATES})
            self.refuse_another_keys_row(found, params["key"])
            return block_values(found)
        with transaction.atomic(using=connection.alias):
            found = one(connection, self.claim_key_statement, {**params, **CLAIM_STATES})
            self.refuse_another_keys_row(found, params["key"])
            self.log_claimed(connection, found, params["owner"])
        return found

    @staticmethod
    def refuse_another_keys_row(found: Values | None, key: str) -> None:
        """An upsert that met another key's row on (task, slot) changed nothing and returned
        that row: raised as the (task, slot) conflict it is."""
        if found is not None and found[7] != key:
            raise IntegrityError("the slot is another key's")

    # -- changing a row ----------------------------------------------------------------

    @lru_cache  # noqa: B019
    def change_block(self, sets: Sets, fenced: bool, lease: str, retry_by: bool, steps: int) -> str:
        """:meth:`update` and its ``steps`` transition rows in one round trip.

        Parameters: the update's, the id again, then (id, from, to, reason, actor) per
        step. The row comes back without its lease left.
        """
        update = self.update(sets, fenced, lease, retry_by)
        values = ", ".join([TRANSITION_ROW] * steps)
        return self.format(
            block(
                f"{update}; IF ROW_COUNT() > 0 THEN SELECT {{row}}, NULL, NULL {INTO} "
                f"FROM {{run}} WHERE id = %s; INSERT INTO {{transition}} ({{columns}}) "
                f"VALUES {values}; END IF;"
            )
        )

    def change(
        self,
        connection: Any,
        update: tuple[Sets, bool, str, bool],
        params: Sequence[Any],
        run_id: int,
        steps: Sequence[tuple[str, str, str]],
        actor: str,
    ) -> Values | None:
        if not self.in_autocommit(connection):
            return super().change(connection, update, params, run_id, steps, actor)
        statement = self.change_block(*update, len(steps))
        step_params = [p for f, t, r in steps for p in (run_id, f, t, r, actor)]
        return block_values(one(connection, statement, [*params, run_id, *step_params]))

    # -- renewing ----------------------------------------------------------------------

    @lru_cache  # noqa: B019
    def renew_bounded(self, milliseconds: int) -> str:
        """The renewal bounded by the statement's own ``SET STATEMENT ... FOR``:
        max_statement_time ends the statement, its waits for locks included; the lock wait
        timeout counts whole seconds (at least one)."""
        ms = int(milliseconds)  # a number, never text: safe to write into the statement
        return (
            f"SET STATEMENT max_statement_time = {ms / 1000:.3f}, "
            f"innodb_lock_wait_timeout = {max(1, -(-ms // 1000))} FOR {self.renew_statement}"
        )

    @cached_property
    def lease_of(self) -> str:
        return self.format("SELECT lease_until FROM {run} WHERE id = %s")

    def renew(
        self, connection: Any, params: Mapping[str, Any], milliseconds: int | None
    ) -> Values | None:
        """No ``RETURNING``: the lease is read back in the renewal's transaction."""
        statement = (
            self.renew_statement if milliseconds is None else self.renew_bounded(milliseconds)
        )
        with transaction.atomic(using=connection.alias):
            with connection.cursor() as cursor:
                cursor.execute(statement, params)
                renewed = cursor.rowcount > 0
            return one(connection, self.lease_of, [params["id"]]) if renewed else None

    # -- deleting runs -----------------------------------------------------------------

    def delete_runs_where(self, where: str) -> str:
        """Foreign keys are checked at each statement: a run cannot go before its
        transitions. Its row is locked and returned instead, to be deleted after them."""
        return f"SELECT id FROM {RUN} WHERE {where} FOR UPDATE"

    def delete_locked_runs(self, cursor: Any, ids: list[int]) -> None:
        cursor.execute(f"DELETE FROM {RUN} WHERE id IN ({placeholders(len(ids))})", ids)

    # -- reads -------------------------------------------------------------------------

    def task_names(self, limited: bool = True) -> str:
        """MariaDB runs the recursive CTE slowly (each hop a scan) but does the loose scan
        itself for ``DISTINCT`` ("Using index for group-by")."""
        limit = " LIMIT %s" if limited else ""
        return f"SELECT DISTINCT task_name FROM {RUN} ORDER BY task_name{limit}"

    def last_ended(self, failed: bool) -> str:
        """MariaDB cannot see the outer task in a derived table: "the last N ended runs" is
        the ended runs from the N-th latest one's slot on (slots are unique per task).
        Parameters: the ended states, N less one, the ended states again."""
        not_succeeded = " AND r.state <> %s" if failed else ""
        return (
            "(SELECT COUNT(*) FROM {run} r WHERE r.task_name = t.name AND r.slot >= "
            "COALESCE((SELECT q.slot FROM {run} q WHERE q.task_name = t.name AND q.state IN "
            "(%s, %s, %s) ORDER BY q.slot DESC LIMIT 1 OFFSET %s), {min_slot}) AND "
            + self.ENDED
            + not_succeeded
            + ")"
        )

    def last_ended_params(self, ended: tuple[str, ...], last: int) -> list[Any]:
        return [*ended, last - 1, *ended]

    def late_starts(self) -> str:
        """As :meth:`last_ended`: the first starts from the N-th latest one's slot on (none
        when there are fewer than N: the bound is NULL). ``CONCAT_WS`` gives "" for no row.
        Parameters: the first attempt, N less one, the first attempt again."""
        started = FIRST_START.format(r="q")
        return (
            "(SELECT CONCAT_WS(' ', MIN({lateness}), MAX({lateness})) FROM {run} r "
            "WHERE r.task_name = t.name AND r.slot >= "
            f"(SELECT q.slot FROM {{run}} q WHERE q.task_name = t.name AND {started} "
            "ORDER BY q.slot DESC LIMIT 1 OFFSET %s) AND " + FIRST_START.format(r="r") + ")"
        )

    def late_starts_params(self, last: int, first: int) -> list[Any]:
        return [first, last - 1, first]
