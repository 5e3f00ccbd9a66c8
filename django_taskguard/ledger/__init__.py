"""The run ledger: the only code that reads or writes ``TaskRun`` and ``TaskRunTransition``.

Every function takes values and uses the database named by
``TASKGUARD["DATABASE_ALIAS"]``; the SQL is in :mod:`.sql`, named. State
changes are checked against ``states.TRANSITIONS`` and compare-and-set on the
row as it was read (its state, and its fence for an owner's write, and its
lease by the database's clock where asked), so a stale writer changes
nothing; each is written with its transition rows in one transaction.

The hot paths (:func:`claim`, :func:`finish`, :func:`renew`) raise the
database's own errors, because their callers settle a lost reply by reading
back; maintenance functions raise ``BackendUnavailable`` instead.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from datetime import timezone as dt_timezone
from typing import Any

from django.db import DatabaseError, InterfaceError, OperationalError, connections, transaction
from django.db.models import Max, Q, QuerySet
from django.utils.dateparse import parse_datetime

from ..conf import taskguard_settings
from ..exceptions import BackendUnavailable, TaskGuardError
from ..models import Ledger, TaskRun, TaskRunQuerySet, TaskRunTransition
from ..owner import token_of
from ..states import PRUNABLE_STATES, RunState, check_transition
from . import sql

__all__ = [
    "Row",
    "RunRef",
    "Step",
    "abandon",
    "add_duplicates",
    "claim",
    "finish",
    "read",
    "renew",
    "runs",
]

logger = logging.getLogger("taskguard.ledger")

CONNECTION_ERRORS = (OperationalError, InterfaceError)
# Text the ledger stores for people: reasons and errors are cut to this.
REASON_MAX_LENGTH = 500
ERROR_MAX_LENGTH = 10_000


def alias() -> str:
    """The database that holds the ledger."""
    return taskguard_settings.DATABASE_ALIAS


def runs() -> TaskRunQuerySet:
    """Every run, read from the ledger's database (for the admin and other readers)."""
    queryset: TaskRunQuerySet = TaskRun.objects.using(alias())
    return queryset


def transitions(run_id: int) -> QuerySet[TaskRunTransition]:
    """One run's transition log, oldest first."""
    return TaskRunTransition.objects.using(alias()).filter(run_id=run_id).order_by("at", "id")


@dataclass(frozen=True)
class Row:
    """The columns of a ``TaskRun`` that the hot paths read back."""

    id: int
    state: str
    attempt: int
    fence: int | None
    owner: str
    lease_until: datetime | None
    lease_left: float | None = None  # seconds, by the database's clock (read rows only)

    @property
    def expired(self) -> bool:
        """The lease ran out, by the database's clock."""
        return self.lease_left is not None and self.lease_left <= 0


@dataclass(frozen=True)
class RunRef:
    """A run as maintenance reads it: a :class:`Row` with its task and slot."""

    id: int
    task_name: str
    slot: datetime
    state: str
    attempt: int
    fence: int | None
    owner: str
    lease_until: datetime | None

    @property
    def row(self) -> Row:
        return Row(self.id, self.state, self.attempt, self.fence, self.owner, self.lease_until)

    @property
    def token(self) -> str:
        return token_of(self.owner)


@dataclass(frozen=True)
class Step:
    to_state: str
    reason: str


# -- plumbing ----------------------------------------------------------------------


def connection_lost(exc: Exception) -> bool:
    """True when ``exc`` may have cut a statement off mid-flight (outcome unknown).

    Only a networked database loses connections; SQLite raises
    ``OperationalError`` for real errors too, which must not be retried.
    """
    return isinstance(exc, CONNECTION_ERRORS) and connections[alias()].vendor != "sqlite"


def settle_connection() -> None:
    """Drop a connection that failed mid-statement so the next statement reconnects."""
    connections[alias()].close()


def unreachable(exc: Exception) -> BackendUnavailable:
    """``BackendUnavailable`` saying what ``exc`` means: unreachable, or busy (SQLite)."""
    return BackendUnavailable(f"the taskguard database {describe_error(exc)}")


