"""The ledger's SQL, one named statement per job, for each database taskguard supports.

Only :mod:`django_taskguard.ledger` runs these. Every statement takes ``%s``
parameters; state names are parameters too, never pasted. Deadlines are
judged by the database's clock (``now``).

On PostgreSQL a state change and its transition row are one statement (a
data-modifying CTE); elsewhere they are two statements in one transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

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
)
DIALECTS = {"postgresql": POSTGRES, "sqlite": SQLITE}


def dialect(alias: str) -> Dialect:
    vendor = connections[alias].vendor
    try:
        return DIALECTS[vendor]
    except KeyError:
        raise TaskGuardError(
            f"database vendor {vendor!r} is not supported (PostgreSQL or SQLite)"
        ) from None


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


@lru_cache
def claim(d: Dialect) -> str:
    """Upsert the (task, slot) row as ``running``; with the ``claimed`` transition on PostgreSQL.

    PostgreSQL takes one more parameter, the owner again (the transition is
    written only when this call created the row).
    """
    upsert = _format(_CLAIM, d)
    if not d.one_statement:
        return upsert
    log = _format(_CLAIMED, d)
    return f"WITH u AS ({upsert}), t AS ({log} FROM u WHERE owner = %s) SELECT * FROM u"


# Parameters: task, slot (the claim's time), key, owner, lease seconds, count_live,
# abandon_is_final. The same as _CLAIM, one row per (task, key) instead of (task, slot).
_CLAIM_KEY = (
    'INSERT INTO {run} AS r (task_name, slot, "key", state, attempt, fence, owner, created_at, '
    "started_at, lease_until, error, duplicates) "
    "VALUES (%s, %s, %s, 'running', 1, {fence}, %s, {now}, {now}, {lease}, '', 0) "
    'ON CONFLICT (task_name, "key") WHERE "key" IS NOT NULL DO UPDATE SET duplicates = '
    "r.duplicates + CASE WHEN r.state IN ('succeeded', 'failed', 'skipped') "
    "OR (r.state = 'running' AND r.lease_until > {now} AND %s) "
    "OR (r.state = 'abandoned' AND %s) THEN 1 ELSE 0 END "
    "RETURNING {row}, {left}"
)


@lru_cache
def claim_key(d: Dialect) -> str:
    """:func:`claim` for a keyed run: the row of (task, key), its slot the claim's time."""
    upsert = _format(_CLAIM_KEY, d)
    if not d.one_statement:
        return upsert
    log = _format(_CLAIMED, d)
    return f"WITH u AS ({upsert}), t AS ({log} FROM u WHERE owner = %s) SELECT * FROM u"


@lru_cache
def claimed_transition(d: Dialect) -> str:
    """The ``claimed`` transition of run ``%s`` (SQLite: after :func:`claim`)."""
    return _format(_CLAIMED, d) + f"FROM {RUN} WHERE id = %s"


# -- reading ---------------------------------------------------------------------


@lru_cache
def read_slot(d: Dialect) -> str:
    return _format("SELECT {row}, {left} FROM {run} WHERE task_name = %s AND slot = %s", d)


@lru_cache
def read_key(d: Dialect) -> str:
    return _format('SELECT {row}, {left} FROM {run} WHERE task_name = %s AND "key" = %s', d)


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


@lru_cache
def change(d: Dialect, assignments: tuple[str, ...], fenced: bool, lease: str) -> str:
    """Compare-and-set one row: ``SET state = %s, <assignments> WHERE id, state[, fence][, lease]``.

    Parameters: the new state, the assignments' own, the id, the expected
    state, the fence when ``fenced``.
    """
    where = "r.id = %s AND r.state = %s"
    if fenced:
        where += " AND r.fence = %s"
    if lease == "expired":
        where += " AND r.lease_until <= {now}"
    elif lease == "live":
        where += " AND r.lease_until > {now}"
    sets = ", ".join(("state = %s", *assignments))
    return _format(f"UPDATE {{run}} AS r SET {sets} WHERE {where} RETURNING {{row}}", d)


