"""The ledger's backend: the statements and strategies every database implements.

One subclass per database (:mod:`.postgresql`, :mod:`.mysql`, :mod:`.sqlite`) holds that
database's SQL; what they share is here or in :mod:`.fragments`. Like Django's
``django/db/backends/base/features.py``, what a database can do is a documented class
attribute (a capability flag), and the statements and strategies read those flags, never
the vendor's name.

Statements take named ``%(name)s`` parameters (the claims, the renewal, the reads that
name a state) or ``%s`` ones (the rest, their order in the docstring). State names are
parameters, from the sets of :mod:`django_taskguard.states`, never pasted into SQL.
Deadlines are judged by the database's clock (:attr:`Backend.now`).

A strategy (:meth:`Backend.claim`, :meth:`Backend.change`, :meth:`Backend.renew`...)
runs its statements on the ledger's connection it is given and returns the row's values
as the database gave them (``None``: nothing was written); :mod:`..core` turns them into
rows and translates errors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from typing import Any, ClassVar

from django.db import transaction

from ...states import PRUNABLE_STATES
from .fragments import (
    CLAIM_STATES,
    CLAIMED,
    CLAIMED_COLUMNS,
    CLAIMED_STATES,
    CLAIMED_VALUES,
    FENCE_SEQUENCE,
    FIRST_START,
    REFUSED_EARLY,
    ROW,
    RUN,
    TRANSITION,
    TRANSITION_COLUMNS,
    TRANSITION_ROW,
    Sets,
    counts_duplicate,
)

Values = Sequence[Any]
# A statement's parameters: a list for ``%s``, a mapping for ``%(name)s``.
Params = Sequence[Any] | Mapping[str, Any]


def one(connection: Any, statement: str, params: Params) -> Values | None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchone() if cursor.description else None


def fetch_all(connection: Any, statement: str, params: Params) -> list[Values]:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return list(cursor.fetchall())


def placeholders(count: int) -> str:
    return ", ".join(["%s"] * count)


class Backend:
    """The ledger on one database. One instance per database alias, for the process's life
    (:func:`..backend_for`): its statements are built once and cached on it."""

    vendor: ClassVar[str]

    # -- capabilities (what the database can do; the statements and strategies read these)

    writes_transitions_in_statement: ClassVar[bool] = False
    """A write and its transition rows are one statement (data-modifying CTEs): a claim, a
    change and the batch writes are one round trip and one atomic unit."""

    returns_from_update: ClassVar[bool] = True
    """``UPDATE ... RETURNING``. Without it a change reads its row back in its transaction,
    under the lock the ``UPDATE`` took."""

    has_compound_statements: ClassVar[bool] = False
    """A write and its transitions as one anonymous compound statement with a transaction of
    its own (``BEGIN NOT ATOMIC``): one round trip, but only on a connection in autocommit
    (``START TRANSACTION`` inside the caller's transaction would commit it)."""

    fences_from_ledger_row: ClassVar[bool] = False
    """Fences come from the ledger row's counter, moved on first in the writer's transaction
    (one writer at a time), not from a sequence."""

    checks_foreign_keys_per_statement: ClassVar[bool] = False
    """Foreign keys are checked at each statement, not at commit: a run's transitions are
    deleted before it, so the run is locked first and deleted last."""

    upsert_meets_any_unique_key: ClassVar[bool] = False
    """The upsert has no conflict target (``ON DUPLICATE KEY UPDATE``): a keyed claim may
    meet another key's row on (task, slot), which it returns unchanged with its key."""

    writes_in_batches: ClassVar[bool] = False
    """Many tasks' claims, successes, missed slots and reads of one slot in one statement
    (arrays as parameters). Without it the callers go one row at a time."""

    # -- the database's own expressions ------------------------------------------------

    now: ClassVar[str]
    """The database's clock, for deadlines and timestamps."""
    lease_after: ClassVar[str]
    """A lease's end: now plus ``{seconds}`` (a parameter: ``%s``, or ``%(lease)s`` in the
    claims)."""
    seconds_ago: ClassVar[str]
    """Now less one ``%s`` parameter of seconds."""
    lease_left: ClassVar[str]
    """Seconds until ``lease_until``, by the database's clock (NULL: no lease)."""
    next_fence: ClassVar[str]
    """The next fence."""
    duration: ClassVar[str]
    """A finished attempt's duration in seconds (NULL when it has no start or end)."""
    lateness: ClassVar[str]
    """A run's start less its slot, in seconds (NULL when it has not started)."""
    key: ClassVar[str] = '"key"'
    """The key column, quoted (a reserved word)."""
    min_slot: ClassVar[str] = "'0000-01-01'"
    """Before every slot (the boundary of a scan that finds no N-th latest slot)."""
    name_row: ClassVar[str] = "(%s)"
    """A VALUES row of one task name."""
    task_row: ClassVar[str] = "(%s, %s)"
    """A VALUES row of (task name, due slot)."""
    task_state_hint: ClassVar[str] = ""
    """Where the planner must be told to probe (task_name, state, slot)."""
    marks_in_one_statement: ClassVar[bool] = False
    """Whether :attr:`mark_swept_many` writes the sweep's marks of many schedules in one
    statement (else the ORM writes a statement per group of equal values)."""
    binds_arrays: ClassVar[bool] = False
    """Whether the monitoring reads bind their task names (and due slots) as one array
    each (one statement for any number of tasks), not as a VALUES list per chunk."""

    @property
    def mark_swept_many(self) -> str:
        """The statement of :attr:`marks_in_one_statement` (where it is True)."""
        raise NotImplementedError

    def names_table(self, names: int) -> str:
        """The rows ``t(name)`` of ``names`` task names (:attr:`binds_arrays`: one array
        parameter, whatever ``names``)."""
        return "VALUES " + ", ".join([self.name_row] * names)

    def tasks_table(self, tasks: int) -> str:
        """The rows ``t(name, due)`` of ``tasks`` (task name, due slot) pairs."""
        return "VALUES " + ", ".join([self.task_row] * tasks)

    def format(self, template: str) -> str:
        return template.format(
            run=RUN,
            transition=TRANSITION,
            columns=TRANSITION_COLUMNS,
            now=self.now,
            lease=self.lease_after.format(seconds="%s"),
            lease_named=self.lease_after.format(seconds="%(lease)s"),
            fence=self.next_fence,
            row=ROW,
            left=self.lease_left,
            lateness=self.lateness,
            key=self.key,
            min_slot=self.min_slot,
            hint=self.task_state_hint,
        )

    def server_problem(self, connection: Any) -> str | None:
        """Why the ledger cannot live on this server (None: it can)."""
        return None

    def connection_lost(self, exc: Exception) -> bool:
        """True when ``exc`` (a connection error) may have cut a statement off mid-flight:
        the outcome is unknown, and reading the row back decides."""
        return True

    def estimated_rows(self, queryset: Any) -> int | None:
        """The planner's estimate of ``queryset``'s row count, where the database gives one
        without counting (None: count them)."""
        return None

    # -- claiming ----------------------------------------------------------------------

    @cached_property
    def claim_statement(self) -> str:
        """Upsert the (task, slot) row as ``running``. Named parameters: task, slot, owner,
        lease (seconds), count_live, abandon_is_final, and :data:`.fragments.CLAIM_STATES`.
        A plainly taken slot counts a duplicate."""
        return self.format(
            f"INSERT INTO {{run}} AS r (task_name, slot, {CLAIMED_COLUMNS}) "
            f"VALUES (%(task)s, %(slot)s, {CLAIMED_VALUES}) "
            "ON CONFLICT (task_name, slot) DO UPDATE SET duplicates = r.duplicates + "
            f"CASE WHEN {counts_duplicate()} THEN 1 ELSE 0 END "
            "RETURNING {row}, {left}"
        )

    @cached_property
    def claim_key_statement(self) -> str:
        """:attr:`claim_statement` for a keyed run: the row of (task, key), its slot the
        claim's time. Named parameters: :attr:`claim_statement`'s and the key."""
        return self.format(
            f"INSERT INTO {{run}} AS r (task_name, slot, {{key}}, {CLAIMED_COLUMNS}) "
            f"VALUES (%(task)s, %(slot)s, %(key)s, {CLAIMED_VALUES}) "
            "ON CONFLICT (task_name, {key}) WHERE {key} IS NOT NULL DO UPDATE SET duplicates = "
            f"r.duplicates + CASE WHEN {counts_duplicate()} THEN 1 ELSE 0 END "
            "RETURNING {row}, {left}"
        )

    @cached_property
    def claimed_transition(self) -> str:
        """The ``claimed`` transition of run ``%(id)s`` (after a claim that made the row;
        with :data:`.fragments.CLAIMED_STATES`)."""
        return self.format(CLAIMED) + f"FROM {RUN} WHERE id = %(id)s"

    def claim(self, connection: Any, params: Mapping[str, Any]) -> Values | None:
        """The claim and, when it made the row (the row's owner is ``params["owner"]``),
        its ``claimed`` transition: the row and its lease left. Parameters:
        :attr:`claim_statement`'s but the states."""
        return self._claim_in_transaction(connection, self.claim_statement, params)

    def claim_key(self, connection: Any, params: Mapping[str, Any]) -> Values | None:
        """:meth:`claim` of a keyed run (``params["key"]``). Raises ``IntegrityError`` when
        the (task, slot) constraint refused it (another key's row has the slot)."""
        return self._claim_in_transaction(connection, self.claim_key_statement, params)

    def _claim_in_transaction(
        self, connection: Any, statement: str, params: Mapping[str, Any]
    ) -> Values | None:
        with transaction.atomic(using=connection.alias):
            self.fence_moved_on(connection)
            found = one(connection, statement, {**params, **CLAIM_STATES})
            self.log_claimed(connection, found, params["owner"])
        return found

    def log_claimed(self, connection: Any, found: Values | None, owner: str) -> None:
        """The ``claimed`` transition of the row a claim returned, when it made it."""
        if found is not None and found[4] == owner:
            one(connection, self.claimed_transition, {"id": found[0], **CLAIMED_STATES})

    def fence_moved_on(self, connection: Any) -> None:
        """Before a write that hands out a fence, in its transaction (see
        :attr:`fences_from_ledger_row`)."""

    def claim_many(self, connection: Any, params: Mapping[str, Any]) -> list[Values] | None:
        """Many tasks' rows of one slot at once (named parameters: tasks, owners, leases, the
        slot), with their ``claimed`` transitions (None: not in one statement, see
        :attr:`writes_in_batches`)."""
        return None

    def succeed_many(self, connection: Any, params: Sequence[Any]) -> list[Values] | None:
        """Many attempts recorded ``succeeded`` at once (None: not in one statement)."""
        return None

    def read_slot_many(self, connection: Any, params: Sequence[Any]) -> list[Values] | None:
        """Each task's row of one slot (None: not in one statement)."""
        return None

    def insert_unheld_many(
        self, connection: Any, params: Sequence[Any]
    ) -> list[tuple[str, datetime]] | None:
        """Many rows no attempt held, with their transitions; the ``(task, slot)`` of each
        row written (None: not in one statement)."""
        return None

    # -- reading -----------------------------------------------------------------------

    @cached_property
    def read_slot(self) -> str:
        return self.format("SELECT {row}, {left} FROM {run} WHERE task_name = %s AND slot = %s")

    @cached_property
    def last_slot_from(self) -> str:
        """A keyed claim that met another key's row on (task, slot): the latest slot the
        task has from there on (the (task, slot) index answers it), so the claim takes the
        next one."""
        return self.format("SELECT MAX(slot) FROM {run} WHERE task_name = %s AND slot >= %s")

    @cached_property
    def read_key(self) -> str:
        return self.format("SELECT {row}, {left} FROM {run} WHERE task_name = %s AND {key} = %s")

    @cached_property
    def read_id(self) -> str:
        return self.format("SELECT {row}, {left} FROM {run} WHERE id = %s")

    @cached_property
    def earlier_running(self) -> str:
        """The slot of a live attempt of a task before a slot (named parameters: task, slot,
        running)."""
        return self.format(
            "SELECT slot FROM {run} WHERE task_name = %(task)s AND slot < %(slot)s "
            "AND state = %(running)s AND lease_until > {now} ORDER BY slot LIMIT 1"
        )

    @cached_property
    def read_now(self) -> str:
        """The database's clock, read (run without parameters: no ``%`` is doubled)."""
        return f"SELECT {self.now}"

    # -- changing a row ----------------------------------------------------------------

    @lru_cache  # noqa: B019 (one backend per database, for the process's life)
    def assignments(self, sets: Sets) -> tuple[str, ...]:
        return tuple(self.format(clause) for clause in sets.clauses)

    @lru_cache  # noqa: B019
    def update(self, sets: Sets, fenced: bool, lease: str, retry_by: bool = False) -> str:
        """Compare-and-set one row: ``SET state = %s, <sets> WHERE id, state[, fence][, lease]
        [, retry_by]``.

        Parameters: the new state, the sets' own, the id, the expected state, the fence
        when ``fenced``, the caller's message id when ``retry_by`` (the row names no
        message that asked for its retry, or names this one, or that retry is overdue:
        its deadline passed, so it never came and any copy may start the attempt).
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
        assignments = ", ".join(("state = %s", *self.assignments(sets)))
        returning = " RETURNING {row}" if self.returns_from_update else ""
        return self.format(f"UPDATE {{run}} AS r SET {assignments} WHERE {where}{returning}")

    @cached_property
    def transition(self) -> str:
        """One transition row: run, from, to, reason, actor (at = the database's now)."""
        return self.format(f"INSERT INTO {{transition}} ({{columns}}) VALUES {TRANSITION_ROW}")

    @cached_property
    def changed_row(self) -> str:
        """The row an ``UPDATE`` without ``RETURNING`` changed, read back in its transaction
        (its lock still held: the row as changed)."""
        return self.format("SELECT {row} FROM {run} WHERE id = %s")

    def change(
        self,
        connection: Any,
        update: tuple[Sets, bool, str, bool],
        params: Sequence[Any],
        run_id: int,
        steps: Sequence[tuple[str, str, str]],
        actor: str,
    ) -> Values | None:
        """Compare-and-set run ``run_id`` by :meth:`update` (its arguments ``update``, its
        parameters ``params``) and write one transition per step ``(from, to, reason)``,
        as one atomic unit: the row as changed, or None."""
        sets = update[0]
        with transaction.atomic(using=connection.alias):
            if sets.new_fence:
                self.fence_moved_on(connection)
            found = self._update(connection, self.update(*update), params, run_id)
            if found is not None:
                with connection.cursor() as cursor:
                    cursor.executemany(
                        self.transition, [(run_id, f, t, r, actor) for f, t, r in steps]
                    )
        return found

    def _update(
        self, connection: Any, statement: str, params: Sequence[Any], run_id: int
    ) -> Values | None:
        if self.returns_from_update:
            return one(connection, statement, params)
        with connection.cursor() as cursor:
            cursor.execute(statement, params)
            if cursor.rowcount == 0:
                return None
        return one(connection, self.changed_row, [run_id])

    # -- renewing a lease --------------------------------------------------------------

    @cached_property
    def renew_statement(self) -> str:
        """Extend the lease of a running attempt (named parameters: lease (seconds), id,
        fence, running)."""
        returning = " RETURNING lease_until" if self.returns_from_update else ""
        return self.format(
            "UPDATE {run} AS r SET lease_until = {lease_named} "
            "WHERE r.id = %(id)s AND r.fence = %(fence)s AND r.state = %(running)s" + returning
        )

    def renew(
        self, connection: Any, params: Mapping[str, Any], milliseconds: int | None
    ) -> Values | None:
        """:attr:`renew_statement`, bounded (its waits for locks and its run time) by
        ``milliseconds`` when given: the new ``lease_until``, or None (not renewed)."""
        if milliseconds is None:
            return one(connection, self.renew_statement, params)
        with transaction.atomic(using=connection.alias):
            self.bound_transaction(connection, milliseconds)
            return one(connection, self.renew_statement, params)

    def bound_transaction(self, connection: Any, milliseconds: int) -> None:
        """Bound the rest of the current transaction to ``milliseconds``."""
        raise NotImplementedError

    # -- counting and recording what no attempt wrote ----------------------------------

    @cached_property
    def add_duplicates(self) -> str:
        return self.format(
            "UPDATE {run} SET duplicates = duplicates + %s WHERE task_name = %s AND slot = %s"
        )

    @cached_property
    def count_other_copy(self) -> str:
        """A copy that found the row retrying for another message, whose retry is not
        overdue (named parameters: id, message: the copy's message id or NULL, retrying):
        counted, in the same statement that checks it; no row: it was not."""
        return self.format(
            "UPDATE {run} SET duplicates = duplicates + 1 WHERE id = %(id)s "
            "AND state = %(retrying)s AND retry_by IS NOT NULL "
            "AND retry_by <> COALESCE(%(message)s, '') AND lease_until > {now}"
        )

    @cached_property
    def add_duplicates_key(self) -> str:
        return self.format(
            "UPDATE {run} SET duplicates = duplicates + %s WHERE task_name = %s AND {key} = %s"
        )

    @cached_property
    def store_result(self) -> str:
        """The JSON result of a keyed run (return_result=True), written by its live attempt
        (fenced): result, id, fence, the running state."""
        return self.format(
            "UPDATE {run} SET result = %s WHERE id = %s AND fence = %s AND state = %s"
        )

    @cached_property
    def read_result(self) -> str:
        return self.format("SELECT state, result FROM {run} WHERE task_name = %s AND {key} = %s")

    # ``INSERT`` that leaves a row already there alone, returning the id of a new one.
    insert_new: ClassVar[str] = "INSERT INTO "

    def unless_there(self, target: str) -> str:
        return f"ON CONFLICT {target} DO NOTHING "

    @cached_property
    def insert_unheld(self) -> str:
        """task, slot, state, reason (the error), duplicates: a row no attempt ever held."""
        return self.format(
            self.insert_new
            + "{run} (task_name, slot, state, attempt, fence, owner, created_at, finished_at, "
            "error, duplicates) VALUES (%s, %s, %s, 0, NULL, '', {now}, {now}, %s, %s) "
            + self.unless_there("(task_name, slot)")
            + "RETURNING id"
        )

    @cached_property
    def insert_unheld_key(self) -> str:
        """task, slot, key, state, reason (the error), duplicates: a keyed row no attempt held."""
        return self.format(
            self.insert_new
            + "{run} (task_name, slot, {key}, state, attempt, fence, owner, created_at, "
            "finished_at, error, duplicates) "
            "VALUES (%s, %s, %s, %s, 0, NULL, '', {now}, {now}, %s, %s) "
            + self.unless_there("(task_name, {key}) WHERE {key} IS NOT NULL")
            + "RETURNING id"
        )

    @cached_property
    def insert_pending(self) -> str:
        """task, slot, the pending state: a slot handed to a task queue and not started yet
        (run_schedules --enqueue)."""
        return self.format(
            self.insert_new
            + "{run} (task_name, slot, state, attempt, fence, owner, created_at, error, "
            "duplicates) VALUES (%s, %s, %s, 0, NULL, '', {now}, '', 0) "
            + self.unless_there("(task_name, slot)")
            + "RETURNING id"
        )

    @cached_property
    def give_back_pending(self) -> str:
        """id, the pending state: a pending row whose hand-off failed is given back, only
        while nothing started it."""
        return self.format(
            "DELETE FROM {run} WHERE id = %s AND state = %s AND attempt = 0 RETURNING id"
        )

    # -- deleting runs -----------------------------------------------------------------

    def delete_runs_where(self, where: str) -> str:
        """Delete the runs ``where`` holds for, returning their ids."""
        return f"DELETE FROM {RUN} WHERE {where} RETURNING id"

    def delete_runs(
        self, connection: Any, statement: str, params: Sequence[Any]
    ) -> tuple[int, int]:
        """Delete the runs a :meth:`delete_runs_where` statement picks, and their
        transitions, in the caller's transaction: (runs, transitions) deleted."""
        deleted = [run_id for (run_id,) in fetch_all(connection, statement, params)]
        if not deleted:
            return 0, 0
        with connection.cursor() as cursor:
            cursor.execute(self.delete_transitions(len(deleted)), deleted)
            transitions = max(cursor.rowcount, 0)
            self.delete_locked_runs(cursor, deleted)
        return len(deleted), transitions

    def delete_locked_runs(self, cursor: Any, ids: list[int]) -> None:
        """The runs :meth:`delete_runs_where` locked instead of deleting (see
        :attr:`checks_foreign_keys_per_statement`)."""

    @lru_cache  # noqa: B019
    def delete_transitions(self, count: int) -> str:
        return f"DELETE FROM {TRANSITION} WHERE run_id IN ({placeholders(count)})"

    @cached_property
    def reopen_key(self) -> str:
        """id, keep seconds, then the prunable states: a finished keyed run whose ``keep``
        has run out (by the database's clock) is deleted, so its key may run again."""
        states = placeholders(len(PRUNABLE_STATES))
        where = (
            f"id = %s AND {{key}} IS NOT NULL AND "
            f"COALESCE(finished_at, created_at) <= {self.seconds_ago} AND state IN ({states})"
        )
        return self.format(self.delete_runs_where(where))

    @lru_cache  # noqa: B019
    def delete_finished(self, count: int) -> str:
        """Delete ``count`` runs by id if they are (still) in one of the prunable states, or
        ``pending`` with their slot and the time they were made pending before a time
        (parameters: the ids, the prunable states, ``'pending'``, that time twice)."""
        ids = placeholders(count)
        states = placeholders(len(PRUNABLE_STATES))
        given_back = "state = %s AND slot < %s AND COALESCE(finished_at, created_at) < %s"
        return self.delete_runs_where(f"id IN ({ids}) AND (state IN ({states}) OR ({given_back}))")

    # -- schedules: what the scheduler and the missed-slot sweep read ------------------

    @cached_property
    def latest_slot(self) -> str:
        """The newest slot of task ``%s`` with a row not in state ``%s`` (the (task, slot)
        index)."""
        return self.format("SELECT MAX(slot) FROM {run} WHERE task_name = %s AND state <> %s")

    @cached_property
    def slots_in(self) -> str:
        """The slots with a row of a task in ``(after, until]`` (an early call's refusal is
        none). Named parameters: task, after, until, skipped."""
        return self.format(
            "SELECT slot FROM {run} WHERE task_name = %(task)s AND slot > %(after)s "
            f"AND slot <= %(until)s AND NOT (state = %(skipped)s AND {REFUSED_EARLY})"
        )

    @lru_cache(maxsize=16)  # noqa: B019
    def states_at(self, count: int) -> str:
        """The slot and state of each row of a task at one of ``count`` slots (one probe of
        (task, slot) each); a row that only recorded an early call's refusal is none. Named
        parameters: task, slot_0 ... slot_<count - 1>, skipped."""
        slots = ", ".join(f"%(slot_{n})s" for n in range(count))
        return self.format(
            f"SELECT slot, state FROM {{run}} WHERE task_name = %(task)s AND slot IN ({slots}) "
            f"AND NOT (state = %(skipped)s AND {REFUSED_EARLY})"
        )

    @cached_property
    def last_states(self) -> str:
        """The states of task ``%s``'s newest ``%s`` finished rows, newest first."""
        return self.format(
            "SELECT state FROM {run} WHERE task_name = %s AND state IN (%s, %s, %s) "
            "ORDER BY slot DESC LIMIT %s"
        )

    def task_names(self, limited: bool = True) -> str:
        """The first ``%s`` distinct task names (``limited=False``: all, no parameter), by a
        loose index scan of (task_name, slot): a recursive CTE hops from name to next name
        through the index (no skip scan)."""
        limit = " LIMIT %s" if limited else ""
        return (
            f"WITH RECURSIVE names(name) AS (SELECT MIN(task_name) FROM {RUN} "
            f"UNION ALL SELECT (SELECT MIN(task_name) FROM {RUN} WHERE task_name > names.name) "
            f"FROM names WHERE names.name IS NOT NULL) "
            f"SELECT name FROM names WHERE name IS NOT NULL{limit}"
        )

    # -- the ledger's own row ----------------------------------------------------------

    fence_at_least_statement: ClassVar[str]
    """Make the next fence larger than ``%s`` (rows imported with their fences)."""

    def fence_at_least(self, connection: Any, value: int) -> None:
        with transaction.atomic(using=connection.alias):
            one(connection, self.fence_at_least_statement, [value])

    # -- monitoring (health, metrics, the admin's overview) ----------------------------

    @lru_cache  # noqa: B019
    def window_summary(self, durations: int, lateness: int) -> str:
        """Per (task, state) over the slots since ``%(since)s``: runs, duplicates, duration
        sum and count, how many durations are at most each of ``durations`` bounds
        (``%(duration_0)s``...), then the same of the start lateness of the slots' first
        attempts (:data:`FIRST_START`, ``%(first)s``; bounds ``%(lateness_0)s``...).

        A range scan of the slot index: its cost is the number of runs in the window.
        """
        duration = self.duration
        late = f"CASE WHEN {FIRST_START.format(r=RUN)} THEN {self.lateness} END"
        late = late.replace("%s", "%(first)s").replace("{key}", self.key)
        counts = "".join(
            f", SUM(CASE WHEN {duration} <= %(duration_{i})s THEN 1 ELSE 0 END)"
            for i in range(durations)
        ) + "".join(
            f", SUM(CASE WHEN {late} <= %(lateness_{i})s THEN 1 ELSE 0 END)"
            for i in range(lateness)
        )
        return (
            f"SELECT task_name, state, COUNT(*), COALESCE(SUM(duplicates), 0), "
            f"COALESCE(SUM({duration}), 0), COUNT({duration}), "
            f"COALESCE(SUM({late}), 0), COUNT({late}){counts} "
            f"FROM {RUN} WHERE slot >= %(since)s GROUP BY task_name, state"
        )

    @lru_cache  # noqa: B019
    def latest_in_state(self, names: int) -> str:
        """For each of ``names`` task names (the VALUES list; then the state, twice): the slot
        and end of its run in that state with the latest slot (NULL: none). One backward
        probe of (task_name, state, slot) each."""
        latest = (
            "(SELECT r.{column} FROM {run} r {hint}WHERE r.task_name = t.name AND r.state = %s "
            "ORDER BY r.slot DESC LIMIT 1)"
        )
        hint = self.task_state_hint
        return (
            f"WITH t(name) AS ({self.names_table(names)}) SELECT t.name, "
            f"{latest.format(column='slot', run=RUN, hint=hint)}, "
            f"{latest.format(column='finished_at', run=RUN, hint=hint)} FROM t"
        )

    # Per task, its health facts: the tasks are a VALUES list (name, due slot), the facts
    # correlated subqueries, planned once whatever the number of tasks. Parameters after
    # the VALUES: missed, since; running (x3); :meth:`last_ended_params` and the succeeded
    # state (the last N ended runs, and those of them not succeeded); the ended states; the
    # outcome states three times (the latest outcome's slot, state and error);
    # :meth:`late_starts_params` (the last N first starts' lateness).
    ENDED = "r.state IN (%s, %s, %s)"

    def last_ended(self, failed: bool) -> str:
        """Count the task's last N ended runs (``failed``: those not succeeded, one more
        parameter), N and the states being :meth:`last_ended_params`."""
        not_succeeded = " WHERE e.state <> %s" if failed else ""
        return (
            "(SELECT COUNT(*) FROM (SELECT r.state FROM {run} r WHERE r.task_name = t.name AND "
            + self.ENDED
            + " ORDER BY r.slot DESC LIMIT %s) AS e"
            + not_succeeded
            + ")"
        )

    def last_ended_params(self, ended: tuple[str, ...], last: int) -> list[Any]:
        """The parameters that pick a task's ``last`` ended runs in :meth:`task_facts`."""
        return [*ended, last]

    @lru_cache  # noqa: B019
    def task_facts(self, tasks: int, late_starts: bool = False) -> str:
        """The health facts of ``tasks`` tasks, one row each: every value an index probe on
        (task_name, slot) or (task_name, state, slot). See :meth:`last_ended_params`;
        ``late_starts``: :meth:`late_starts` last."""
        return self.format(
            f"WITH t(name, due) AS ({self.tasks_table(tasks)}) SELECT t.name, "
            "(SELECT r.state FROM {run} r WHERE r.task_name = t.name AND r.slot = t.due), "
            "(SELECT COUNT(*) FROM {run} r WHERE r.task_name = t.name AND r.state = %s "
            "AND r.slot >= %s), "
            "(SELECT COUNT(*) FROM {run} r WHERE r.task_name = t.name AND r.state = %s "
            "AND r.lease_until <= {now}), "
            "(SELECT r.slot FROM {run} r {hint}WHERE r.task_name = t.name AND r.state = %s "
            "AND r.lease_until <= {now} ORDER BY r.slot LIMIT 1), "
            "(SELECT r.lease_until FROM {run} r {hint}WHERE r.task_name = t.name AND r.state = %s "
            "AND r.lease_until <= {now} ORDER BY r.slot LIMIT 1), "
            f"{self.last_ended(failed=False)}, {self.last_ended(failed=True)}, "
            "(SELECT r.slot FROM {run} r WHERE r.task_name = t.name AND "
            + self.ENDED
            + " ORDER BY r.slot DESC LIMIT 1), "
            + ", ".join(self.latest_outcome(column) for column in ("slot", "state", "error"))
            + (", " + self.late_starts() if late_starts else "")
            + " FROM t"
        )

    def late_starts(self) -> str:
        """The least and the greatest start lateness (seconds) of the task's last N first
        starts (:data:`FIRST_START`), as one text "least greatest" (a scalar subquery has
        one column: one probe of (task_name, slot), not two); NULL or "" when it has fewer
        than N. Parameters: :meth:`late_starts_params`."""
        return (
            "(SELECT CASE WHEN COUNT(*) = %s THEN "
            "CAST(MIN(e.l) AS TEXT) || ' ' || CAST(MAX(e.l) AS TEXT) END FROM "
            "(SELECT {lateness} AS l FROM {run} r WHERE r.task_name = t.name AND "
            + FIRST_START.format(r="r")
            + " ORDER BY r.slot DESC LIMIT %s) AS e)"
        )

    def late_starts_params(self, last: int, first: int) -> list[Any]:
        """The parameters of :meth:`late_starts` for the last ``last`` starts of attempt
        ``first``."""
        return [last, first, last]

    OUTCOME = "r.state IN (%s, %s, %s, %s)"

    def latest_outcome(self, column: str) -> str:
        """``column`` of the task's latest run in an outcome state (the states are its
        parameters): one backward probe of (task_name, slot)."""
        return (
            "(SELECT r."
            + column
            + " FROM {run} r WHERE r.task_name = t.name AND "
            + self.OUTCOME
            + " ORDER BY r.slot DESC LIMIT 1)"
        )

    def recent_limit(self, limit: int) -> int:
        """The parameter :meth:`recent_runs` takes for ``limit`` runs per task: the OFFSET of
        the ``limit``-th latest slot."""
        return max(limit - 1, 0)

    @lru_cache  # noqa: B019
    def recent_runs(self, tasks: int) -> str:
        """Each of ``tasks`` tasks' runs with the latest slots (parameters: the names, then
        :meth:`recent_limit` of the limit): the runs of each task whose slot is at or after
        its ``limit``-th latest (one backward probe and one range scan of (task_name, slot)
        each)."""
        return self.format(
            f"WITH t(name) AS ({self.names_table(tasks)}) "
            "SELECT r.task_name, r.id, r.slot, r.state "
            "FROM t JOIN {run} r ON r.task_name = t.name AND r.slot >= COALESCE("
            "(SELECT q.slot FROM {run} q WHERE q.task_name = t.name ORDER BY q.slot DESC "
            "LIMIT 1 OFFSET %s), {min_slot})"
        )


__all__ = ["FENCE_SEQUENCE", "Backend", "fetch_all", "one", "placeholders"]