def describe_error(exc: Exception) -> str:
    """``is unreachable (...)``, or ``is busy (...)`` for SQLite's lock timeout."""
    if "database is locked" in str(exc):
        return (
            f"is busy: another connection held SQLite's write lock past its timeout ({exc}); "
            f"raise DATABASES[...]['OPTIONS']['timeout'] or use PostgreSQL for many writers"
        )
    return f"is unreachable ({exc})"


def ensure_reachable() -> None:
    """Raise ``BackendUnavailable`` unless the ledger's database answers."""
    try:
        connections[alias()].ensure_connection()
    except DatabaseError as exc:
        raise unreachable(exc) from exc


def ensure_autocommit() -> None:
    """Refuse to claim inside the caller's transaction.

    A claim inside an open ``atomic`` block would hold the row lock (and hide
    the row from every other instance) until the caller commits, and would
    vanish if the caller rolled back: the opposite of a durable claim.
    """
    connection = transaction.get_connection(alias())
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


def _dialect() -> sql.Dialect:
    return sql.dialect(alias())


def _one(statement: str, params: Sequence[Any]) -> Sequence[Any] | None:
    with connections[alias()].cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchone() if cursor.description else None


def _all(statement: str, params: Sequence[Any]) -> list[Sequence[Any]]:
    with connections[alias()].cursor() as cursor:
        cursor.execute(statement, params)
        return list(cursor.fetchall())


def _slot(slot: datetime) -> Any:
    return connections[alias()].ops.adapt_datetimefield_value(slot)


def aware(value: Any) -> datetime | None:
    """A datetime column's value as an aware UTC datetime (SQLite hands back text)."""
    dt = value if value is None or isinstance(value, datetime) else parse_datetime(str(value))
    if dt is not None and dt.tzinfo is None:
        dt = dt.replace(tzinfo=dt_timezone.utc)
    return dt


def _row(values: Sequence[Any] | None) -> Row | None:
    if values is None:
        return None
    left = float(values[6]) if len(values) > 6 and values[6] is not None else None
    return Row(
        int(values[0]), values[1], int(values[2]), values[3], values[4], aware(values[5]), left
    )


def clip(text: str, limit: int) -> str:
    """``text`` made storable and cut to ``limit`` characters (marked when cut).

    What a database refuses becomes visible instead: NUL (PostgreSQL rejects it
    in text) as ``\\x00``, lone surrogates (no encoding takes them) as
    ``\\udcxx``. A message is the user's, any text at all.
    """
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- the hot paths -----------------------------------------------------------------


def claim(
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
    put back is counted when it comes back); the other cases (pending,
    retrying, stale) are for the caller to decide (:func:`start_attempt`,
    :func:`take_over`, :func:`abandon`).
    """
    d = _dialect()
    params = [task_name, _slot(slot), owner, lease_seconds, count_live, abandon_is_final]
    if d.one_statement:
        row = _row(_one(sql.claim(d), [*params, owner]))
    else:
        with transaction.atomic(using=alias()):
            _bump_fence(d)
            row = _row(_one(sql.claim(d), params))
            if row is not None and row.owner == owner:
                _one(sql.claimed_transition(d), [row.id])
    assert row is not None
    return row


def claim_many(
    task_names: Sequence[str], slot: datetime, owners: Sequence[str], leases: Sequence[float]
) -> dict[str, Row] | None:
    """:func:`claim` for one slot of many tasks in one statement (``on_stale="abandon"``).

    Returns each task's row (``owner`` equal to the one given: this call created it), or
    None where the database cannot do it in one statement (SQLite: claim one by one).
    """
    statement = sql.claim_many(_dialect())
    if statement is None:
        return None
    found = _all(statement, [list(task_names), list(owners), list(leases), _slot(slot)])
    rows = {}
    for values in found:
        row = _row(values[1:])
        assert row is not None
        rows[str(values[0])] = row
    return rows


def succeed_many(items: Sequence[tuple[int, int, str, str]]) -> set[int] | None:
    """Record many running attempts ``succeeded`` in one statement, each fenced:
    ``(run id, fence, owner, reason)``; returns the ids recorded (an attempt missing was
    fenced out). None where the database cannot do it in one statement (SQLite)."""
    d = _dialect()
    statement = sql.succeed_many(d)
    if statement is None:
        return None
    check_transition(RunState.RUNNING, RunState.SUCCEEDED)
    params = [
        [run_id for run_id, _, _, _ in items],
        [fence for _, fence, _, _ in items],
        [owner for _, _, owner, _ in items],
        [clip(reason, REASON_MAX_LENGTH) for _, _, _, reason in items],
        RunState.SUCCEEDED,
        RunState.RUNNING,
        RunState.RUNNING,
        RunState.SUCCEEDED,
    ]
    return {int(run_id) for (run_id,) in _all(statement, params)}


def read(task_name: str, slot: datetime) -> Row | None:
    return _row(_one(sql.read_slot(_dialect()), [task_name, _slot(slot)]))


def read_by_id(run_id: int) -> Row | None:
    return _row(_one(sql.read_id(_dialect()), [run_id]))


def start_attempt(row: Row, owner: str, lease_seconds: float, reason: str) -> Row | None:
    """A pending or retrying row becomes ``owner``'s running attempt (``None``: it changed)."""
    return change(
        row,
        [Step(RunState.RUNNING, reason)],
        actor=owner,
        fenced=False,
        sets=sql.START_ATTEMPT,
        values=(owner, lease_seconds),
    )