@lru_cache
def change_logged(
    d: Dialect, assignments: tuple[str, ...], fenced: bool, lease: str, steps: int
) -> str:
    """:func:`change` and its ``steps`` transition rows in one statement (PostgreSQL).

    Parameters: :func:`change`'s, the actor, then (from, to, reason, order) per step.
    """
    update = change(d, assignments, fenced, lease)
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
)
END_ATTEMPT = ("error = %s", "finished_at = {now}", "duplicates = r.duplicates + %s")
# An attempt after which another follows (a Celery retry): the lease says by when.
PAUSE_ATTEMPT = ("error = %s", "lease_until = {lease}", "duplicates = r.duplicates + %s")
ABANDON = ("error = %s", "duplicates = r.duplicates + %s")


@lru_cache
def assignments(d: Dialect, names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(_format(name, d) for name in names)


@lru_cache
def renew(d: Dialect) -> str:
    return _format(
        "UPDATE {run} AS r SET lease_until = {lease} "
        "WHERE r.id = %s AND r.fence = %s AND r.state = 'running' RETURNING lease_until",
        d,
    )


# -- counting and recording what no attempt wrote --------------------------------


@lru_cache
def add_duplicates(d: Dialect) -> str:
    return _format(
        "UPDATE {run} SET duplicates = duplicates + %s WHERE task_name = %s AND slot = %s", d
    )


@lru_cache
def add_duplicates_key(d: Dialect) -> str:
    return _format(
        'UPDATE {run} SET duplicates = duplicates + %s WHERE task_name = %s AND "key" = %s', d
    )


# task, slot, key, state, reason (the error), duplicates: a keyed row no attempt held.
@lru_cache
def insert_unheld_key(d: Dialect) -> str:
    return _format(
        'INSERT INTO {run} (task_name, slot, "key", state, attempt, fence, owner, created_at, '
        "finished_at, error, duplicates) "
        "VALUES (%s, %s, %s, %s, 0, NULL, '', {now}, {now}, %s, %s) "
        'ON CONFLICT (task_name, "key") WHERE "key" IS NOT NULL DO NOTHING RETURNING id',
        d,
    )


_SECONDS_AGO = {  # the database's now minus %s seconds
    "postgresql": "statement_timestamp() - make_interval(secs => %s)",
    "sqlite": "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', '-' || %s || ' seconds')",
}


# id, keep seconds, then the prunable states: a finished keyed run whose ``keep``
# has run out (by the database's clock) is deleted, so its key may run again.
@lru_cache
def reopen_key(d: Dialect) -> str:
    states = ", ".join(["%s"] * len(PRUNABLE_STATES))
    finished_before = _SECONDS_AGO[d.vendor]
    return _format(
        f'DELETE FROM {{run}} WHERE id = %s AND "key" IS NOT NULL AND '
        f"COALESCE(finished_at, created_at) <= {finished_before} AND state IN ({states}) "
        f"RETURNING id",
        d,
    )


# task, slot, state, reason (the error), duplicates: a row no attempt ever held.
@lru_cache
def insert_unheld(d: Dialect) -> str:
    return _format(
        "INSERT INTO {run} (task_name, slot, state, attempt, fence, owner, created_at, "
        "finished_at, error, duplicates) VALUES (%s, %s, %s, 0, NULL, '', {now}, {now}, %s, %s) "
        "ON CONFLICT (task_name, slot) DO NOTHING RETURNING id",
        d,
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
    return f"UPDATE {LEDGER} SET fence = MAX(fence, %s) WHERE id = 1"


def identity() -> str:
    return f"SELECT identity FROM {LEDGER} WHERE id = 1"


# -- retention ---------------------------------------------------------------------


@lru_cache
def delete_finished(d: Dialect, count: int) -> str:
    """Delete ``count`` runs by id if they are (still) in one of the prunable states."""
    ids = ", ".join(["%s"] * count)
    states = ", ".join(["%s"] * len(PRUNABLE_STATES))
    return f"DELETE FROM {RUN} WHERE id IN ({ids}) AND state IN ({states}) RETURNING id"


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
    )
