"""The database side of a run: claim, renew, and fenced state changes.

These are the hot paths, so they are hand-written SQL: on PostgreSQL each is
one statement (a data-modifying CTE writes the row and its transition
together, atomically, in one round trip); on SQLite each is one short
transaction. Every state change is checked against ``states.TRANSITIONS``
and compares-and-sets on the row's current state (and fence, for an owner),
so a stale writer changes nothing.

Deadlines are judged by the database's clock only (``NOW`` below).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from datetime import timezone as dt_timezone
from typing import Any

from django.db import InterfaceError, OperationalError, connections, transaction
from django.utils.dateparse import parse_datetime

from .exceptions import TaskGuardError
from .models import TaskRun, TaskRunTransition
from .states import RunState, check_transition

logger = logging.getLogger("taskguard.ledger")

RUN = TaskRun._meta.db_table
TRANSITION = TaskRunTransition._meta.db_table
FENCE_SEQUENCE = "taskguard_fence"
# Unqualified: SQLite does not accept table-qualified names in RETURNING.
RETURNING = "id, state, attempt, fence, owner, lease_until"
CONNECTION_ERRORS = (OperationalError, InterfaceError)


def connection_lost(alias: str, exc: Exception) -> bool:
    """True when ``exc`` may have cut a statement off mid-flight (outcome unknown).

    Only a networked database loses connections; SQLite raises
    ``OperationalError`` for real errors too, which must not be retried.
    """
    return isinstance(exc, CONNECTION_ERRORS) and connections[alias].vendor != "sqlite"


# One SET clause of an UPDATE and the parameters its %s placeholders take.
Assignment = tuple[str, tuple[Any, ...]]


@dataclass(frozen=True)
class Dialect:
    now: str
    lease_from_now: str  # one %s parameter: seconds
    next_fence: str
    one_statement: bool  # True: data-modifying CTEs (PostgreSQL)


POSTGRES = Dialect(
    now="statement_timestamp()",
    lease_from_now="statement_timestamp() + make_interval(secs => %s)",
    next_fence=f"nextval('{FENCE_SEQUENCE}')",
    one_statement=True,
)
SQLITE = Dialect(
    now="strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now')",
    lease_from_now="strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', '+' || %s || ' seconds')",
    # SQLite runs one writer at a time and a write statement takes the write
    # lock before it reads, so MAX()+1 here cannot hand out a fence twice.
    next_fence=f"(SELECT COALESCE(MAX(fence), 0) + 1 FROM {RUN})",
    one_statement=False,
)


def dialect(alias: str) -> Dialect:
    vendor = connections[alias].vendor
    if vendor == "postgresql":
        return POSTGRES
    if vendor == "sqlite":
        return SQLITE
    raise TaskGuardError(f"database vendor {vendor!r} is not supported (PostgreSQL or SQLite)")


@dataclass(frozen=True)
class Row:
    """The columns of a ``TaskRun`` that the hot paths read back."""

    id: int
    state: str
    attempt: int
    fence: int | None
    owner: str
    lease_until: datetime | None
    expired: bool = False


def _aware(value: Any) -> datetime | None:
    dt = value if value is None or isinstance(value, datetime) else parse_datetime(str(value))
    if dt is not None and dt.tzinfo is None:
        dt = dt.replace(tzinfo=dt_timezone.utc)
    return dt


def _row(values: Sequence[Any] | None) -> Row | None:
    if values is None:
        return None
    expired = bool(values[6]) if len(values) > 6 else False
    return Row(
        int(values[0]), values[1], int(values[2]), values[3], values[4], _aware(values[5]), expired
    )


def ensure_autocommit(alias: str) -> None:
    """Refuse to claim inside the caller's transaction.

    A claim inside an open ``atomic`` block would hold the row lock (and hide
    the row from every other instance) until the caller commits, and would
    vanish if the caller rolled back: the opposite of a durable claim.
    """
    connection = transaction.get_connection(alias)
    # Not get_autocommit(): it would connect, and an unreachable database must
    # surface from the claim as BackendUnavailable. A closed connection opens
    # with the configured AUTOCOMMIT.
    opened = connection.connection is not None
    autocommit = connection.autocommit if opened else connection.settings_dict["AUTOCOMMIT"]
    if connection.in_atomic_block or not autocommit:
        raise TaskGuardError(
            "a taskguard claim cannot run inside an open transaction (transaction.atomic, "
            "ATOMIC_REQUESTS or autocommit turned off): it must commit on its own so other "
            "instances see it. Call the guarded function outside the atomic block, or from "
            "transaction.on_commit()."
        )


def _execute(alias: str, sql: str, params: Sequence[Any]) -> Sequence[Any] | None:
    with connections[alias].cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone() if cursor.description else None


def _slot_param(alias: str, slot: datetime) -> Any:
    return connections[alias].ops.adapt_datetimefield_value(slot)


def claim(
    alias: str,
    task_name: str,
    slot: datetime,
    owner: str,
    lease_seconds: float,
    *,
    abandon_is_final: bool,
    count_live: bool = True,
) -> Row:
    """Insert the (task, slot) row as ``running`` for ``owner``, or find it taken.

    One round trip either way. The returned row's ``owner`` equals ``owner``
    exactly when this call created it. When the slot is plainly taken (a live
    or finished attempt) the row's ``duplicates`` is incremented in the same
    statement (a live attempt only with ``count_live``: a caller that will be
    put back is counted when it comes back); other cases (pending, retrying,
    stale) are left to the caller (``claim._decide``, through :func:`change`).
    """
    d = dialect(alias)
    duplicate = (
        f"r.state IN ('{RunState.SUCCEEDED}', '{RunState.FAILED}', '{RunState.SKIPPED}') "
        f"OR (r.state = '{RunState.RUNNING}' AND r.lease_until > {d.now} AND %s) "
        f"OR (r.state = '{RunState.ABANDONED}' AND %s)"
    )
    upsert = (
        f"INSERT INTO {RUN} AS r (task_name, slot, state, attempt, fence, owner, created_at, "
        f"started_at, lease_until, error, duplicates) "
        f"VALUES (%s, %s, '{RunState.RUNNING}', 1, {d.next_fence}, %s, {d.now}, {d.now}, "
        f"{d.lease_from_now}, '', 0) "
        f"ON CONFLICT (task_name, slot) DO UPDATE SET duplicates = r.duplicates + "
        f"CASE WHEN {duplicate} THEN 1 ELSE 0 END "
        f"RETURNING {RETURNING}, lease_until <= {d.now}"
    )
    params: list[Any] = [
        task_name,
        _slot_param(alias, slot),
        owner,
        lease_seconds,
        count_live,
        abandon_is_final,
    ]
    log = (
        f"INSERT INTO {TRANSITION} (run_id, from_state, to_state, at, reason, owner) "
        f"SELECT id, '{RunState.PENDING}', '{RunState.RUNNING}', {d.now}, 'claimed', owner "
    )
    if d.one_statement:
        sql = f"WITH u AS ({upsert}), t AS ({log} FROM u WHERE owner = %s) SELECT * FROM u"
        row = _row(_execute(alias, sql, [*params, owner]))
    else:
        with transaction.atomic(using=alias):
            row = _row(_execute(alias, upsert, params))
            if row is not None and row.owner == owner:
                _execute(alias, f"{log} FROM {RUN} WHERE id = %s", [row.id])
    assert row is not None
    return row


def read(alias: str, task_name: str, slot: datetime) -> Row | None:
    d = dialect(alias)
    sql = (
        f"SELECT {RETURNING}, lease_until <= {d.now} FROM {RUN} WHERE task_name = %s AND slot = %s"
    )
    return _row(_execute(alias, sql, [task_name, _slot_param(alias, slot)]))


def read_by_id(alias: str, run_id: int) -> Row | None:
    d = dialect(alias)
    sql = f"SELECT {RETURNING}, lease_until <= {d.now} FROM {RUN} WHERE id = %s"
    return _row(_execute(alias, sql, [run_id]))


@dataclass(frozen=True)
class Step:
    to_state: str
    reason: str


def change(
    alias: str,
    row: Row,
    path: Sequence[Step],
    *,
    actor: str,
    fenced: bool = True,
    lease: str = "",
    sets: Sequence[Assignment] = (),
) -> Row | None:
    """Move ``row`` along ``path`` (one or more transitions) if it is still as read.

    Compares-and-sets on the row's state (and fence, when ``fenced``), and on
    its lease (``lease="expired"``/``"live"``, judged by the database clock).
    Writes one transition row per step in the same transaction. Returns the
    updated row, or ``None`` when the row had changed (the write is refused).
    """
    d = dialect(alias)
    state = row.state
    for step in path:
        check_transition(state, step.to_state)
        state = step.to_state
    assignments = [f"state = '{state}'"] + [sql for sql, _ in sets]
    params: list[Any] = [value for _, values in sets for value in values]
    where = f"r.id = %s AND r.state = '{row.state}'"
    params.append(row.id)
    if fenced:
        where += " AND r.fence = %s"
        params.append(row.fence)
    if lease == "expired":
        where += f" AND r.lease_until <= {d.now}"
    elif lease == "live":
        where += f" AND r.lease_until > {d.now}"
    update = f"UPDATE {RUN} AS r SET {', '.join(assignments)} WHERE {where} RETURNING {RETURNING}"
    steps: list[tuple[str, str, str]] = []
    before = row.state
    for step in path:
        steps.append((before, step.to_state, step.reason))
        before = step.to_state
    if d.one_statement:
        values = ", ".join(["(%s, %s, %s, %s)"] * len(steps))
        step_params = [p for i, s in enumerate(steps) for p in (*s, i)]
        sql = (
            f"WITH u AS ({update}), t AS (INSERT INTO {TRANSITION} "
            f"(run_id, from_state, to_state, at, reason, owner) "
            f"SELECT u.id, v.f, v.t, {d.now}, v.r, %s FROM u, (VALUES {values}) AS v(f, t, r, n) "
            f"ORDER BY v.n) SELECT * FROM u"
        )
        return _row(_execute(alias, sql, [*params, actor, *step_params]))
    with transaction.atomic(using=alias):
        updated = _row(_execute(alias, update, params))
        if updated is not None:
            with connections[alias].cursor() as cursor:
                cursor.executemany(
                    f"INSERT INTO {TRANSITION} (run_id, from_state, to_state, at, reason, owner) "
                    f"VALUES (%s, %s, %s, {d.now}, %s, %s)",
                    [(row.id, f, t, r, actor) for f, t, r in steps],
                )
        return updated


def start_assignments(alias: str, owner: str, lease_seconds: float) -> list[Assignment]:
    """The SET clauses that start a new attempt on an existing row."""
    d = dialect(alias)
    return [
        ("attempt = r.attempt + 1", ()),
        (f"fence = {d.next_fence}", ()),
        ("owner = %s", (owner,)),
        (f"started_at = {d.now}", ()),
        (f"lease_until = {d.lease_from_now}", (lease_seconds,)),
        ("finished_at = NULL", ()),
    ]


def finish_assignments(
    alias: str, error: str = "", duplicates: int = 0, *, ended: bool = True
) -> list[Assignment]:
    """The SET clauses that end an attempt (``ended=False``: a retry follows)."""
    d = dialect(alias)
    sets: list[Assignment] = [("error = %s", (error,))]
    if ended:
        sets.append((f"finished_at = {d.now}", ()))
    else:
        sets.append(("lease_until = NULL", ()))
    if duplicates:
        sets.append(("duplicates = r.duplicates + %s", (duplicates,)))
    return sets


def renew(alias: str, run_id: int, fence: int, lease_seconds: float) -> datetime | None:
    """Extend a live attempt's lease; ``None`` when the attempt no longer owns the row."""
    d = dialect(alias)
    sql = (
        f"UPDATE {RUN} AS r SET lease_until = {d.lease_from_now} "
        f"WHERE r.id = %s AND r.fence = %s AND r.state = '{RunState.RUNNING}' "
        f"RETURNING lease_until"
    )
    values = _execute(alias, sql, [lease_seconds, run_id, fence])
    return _aware(values[0]) if values else None


def earlier_slot_running(alias: str, task_name: str, slot: datetime) -> datetime | None:
    """The slot of a live attempt of ``task_name`` before ``slot``, if any."""
    d = dialect(alias)
    sql = (
        f"SELECT slot FROM {RUN} WHERE task_name = %s AND slot < %s "
        f"AND state = '{RunState.RUNNING}' AND lease_until > {d.now} ORDER BY slot LIMIT 1"
    )
    values = _execute(alias, sql, [task_name, _slot_param(alias, slot)])
    return _aware(values[0]) if values else None


def settle_connection(alias: str) -> None:
    """Drop a connection that failed mid-statement so the next read reconnects."""
    connections[alias].close()