def take_over(row: Row, owner: str, lease_seconds: float, why: str) -> Row | None:
    """A dead attempt's row (running past its lease, or abandoned) becomes ``owner``'s.

    A running row is taken only while its lease has expired by the database's
    clock: the compare-and-set checks it, so a live owner is never displaced.
    """
    running = row.state == RunState.RUNNING
    return change(
        row,
        [
            Step(RunState.RETRYING, why),
            Step(RunState.RUNNING, f"taken over by attempt {row.attempt + 1}"),
        ],
        actor=owner,
        fenced=running,
        lease="expired" if running else "",
        sets=sql.START_ATTEMPT,
        values=(owner, lease_seconds),
    )


def abandon(
    row: Row, *, actor: str, reason: str, lease: str = "expired", count_duplicate: bool = False
) -> Row | None:
    """A running row whose owner is dead becomes ``abandoned`` (``None``: it changed).

    ``lease="expired"``: only while its lease has expired by the database's
    clock; ``""``: the caller has other proof (its process is gone).
    ``count_duplicate``: the caller that found it counts as a duplicate.
    """
    return change(
        row,
        [Step(RunState.ABANDONED, reason)],
        actor=actor,
        lease=lease,
        sets=sql.ABANDON,
        values=(clip(reason, ERROR_MAX_LENGTH), int(count_duplicate)),
    )


def finish(
    run_id: int,
    attempt: int,
    fence: int,
    owner: str,
    to_state: str,
    reason: str,
    *,
    error: str = "",
    duplicates: int = 0,
    retry_within: float | None = None,
) -> Row | None:
    """Record how an attempt ended, fenced: ``None`` when it no longer owns the row.

    ``retry_within``: another attempt follows (a retry) within that many
    seconds; the row's lease says by when, so that ``cleanup_locks`` records it
    ``abandoned`` if the retry never comes.
    """
    row = Row(run_id, RunState.RUNNING, attempt, fence, owner, None)
    stored = clip(error, ERROR_MAX_LENGTH)
    values: tuple[Any, ...]
    if retry_within is None:
        sets, values = sql.END_ATTEMPT, (stored, duplicates)
    else:
        sets, values = sql.PAUSE_ATTEMPT, (stored, retry_within, duplicates)
    return change(row, [Step(to_state, reason)], actor=owner, sets=sets, values=values)


