"""The hot paths of an attempt: claim, start, take over, abandon, finish, renew."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import (
    IntegrityError,
    connections,
    transaction,
)

from ..exceptions import TaskGuardError
from ..states import PRUNABLE_STATES, RunState, check_transition
from .backends import fragments
from .core import (
    ERROR_MAX_LENGTH,
    REASON_MAX_LENGTH,
    Row,
    Step,
    alias,
    aware,
    change,
    clip,
    connection,
    dialect,
    message_key,
    one,
    slot_param,
    to_row,
    translated,
)

# -- the hot paths -----------------------------------------------------------------


def claim(
    task_name: str,
    slot: datetime,
    owner: str,
    lease_seconds: float,
    *,
    abandon_is_final: bool,
    count_live: bool = True,
    key: str | None = None,
) -> Row:
    """Insert the (task, slot) row as ``running`` for ``owner``, or find it taken.

    With ``key``: the (task, key) row instead, ``slot`` being the claim's time.

    One round trip either way. The returned row's ``owner`` equals ``owner``
    exactly when this call created it. When the slot is plainly taken (a live
    or finished attempt) the row's ``duplicates`` is incremented in the same
    statement (a live attempt only with ``count_live``: a caller that will be
    put back is counted when it comes back); the other cases (pending,
    retrying, stale) are for the caller to decide (:func:`start_attempt`,
    :func:`take_over`, :func:`abandon`).
    """
    if key is not None:
        return _claim_key(task_name, slot, key, owner, lease_seconds, abandon_is_final, count_live)
    params = {
        "task": task_name,
        "slot": slot_param(slot),
        "owner": owner,
        "lease": lease_seconds,
        "count_live": count_live,
        "abandon_is_final": abandon_is_final,
    }
    row = to_row(dialect().claim(connection(), params))
    assert row is not None
    return row


def claim_many(
    task_names: Sequence[str], slot: datetime, owners: Sequence[str], leases: Sequence[float]
) -> dict[str, Row] | None:
    """:func:`claim` for one slot of many tasks in one statement (``on_stale="abandon"``).

    Returns each task's row (``owner`` equal to the one given: this call created it), or
    None where the database cannot do it in one statement (SQLite, MariaDB: claim one by one).
    """
    params = {
        "tasks": list(task_names),
        "owners": list(owners),
        "leases": list(leases),
        "slot": slot_param(slot),
    }
    found = dialect().claim_many(connection(), params)
    if found is None:
        return None
    rows = {}
    for values in found:
        row = to_row(values[1:])
        assert row is not None
        rows[str(values[0])] = row
    return rows


def succeed_many(items: Sequence[tuple[int, int, str, str]]) -> set[int] | None:
    """Record many running attempts ``succeeded`` in one statement, each fenced:
    ``(run id, fence, owner, reason)``; returns the ids recorded (an attempt missing was
    fenced out). None where the database cannot do it in one statement (SQLite, MariaDB)."""
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
    found = dialect().succeed_many(connection(), params)
    return None if found is None else {int(run_id) for (run_id,) in found}


# A keyed row's slot is its claim's time; two keys of one task claimed in the same
# microsecond meet on the (task, slot) constraint: the later takes the microsecond after
# the task's latest slot from there on. A frozen clock (a test's) gives every key the same
# time: each takes the next free one, however many keys there are; only claims racing
# for the same free microsecond go another round.
SLOT_COLLISION_ROUNDS = 5


def _claim_key(
    task_name: str,
    slot: datetime,
    key: str,
    owner: str,
    lease_seconds: float,
    abandon_is_final: bool,
    count_live: bool,
) -> Row:
    d = dialect()
    for _ in range(SLOT_COLLISION_ROUNDS):
        params = {
            "task": task_name,
            "slot": slot_param(slot),
            "key": key,
            "owner": owner,
            "lease": lease_seconds,
            "count_live": count_live,
            "abandon_is_final": abandon_is_final,
        }
        try:
            row = to_row(d.claim_key(connection(), params))
        except IntegrityError:
            # Only the (task, slot) constraint can refuse it: (task, key) is the arbiter.
            slot = _next_free_slot(task_name, slot)
            continue
        assert row is not None
        return row
    raise TaskGuardError(
        f"{task_name!r} key {key!r}: {SLOT_COLLISION_ROUNDS} claims of this task at the same "
        f"microsecond; try again"
    )


def _next_free_slot(task_name: str, slot: datetime) -> datetime:
    """The microsecond after ``task_name``'s latest slot at or after ``slot``."""
    found = one(dialect().last_slot_from, [task_name, slot_param(slot)])
    latest = aware(found[0]) if found is not None else None
    return max(slot, latest or slot) + timedelta(microseconds=1)


