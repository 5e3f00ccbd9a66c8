"""What no attempt wrote: duplicate counts, rows no attempt held, slot queries."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db import (
    connections,
    transaction,
)
from django.db.models import F, Q

from ..states import ATTEMPT_STATES, ENDED_STATES, RunState, check_transition
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
    fetch_all,
    message_key,
    one,
    runs,
    slot_param,
    translated,
)

# -- what no attempt wrote -----------------------------------------------------------


def add_duplicates(task_name: str, slot: datetime, count: int, key: str | None = None) -> bool:
    """Add ``count`` duplicate calls to the slot's (or key's) row; False when there is no row."""
    params: list[Any]
    if key is not None:
        statement, params = dialect().add_duplicates_key, [count, task_name, key]
    else:
        statement, params = dialect().add_duplicates, [count, task_name, slot_param(slot)]
    with translated, connections[alias()].cursor() as cursor:
        cursor.execute(statement, params)
        return bool(cursor.rowcount)


def duplicates_of(run_id: int) -> int | None:
    """The row's duplicate count as it stands now (None: no such row)."""
    with translated:
        found: int | None = runs().filter(pk=run_id).values_list("duplicates", flat=True).first()
    return found


def count_other_copy(run_id: int, message_id: str | None) -> bool:
    """A call that found run ``run_id`` retrying: True (and counted as a duplicate) when
    the row waits for the retry another message carries, not ``message_id``'s."""
    with translated, connections[alias()].cursor() as cursor:
        params = {
            "id": run_id,
            "message": message_key(message_id),
            "retrying": RunState.RETRYING,
        }
        cursor.execute(dialect().count_other_copy, params)
        return bool(cursor.rowcount)


def insert_abandoned(
    task_name: str,
    slot: datetime,
    *,
    reason: str,
    duplicates: int,
    actor: str,
    key: str | None = None,
) -> int | None:
    """Record a slot (or key) no attempt ever held as ``abandoned``; None when it has a row."""
    return insert_unheld(task_name, slot, RunState.ABANDONED, reason, duplicates, actor, key)


def insert_skipped(task_name: str, slot: datetime, *, reason: str, actor: str) -> int | None:
    """Record a slot that will not run as ``skipped``; None when it has a row already."""
    return insert_unheld(task_name, slot, RunState.SKIPPED, reason, 0, actor)


def insert_missed(task_name: str, slot: datetime, *, reason: str, actor: str) -> int | None:
    """Record a due slot that no instance claimed within its grace as ``missed``;
    None when it has a row already."""
    return insert_unheld(task_name, slot, RunState.MISSED, reason, 0, actor)


def insert_unheld_many(
    state: str, rows: Sequence[tuple[str, datetime, str]], *, actor: str
) -> set[tuple[str, datetime]]:
    """Record many slots no attempt held (``missed``, or ``skipped`` while paused) at once:
    ``(task, slot, reason)`` each; a slot that has a row keeps it. Returns the ``(task,
    slot)`` pairs written by this call (not those another writer recorded first, even in the
    same state: a concurrent sweep's)."""
    check_transition(RunState.PENDING, state)
    if not rows:
        return set()
    params = [
        [task for task, _, _ in rows],
        [slot_param(slot) for _, slot, _ in rows],
        [clip(reason, REASON_MAX_LENGTH) for _, _, reason in rows],
        state,
        RunState.PENDING,
        state,
        actor,
    ]
    with translated:
        written = dialect().insert_unheld_many(connection(), params)
        if written is not None:
            return set(written)
        # Not in one statement: a row and its transition at a time, one commit for them all.
        with transaction.atomic(using=alias()):
            inserted = [(t, s, insert_unheld(t, s, state, r, 0, actor)) for t, s, r in rows]
    return {(task, slot) for task, slot, run_id in inserted if run_id is not None}


def _miss_refused(row: Row, reason: str, actor: str) -> bool:
    missed = change(
        row,
        [Step(RunState.MISSED, reason)],
        actor=actor,
        fenced=False,
        lease="refused_early",
        sets=fragments.MISS_REFUSED_EARLY,
        values=(clip(reason, ERROR_MAX_LENGTH),),
    )
    return missed is not None


# Windows (or pairs) per statement of the many-schedule reads: three (two) parameters each,
# within SQLite's 999.
WINDOWS_PER_STATEMENT = 300


