"""Reads for health, metrics and the admin's overview, a fixed number of statements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import Min

from ..states import ENDED_STATES, LIVE_STATES, OUTCOME_STATES, PROBLEM_STATES, RunState
from .backends import backend_for
from .core import aware, dialect, fetch_all, runs, slot_param, translated

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
    d = dialect()
    with translated:
        for part in _chunks(names):
            statement = d.latest_in_state(_size(part))
            for name, slot, finished in fetch_all(statement, [*_names(part), state, state]):
                slot_at = aware(slot)
                if slot_at is not None:
                    found[name] = LastRun(slot_at, aware(finished))
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
    # The start lateness (start less slot) of the slots' first attempts (keyed runs left
    # out): sum, count, and how many are at most each lateness bound.
    lateness_sum: float = 0.0
    lateness_count: int = 0
    lateness_buckets: tuple[int, ...] = ()


def window_summary(
    since: datetime, bounds: Sequence[float], lateness: Sequence[float] = ()
) -> dict[tuple[str, str], StateSummary]:
    """Per (task, state), the runs whose slot is at or after ``since``, their durations
    counted at most each of ``bounds`` and their start lateness at most each of ``lateness``:
    one statement, a range scan of the slot index (its cost is the window's row count)."""
    statement = dialect().window_summary(len(bounds), len(lateness))
    params: dict[str, Any] = {"since": slot_param(since), "first": FIRST_ATTEMPT}
    params.update({f"duration_{i}": bound for i, bound in enumerate(bounds)})
    params.update({f"lateness_{i}": bound for i, bound in enumerate(lateness)})
    with translated:
        rows = fetch_all(statement, params)
    found = {}
    for name, state, count, duplicates, total, timed, late_total, late, *below in rows:
        found[(name, state)] = StateSummary(
            int(count),
            int(duplicates),
            float(total),
            int(timed),
            tuple(int(n or 0) for n in below[: len(bounds)]),
            float(late_total),
            int(late),
            tuple(int(n or 0) for n in below[len(bounds) :]),
        )
    return found


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
    # Its latest run in an outcome state (succeeded, failed, abandoned, missed), by slot.
    outcome_slot: datetime | None = None
    outcome_state: str | None = None
    outcome_error: str = ""
    # The least and greatest start lateness (seconds) of its last ``last`` first starts
    # (None: fewer than that many started).
    late_starts: tuple[float, float] | None = None


# The attempt whose start is a slot's start (a retry's is later by its backoff).
FIRST_ATTEMPT = 1
FACTS_CHUNK = 200  # tasks per statement (where the names are not bound as one array)


def _chunks(items: Sequence[Any]) -> list[Sequence[Any]]:
    """``items`` in the parts one statement reads: all of them where the database binds
    arrays (PostgreSQL: a fixed number of statements whatever the tasks), else
    :data:`FACTS_CHUNK` each."""
    if dialect().binds_arrays:
        return [items] if items else []
    return [items[start : start + FACTS_CHUNK] for start in range(0, len(items), FACTS_CHUNK)]


def _size(part: Sequence[Any]) -> int:
    """The count a statement is built for (one statement text for any count of arrays)."""
    return 1 if dialect().binds_arrays else len(part)


def _names(part: Sequence[str]) -> list[Any]:
    """The parameters of ``part``'s names: one array, or one each."""
    return [list(part)] if dialect().binds_arrays else list(part)


def task_facts(
    asks: Sequence[tuple[str, datetime | None]],
    since: datetime,
    last: int,
    late_runs: int | None = None,
) -> dict[str, TaskFacts]:
    """For each ``(task, due slot)``: its :class:`TaskFacts`, one statement (per 200 tasks
    where names are not bound as arrays). ``late_runs``: read the lateness of each task's
    last this many first starts too (None: not read, ``late_starts`` is None)."""
    d = dialect()
    found: dict[str, TaskFacts] = {}
    with translated:
        for part in _chunks(asks):
            params: list[Any] = []
            dues = [None if due is None else slot_param(due) for _, due in part]
            if d.binds_arrays:
                params += [[name for name, _ in part], dues]
            else:
                for (name, _), due in zip(part, dues, strict=True):
                    params += [name, due]
            params += [RunState.MISSED, slot_param(since), *[RunState.RUNNING] * 3]
            recent = d.last_ended_params(ENDED_STATES, last)
            params += [*recent, *recent, RunState.SUCCEEDED]
            params += [*ENDED_STATES, *OUTCOME_STATES * 3]
            if late_runs is not None:
                params += d.late_starts_params(late_runs, FIRST_ATTEMPT)
            statement = d.task_facts(_size(part), late_runs is not None)
            for values in fetch_all(statement, params):
                name, due_state, missed, stale, stale_slot, stale_lease, ended, failed = values[:8]
                latest, outcome_slot, outcome_state, outcome_error, *late = values[8:]
                found[name] = TaskFacts(
                    due_state,
                    int(missed),
                    int(stale),
                    aware(stale_slot),
                    aware(stale_lease),
                    int(ended),
                    int(failed),
                    aware(latest),
                    aware(outcome_slot),
                    outcome_state,
                    outcome_error or "",
                    _pair(late[0] if late else None),
                )
    return found


def _pair(text: str | None) -> tuple[float, float] | None:
    """The "least greatest" text of :meth:`Backend.late_starts` (None: NULL or "")."""
    if not text:
        return None
    least, greatest = text.split()
    return float(least), float(greatest)


def alive_since(now: datetime) -> dict[str, datetime]:
    """Each task with a ``running`` row whose lease is alive by ``now`` (the database's
    clock): when the oldest such run started. One statement, a range scan of the
    (state, lease_until) index: its cost is the number of runs in flight."""
    alive = runs().filter(state=RunState.RUNNING, lease_until__gt=now, started_at__isnull=False)
    with translated:
        rows = list(alive.values("task_name").annotate(since=Min("started_at")).order_by())
    return {row["task_name"]: row["since"] for row in rows}


def recent_runs_of(names: Sequence[str], limit: int) -> dict[str, list[SlotRun]]:
    """Each task's ``limit`` runs with the latest slots, newest first: one statement per
    200 tasks; per task, one probe for its ``limit``-th latest slot and a range scan of
    the (task_name, slot) index from there."""
    d = dialect()
    found: dict[str, list[SlotRun]] = {name: [] for name in names}
    with translated:
        for part in _chunks(names):
            for name, run_id, slot, state in fetch_all(
                d.recent_runs(_size(part)), [*_names(part), d.recent_limit(limit)]
            ):
                slot_at = aware(slot)
                assert slot_at is not None
                found[name].append(SlotRun(int(run_id), slot_at, state))
    for runs_of_task in found.values():
        runs_of_task.sort(key=lambda run: run.slot, reverse=True)
    return found


def problem_slots(task_name: str, after: datetime | None, until: datetime) -> int:
    """How many of ``task_name``'s slots after ``after`` (None: ever) and at or before
    ``until`` did not succeed (failed, abandoned, missed): what an acknowledgement covers."""
    found = runs().filter(task_name=task_name, state__in=PROBLEM_STATES, slot__lte=until)
    if after is not None:
        found = found.filter(slot__gt=after)
    with translated:
        return found.count()


def earliest_live_slot(task_name: str) -> datetime | None:
    """The earliest slot of ``task_name`` still in flight (pending, running, retrying):
    its outcome is not known yet, so no acknowledgement covers it."""
    found = runs().filter(task_name=task_name, state__in=LIVE_STATES)
    with translated:
        earliest = found.aggregate(earliest=Min("slot"))["earliest"]
    return aware(earliest) if earliest is not None else None


@translated
def estimated_count(queryset: Any) -> int | None:
    """The planner's estimate of the rows of ``queryset`` (of ``TaskRun``, on any alias),
    where its database gives one without counting them (PostgreSQL); None elsewhere."""
    return backend_for(queryset.db).estimated_rows(queryset)