def renew(
    run_id: int, fence: int, lease_seconds: float, timeout_seconds: float | None = None
) -> datetime | None:
    """Extend a live attempt's lease; ``None`` when the attempt no longer owns the row.

    Only a ``running`` row with this ``fence`` is renewed: an attempt that
    finished, paused for a retry or was taken over (a new fence) never is.
    ``timeout_seconds`` bounds the renewal (its waits for locks and its run
    time); past it the database's error is raised, as for any failed renewal.
    """
    d = _dialect()
    params = [lease_seconds, run_id, fence]
    if timeout_seconds is None:
        values = _one(sql.renew(d), params)
    else:
        own = sql.busy_timeout(d)
        previous = _one(own, []) if own else None
        try:
            with transaction.atomic(using=alias()):
                _one(sql.renew_timeout(d, max(1, round(timeout_seconds * 1000))), [])
                values = _one(sql.renew(d), params)
        finally:
            if previous:
                _one(sql.renew_timeout(d, int(previous[0])), [])
    return aware(values[0]) if values else None


def earlier_slot_running(task_name: str, slot: datetime) -> datetime | None:
    """The slot of a live attempt of ``task_name`` before ``slot``, if any."""
    values = _one(sql.earlier_running(_dialect()), [task_name, _slot(slot)])
    return aware(values[0]) if values else None


def change(
    row: Row,
    path: Sequence[Step],
    *,
    actor: str,
    fenced: bool = True,
    lease: str = "",
    sets: tuple[str, ...] = (),
    values: tuple[Any, ...] = (),
) -> Row | None:
    """Move ``row`` along ``path`` if it is still as read; write one transition per step."""
    state = row.state
    steps: list[tuple[str, str, str]] = []
    for step in path:
        check_transition(state, step.to_state)
        steps.append((state, step.to_state, clip(step.reason, REASON_MAX_LENGTH)))
        state = step.to_state
    d = _dialect()
    params: list[Any] = [state, *values, row.id, row.state]
    if fenced:
        params.append(row.fence)
    assignments = sql.assignments(d, sets)
    if d.one_statement:
        statement = sql.change_logged(d, assignments, fenced, lease, len(steps))
        step_params = [p for n, step in enumerate(steps) for p in (*step, n)]
        return _row(_one(statement, [*params, actor, *step_params]))
    with transaction.atomic(using=alias()):
        if sets is sql.START_ATTEMPT:
            _bump_fence(d)
        updated = _row(_one(sql.change(d, assignments, fenced, lease), params))
        if updated is not None:
            with connections[alias()].cursor() as cursor:
                cursor.executemany(
                    sql.transition(d), [(row.id, f, t, r, actor) for f, t, r in steps]
                )
        return updated


# -- the ledger's own row: identity and fences ------------------------------------

_identities: dict[str, str] = {}


def identity() -> str:
    """This ledger's identity (a UUID's hex), read once per process and database.

    Written by the migration that made the table; made again if the row is gone
    (a flushed test database): what matters is that two ledgers differ.
    """
    name = alias()
    try:
        return _identities[name]
    except KeyError:
        pass
    try:
        found = _one(sql.identity(), [])
        if found is None:
            found = (ensure_ledger_row().identity,)
    except DatabaseError as exc:
        raise unreachable(exc) from exc
    value = _identities[name] = uuid.UUID(str(found[0])).hex
    return value


def ensure_ledger_row(using: str | None = None) -> Ledger:
    """The ledger's row; made (fences counted on from the highest stored) when missing.

    A new row keeps the identity this process already knows for that database,
    if any: a flushed table (``manage.py flush``, a test case) must not give the
    ledger a second identity while its keys are in use.
    """
    using = using or alias()
    last = TaskRun.objects.using(using).aggregate(last=Max("fence"))["last"] or 0
    defaults: dict[str, Any] = {"fence": last}
    if using in _identities:
        defaults["identity"] = uuid.UUID(_identities[using])
    row, _ = Ledger.objects.using(using).get_or_create(id=1, defaults=defaults)
    return row


def _bump_fence(d: sql.Dialect) -> None:
    """SQLite: move the fence counter on, inside the caller's transaction."""
    with connections[alias()].cursor() as cursor:
        cursor.execute(sql.bump_fence(d))
        if cursor.rowcount == 0:
            ensure_ledger_row()
            cursor.execute(sql.bump_fence(d))