def refused_early_many(
    windows: Sequence[tuple[str, datetime, datetime]], *, reasons: dict[str, str], actor: str
) -> dict[str, int]:
    """The rows of ``(task, after, until)`` windows that only record an early call's
    refusal (no on-time call took them) become ``missed``, each by compare-and-set (a claim
    that got there first keeps its row): one read per :data:`WINDOWS_PER_STATEMENT` windows;
    ``reasons`` by task. Returns how many each task's rows became ``missed``."""
    changed: dict[str, int] = {}
    refused = Q(state=RunState.SKIPPED, attempt=0, created_at__lt=F("slot"))
    with translated:
        for start in range(0, len(windows), WINDOWS_PER_STATEMENT):
            part = windows[start : start + WINDOWS_PER_STATEMENT]
            within = Q()
            for task, after, until in part:
                within |= Q(task_name=task, slot__gt=after, slot__lte=until)
            found = runs().filter(refused, within).order_by("slot")
            fields = ("id", "task_name", "fence", "owner", "lease_until")
            for run_id, task, fence, owner, lease_until in found.values_list(*fields):
                row = Row(run_id, RunState.SKIPPED, 0, fence, owner, lease_until)
                if _miss_refused(row, reasons[task], actor):
                    changed[task] = changed.get(task, 0) + 1
    return changed


def latest_slot(task_name: str) -> datetime | None:
    """The newest slot of ``task_name`` that has a row other than ``missed`` (a missed
    slot is one a catch-up still runs)."""
    with translated:
        found = one(dialect().latest_slot, [task_name, RunState.MISSED])
    return aware(found[0]) if found else None


def slots_in(task_name: str, after: datetime, until: datetime) -> set[datetime]:
    """The slots of ``task_name`` in ``(after, until]`` that have a row."""
    with translated:
        params = {
            "task": task_name,
            "after": slot_param(after),
            "until": slot_param(until),
            "skipped": RunState.SKIPPED,
        }
        found = fetch_all(dialect().slots_in, params)
    return {slot for (value,) in found if (slot := aware(value)) is not None}


STATES_AT_CHUNK = 1_000  # slots per statement


def states_at(task_name: str, slots: Sequence[datetime]) -> dict[datetime, str]:
    """The state of ``task_name``'s row at each of ``slots`` that has one: a statement per
    ``STATES_AT_CHUNK`` slots (fewer where the database binds fewer parameters), whatever
    other rows lie between them."""
    found: dict[datetime, str] = {}
    d = dialect()
    # The task name and the skipped state are parameters too; SQLite may be built with a
    # limit of 999.
    most = connections[alias()].features.max_query_params
    chunk = STATES_AT_CHUNK if most is None else min(STATES_AT_CHUNK, most - 2)
    with translated:
        for start in range(0, len(slots), chunk):
            part = slots[start : start + chunk]
            params = {
                "task": task_name,
                "skipped": RunState.SKIPPED,
                **{f"slot_{n}": slot_param(slot) for n, slot in enumerate(part)},
            }
            for value, state in fetch_all(d.states_at(len(part)), params):
                if (slot := aware(value)) is not None:
                    found[slot] = state
    return found


def pairs_without_row(pairs: Sequence[tuple[str, datetime]]) -> list[tuple[str, datetime]]:
    """Those of the ``(task, slot)`` pairs (of many tasks) that have no row, in their order;
    a row that only recorded an early call's refusal is none (as in :func:`states_at`). One
    statement per as many probes as the database binds, grouped by slot or by task,
    whichever makes fewer terms (10,000 tasks due at one instant: one term per statement)."""
    have = pair_states(pairs)
    return [pair for pair in pairs if pair not in have]


def pair_states(pairs: Sequence[tuple[str, datetime]]) -> dict[tuple[str, datetime], str]:
    """The state of the row at each of the ``(task, slot)`` pairs that has one (see
    :func:`pairs_without_row`)."""
    by_slot: dict[datetime, list[str]] = {}
    by_task: dict[str, list[datetime]] = {}
    for task, slot in pairs:
        by_slot.setdefault(slot, []).append(task)
        by_task.setdefault(task, []).append(slot)
    refused = Q(state=RunState.SKIPPED, attempt=0, created_at__lt=F("slot"))
    budget = _parameter_budget()
    have: dict[tuple[str, datetime], str] = {}
    terms: list[tuple[Q, int]]  # a probe and its parameter count
    if len(by_slot) <= len(by_task):
        terms = [
            (Q(slot=slot, task_name__in=part), 1 + len(part))
            for slot, tasks in by_slot.items()
            for part in _parts(tasks, budget - 1)
        ]
    else:
        terms = [
            (Q(task_name=task, slot__in=part), 1 + len(part))
            for task, slots in by_task.items()
            for part in _parts(slots, budget - 1)
        ]
    with translated:
        for group in _groups(terms, budget):
            found = runs().filter(group).exclude(refused)
            for task, slot, state in found.values_list("task_name", "slot", "state"):
                have[(task, slot)] = state
    return have


