"""The ledger on PostgreSQL: a state change and its transition rows are one statement (a
data-modifying CTE), and so are the batch writes (arrays as parameters). Fences come
from a sequence (migration 0002)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property, lru_cache
from typing import Any

from django.db import NotSupportedError

from .base import Backend, Params, Values, fetch_all, one
from .fragments import (
    CLAIM_STATES,
    CLAIMED,
    CLAIMED_COLUMNS,
    END_ATTEMPT,
    FENCE_SEQUENCE,
    SCHEDULE,
    TRANSITION,
    TRANSITION_COLUMNS,
    Sets,
    counts_duplicate,
)

try:  # psycopg 3: the hot statements may be prepared (see :func:`one_prepared`)
    from psycopg import Connection as Psycopg3Connection
    from psycopg import Cursor as ServerBindingCursor
except ImportError:  # psycopg2, or no PostgreSQL driver at all
    Psycopg3Connection = ServerBindingCursor = None  # type: ignore[assignment,misc]


def one_prepared(connection: Any, statement: str, params: Params) -> Values | None:
    """:func:`.base.one` for the hot statements (each returns rows), bound by the server
    (psycopg 3), and prepared by it where the project lets psycopg prepare
    (``DATABASES[...]["OPTIONS"]["prepare_threshold"]`` not None; Django leaves it None so
    that connection poolers keep working).

    The statement goes through a server-binding cursor of psycopg's own on the same
    connection, wrapped by Django as its cursors are (``execute_wrapper``, error
    translation). With ``prepare_threshold`` None it is psycopg's unnamed statement (parse,
    bind and execute in one batch of messages: nothing named is left on the connection,
    safe through any pooler), its parameters apart from its text. With it set, psycopg
    prepares the statement once that many runs have been seen, per connection: a new
    connection prepares anew, nothing is shared between connections. A connection that
    logs its queries (``DEBUG``, ``assertNumQueries``) binds on the client: Django can show
    a client-bound statement's SQL, not a server-bound one's.
    """
    if connection.queries_logged:
        return one(connection, statement, params)
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    if Psycopg3Connection is None or not isinstance(connection.connection, Psycopg3Connection):
        return one(connection, statement, params)
    connection.validate_thread_sharing()
    try:
        return _server_bound(connection, statement, params)
    except NotSupportedError:
        # "cached plan must not change result type": a migration retyped a column the
        # statement returns since this connection prepared it. Nothing ran. In a
        # transaction, its rollback drops psycopg's prepared statements; in autocommit
        # nothing would, for the connection's life: drop them here and run it again.
        prepares = connection.settings_dict["OPTIONS"].get("prepare_threshold") is not None
        if connection.in_atomic_block or not prepares:
            raise
        with connection.cursor() as cursor:
            cursor.execute("DEALLOCATE ALL")  # psycopg forgets its own names too
        return _server_bound(connection, statement, params)


def _server_bound(connection: Any, statement: str, params: Params) -> Values | None:
    raw: Any = ServerBindingCursor(connection.connection)  # django-stubs: a CursorWrapper
    with connection.make_cursor(raw) as cursor:
        cursor.execute(statement, params)
        found: Values | None = cursor.fetchone()  # rows always: no ``description``
        return found


# Many tasks' rows for one slot at once, with the ``claimed`` transitions of the rows this
# statement created. Named parameters: tasks (text[]), owners (text[]), leases (seconds,
# float8[]), the slot, and CLAIM_STATES. A plainly taken slot (finished, abandoned, live)
# counts a duplicate, as a claim does for ``on_stale="abandon"`` (``abandon_is_final``:
# an abandoned row always counts, so ``abandoned`` is in the rule here). Not a skipped row
# at attempt 0 (skipped behind a live run, or an early call's refusal): the claim hands it
# to the one-task path, which counts it, or takes it over, as a single call would. Rows go in task
# order, so two schedulers claiming the same batch wait on each other instead of
# deadlocking.
CLAIM_MANY = (
    "WITH c AS (SELECT * FROM unnest(%(tasks)s::text[], %(owners)s::text[], "
    "%(leases)s::float8[]) AS c(task_name, owner, lease)), "
    f"u AS (INSERT INTO {{run}} AS r (task_name, slot, {CLAIMED_COLUMNS}) "
    "SELECT c.task_name, %(slot)s, %(running)s, 1, {fence}, c.owner, {now}, {now}, "
    "{now} + make_interval(secs => c.lease), '', 0 FROM c ORDER BY c.task_name "
    "ON CONFLICT (task_name, slot) DO UPDATE SET duplicates = r.duplicates + "
    f"CASE WHEN ({counts_duplicate(live='TRUE', abandoned='TRUE')}) "
    "AND NOT (r.state = %(skipped)s AND r.attempt = 0) THEN 1 ELSE 0 END "
    "RETURNING r.task_name, {row}, {left}), "
    "t AS (INSERT INTO {transition} ({columns}) "
    "SELECT u.id, %(pending)s, %(running)s, {now}, 'claimed', u.owner FROM u JOIN c USING (owner)) "
    "SELECT * FROM u"
)
# Many attempts recorded ``succeeded`` at once, each fenced like a change, with their
# transitions. Parameters: ids (bigint[]), fences (bigint[]), owners (text[]), reasons
# (text[]), the new state, the old state, the old state again, the new state again. The rows
# are locked first in (task, slot) order, the order :data:`CLAIM_MANY` locks them in: a
# batch finish and a batch claim on the same rows never deadlock.
SUCCEED_MANY = (
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
# Many rows no attempt ever held, with their transitions. Parameters: tasks (text[]),
# slots (timestamptz[]), reasons (text[]), state, from state, state again, actor. Returns
# the number of rows inserted.
INSERT_UNHELD_MANY = (
    "WITH c(task_name, slot, reason) AS "
    "(SELECT * FROM unnest(%s::text[], %s::timestamptz[], %s::text[])), "
    "i AS (INSERT INTO {run} (task_name, slot, state, attempt, fence, owner, created_at, "
    "finished_at, error, duplicates) SELECT task_name, slot, %s, 0, NULL, '', {now}, {now}, "
    "reason, 0 FROM c ON CONFLICT (task_name, slot) DO NOTHING "
    "RETURNING id, error, task_name, slot), "
    "t AS (INSERT INTO {transition} ({columns}) SELECT id, %s, %s, {now}, error, %s FROM i) "
    "SELECT task_name, slot FROM i"
)
# Tasks (text[]), a slot: each task's row of that slot (the batch claim's read-back after
# a lost reply).
READ_SLOT_MANY = (
    "SELECT task_name, {row}, {left} FROM {run} WHERE task_name = ANY(%s::text[]) AND slot = %s"
)


@dataclass(frozen=True)
class Function:
    """A hot statement of the backend's as a PL/pgSQL function (migration 0013).

    With Django's default ``OPTIONS`` every claim and finish sent as a data-modifying CTE
    is parsed, analysed and planned anew, about as long as running it. A PL/pgSQL
    function's statement is planned once per session and its plan kept (SPI's plan
    cache), while its call is a plain ``SELECT * FROM name(...)``: nothing named is left on
    the connection, so it is safe through any pooler. Its body is the backend's own
    statement (``RETURN QUERY``), the statement's parameters made the function's
    arguments and its states the names in ``states.py``: the SQL is written once.

    Names carry a version, and a body is never changed in place: the migration that
    creates a version holds its text, frozen, and ``tests/test_functions.py`` fails when
    the backend renders another body under that name. A change adds ``_v2`` beside
    ``_v1`` in a new migration (a rolling deploy's old code keeps calling its own), and a
    later release drops ``_v1``. A database migrated to an earlier release has no function: the call
    fails with ``undefined_function``, which the ledger reports as ``NotMigrated``.
    """

    name: str
    arguments: tuple[tuple[str, str], ...]  # (name, type), in the call's order
    returns: str
    body: str

    @property
    def call(self) -> str:
        """The statement that calls it: one ``%s`` per argument."""
        return f"SELECT * FROM {self.name}({', '.join(['%s'] * len(self.arguments))})"

    @property
    def signature(self) -> str:
        return ", ".join(f"{name} {kind}" for name, kind in self.arguments)

    @property
    def create(self) -> str:
        return (
            f"CREATE OR REPLACE FUNCTION {self.name}({self.signature}) RETURNS {self.returns} "
            f"LANGUAGE plpgsql VOLATILE AS $taskguard${self.body}$taskguard$"
        )

    @property
    def drop(self) -> str:
        return f"DROP FUNCTION IF EXISTS {self.name}({self.signature})"


def quoted_states(states: Mapping[str, str]) -> dict[str, str]:
    """States as SQL literals, for a function body (each a plain lowercase word)."""
    assert all(state.isidentifier() and state.islower() for state in states.values())
    return {name: f"'{state}'" for name, state in states.items()}


# What a function returns: the hot paths' row (``ROW``), and for a claim its lease's
# seconds left. Output names of their own: a body's column names must not meet them.
RETURNED_ROW = (
    "o_id bigint, o_state varchar, o_attempt integer, o_fence bigint, o_owner varchar, "
    "o_lease_until timestamptz"
)
CLAIM_ARGUMENTS = (
    ("p_task", "varchar"),
    ("p_slot", "timestamptz"),
    ("p_owner", "varchar"),
    ("p_lease", "float8"),
    ("p_count_live", "boolean"),
    ("p_abandon_final", "boolean"),
)
# The argument each of a claim's named parameters becomes.
CLAIM_NAMES = {
    "task": "p_task",
    "slot": "p_slot",
    "key": "p_key",
    "owner": "p_owner",
    "lease": "p_lease",
    "count_live": "p_count_live",
    "abandon_is_final": "p_abandon_final",
    **quoted_states(CLAIM_STATES),
}
# The end of a running attempt (``fragments.END_ATTEMPT``, fenced, one step): the
# arguments in the order of :meth:`PostgreSQLBackend.change_logged`'s parameters.
END_ATTEMPT_ARGUMENTS = (
    ("p_state", "varchar"),
    ("p_error", "text"),
    ("p_duplicates", "integer"),
    ("p_id", "bigint"),
    ("p_expected", "varchar"),
    ("p_fence", "bigint"),
    ("p_actor", "varchar"),
    ("p_reason", "text"),
)
END_ATTEMPT_UPDATE = (END_ATTEMPT, True, "", False)


class PostgreSQLBackend(Backend):
    vendor = "postgresql"
    writes_transitions_in_statement = True
    writes_in_batches = True

    now = "statement_timestamp()"
    lease_after = "statement_timestamp() + make_interval(secs => {seconds})"
    seconds_ago = "statement_timestamp() - make_interval(secs => %s)"
    lease_left = "EXTRACT(EPOCH FROM lease_until - statement_timestamp())"
    next_fence = f"nextval('{FENCE_SEQUENCE}')"
    duration = "EXTRACT(EPOCH FROM (finished_at - started_at))"
    # PostgreSQL cannot infer a parameter's type in a VALUES row.
    name_row = "(CAST(%s AS varchar))"
    task_row = "(CAST(%s AS varchar), CAST(%s AS timestamp with time zone))"
    # 100,000 schedules' health in one statement: the names (and due slots) as arrays.
    binds_arrays = True

    def names_table(self, names: int) -> str:
        return "SELECT * FROM unnest(CAST(%s AS varchar[]))"

    def tasks_table(self, tasks: int) -> str:
        return "SELECT * FROM unnest(CAST(%s AS varchar[]), CAST(%s AS timestamp with time zone[]))"

    def connection_lost(self, exc: Exception) -> bool:
        return True

    def estimated_rows(self, queryset: Any) -> int | None:
        plan = json.loads(queryset.order_by().explain(format="json"))
        return int(plan[0]["Plan"]["Plan Rows"])

    # -- claiming: the upsert and its ``claimed`` transition, one statement ------------

    def logged_claim(self, upsert: str) -> str:
        """``upsert`` and the ``claimed`` transition of a row it made (the transition is
        written only when this call created the row: the row's owner is the claim's)."""
        claimed = self.format(CLAIMED)
        return (
            f"WITH u AS ({upsert}), t AS ({claimed} FROM u WHERE owner = %(owner)s) SELECT * FROM u"
        )

    @cached_property
    def claim_logged(self) -> str:
        return self.logged_claim(self.claim_statement)

    @cached_property
    def claim_key_logged(self) -> str:
        return self.logged_claim(self.claim_key_statement)

    def claim(self, connection: Any, params: Mapping[str, Any]) -> Values | None:
        names = ("task", "slot", "owner", "lease", "count_live", "abandon_is_final")
        arguments = [params[name] for name in names]
        return one_prepared(connection, self.claim_function.call, arguments)

    def claim_key(self, connection: Any, params: Mapping[str, Any]) -> Values | None:
        names = ("task", "slot", "key", "owner", "lease", "count_live", "abandon_is_final")
        arguments = [params[name] for name in names]
        return one_prepared(connection, self.claim_key_function.call, arguments)

    # -- the hot statements as functions (:class:`Function`, migration 0013) ------------

    @cached_property
    def claim_function(self) -> Function:
        return Function(
            name="taskguard_claim_v1",
            arguments=CLAIM_ARGUMENTS,
            returns=f"TABLE ({RETURNED_ROW}, o_left numeric)",
            body=f" BEGIN RETURN QUERY {self.claim_logged % CLAIM_NAMES}; END; ",
        )

    @cached_property
    def claim_key_function(self) -> Function:
        arguments = (*CLAIM_ARGUMENTS[:2], ("p_key", "varchar"), *CLAIM_ARGUMENTS[2:])
        return Function(
            name="taskguard_claim_key_v1",
            arguments=arguments,
            returns=f"TABLE ({RETURNED_ROW}, o_left numeric)",
            body=f" BEGIN RETURN QUERY {self.claim_key_logged % CLAIM_NAMES}; END; ",
        )

    @cached_property
    def end_attempt_function(self) -> Function:
        # The one step's (from, to, reason, order): the expected state, the new one.
        names = [name for name, _ in END_ATTEMPT_ARGUMENTS]
        step = ("p_expected", "p_state", "p_reason", "0")
        statement = self.change_logged(*END_ATTEMPT_UPDATE, 1) % (*names[:7], *step)
        return Function(
            name="taskguard_end_attempt_v1",
            arguments=END_ATTEMPT_ARGUMENTS,
            returns=f"TABLE ({RETURNED_ROW})",
            body=f" BEGIN RETURN QUERY {statement}; END; ",
        )

    @cached_property
    def functions(self) -> tuple[Function, ...]:
        return (self.claim_function, self.claim_key_function, self.end_attempt_function)

    def claim_many(self, connection: Any, params: Mapping[str, Any]) -> list[Values] | None:
        return fetch_all(connection, self.claim_many_statement, {**params, **CLAIM_STATES})

    @cached_property
    def claim_many_statement(self) -> str:
        return self.format(CLAIM_MANY)

    def succeed_many(self, connection: Any, params: Sequence[Any]) -> list[Values] | None:
        return fetch_all(connection, self.succeed_many_statement, params)

    @cached_property
    def succeed_many_statement(self) -> str:
        return self.format(SUCCEED_MANY)

    def read_slot_many(self, connection: Any, params: Sequence[Any]) -> list[Values] | None:
        return fetch_all(connection, self.read_slot_many_statement, params)

    @cached_property
    def read_slot_many_statement(self) -> str:
        return self.format(READ_SLOT_MANY)

    def insert_unheld_many(
        self, connection: Any, params: Sequence[Any]
    ) -> list[tuple[str, datetime]] | None:
        found = fetch_all(connection, self.insert_unheld_many_statement, params)
        return [(str(task), slot) for task, slot in found]

    @cached_property
    def insert_unheld_many_statement(self) -> str:
        return self.format(INSERT_UNHELD_MANY)

    # -- the missed-slot sweep's marks: a page of schedules in one statement -----------

    marks_in_one_statement = True

    @cached_property
    def mark_swept_many(self) -> str:
        """Per schedule (arrays: id, until, due, version, the next look as read): move
        ``swept_until`` to ``until`` (never back; NULL: leave it) and set ``sweep_due_at``
        to ``due`` if the row is still as read (its version and next look), else NULL."""
        return (
            f"UPDATE {SCHEDULE} AS s SET "
            "swept_until = CASE WHEN v.until IS NULL THEN s.swept_until "
            "ELSE GREATEST(COALESCE(s.swept_until, v.until), v.until) END, "
            "sweep_due_at = CASE WHEN s.version = v.version AND "
            "s.sweep_due_at IS NOT DISTINCT FROM v.read THEN v.due END "
            "FROM unnest(CAST(%s AS bigint[]), CAST(%s AS timestamp with time zone[]), "
            "CAST(%s AS timestamp with time zone[]), CAST(%s AS integer[]), "
            "CAST(%s AS timestamp with time zone[])) AS v(id, until, due, version, read) "
            "WHERE s.id = v.id"
        )

    # -- changing a row: the update and its transitions, one statement -----------------

    @lru_cache  # noqa: B019 (one backend per database, for the process's life)
    def change_logged(
        self, sets: Sets, fenced: bool, lease: str, retry_by: bool, steps: int
    ) -> str:
        """:meth:`update` and its ``steps`` transition rows in one statement.

        Parameters: the update's, the actor, then (from, to, reason, order) per step.
        """
        update = self.update(sets, fenced, lease, retry_by)
        values = ", ".join(["(%s, %s, %s, %s)"] * steps)
        return (
            f"WITH u AS ({update}), t AS (INSERT INTO {TRANSITION} ({TRANSITION_COLUMNS}) "
            f"SELECT u.id, v.f, v.t, {self.now}, v.r, %s FROM u, (VALUES {values}) "
            f"AS v(f, t, r, n) ORDER BY v.n) SELECT * FROM u"
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
        if update == END_ATTEMPT_UPDATE and len(steps) == 1:  # a finish: its function
            reason = steps[0][2]
            arguments = [*params, actor, reason]
            return one_prepared(connection, self.end_attempt_function.call, arguments)
        statement = self.change_logged(*update, len(steps))
        step_params = [p for n, step in enumerate(steps) for p in (*step, n)]
        return one_prepared(connection, statement, [*params, actor, *step_params])

    # -- renewing ----------------------------------------------------------------------

    def bound_transaction(self, connection: Any, milliseconds: int) -> None:
        """``SET LOCAL`` (``set_config(..., true)``) of ``statement_timeout`` and
        ``lock_timeout``, for the renewal's own transaction only."""
        ms = int(milliseconds)  # a number, never text: safe to write into the statement
        one(
            connection,
            f"SELECT set_config('statement_timeout', '{ms}', true), "
            f"set_config('lock_timeout', '{ms}', true)",
            [],
        )

    # -- the ledger's own row ----------------------------------------------------------

    fence_at_least_statement = (
        f"SELECT setval('{FENCE_SEQUENCE}', GREATEST(%s, "
        f"(SELECT last_value FROM {FENCE_SEQUENCE})))"
    )

    # -- monitoring --------------------------------------------------------------------

    def recent_limit(self, limit: int) -> int:
        return limit

    @lru_cache  # noqa: B019
    def recent_runs(self, tasks: int) -> str:
        """A LATERAL join says it with a LIMIT the planner sees (a plan that looks cheap, so
        no JIT compilation on a big table). Parameter after the VALUES: the limit."""
        return self.format(
            f"WITH t(name) AS ({self.names_table(tasks)}) "
            "SELECT t.name, r.id, r.slot, r.state FROM t CROSS JOIN LATERAL "
            "(SELECT q.id, q.slot, q.state FROM {run} q WHERE q.task_name = t.name "
            "ORDER BY q.slot DESC LIMIT %s) AS r"
        )