def fence_at_least(value: int) -> None:
    """Make every fence handed out from now on larger than ``value``.

    For rows that arrive with their fences (``loaddata``, a restore): the fence
    source must never hand out one of theirs again.
    """
    d = _dialect()
    with transaction.atomic(using=alias()):
        if not d.one_statement:
            ensure_ledger_row()
        _one(sql.fence_at_least(d), [value])


# -- what no attempt wrote -----------------------------------------------------------


def add_duplicates(task_name: str, slot: datetime, count: int) -> bool:
    """Add ``count`` duplicate calls to the slot's row; False when there is no row."""
    try:
        with connections[alias()].cursor() as cursor:
            cursor.execute(sql.add_duplicates(_dialect()), [count, task_name, _slot(slot)])
            return bool(cursor.rowcount)
    except DatabaseError as exc:
        raise unreachable(exc) from exc


def insert_abandoned(
    task_name: str, slot: datetime, *, reason: str, duplicates: int, actor: str
) -> int | None:
    """Record a slot no attempt ever held as ``abandoned``; None when it has a row already."""
    return _insert_unheld(task_name, slot, RunState.ABANDONED, reason, duplicates, actor)


def insert_skipped(task_name: str, slot: datetime, *, reason: str, actor: str) -> int | None:
    """Record a slot that will not run as ``skipped``; None when it has a row already."""
    return _insert_unheld(task_name, slot, RunState.SKIPPED, reason, 0, actor)


def insert_missed(task_name: str, slot: datetime, *, reason: str, actor: str) -> int | None:
    """Record a due slot that no instance claimed within its grace as ``missed``;
    None when it has a row already."""
    return _insert_unheld(task_name, slot, RunState.MISSED, reason, 0, actor)


def insert_unheld_many(state: str, rows: Sequence[tuple[str, datetime, str]], *, actor: str) -> int:
    """Record many slots no attempt held (``missed``, or ``skipped`` while paused) at once:
    ``(task, slot, reason)`` each; a slot that has a row keeps it. Returns how many were new."""
    check_transition(RunState.PENDING, state)
    if not rows:
        return 0
    d = _dialect()
    if not d.one_statement:
        inserted = [_insert_unheld(t, s, state, r, 0, actor) for t, s, r in rows]
        return sum(1 for run_id in inserted if run_id is not None)
    params = [
        [task for task, _, _ in rows],
        [_slot(slot) for _, slot, _ in rows],
        [clip(reason, REASON_MAX_LENGTH) for _, _, reason in rows],
        state,
        RunState.PENDING,
        state,
        actor,
    ]
    try:
        found = _one(sql.insert_unheld_many(d), params)
    except DatabaseError as exc:
        raise unreachable(exc) from exc
    return int(found[0]) if found else 0


def latest_slot(task_name: str) -> datetime | None:
    """The newest slot of ``task_name`` that has a row other than ``missed`` (a missed
    slot is one a catch-up still runs)."""
    try:
        found = _one(sql.latest_slot(_dialect()), [task_name, RunState.MISSED])
    except DatabaseError as exc:
        raise unreachable(exc) from exc
    return aware(found[0]) if found else None


def slots_in(task_name: str, after: datetime, until: datetime) -> set[datetime]:
    """The slots of ``task_name`` in ``(after, until]`` that have a row."""
    try:
        found = _all(sql.slots_in(_dialect()), [task_name, _slot(after), _slot(until)])
    except DatabaseError as exc:
        raise unreachable(exc) from exc
    return {slot for (value,) in found if (slot := aware(value)) is not None}


def count_slots(task_name: str, after: datetime, until: datetime) -> int:
    try:
        found = _one(sql.count_slots(_dialect()), [task_name, _slot(after), _slot(until)])
    except DatabaseError as exc:
        raise unreachable(exc) from exc
    return int(found[0]) if found else 0


def failed_streak(task_name: str, length: int) -> bool:
    """True when the newest ``length`` finished runs of ``task_name`` all failed."""
    states = (RunState.SUCCEEDED, RunState.FAILED, RunState.ABANDONED)
    try:
        found = _all(sql.last_states(_dialect()), [task_name, *states, length])
    except DatabaseError as exc:
        raise unreachable(exc) from exc
    return len(found) == length and all(state == RunState.FAILED for (state,) in found)