# Parameters per statement of :func:`pair_states` where the database sets no lower limit.
MOST_PARAMETERS = 20_000


def _parameter_budget() -> int:
    """The parameters a probe statement may bind (the state and attempt of the refusal
    test bind a few more)."""
    most = connections[alias()].features.max_query_params
    return min(MOST_PARAMETERS, most or MOST_PARAMETERS) - 10


def _parts(values: list[Any], size: int) -> list[list[Any]]:
    return [values[start : start + size] for start in range(0, len(values), size)]


def _groups(terms: Sequence[tuple[Q, int]], budget: int) -> list[Q]:
    """The ``terms`` OR-ed together, a group per at most ``budget`` parameters."""
    groups: list[Q] = []
    current, size = Q(), 0
    for term, weight in terms:
        if size and size + weight > budget:
            groups.append(current)
            current, size = Q(), 0
        current |= term
        size += weight
    if size:
        groups.append(current)
    return groups


def failed_streak(task_name: str, length: int) -> bool:
    """True when the newest ``length`` finished runs of ``task_name`` all failed."""
    with translated:
        found = fetch_all(dialect().last_states, [task_name, *ENDED_STATES, length])
    return len(found) == length and all(state == RunState.FAILED for (state,) in found)


def insert_unheld(
    task_name: str,
    slot: datetime,
    state: str,
    reason: str,
    duplicates: int,
    actor: str,
    key: str | None = None,
) -> int | None:
    """A row no attempt ever held (attempt 0, no owner, no fence), with its transition."""
    check_transition(RunState.PENDING, state)
    d = dialect()
    reason = clip(reason, REASON_MAX_LENGTH)
    with translated, transaction.atomic(using=alias()):
        if key is None:
            statement = d.insert_unheld
            params = [task_name, slot_param(slot), state, reason, duplicates]
        else:
            statement = d.insert_unheld_key
            params = [task_name, slot_param(slot), key, state, reason, duplicates]
        inserted = one(statement, params)
        if inserted is None:
            return None
        one(d.transition, [inserted[0], RunState.PENDING, state, reason, actor])
    return int(inserted[0])


def row_exists(task_name: str, slot: datetime, key: str | None = None) -> bool:
    found = runs().filter(task_name=task_name)
    found = found.filter(key=key) if key is not None else found.filter(slot=slot)
    with translated:
        return found.exists()


def token_holders(slot: datetime, token: str) -> list[tuple[str, bool]]:
    """``(task_name, lease alive)`` of the runs at ``slot`` whose owner holds ``token``."""
    with translated:
        found = runs().filter(slot=slot, owner__endswith=f":{token}").with_lease()
        pairs = found.values_list("task_name", "lease_alive")  # type: ignore[misc]  # annotation
        return [(name, bool(alive)) for name, alive in pairs]


def keyed_token_holders(token: str) -> list[tuple[str, bool]]:
    """``(task_name, lease alive)`` of the unfinished keyed runs whose owner holds ``token``."""
    with translated:
        found = (
            runs()
            .filter(state__in=ATTEMPT_STATES, key__isnull=False)
            .filter(owner__endswith=f":{token}")
            .with_lease()
        )
        pairs = found.values_list("task_name", "lease_alive")  # type: ignore[misc]  # annotation
        return [(name, bool(alive)) for name, alive in pairs]


def note_schedule_version(run_id: int, version: int) -> None:
    """Record which version of its data schedule fired run ``run_id`` (its attempt claimed
    it a moment ago; a later attempt of the same row writes its own)."""
    with translated:
        runs().filter(id=run_id).update(schedule_version=version)


def note_schedule_versions(versions: dict[int, int]) -> None:
    """:func:`note_schedule_version` for many runs (``{run id: version}``): one UPDATE per
    distinct version (a batch claimed at one slot mostly shares one)."""
    by_version: dict[int, list[int]] = {}
    for run_id, version in versions.items():
        by_version.setdefault(version, []).append(run_id)
    with translated:
        for version, ids in by_version.items():
            runs().filter(id__in=ids).update(schedule_version=version)
