"""Slots handed to a task queue (``run_schedules --enqueue``, ``backfill --enqueue``).

A ``pending`` row says that one copy enqueued the slot: the other copies find the row
and enqueue nothing, and the worker's claim turns it ``running``. A hand-off that failed
gives its row back; one that no worker starts within its grace is ended by the
missed-slot sweep (``missed``, or ``skipped`` while the task is paused). An attempt
that ended before its function started gives its row back to the state its claim found
it in (:func:`give_back`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from django.db.models import QuerySet
from django.db.models.functions import Coalesce
from django.db.models.lookups import GreaterThanOrEqual, LessThan, LessThanOrEqual

from ..models import TaskRun, TaskSchedule
from ..states import GIVEN_BACK_TO, RunState
from .backends import fragments
from .core import (
    ERROR_MAX_LENGTH,
    Row,
    Step,
    change,
    clip,
    database_now,
    dialect,
    one,
    runs,
    slot_param,
    to_row,
    translated,
)
from .schedules import data_schedules
from .schedules import get as schedule_of

# When a pending row was last made pending: the time it was given back (``finished_at``,
# which only a give-back sets on a pending row) or else created (handed to a task queue).
HANDED_OUT = Coalesce("finished_at", "created_at")


def insert_pending(task_name: str, slot: datetime) -> int | None:
    """Record ``slot`` as handed out (``pending``); None when it has a row already."""
    with translated:
        found = one(dialect().insert_pending, [task_name, slot_param(slot), RunState.PENDING.value])
    return int(found[0]) if found else None


def pend_refused_early(task_name: str, slot: datetime, *, actor: str) -> int | None:
    """Hand out ``slot`` (``pending``) when its row only records a call refused for being
    ahead of the clock; None when it has no such row (compare-and-set)."""
    d = dialect()
    with translated:
        row = to_row(one(d.read_slot, [task_name, slot_param(slot)]))
        if row is None or row.state != RunState.SKIPPED or row.attempt != 0:
            return None
        reason = "handed out on time: the skipped row only recorded a call ahead of the clock"
        pending = change(
            row,
            [Step(RunState.PENDING, reason)],
            actor=actor,
            fenced=False,
            lease="refused_early",
            sets=fragments.PEND_REFUSED_EARLY,
        )
    return None if pending is None else pending.id


def give_back_pending(
    run_id: int,
    task_name: str,
    slot: datetime,
    *,
    reason: str,
    actor: str,
    grace_of: Callable[[TaskSchedule], timedelta],
) -> str | None:
    """Give back a ``pending`` row that no attempt started (its enqueue failed).

    Deleted, so that the slot has no row again (``"given back"``): the sweep records it
    ``missed`` after its grace, or it is handed out again. But a slot the sweep will not
    judge again (older than its schedule's grace by the database's clock, or at or behind
    its ``swept_until``) would then be lost without a record: its row is ended ``missed``
    with ``reason`` instead (``"missed"``, a compare-and-set from ``pending``). None when
    something started it meanwhile. ``grace_of``: the grace the schedule's slots are judged
    by (``data_schedules.grace_of``).
    """
    with translated:
        schedule = schedule_of(task_name)
        if schedule is not None and (
            slot <= database_now() - grace_of(schedule)
            or (schedule.swept_until is not None and slot <= schedule.swept_until)
        ):
            ended = _end(
                runs().filter(pk=run_id),
                task_name,
                state=RunState.MISSED,
                reason=reason,
                actor=actor,
                limit=1,
            )
            return "missed" if ended else None
        deleted = one(dialect().give_back_pending, [run_id, RunState.PENDING.value])
    return None if deleted is None else "given back"


def give_back(
    run_id: int,
    fence: int,
    owner: str,
    reason: str,
    *,
    claimed_from: str = RunState.PENDING,
    retry_by: str | None = None,
    retry_within: float = 0.0,
) -> Row | None:
    """Give back a ``running`` attempt that never entered its function: nothing ran.

    The one operation for every claim that ends before the body starts (a coroutine
    cancelled while it claimed, a hook that raised before the function, a batch claim
    whose run could not be handed to a thread). The row goes back to the state its claim
    found it in (``claimed_from``, mapped by ``states.GIVEN_BACK_TO``), with the attempt
    count as before the claim and no owner; the next claim of its slot or key counts the
    attempt again and gets a new fence from the counter (fences only grow: this attempt's
    is never valid again). ``reason`` says why, in the transition log.

    - ``pending`` (a row the claim created, or one handed to a task queue) and ``missed``
      (a late claim of a missed slot): not started, ``finished_at`` the time it was given
      back; the missed-slot sweep ends a pending slot nobody claims again within its grace
      of that time, retention deletes a pending key's row (see ``prunable``).
    - ``retrying`` (a retry's attempt, or a takeover of a dead one): due again within
      ``retry_within`` seconds (else ``cleanup_locks`` records it abandoned, "retry never
      came"), startable only by the message ``retry_by`` (None: any caller).

    Fenced like a finish: None when the attempt no longer owns the row (ended, taken over,
    abandoned), and then nothing is changed. The caller frees its own lock afterwards (a
    Redis key, if it holds one), so that the next caller takes the slot. Raises
    ``BackendUnavailable``.
    """
    to_state = GIVEN_BACK_TO[claimed_from]
    row = Row(run_id, RunState.RUNNING, 0, fence, owner, None)
    sets: fragments.Sets = fragments.GIVE_BACK
    values: tuple[float, str | None] | tuple[()] = ()
    if to_state == RunState.RETRYING:
        sets, values = fragments.GIVE_BACK_RETRY, (retry_within, retry_by)
    with translated:
        return change(row, [Step(to_state, reason)], actor=owner, sets=sets, values=values)


def end_pending(
    task_name: str,
    handed_out_by: datetime,
    *,
    state: str,
    reason: str,
    actor: str,
    limit: int,
    since: datetime | None = None,
    before: datetime | None = None,
) -> list[datetime]:
    """The ``pending`` rows of ``task_name`` handed out at or before ``handed_out_by``
    (and at or after ``since``, before ``before``: a pause's window), at most ``limit``,
    oldest slot first, become ``state`` (``missed``, or ``skipped``); returns the slots
    changed.

    Judged by when the slot was handed out or given back (:data:`HANDED_OUT`),
    not by the slot: ``backfill --enqueue`` hands out slots long past, a row no worker
    starts must end whatever its slot, and a row given back is given its grace anew.
    """
    candidates = runs().filter(LessThanOrEqual(HANDED_OUT, handed_out_by))
    if since is not None:
        candidates = candidates.filter(GreaterThanOrEqual(HANDED_OUT, since))
    if before is not None:
        candidates = candidates.filter(LessThan(HANDED_OUT, before))
    return _end(
        candidates.order_by("slot"),
        task_name,
        state=state,
        reason=reason,
        actor=actor,
        limit=limit,
    )


def tasks_pending(handed_out_by: datetime) -> list[str]:
    """The tasks that have a slot (not a key) ``pending`` since at or before
    ``handed_out_by``: one statement whatever the number of schedules (the sweep ends their
    pending slots, and looks at no other schedule for that)."""
    found = runs().filter(
        LessThanOrEqual(HANDED_OUT, handed_out_by), state=RunState.PENDING, key__isnull=True
    )
    with translated:
        return sorted(set(found.values_list("task_name", flat=True)))


def end_pending_slot(
    task_name: str, slot: datetime, *, state: str, reason: str, actor: str
) -> bool:
    """The ``pending`` row of (``task_name``, ``slot``), if there is one and nothing started
    it, becomes ``state``; True when this call changed it."""
    found = _end(
        runs().filter(slot=slot), task_name, state=state, reason=reason, actor=actor, limit=1
    )
    return bool(found)


def _end(
    candidates: QuerySet[TaskRun],
    task_name: str,
    *,
    state: str,
    reason: str,
    actor: str,
    limit: int,
) -> list[datetime]:
    """Compare-and-set each pending row of ``candidates`` to ``state``: a worker's claim
    that got there first wins, and the row is left to it."""
    with translated:
        found = list(
            candidates.filter(
                task_name=task_name, key__isnull=True, state=RunState.PENDING
            ).values_list("id", "slot", "attempt", "fence", "owner", "lease_until")[:limit]
        )
        ended = []
        stored = clip(reason, ERROR_MAX_LENGTH)
        for run_id, slot, attempt, fence, owner, lease_until in found:
            row = Row(run_id, RunState.PENDING, attempt, fence, owner, lease_until)
            changed = change(
                row,
                [Step(state, reason)],
                actor=actor,
                fenced=False,
                sets=fragments.END_ATTEMPT,
                values=(stored, 0),
            )
            if changed is not None:
                ended.append(slot)
    return ended


def pending_of_data(target_kinds: list[str], limit: int) -> list[tuple[str, datetime]]:
    """``(task, slot)`` of the ``pending`` rows of the enabled data schedules of
    ``target_kinds`` (a "run now" waiting for its executor), newest first, at most
    ``limit``: one query, on the index of (state, slot)."""
    live = data_schedules(target_kinds).filter(removed_at__isnull=True)
    rows = runs().filter(
        state=RunState.PENDING, key__isnull=True, task_name__in=live.values("task_name")
    )
    with translated:
        return list(rows.order_by("-slot").values_list("task_name", "slot")[:limit])