def _insert_unheld(
    task_name: str, slot: datetime, state: str, reason: str, duplicates: int, actor: str
) -> int | None:
    """A row no attempt ever held (attempt 0, no owner, no fence), with its transition."""
    check_transition(RunState.PENDING, state)
    d = _dialect()
    reason = clip(reason, REASON_MAX_LENGTH)
    try:
        with transaction.atomic(using=alias()):
            inserted = _one(
                sql.insert_unheld(d), [task_name, _slot(slot), state, reason, duplicates]
            )
            if inserted is None:
                return None
            _one(sql.transition(d), [inserted[0], RunState.PENDING, state, reason, actor])
    except DatabaseError as exc:
        raise unreachable(exc) from exc
    return int(inserted[0])


def row_exists(task_name: str, slot: datetime) -> bool:
    try:
        return runs().filter(task_name=task_name, slot=slot).exists()
    except DatabaseError as exc:
        raise unreachable(exc) from exc


def token_holders(slot: datetime, token: str) -> list[tuple[str, bool]]:
    """``(task_name, lease alive)`` of the runs at ``slot`` whose owner holds ``token``."""
    try:
        found = runs().filter(slot=slot, owner__endswith=f":{token}").with_lease()
        pairs = found.values_list("task_name", "lease_alive")  # type: ignore[misc]  # annotation
        return [(name, bool(alive)) for name, alive in pairs]
    except DatabaseError as exc:
        raise unreachable(exc) from exc


# -- maintenance -------------------------------------------------------------------


def stale_runs(
    *, task: str | None = None, among: QuerySet[TaskRun] | None = None, batch_size: int = 500
) -> Iterator[RunRef]:
    """Rows whose owner is presumed gone, by the database's clock, by ascending id:
    running past their lease, and retrying past the deadline of their retry.

    ``among`` limits them to a queryset's runs (read as a subquery).
    """
    queryset = _for_task(runs().overdue(), task)
    if among is not None:
        queryset = queryset.filter(pk__in=among.order_by().values("pk"))
    return _refs(queryset, batch_size)


def in_flight(
    *, task: str | None = None, among: QuerySet[TaskRun] | None = None, limit: int = 100
) -> list[tuple[str, datetime, str, datetime, float]]:
    """Live attempts (lease valid by the database's clock), soonest to expire first:
    ``(task, slot, owner, lease_until, seconds left)``."""
    queryset = _for_task(runs().live(), task)
    if among is not None:
        queryset = queryset.filter(pk__in=among.order_by().values("pk"))
    try:
        now = database_now()
        found = queryset.order_by("lease_until").values_list(
            "task_name", "slot", "owner", "lease_until"
        )[:limit]
        return [
            (name, slot, owner, until, (until - now).total_seconds())
            for name, slot, owner, until in found
            if until is not None
        ]
    except DatabaseError as exc:
        raise unreachable(exc) from exc


def _for_task(queryset: TaskRunQuerySet, task: str | None) -> TaskRunQuerySet:
    """Runs of ``task``: its own name, or one of its per-schedule names (``task[entry]``)."""
    if task is None:
        return queryset
    return queryset.filter(Q(task_name=task) | Q(task_name__startswith=f"{task}["))


def known_task_names(limit: int = 1000) -> list[str]:
    """Task names the ledger has runs of (for messages that suggest one)."""
    try:
        return task_names(limit)
    except DatabaseError as exc:
        raise unreachable(exc) from exc


def running_in_pid_space(space: str, batch_size: int = 500) -> Iterator[RunRef]:
    """Running rows whose owner's pid space is ``space`` (see ``owner.Owner``)."""
    return _refs(runs().running().filter(owner__contains=f":{space}:"), batch_size)


def run_ref(run_id: int) -> tuple[RunRef, bool] | None:
    """One run and whether its lease is alive by the database's clock."""
    try:
        found = runs().filter(pk=run_id).with_lease().values(*_REF_FIELDS, "lease_alive").first()
    except DatabaseError as exc:
        raise unreachable(exc) from exc
    if found is None:
        return None
    alive = bool(found.pop("lease_alive"))
    return RunRef(**found), alive


