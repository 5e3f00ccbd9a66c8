"""The ledger's SQL, one named statement per job, for each database taskguard supports.

Only :mod:`django_taskguard.ledger` runs these. Every statement takes ``%s``
parameters; state names are parameters too, never pasted. Deadlines are
judged by the database's clock (``now``).

On PostgreSQL a state change and its transition row are one statement (a
data-modifying CTE); elsewhere they are two statements in one transaction.

MariaDB (Django's vendor "mysql") has no ``UPDATE ... RETURNING`` and no
data-modifying CTEs: a change is an ``UPDATE`` and a read of the row it changed
under its lock, a claim ``INSERT ... ON DUPLICATE KEY UPDATE``; with their
transitions they are one compound statement with a transaction of its own
(:data:`_BLOCK`), or, inside the caller's transaction, separate statements. Its
clock is ``UTC_TIMESTAMP(6)`` (Django stores UTC there, whatever the session's
time zone).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from django.db import connections

from ..exceptions import TaskGuardError
from ..models import Ledger, TaskRun, TaskRunTransition
from ..states import PRUNABLE_STATES

RUN = TaskRun._meta.db_table
LEDGER = Ledger._meta.db_table
TRANSITION = TaskRunTransition._meta.db_table
FENCE_SEQUENCE = "taskguard_fence"
# What the hot paths read back. Unqualified: SQLite rejects qualified names in RETURNING.
ROW = "id, state, attempt, fence, owner, lease_until"
# The same, with the run's identity, for maintenance.
REF = "id, task_name, slot, state, attempt, fence, owner, lease_until"
TRANSITION_COLUMNS = "run_id, from_state, to_state, at, reason, owner"


@dataclass(frozen=True)
class Dialect:
    vendor: str
    now: str
    lease_from_now: str  # one %s parameter: seconds
    lease_left: str  # seconds until lease_until, by the database's clock (NULL: no lease)
    next_fence: str
    one_statement: bool  # True: data-modifying CTEs (PostgreSQL)
    key: str = '"key"'  # the key column, quoted (a reserved word)
    update_returning: bool = True  # False: UPDATE, then read the row back (MariaDB)
    fence_counter: bool = False  # the ledger row's counter, bumped first (SQLite)
    # Foreign keys checked at each statement, not at commit (MariaDB): a run's
    # transitions are deleted before it.
    immediate_foreign_keys: bool = False
    # A write and its transitions as one compound statement in autocommit (MariaDB).
    compound: bool = False
    # Before every slot (the boundary of a scan that finds no N-th latest slot).
    min_slot: str = "'0000-01-01'"


POSTGRES = Dialect(
    vendor="postgresql",
    now="statement_timestamp()",
    lease_from_now="statement_timestamp() + make_interval(secs => %s)",
    lease_left="EXTRACT(EPOCH FROM lease_until - statement_timestamp())",
    next_fence=f"nextval('{FENCE_SEQUENCE}')",
    one_statement=True,
)
SQLITE = Dialect(
    vendor="sqlite",
    now="strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now')",
    lease_from_now="strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', '+' || %s || ' seconds')",
    lease_left="(julianday(lease_until) - julianday('now')) * 86400.0",
    # The ledger row's counter, moved on by :func:`bump_fence` first in the same
    # transaction (SQLite runs one writer at a time). Never MAX(fence) + 1: that
    # goes back when retention deletes the newest rows.
    next_fence=f"(SELECT fence FROM {LEDGER} WHERE id = 1)",
    one_statement=False,
    fence_counter=True,
)
MARIADB = Dialect(
    vendor="mysql",
    now="UTC_TIMESTAMP(6)",
    lease_from_now="UTC_TIMESTAMP(6) + INTERVAL CAST(%s AS DECIMAL(20, 6)) SECOND",
    lease_left="TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), lease_until) / 1000000",
    # A MariaDB SEQUENCE (migration 0009): not transactional, never goes back.
    next_fence=f"NEXTVAL({FENCE_SEQUENCE})",
    one_statement=False,
    key="`key`",
    update_returning=False,
    immediate_foreign_keys=True,
    compound=True,
    min_slot="'1000-01-01'",
)
DIALECTS = {"postgresql": POSTGRES, "sqlite": SQLITE, "mysql": MARIADB}
# The oldest MariaDB the ledger runs on (INSERT/DELETE ... RETURNING, sequences: 10.5 and
# 10.3; 10.11 is the oldest long-term release still maintained, and the one tested).
MARIADB_MINIMUM = (10, 11)


def dialect(alias: str) -> Dialect:
    connection = connections[alias]
    vendor = connection.vendor
    problem = vendor_problem(connection)
    if problem is not None:
        raise TaskGuardError(problem)
    return DIALECTS[vendor]


def vendor_problem(connection: Any) -> str | None:
    """Why the ledger cannot live on ``connection``'s database (None: it can).

    MySQL-compatible databases connect to tell MariaDB from MySQL (once per connection
    object: Django caches what the server said).
    """
    vendor = connection.vendor
    if vendor not in DIALECTS:
        return f"database vendor {vendor!r} is not supported (PostgreSQL, MariaDB or SQLite)"
    if vendor == "mysql":
        return mysql_problem(bool(connection.mysql_is_mariadb), tuple(connection.mysql_version))
    return None


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


# -- claiming --------------------------------------------------------------------

# Parameters: task, slot, owner, lease seconds, count_live, abandon_is_final.
# A plainly taken slot (finished; live; abandoned for good) counts a duplicate.
_CLAIM = (
    "INSERT INTO {run} AS r (task_name, slot, state, attempt, fence, owner, created_at, "
    "started_at, lease_until, error, duplicates) "
    "VALUES (%s, %s, 'running', 1, {fence}, %s, {now}, {now}, {lease}, '', 0) "
    "ON CONFLICT (task_name, slot) DO UPDATE SET duplicates = r.duplicates + "
    "CASE WHEN r.state IN ('succeeded', 'failed', 'skipped') "
    "OR (r.state = 'running' AND r.lease_until > {now} AND %s) "
    "OR (r.state = 'abandoned' AND %s) THEN 1 ELSE 0 END "
    "RETURNING {row}, {left}"
)
_CLAIMED = (
    "INSERT INTO {transition} ({columns}) SELECT id, 'pending', 'running', {now}, 'claimed', owner "
)


# MariaDB: the same upsert, by ON DUPLICATE KEY UPDATE (its bare column names are the
# existing row's), with the same parameters. It takes the row's lock (exclusive) at once
# when it finds the row: no shared lock to upgrade, so no deadlock between claimers.
_COUNT_DUPLICATE = (
    "duplicates = duplicates + CASE WHEN ({mine}) AND (state IN ('succeeded', 'failed', "
    "'skipped') OR (state = 'running' AND lease_until > {now} AND %s) "
    "OR (state = 'abandoned' AND %s)) THEN 1 ELSE 0 END"
)
_CLAIM_UPSERT = (
    "INSERT INTO {run} (task_name, slot, state, attempt, fence, owner, created_at, "
    "started_at, lease_until, error, duplicates) "
    "VALUES (%s, %s, 'running', 1, {fence}, %s, {now}, {now}, {lease}, '', 0) "
    "ON DUPLICATE KEY UPDATE " + _COUNT_DUPLICATE.replace("{mine}", "TRUE") + " "
    "RETURNING {row}, {left}"
)
# Keyed: ON DUPLICATE KEY UPDATE meets any unique key, so a (task, slot) collision finds
# another key's row: it is left as it is (the CASE asks for this key) and returned with
# its key, which the caller compares (and then claims the next microsecond).
_CLAIM_KEY_UPSERT = (
    "INSERT INTO {run} (task_name, slot, {key}, state, attempt, fence, owner, created_at, "
    "started_at, lease_until, error, duplicates) "
    "VALUES (%s, %s, %s, 'running', 1, {fence}, %s, {now}, {now}, {lease}, '', 0) "
    "ON DUPLICATE KEY UPDATE "
    + _COUNT_DUPLICATE.replace("{mine}", "{key} <=> VALUES({key})")
    + " RETURNING {row}, {left}, {key}"
)

# MariaDB in one round trip, as PostgreSQL's data-modifying CTEs are: an anonymous
# compound statement that runs a write and its transitions in a transaction of its own,
# rolls back and re-raises on any error, and only then returns the row (read into
# variables under the row's lock; all NULL when nothing was written). Only on a
# connection in autocommit: START TRANSACTION inside the caller's transaction would
# commit it (see :func:`core.in_autocommit`).
_BLOCK = (
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
_INTO = "INTO v_id, v_state, v_attempt, v_fence, v_owner, v_lease, v_left, v_key"
# After an upsert: the row it inserted or found (ON DUPLICATE KEY UPDATE ... id =
# LAST_INSERT_ID(id) makes LAST_INSERT_ID() name it either way), and its ``claimed``
# transition when this call made it (one more parameter: the owner).
_CLAIMED_ROW = (
    "; SELECT {row}, {left}, {key} " + _INTO + " FROM {run} WHERE id = LAST_INSERT_ID(); "
    "IF v_owner = %s THEN INSERT INTO {transition} ({columns}) "
    "VALUES (v_id, 'pending', 'running', {now}, 'claimed', v_owner); END IF;"
)


def _block(body: str) -> str:
    return _BLOCK.replace("{body}", body)


@lru_cache
def claim_block(d: Dialect, keyed: bool) -> str:
    """MariaDB: :func:`claim` (or :func:`claim_key`) and its ``claimed`` transition in one
    round trip; :func:`claim`'s parameters and the owner again. Returns the row and its
    key (the caller compares it: another key's row when the slot collided)."""
    upsert = _CLAIM_KEY_UPSERT if keyed else _CLAIM_UPSERT
    upsert = upsert.split(" RETURNING ")[0] + ", id = LAST_INSERT_ID(id)"
    return _format(_block(upsert + _CLAIMED_ROW), d)


@lru_cache
def claim(d: Dialect) -> str:
    """Upsert the (task, slot) row as ``running``; with the ``claimed`` transition on PostgreSQL.

    PostgreSQL takes one more parameter, the owner again (the transition is
    written only when this call created the row).
    """
    if not d.update_returning:
        return _format(_CLAIM_UPSERT, d)
    upsert = _format(_CLAIM, d)
    if not d.one_statement:
        return upsert
    log = _format(_CLAIMED, d)
    return f"WITH u AS ({upsert}), t AS ({log} FROM u WHERE owner = %s) SELECT * FROM u"


# Parameters: task, slot (the claim's time), key, owner, lease seconds, count_live,
# abandon_is_final. The same as _CLAIM, one row per (task, key) instead of (task, slot).
_CLAIM_KEY = (
    "INSERT INTO {run} AS r (task_name, slot, {key}, state, attempt, fence, owner, created_at, "
    "started_at, lease_until, error, duplicates) "
    "VALUES (%s, %s, %s, 'running', 1, {fence}, %s, {now}, {now}, {lease}, '', 0) "
    "ON CONFLICT (task_name, {key}) WHERE {key} IS NOT NULL DO UPDATE SET duplicates = "
    "r.duplicates + CASE WHEN r.state IN ('succeeded', 'failed', 'skipped') "
    "OR (r.state = 'running' AND r.lease_until > {now} AND %s) "
    "OR (r.state = 'abandoned' AND %s) THEN 1 ELSE 0 END "
    "RETURNING {row}, {left}"
)


# Many tasks' rows for one slot at once, with the ``claimed`` transitions of the rows this
# statement created (PostgreSQL only). Parameters: tasks (text[]), owners (text[]), lease
# seconds (float8[]), the slot. A plainly taken slot (finished, abandoned, live) counts a
# duplicate, as :func:`claim` does for ``on_stale="abandon"``. Rows go in task order, so
# two schedulers claiming the same batch wait on each other instead of deadlocking.
_CLAIM_MANY = (
    "WITH c AS (SELECT * FROM unnest(%s::text[], %s::text[], %s::float8[]) "
    "AS c(task_name, owner, lease)), "
    "u AS (INSERT INTO {run} AS r (task_name, slot, state, attempt, fence, owner, created_at, "
    "started_at, lease_until, error, duplicates) "
    "SELECT c.task_name, %s, 'running', 1, {fence}, c.owner, {now}, {now}, "
    "{now} + make_interval(secs => c.lease), '', 0 FROM c ORDER BY c.task_name "
    "ON CONFLICT (task_name, slot) DO UPDATE SET duplicates = r.duplicates + "
    "CASE WHEN r.state IN ('succeeded', 'failed', 'skipped', 'abandoned') "
    "OR (r.state = 'running' AND r.lease_until > {now}) THEN 1 ELSE 0 END "
    "RETURNING r.task_name, {row}, {left}), "
    "t AS (INSERT INTO {transition} ({columns}) "
    "SELECT u.id, 'pending', 'running', {now}, 'claimed', u.owner FROM u JOIN c USING (owner)) "
    "SELECT * FROM u"
)


@lru_cache
def claim_key(d: Dialect) -> str:
    """:func:`claim` for a keyed run: the row of (task, key), its slot the claim's time.

    MariaDB returns the row's key too: another key's row when the slot collided.
    """
    if not d.update_returning:
        return _format(_CLAIM_KEY_UPSERT, d)
    upsert = _format(_CLAIM_KEY, d)
    if not d.one_statement:
        return upsert
    log = _format(_CLAIMED, d)
    return f"WITH u AS ({upsert}), t AS ({log} FROM u WHERE owner = %s) SELECT * FROM u"


@lru_cache
def claim_many(d: Dialect) -> str | None:
    """:data:`_CLAIM_MANY`, or None where it cannot be one statement (SQLite, MariaDB)."""
    return _format(_CLAIM_MANY, d) if d.one_statement else None


# Many attempts recorded ``succeeded`` at once, each fenced like :func:`change`, with
# their transitions (PostgreSQL only). Parameters: ids (bigint[]), fences (bigint[]),
# owners (text[]), reasons (text[]), the new state, the old state, the new state again.
# The rows are locked first in (task, slot) order, the order :data:`_CLAIM_MANY` locks
# them in: a batch finish and a batch claim on the same rows never deadlock.
_SUCCEED_MANY = (
    "WITH c AS (SELECT * FROM unnest(%s::bigint[], %s::bigint[], %s::text[], %s::text[]) "
    "AS c(id, fence, owner, reason)), "
    "l AS (SELECT r.id FROM {run} AS r JOIN c USING (id) ORDER BY r.task_name, r.slot "
    "FOR UPDATE OF r), "
    "u AS (UPDATE {run} AS r SET state = %s, error = '', finished_at = {now} FROM c "
    "WHERE r.id = c.id AND r.id IN (SELECT id FROM l) AND r.state = %s AND r.fence = c.fence "
    "RETURNING r.id), "
    "t AS (INSERT INTO {transition} ({columns}) "
    "SELECT c.id, %s, %s, {now}, c.reason, c.owner FROM c JOIN u USING (id)) "
    "SELECT id FROM u"
)


@lru_cache
def succeed_many(d: Dialect) -> str | None:
    return _format(_SUCCEED_MANY, d) if d.one_statement else None


@lru_cache
def claimed_transition(d: Dialect) -> str:
    """The ``claimed`` transition of run ``%s`` (SQLite: after :func:`claim`)."""
    return _format(_CLAIMED, d) + f"FROM {RUN} WHERE id = %s"


# -- reading ---------------------------------------------------------------------


@lru_cache
def read_slot(d: Dialect) -> str:
    return _format("SELECT {row}, {left} FROM {run} WHERE task_name = %s AND slot = %s", d)


# A keyed claim that met another key's row on (task, slot): the latest slot the task has
# from there on (the (task, slot) index answers it), so the claim takes the next one.
@lru_cache
def last_slot_from(d: Dialect) -> str:
    return _format("SELECT MAX(slot) FROM {run} WHERE task_name = %s AND slot >= %s", d)


# Tasks (text[]), a slot: each task's row of that slot (PostgreSQL; the batch claim's
# read-back after a lost reply).
@lru_cache
def read_slot_many(d: Dialect) -> str | None:
    if not d.one_statement:
        return None
    return _format(
        "SELECT task_name, {row}, {left} FROM {run} WHERE task_name = ANY(%s::text[]) "
        "AND slot = %s",
        d,
    )


@lru_cache
def read_key(d: Dialect) -> str:
    return _format("SELECT {row}, {left} FROM {run} WHERE task_name = %s AND {key} = %s", d)


@lru_cache
def read_id(d: Dialect) -> str:
    return _format("SELECT {row}, {left} FROM {run} WHERE id = %s", d)


@lru_cache
def earlier_running(d: Dialect) -> str:
    return _format(
        "SELECT slot FROM {run} WHERE task_name = %s AND slot < %s AND state = 'running' "
        "AND lease_until > {now} ORDER BY slot LIMIT 1",
        d,
    )


@lru_cache
def now(d: Dialect) -> str:
    return f"SELECT {d.now}".replace("%%", "%")


# -- changing a row --------------------------------------------------------------


# A (skipped) row that only records a call refused for being ahead of the clock: nothing
# ever held it, and it was written before its slot came (no other writer does that). The
# first on-time call takes it over; it does not count as the slot's row.
REFUSED_EARLY = "attempt = 0 AND created_at < slot"


@lru_cache
def change(
    d: Dialect, assignments: tuple[str, ...], fenced: bool, lease: str, retry_by: bool = False
) -> str:
    """Compare-and-set one row: ``SET state = %s, <assignments> WHERE id, state[, fence][, lease]
    [, retry_by]``.

    Parameters: the new state, the assignments' own, the id, the expected
    state, the fence when ``fenced``, the caller's message id when ``retry_by`` (the row
    names no message that asked for its retry, or names this one, or that retry is
    overdue: its deadline passed, so it never came and any copy may start the attempt).
    """
    where = "r.id = %s AND r.state = %s"
    if fenced:
        where += " AND r.fence = %s"
    if retry_by:
        where += " AND (r.retry_by IS NULL OR r.retry_by = %s OR r.lease_until <= {now})"
    if lease == "expired":
        where += " AND r.lease_until <= {now}"
    elif lease == "live":
        where += " AND r.lease_until > {now}"
    elif lease == "refused_early":
        where += " AND " + REFUSED_EARLY
    sets = ", ".join(("state = %s", *assignments))
    returning = " RETURNING {row}" if d.update_returning else ""
    return _format(f"UPDATE {{run}} AS r SET {sets} WHERE {where}{returning}", d)


@lru_cache
def change_block(
    d: Dialect,
    assignments: tuple[str, ...],
    fenced: bool,
    lease: str,
    steps: int,
    retry_by: bool = False,
) -> str:
    """MariaDB: :func:`change` and its ``steps`` transition rows in one round trip.

    Parameters: :func:`change`'s, the id again, then (id, from, to, reason, actor) per
    step. The row comes back without its lease left, as from :func:`change_logged`.
    """
    update = change(d, assignments, fenced, lease, retry_by)
    values = ", ".join(["(%s, %s, %s, {now}, %s, %s)"] * steps)
    return _format(
        _block(
            f"{update}; IF ROW_COUNT() > 0 THEN SELECT {{row}}, NULL, NULL {_INTO} FROM {{run}} "
            f"WHERE id = %s; INSERT INTO {{transition}} ({{columns}}) VALUES {values}; END IF;"
        ),
        d,
    )


@lru_cache
def changed_row(d: Dialect) -> str:
    """Read back the row an ``UPDATE`` without ``RETURNING`` changed (MariaDB), in its
    transaction: the row's lock is still held, so it is the row as changed."""
    return _format("SELECT {row} FROM {run} WHERE id = %s", d)


@lru_cache
def change_logged(
    d: Dialect,
    assignments: tuple[str, ...],
    fenced: bool,
    lease: str,
    steps: int,
    retry_by: bool = False,
) -> str:
    """:func:`change` and its ``steps`` transition rows in one statement (PostgreSQL).

    Parameters: :func:`change`'s, the actor, then (from, to, reason, order) per step.
    """
    update = change(d, assignments, fenced, lease, retry_by)
    values = ", ".join(["(%s, %s, %s, %s)"] * steps)
    return (
        f"WITH u AS ({update}), t AS (INSERT INTO {TRANSITION} ({TRANSITION_COLUMNS}) "
        f"SELECT u.id, v.f, v.t, {d.now}, v.r, %s FROM u, (VALUES {values}) AS v(f, t, r, n) "
        f"ORDER BY v.n) SELECT * FROM u"
    )


@lru_cache
def transition(d: Dialect) -> str:
    """One transition row: run, from, to, reason, actor (at = the database's now)."""
    return _format("INSERT INTO {transition} ({columns}) VALUES (%s, %s, %s, {now}, %s, %s)", d)


# The SET clauses of the changes, named. Parameters in the order of their %s.
START_ATTEMPT = (  # owner, lease seconds
    "attempt = r.attempt + 1",
    "fence = {fence}",
    "owner = %s",
    "started_at = {now}",
    "lease_until = {lease}",
    "finished_at = NULL",
    "retry_by = NULL",
)
# An on-time call takes a row that only recorded an early call's refusal: the duplicate
# its claim counted on finding the row is taken back (it is no duplicate, it runs).
TAKE_REFUSED_EARLY = (
    *START_ATTEMPT,
    "error = ''",
    "duplicates = CASE WHEN r.duplicates > 0 THEN r.duplicates - 1 ELSE 0 END",
)
# An on-time copy hands to its task queue a slot whose row only recorded an early call's
# refusal: the row is handed out now (the sweep ends a pending row by when it was).
PEND_REFUSED_EARLY = ("error = ''", "finished_at = NULL", "created_at = {now}")
# The sweep: a due slot whose row only recorded an early call's refusal, and that no
# on-time call took within its grace.
MISS_REFUSED_EARLY = ("error = %s", "finished_at = {now}")
END_ATTEMPT = ("error = %s", "finished_at = {now}", "duplicates = r.duplicates + %s")
# An attempt after which another follows (a Celery retry): the lease says by when, and
# retry_by which message carries it (NULL: any caller may start the next attempt).
PAUSE_ATTEMPT = (
    "error = %s",
    "lease_until = {lease}",
    "duplicates = r.duplicates + %s",
    "retry_by = %s",
)
ABANDON = ("error = %s", "duplicates = r.duplicates + %s")
# An attempt that never entered its function, given back (the next claim counts the attempt
# again and hands out a new fence). To ``pending`` or ``missed``: the attempt count as before
# the claim, no owner, not started, and ``finished_at`` when it was given back (the sweep
# and retention judge a given-back row by it; the next claim clears it).
GIVE_BACK = (
    "attempt = r.attempt - 1",
    "owner = ''",
    "started_at = NULL",
    "lease_until = NULL",
    "finished_at = {now}",
)
# To ``retrying``: the attempt count as before the claim, no owner, the retry due within
# the lease given (parameters: seconds, the message that may start it, NULL: any caller).
GIVE_BACK_RETRY = (
    "attempt = r.attempt - 1",
    "owner = ''",
    "lease_until = {lease}",
    "retry_by = %s",
)


@lru_cache
def assignments(d: Dialect, names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(_format(name, d) for name in names)


@lru_cache
def renew(d: Dialect, milliseconds: int | None = None) -> str:
    """Extend the lease of a running attempt (parameters: lease seconds, id, fence).

    MariaDB: no ``RETURNING`` (read the lease back with :func:`lease_of`), and a bound
    of ``milliseconds`` is the statement's own (``SET STATEMENT ... FOR``).
    """
    returning = " RETURNING lease_until" if d.update_returning else ""
    update = _format(
        "UPDATE {run} AS r SET lease_until = {lease} "
        "WHERE r.id = %s AND r.fence = %s AND r.state = 'running'" + returning,
        d,
    )
    if milliseconds is None or d.vendor != "mysql":
        return update
    ms = int(milliseconds)  # a number, never text: safe to write into the statement
    # max_statement_time ends the statement, its waits for locks included; the lock wait
    # timeout counts whole seconds (at least one).
    return (
        f"SET STATEMENT max_statement_time = {ms / 1000:.3f}, "
        f"innodb_lock_wait_timeout = {max(1, -(-ms // 1000))} FOR {update}"
    )


@lru_cache
def lease_of(d: Dialect) -> str:
    return _format("SELECT lease_until FROM {run} WHERE id = %s", d)


@lru_cache
def renew_timeout(d: Dialect, milliseconds: int) -> str:
    """Bound the renewal that follows: it waits for locks and runs ``milliseconds`` at most.

    PostgreSQL: ``SET LOCAL`` (``set_config(..., true)``) of ``statement_timeout`` and
    ``lock_timeout``, for the renewal's own transaction only. SQLite: the
    connection's busy timeout (put back afterwards, see :func:`busy_timeout`).
    """
    ms = int(milliseconds)  # a number, never text: safe to write into the statement
    if d.vendor == "mysql":
        raise AssertionError("MariaDB bounds the renewal itself: sql.renew(d, milliseconds)")
    if d.vendor == "postgresql":
        return (
            f"SELECT set_config('statement_timeout', '{ms}', true), "
            f"set_config('lock_timeout', '{ms}', true)"
        )
    return f"PRAGMA busy_timeout = {ms}"


def busy_timeout(d: Dialect) -> str | None:
    """Read the connection's own wait for locks, to put back after a bounded renewal
    (None: the bound ends with the renewal's transaction)."""
    return "PRAGMA busy_timeout" if d.vendor == "sqlite" else None


# -- counting and recording what no attempt wrote --------------------------------


@lru_cache
def add_duplicates(d: Dialect) -> str:
    return _format(
        "UPDATE {run} SET duplicates = duplicates + %s WHERE task_name = %s AND slot = %s", d
    )


# A copy that found the row retrying for another message, whose retry is not overdue
# (parameters: id, the copy's message id or NULL): counted, in the same statement that
# checks it; no row: it was not.
@lru_cache
def count_other_copy(d: Dialect) -> str:
    return _format(
        "UPDATE {run} SET duplicates = duplicates + 1 WHERE id = %s AND state = 'retrying' "
        "AND retry_by IS NOT NULL AND retry_by <> COALESCE(%s, '') AND lease_until > {now}",
        d,
    )


@lru_cache
def add_duplicates_key(d: Dialect) -> str:
    return _format(
        "UPDATE {run} SET duplicates = duplicates + %s WHERE task_name = %s AND {key} = %s", d
    )


# The JSON result of a keyed run (return_result=True): written by its live attempt
# (fenced), read by its duplicates once it succeeded.
@lru_cache
def store_result(d: Dialect) -> str:
    return _format("UPDATE {run} SET result = %s WHERE id = %s AND fence = %s AND state = %s", d)


@lru_cache
def read_result(d: Dialect) -> str:
    return _format("SELECT state, result FROM {run} WHERE task_name = %s AND {key} = %s", d)


# task, slot, key, state, reason (the error), duplicates: a keyed row no attempt held.
@lru_cache
def insert_unheld_key(d: Dialect) -> str:
    return _format(
        _insert_new(d) + "{run} (task_name, slot, {key}, state, attempt, fence, owner, created_at, "
        "finished_at, error, duplicates) "
        "VALUES (%s, %s, %s, %s, 0, NULL, '', {now}, {now}, %s, %s) "
        + _unless_there(d, "(task_name, {key}) WHERE {key} IS NOT NULL")
        + "RETURNING id",
        d,
    )


def _insert_new(d: Dialect) -> str:
    """``INSERT INTO`` that leaves a row already there alone (with :func:`_unless_there`).

    MariaDB: ``INSERT IGNORE``, which returns no row for a row it left alone. It would
    also turn a bad value into a warning; these rows' values are all checked before.
    """
    return "INSERT INTO " if d.update_returning else "INSERT IGNORE INTO "


def _unless_there(d: Dialect, target: str) -> str:
    return f"ON CONFLICT {target} DO NOTHING " if d.update_returning else ""


_SECONDS_AGO = {  # the database's now minus %s seconds
    "postgresql": "statement_timestamp() - make_interval(secs => %s)",
    "sqlite": "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', '-' || %s || ' seconds')",
    "mysql": "UTC_TIMESTAMP(6) - INTERVAL CAST(%s AS DECIMAL(20, 6)) SECOND",
}


# id, keep seconds, then the prunable states: a finished keyed run whose ``keep``
# has run out (by the database's clock) is deleted, so its key may run again.
@lru_cache
def reopen_key(d: Dialect) -> str:
    states = ", ".join(["%s"] * len(PRUNABLE_STATES))
    finished_before = _SECONDS_AGO[d.vendor]
    where = (
        f"id = %s AND {{key}} IS NOT NULL AND "
        f"COALESCE(finished_at, created_at) <= {finished_before} AND state IN ({states})"
    )
    return _format(_delete_runs_where(d, where), d)


def _delete_runs_where(d: Dialect, where: str) -> str:
    """Delete the runs ``where`` holds for, returning their ids.

    With immediate foreign keys (MariaDB) a run cannot go before its transitions:
    its row is locked and returned instead, for :func:`delete_runs` to delete after
    :func:`delete_transitions`, in the same transaction.
    """
    if d.immediate_foreign_keys:
        return f"SELECT id FROM {RUN} WHERE {where} FOR UPDATE"
    return f"DELETE FROM {RUN} WHERE {where} RETURNING id"


@lru_cache
def delete_runs(d: Dialect, count: int) -> str:
    """Delete ``count`` runs locked by :func:`_delete_runs_where` (MariaDB)."""
    ids = ", ".join(["%s"] * count)
    return f"DELETE FROM {RUN} WHERE id IN ({ids})"


# task, slot, state, reason (the error), duplicates: a row no attempt ever held.
@lru_cache
def insert_unheld(d: Dialect) -> str:
    return _format(
        _insert_new(d)
        + "{run} (task_name, slot, state, attempt, fence, owner, created_at, finished_at, "
        "error, duplicates) VALUES (%s, %s, %s, 0, NULL, '', {now}, {now}, %s, %s) "
        + _unless_there(d, "(task_name, slot)")
        + "RETURNING id",
        d,
    )


# task, slot, the pending state: a slot handed to a task queue and not started yet
# (run_schedules --enqueue).
@lru_cache
def insert_pending(d: Dialect) -> str:
    return _format(
        _insert_new(d) + "{run} (task_name, slot, state, attempt, fence, owner, created_at, error, "
        "duplicates) VALUES (%s, %s, %s, 0, NULL, '', {now}, '', 0) "
        + _unless_there(d, "(task_name, slot)")
        + "RETURNING id",
        d,
    )


# id, the pending state: a pending row whose hand-off failed is given back, only while
# nothing started it.
@lru_cache
def give_back_pending(d: Dialect) -> str:
    return _format("DELETE FROM {run} WHERE id = %s AND state = %s AND attempt = 0 RETURNING id", d)


# Many rows no attempt ever held, with their transitions, in one statement (PostgreSQL).
# Parameters: tasks (text[]), slots (timestamptz[]), reasons (text[]), state, from state,
# state again, actor. Returns the number of rows inserted.
@lru_cache
def insert_unheld_many(d: Dialect) -> str:
    return _format(
        "WITH c(task_name, slot, reason) AS "
        "(SELECT * FROM unnest(%s::text[], %s::timestamptz[], %s::text[])), "
        "i AS (INSERT INTO {run} (task_name, slot, state, attempt, fence, owner, created_at, "
        "finished_at, error, duplicates) SELECT task_name, slot, %s, 0, NULL, '', {now}, {now}, "
        "reason, 0 FROM c ON CONFLICT (task_name, slot) DO NOTHING RETURNING id, error), "
        "t AS (INSERT INTO {transition} ({columns}) SELECT id, %s, %s, {now}, error, %s FROM i) "
        "SELECT count(*) FROM i",
        d,
    )


# -- schedules: what the scheduler and the missed-slot sweep read -------------------


@lru_cache
def latest_slot(d: Dialect) -> str:
    """The newest slot of task ``%s`` with a row not in state ``%s`` (the (task, slot) index)."""
    return _format("SELECT MAX(slot) FROM {run} WHERE task_name = %s AND state <> %s", d)


@lru_cache
def slots_in(d: Dialect) -> str:
    """The slots with a row of task ``%s`` in ``(%s, %s]`` (an early call's refusal is none)."""
    return _format(
        "SELECT slot FROM {run} WHERE task_name = %s AND slot > %s AND slot <= %s "
        f"AND NOT (state = 'skipped' AND {REFUSED_EARLY})",
        d,
    )


@lru_cache(maxsize=16)
def states_at(d: Dialect, count: int) -> str:
    """The slot and state of each row of task ``%s`` at one of ``count`` slots (one probe
    of (task, slot) each); a row that only recorded an early call's refusal is none."""
    slots = ", ".join(["%s"] * count)
    return _format(
        "SELECT slot, state FROM {run} WHERE task_name = %s AND slot IN (" + slots + ") "
        f"AND NOT (state = 'skipped' AND {REFUSED_EARLY})",
        d,
    )


# task, after, until, limit: the rows that only recorded an early call's refusal.
@lru_cache
def refused_early_in(d: Dialect) -> str:
    return _format(
        "SELECT id, fence, owner, lease_until FROM {run} WHERE task_name = %s AND slot > %s "
        f"AND slot <= %s AND state = 'skipped' AND {REFUSED_EARLY} ORDER BY slot LIMIT %s",
        d,
    )


@lru_cache
def last_states(d: Dialect) -> str:
    """The states of task ``%s``'s newest ``%s`` finished rows, newest first."""
    return _format(
        "SELECT state FROM {run} WHERE task_name = %s AND state IN (%s, %s, %s) "
        "ORDER BY slot DESC LIMIT %s",
        d,
    )


@lru_cache
def task_names(d: Dialect, limited: bool = True) -> str:
    """The first ``%s`` distinct task names (``limited=False``: all, no parameter), by a
    loose index scan of (task_name, slot).

    A recursive CTE hops from name to next name through the index (PostgreSQL has no
    skip scan). MariaDB runs that CTE slowly (each hop a scan) but does the loose scan
    itself for ``DISTINCT`` ("Using index for group-by").
    """
    limit = " LIMIT %s" if limited else ""
    if d.vendor == "mysql":
        return f"SELECT DISTINCT task_name FROM {RUN} ORDER BY task_name{limit}"
    return (
        f"WITH RECURSIVE names(name) AS (SELECT MIN(task_name) FROM {RUN} "
        f"UNION ALL SELECT (SELECT MIN(task_name) FROM {RUN} WHERE task_name > names.name) "
        f"FROM names WHERE names.name IS NOT NULL) "
        f"SELECT name FROM names WHERE name IS NOT NULL{limit}"
    )


# -- the ledger's own row ----------------------------------------------------------


def bump_fence(d: Dialect) -> str:
    """Move the fence counter on (SQLite; no row: nothing is updated)."""
    return f"UPDATE {LEDGER} SET fence = fence + 1 WHERE id = 1"


def fence_at_least(d: Dialect) -> str:
    """Make the next fence larger than ``%s`` (rows imported with their fences)."""
    if d.one_statement:
        return (
            f"SELECT setval('{FENCE_SEQUENCE}', GREATEST(%s, "
            f"(SELECT last_value FROM {FENCE_SEQUENCE})))"
        )
    if d.vendor == "mysql":
        # MariaDB's SETVAL ignores a value below the sequence's: it never goes back.
        return f"SELECT SETVAL({FENCE_SEQUENCE}, %s)"
    return f"UPDATE {LEDGER} SET fence = MAX(fence, %s) WHERE id = 1"


def identity() -> str:
    return f"SELECT identity FROM {LEDGER} WHERE id = 1"


# -- retention ---------------------------------------------------------------------


@lru_cache
def delete_finished(d: Dialect, count: int) -> str:
    """Delete ``count`` runs by id if they are (still) in one of the prunable states, or
    ``pending`` with their slot and the time they were made pending before a time
    (parameters: the ids, the prunable states, ``'pending'``, that time twice)."""
    ids = ", ".join(["%s"] * count)
    states = ", ".join(["%s"] * len(PRUNABLE_STATES))
    given_back = "state = %s AND slot < %s AND COALESCE(finished_at, created_at) < %s"
    return _delete_runs_where(d, f"id IN ({ids}) AND (state IN ({states}) OR ({given_back}))")


@lru_cache
def delete_transitions(d: Dialect, count: int) -> str:
    ids = ", ".join(["%s"] * count)
    return f"DELETE FROM {TRANSITION} WHERE run_id IN ({ids})"


def _format(template: str, d: Dialect) -> str:
    return template.format(
        run=RUN,
        transition=TRANSITION,
        columns=TRANSITION_COLUMNS,
        now=d.now,
        lease=d.lease_from_now,
        fence=d.next_fence,
        row=ROW,
        left=d.lease_left,
        key=d.key,
        min_slot=d.min_slot,
    )


# -- monitoring (health, metrics, the admin's overview) ---------------------------

# A finished attempt's duration in seconds (NULL when it has no start or end).
DURATION = {
    "postgresql": "EXTRACT(EPOCH FROM (finished_at - started_at))",
    "sqlite": "(julianday(finished_at) - julianday(started_at)) * 86400.0",
    "mysql": "TIMESTAMPDIFF(MICROSECOND, started_at, finished_at) / 1000000",
}
# A VALUES row of one task name (PostgreSQL cannot infer a parameter's type there).
_NAME_ROW = {"postgresql": "(CAST(%s AS varchar))", "sqlite": "(%s)", "mysql": "(%s)"}


@lru_cache
def window_summary(d: Dialect, buckets: int) -> str:
    """Per (task, state) over the slots since ``%s``: runs, duplicates, duration sum and
    count, and how many durations are at most each of ``buckets`` bounds.

    Parameters: the ``buckets`` bounds (seconds), then the window's start. A range
    scan of the slot index: its cost is the number of runs in the window.
    """
    duration = DURATION[d.vendor]
    counts = "".join(f", SUM(CASE WHEN {duration} <= %s THEN 1 ELSE 0 END)" for _ in range(buckets))
    return (
        f"SELECT task_name, state, COUNT(*), COALESCE(SUM(duplicates), 0), "
        f"COALESCE(SUM({duration}), 0), COUNT({duration}){counts} "
        f"FROM {RUN} WHERE slot >= %s GROUP BY task_name, state"
    )


@lru_cache
def latest_in_state(d: Dialect, names: int) -> str:
    """For each of ``names`` task names (the VALUES list; then the state, twice): the slot
    and end of its run in that state with the latest slot (NULL: none). One backward
    probe of (task_name, state, slot) each."""
    rows = ", ".join([_NAME_ROW[d.vendor]] * names)
    latest = (
        "(SELECT r.{column} FROM {run} r {hint}WHERE r.task_name = t.name AND r.state = %s "
        "ORDER BY r.slot DESC LIMIT 1)"
    )
    hint = _task_state_index(d)
    return (
        f"WITH t(name) AS (VALUES {rows}) SELECT t.name, "
        f"{latest.format(column='slot', run=RUN, hint=hint)}, "
        f"{latest.format(column='finished_at', run=RUN, hint=hint)} FROM t"
    )


def _task_state_index(d: Dialect) -> str:
    """MariaDB: probe (task_name, state, slot) for a task's latest run in a state. Left to
    itself it scans the task's (task_name, slot) range backwards for that state, every
    run of the task when none is in it (178 ms against 1 ms for 100 tasks of 2,000 runs)."""
    return "FORCE INDEX (taskguard_run_task_state) " if d.vendor == "mysql" else ""


# Per task, its health facts: the tasks are a VALUES list (name, due slot), the facts
# correlated subqueries, planned once whatever the number of tasks. Parameters after
# the VALUES: missed, since; running (x3); ended states and N (x2), succeeded; ended.
_ENDED = "r.state IN (%s, %s, %s)"
_FACTS = (
    "WITH t(name, due) AS (VALUES {tasks}) SELECT t.name, "
    "(SELECT r.state FROM {run} r WHERE r.task_name = t.name AND r.slot = t.due), "
    "(SELECT COUNT(*) FROM {run} r WHERE r.task_name = t.name AND r.state = %s "
    "AND r.slot >= %s), "
    "(SELECT COUNT(*) FROM {run} r WHERE r.task_name = t.name AND r.state = %s "
    "AND r.lease_until <= {now}), "
    "(SELECT r.slot FROM {run} r {hint}WHERE r.task_name = t.name AND r.state = %s "
    "AND r.lease_until <= {now} ORDER BY r.slot LIMIT 1), "
    "(SELECT r.lease_until FROM {run} r {hint}WHERE r.task_name = t.name AND r.state = %s "
    "AND r.lease_until <= {now} ORDER BY r.slot LIMIT 1), "
    "(SELECT COUNT(*) FROM (SELECT r.state FROM {run} r WHERE r.task_name = t.name AND "
    + _ENDED
    + " ORDER BY r.slot DESC LIMIT %s) AS e), "
    "(SELECT COUNT(*) FROM (SELECT r.state FROM {run} r WHERE r.task_name = t.name AND "
    + _ENDED
    + " ORDER BY r.slot DESC LIMIT %s) AS e WHERE e.state <> %s), "
    "(SELECT r.slot FROM {run} r WHERE r.task_name = t.name AND "
    + _ENDED
    + " ORDER BY r.slot DESC LIMIT 1) FROM t"
)
# A VALUES row of (task name, due slot), typed (PostgreSQL cannot infer parameter types).
_TASK_ROW = {
    "postgresql": "(CAST(%s AS varchar), CAST(%s AS timestamp with time zone))",
    "sqlite": "(%s, %s)",
    "mysql": "(%s, %s)",
}


# MariaDB cannot see the outer task in a derived table: "the last N ended runs" is the
# ended runs from the N-th latest one's slot on (slots are unique per task). Parameters
# of each of the two: the ended states, N less one, the ended states again.
_LAST_ENDED = (
    "FROM {run} r WHERE r.task_name = t.name AND r.slot >= COALESCE((SELECT q.slot "
    "FROM {run} q WHERE q.task_name = t.name AND q.state IN (%s, %s, %s) "
    "ORDER BY q.slot DESC LIMIT 1 OFFSET %s), {min_slot}) AND " + _ENDED
)
_FACTS_MARIADB = (
    _FACTS.split("(SELECT COUNT(*) FROM (SELECT")[0]
    + "(SELECT COUNT(*) "
    + _LAST_ENDED
    + "), (SELECT COUNT(*) "
    + _LAST_ENDED
    + " AND r.state <> %s), (SELECT r.slot FROM {run} r WHERE r.task_name = t.name AND "
    + _ENDED
    + " ORDER BY r.slot DESC LIMIT 1) FROM t"
)


@lru_cache
def task_facts(d: Dialect, tasks: int) -> str:
    """The health facts of ``tasks`` tasks, one row each: every value an index probe on
    (task_name, slot) or (task_name, state, slot). See :func:`last_ended_params`."""
    rows = ", ".join([_TASK_ROW[d.vendor]] * tasks)
    template = _FACTS_MARIADB if d.vendor == "mysql" else _FACTS
    return _format(template.replace("{tasks}", rows).replace("{hint}", _task_state_index(d)), d)


def last_ended_params(d: Dialect, ended: tuple[str, ...], last: int) -> list[Any]:
    """The parameters that pick a task's ``last`` ended runs in :func:`task_facts`."""
    if d.vendor == "mysql":
        return [*ended, last - 1, *ended]
    return [*ended, last]


# The runs of each task whose slot is at or after its ``limit``-th latest (the tasks a
# VALUES list; one backward probe and one range scan of (task_name, slot) each). On
# PostgreSQL a LATERAL join says the same with a LIMIT the planner sees (a plan that
# looks cheap, so no JIT compilation on a big table). Parameter after the VALUES: the
# limit (PostgreSQL) or the limit less one (the OFFSET, SQLite).
_RECENT = {
    "postgresql": (
        "WITH t(name) AS (VALUES {tasks}) "
        "SELECT t.name, r.id, r.slot, r.state FROM t CROSS JOIN LATERAL "
        "(SELECT q.id, q.slot, q.state FROM {run} q WHERE q.task_name = t.name "
        "ORDER BY q.slot DESC LIMIT %s) AS r"
    ),
    "sqlite": (
        "WITH t(name) AS (VALUES {tasks}) "
        "SELECT r.task_name, r.id, r.slot, r.state "
        "FROM t JOIN {run} r ON r.task_name = t.name AND r.slot >= COALESCE("
        "(SELECT q.slot FROM {run} q WHERE q.task_name = t.name ORDER BY q.slot DESC "
        "LIMIT 1 OFFSET %s), {min_slot})"
    ),
}
_RECENT["mysql"] = _RECENT["sqlite"]


def recent_limit(d: Dialect, limit: int) -> int:
    """The parameter :func:`recent_runs` takes for ``limit`` runs per task."""
    return limit if d.vendor == "postgresql" else max(limit - 1, 0)


@lru_cache
def recent_runs(d: Dialect, tasks: int) -> str:
    """Each of ``tasks`` tasks' runs with the latest slots (parameters: the names, then
    :func:`recent_limit` of the limit)."""
    rows = ", ".join([_NAME_ROW[d.vendor]] * tasks)
    return _format(_RECENT[d.vendor].replace("{tasks}", rows), d)