def read(task_name: str, slot: datetime, key: str | None = None) -> Row | None:
    if key is not None:
        return to_row(one(dialect().read_key, [task_name, key]))
    return to_row(one(dialect().read_slot, [task_name, slot_param(slot)]))


def read_many(task_names: Sequence[str], slot: datetime) -> dict[str, Row] | None:
    """Each task's row of ``slot`` (tasks without one are left out), in one statement;
    None where the database cannot batch (see :func:`claim_many`)."""
    found = dialect().read_slot_many(connection(), [list(task_names), slot_param(slot)])
    if found is None:
        return None
    rows = {}
    for values in found:
        row = to_row(values[1:])
        assert row is not None
        rows[str(values[0])] = row
    return rows


def store_result(run_id: int, fence: int, result: str) -> bool:
    """Store a live keyed attempt's JSON result (fenced); False when it no longer owns the row."""
    with translated, connections[alias()].cursor() as cursor:
        cursor.execute(dialect().store_result, [result, run_id, fence, RunState.RUNNING])
        return bool(cursor.rowcount)


def result_of(task_name: str, key: str) -> str | None:
    """The JSON result a succeeded keyed run stored, or None."""
    with translated:
        found = one(dialect().read_result, [task_name, key])
    if found is None or found[0] != RunState.SUCCEEDED:
        return None
    return None if found[1] is None else str(found[1])


def reopen_key(run_id: int, keep_seconds: float) -> bool:
    """Delete a finished keyed run (and its transitions) once ``keep_seconds`` have
    passed since it finished, by the database's clock: its key may run again.

    False when the row is not finished, not old enough, or already gone.
    """
    d = dialect()
    with transaction.atomic(using=alias()):
        deleted, _ = d.delete_runs(
            connection(), d.reopen_key, [run_id, keep_seconds, *PRUNABLE_STATES]
        )
    return deleted > 0


def read_by_id(run_id: int) -> Row | None:
    return to_row(one(dialect().read_id, [run_id]))


def start_attempt(
    row: Row, owner: str, lease_seconds: float, reason: str, message_id: str | None = None
) -> Row | None:
    """A pending or retrying row becomes ``owner``'s running attempt (``None``: it changed,
    or, retrying, it waits for the retry another message carries: see :func:`count_other_copy`).

    ``message_id``: the message carrying this call (Celery's task id and retry count); a
    retrying row that names the message carrying its retry (``retry_by``) is started by
    that one only, until the retry is overdue (the row's ``lease_until`` has passed).
    """
    return change(
        row,
        [Step(RunState.RUNNING, reason)],
        actor=owner,
        fenced=False,
        sets=fragments.START_ATTEMPT,
        values=(owner, lease_seconds),
        retry_by=(message_key(message_id),) if row.state == RunState.RETRYING else None,
    )


def take_refused_early(row: Row, owner: str, lease_seconds: float, reason: str) -> Row | None:
    """A ``skipped`` row that only records a call refused for being ahead of the clock
    becomes ``owner``'s running attempt; ``None``: the row is no such refusal, or changed."""
    return change(
        row,
        [Step(RunState.RUNNING, reason)],
        actor=owner,
        fenced=False,
        lease="refused_early",
        sets=fragments.TAKE_REFUSED_EARLY,
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
        sets=fragments.START_ATTEMPT,
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
        sets=fragments.ABANDON,
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
    retry_by: str | None = None,
) -> Row | None:
    """Record how an attempt ended, fenced: ``None`` when it no longer owns the row.

    ``retry_within``: another attempt follows (a retry) within that many
    seconds; the row's lease says by when, so that ``cleanup_locks`` records it
    ``abandoned`` if the retry never comes. ``retry_by``: the message that carries
    that retry (only it may start the next attempt; None: any caller).
    """
    row = Row(run_id, RunState.RUNNING, attempt, fence, owner, None)
    stored = clip(error, ERROR_MAX_LENGTH)
    sets: fragments.Sets
    values: tuple[Any, ...]
    if retry_within is None:
        sets, values = fragments.END_ATTEMPT, (stored, duplicates)
    else:
        sets, values = (
            fragments.PAUSE_ATTEMPT,
            (stored, retry_within, duplicates, message_key(retry_by)),
        )
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
    params = {"lease": lease_seconds, "id": run_id, "fence": fence, "running": RunState.RUNNING}
    milliseconds = None if timeout_seconds is None else max(1, round(timeout_seconds * 1000))
    values = dialect().renew(connection(), params, milliseconds)
    return aware(values[0]) if values else None


@translated
def earlier_slot_running(task_name: str, slot: datetime) -> datetime | None:
    """The slot of a live attempt of ``task_name`` before ``slot``, if any."""
    params = {"task": task_name, "slot": slot_param(slot), "running": RunState.RUNNING}
    values = one(dialect().earlier_running, params)
    return aware(values[0]) if values else None