_REF_FIELDS = ("id", "task_name", "slot", "state", "attempt", "fence", "owner", "lease_until")


def _refs(queryset: QuerySet[TaskRun], batch_size: int) -> Iterator[RunRef]:
    last = 0
    while True:
        try:
            batch = list(
                queryset.filter(pk__gt=last).order_by("pk").values(*_REF_FIELDS)[:batch_size]
            )
        except DatabaseError as exc:
            raise unreachable(exc) from exc
        for values in batch:
            yield RunRef(**values)
        if len(batch) < batch_size:
            return
        last = batch[-1]["id"]


def database_now() -> datetime:
    """The database's clock (every instance judges deadlines against the same time)."""
    try:
        value = aware(_one(sql.now(_dialect()), [])[0])  # type: ignore[index]
    except DatabaseError as exc:
        raise unreachable(exc) from exc
    assert value is not None
    return value


def last_transition(run_id: int) -> TaskRunTransition | None:
    return transitions(run_id).order_by("-at", "-id").first()


def prunable(before: datetime) -> TaskRunQuerySet:
    """Finished runs whose slot is older than ``before``."""
    queryset: TaskRunQuerySet = runs().filter(state__in=PRUNABLE_STATES, slot__lt=before)
    return queryset


def count_prunable(before: datetime) -> tuple[int, int]:
    """How many runs, and transitions of theirs, :func:`prunable` finds."""
    queryset = prunable(before)
    pks = queryset.values("pk")
    return queryset.count(), TaskRunTransition.objects.using(alias()).filter(run__in=pks).count()


def prunable_ids(before: datetime, after_id: int, limit: int) -> list[int]:
    return list(
        prunable(before).filter(pk__gt=after_id).order_by("pk").values_list("pk", flat=True)[:limit]
    )


def delete_finished(ids: Sequence[int]) -> tuple[int, int]:
    """Delete these runs if still finished (state re-checked), with their transitions.

    One short transaction; returns (runs, transitions) deleted.
    """
    d = _dialect()
    with transaction.atomic(using=alias()):
        deleted = [
            run_id for (run_id,) in _all(sql.delete_finished(d, len(ids)), [*ids, *PRUNABLE_STATES])
        ]
        if not deleted:
            return 0, 0
        with connections[alias()].cursor() as cursor:
            cursor.execute(sql.delete_transitions(d, len(deleted)), deleted)
            return len(deleted), max(cursor.rowcount, 0)


def task_names(limit: int) -> list[str]:
    """Distinct task names by a loose index scan on (task_name, slot), not a DISTINCT scan."""
    # A recursive CTE hops from name to next name through the index (PostgreSQL
    # has no skip scan; SQLite and PostgreSQL both run it).
    statement = (
        f"WITH RECURSIVE names(name) AS (SELECT MIN(task_name) FROM {sql.RUN} "
        f"UNION ALL SELECT (SELECT MIN(task_name) FROM {sql.RUN} WHERE task_name > names.name) "
        f"FROM names WHERE names.name IS NOT NULL) "
        f"SELECT name FROM names WHERE name IS NOT NULL LIMIT %s"
    )
    return [name for (name,) in _all(statement, [limit])]


# -- monitoring: health, metrics and the admin's overview ---------------------------


@dataclass(frozen=True)
class SlotRun:
    """One run as the overview's strip reads it."""

    id: int
    slot: datetime
    state: str


@dataclass(frozen=True)
class LastRun:
    slot: datetime
    finished_at: datetime | None


def latest_in_state(names: Sequence[str], state: str) -> dict[str, LastRun]:
    """Each named task's run in ``state`` with the latest slot (tasks without one are left out)."""
    found: dict[str, LastRun] = {}
    d = _dialect()
    chunk = 200
    try:
        for start in range(0, len(names), chunk):
            part = names[start : start + chunk]
            statement = sql.latest_in_state(d, len(part))
            for name, slot, finished in _all(statement, [*part, state, state]):
                slot_at = aware(slot)
                if slot_at is not None:
                    found[name] = LastRun(slot_at, aware(finished))
    except DatabaseError as exc:
        raise unreachable(exc) from exc
    return found


@dataclass
class StateSummary:
    """A task's runs in one state over a window of slots."""

    runs: int = 0
    duplicates: int = 0
    duration_sum: float = 0.0
    duration_count: int = 0
    # How many durations are at most each bound (cumulative, as Prometheus has them).
    buckets: tuple[int, ...] = ()


def window_summary(since: datetime, bounds: Sequence[float]) -> dict[tuple[str, str], StateSummary]:
    """Per (task, state), the runs whose slot is at or after ``since``: one statement,
    a range scan of the slot index (its cost is the window's row count)."""
    statement = sql.window_summary(_dialect(), len(bounds))
    try:
        rows = _all(statement, [*bounds, _slot(since)])
    except DatabaseError as exc:
        raise unreachable(exc) from exc
    return {
        (name, state): StateSummary(
            int(count),
            int(duplicates),
            float(total),
            int(timed),
            tuple(int(n or 0) for n in below),
        )
        for name, state, count, duplicates, total, timed, *below in rows
    }


@dataclass(frozen=True)
class TaskFacts:
    """What the health verdict needs of one task's runs, read in one probe per value."""

    due_state: str | None  # the state of the row at the due slot asked for (None: no row)
    missed: int  # runs recorded missed with a slot at or after ``since``
    stale: int  # running rows whose lease expired by the database's clock
    oldest_stale_slot: datetime | None
    oldest_stale_lease: datetime | None
    ended: int  # of the task's last ``last`` ended runs (succeeded, failed, abandoned): how many
    failed: int  # ... and how many of those did not succeed
    latest_ended_slot: datetime | None


ENDED_STATES = (RunState.SUCCEEDED, RunState.FAILED, RunState.ABANDONED)
FACTS_CHUNK = 200  # tasks per statement


def task_facts(
    asks: Sequence[tuple[str, datetime | None]], since: datetime, last: int
) -> dict[str, TaskFacts]:
    """For each ``(task, due slot)``: its :class:`TaskFacts`, one statement per 200 tasks."""
    d = _dialect()
    found: dict[str, TaskFacts] = {}
    try:
        for start in range(0, len(asks), FACTS_CHUNK):
            part = asks[start : start + FACTS_CHUNK]
            params: list[Any] = []
            for name, due in part:
                params += [name, None if due is None else _slot(due)]
            params += [RunState.MISSED, _slot(since), *[RunState.RUNNING] * 3]
            params += [*ENDED_STATES, last, *ENDED_STATES, last, RunState.SUCCEEDED]
            params += ENDED_STATES
            for values in _all(sql.task_facts(d, len(part)), params):
                name, due_state, missed, stale, stale_slot, stale_lease, ended, failed, latest = (
                    values
                )
                found[name] = TaskFacts(
                    due_state,
                    int(missed),
                    int(stale),
                    aware(stale_slot),
                    aware(stale_lease),
                    int(ended),
                    int(failed),
                    aware(latest),
                )
    except DatabaseError as exc:
        raise unreachable(exc) from exc
    return found


def recent_runs_of(names: Sequence[str], limit: int) -> dict[str, list[SlotRun]]:
    """Each task's ``limit`` runs with the latest slots, newest first: one statement per
    200 tasks; per task, one probe for its ``limit``-th latest slot and a range scan of
    the (task_name, slot) index from there."""
    d = _dialect()
    found: dict[str, list[SlotRun]] = {name: [] for name in names}
    try:
        for start in range(0, len(names), FACTS_CHUNK):
            part = names[start : start + FACTS_CHUNK]
            for name, run_id, slot, state in _all(
                sql.recent_runs(d, len(part)), [*part, sql.recent_limit(d, limit)]
            ):
                slot_at = aware(slot)
                assert slot_at is not None
                found[name].append(SlotRun(int(run_id), slot_at, state))
    except DatabaseError as exc:
        raise unreachable(exc) from exc
    for runs_of_task in found.values():
        runs_of_task.sort(key=lambda run: run.slot, reverse=True)
    return found
