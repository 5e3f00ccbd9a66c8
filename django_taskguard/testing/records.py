"""What the ledger recorded for a task, and assertions on it with messages that show it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from .. import ledger
from ..exceptions import TaskGuardError
from ..locks import get_backend
from ..models import RunState, TaskRun, TaskRunQuerySet
from ..schedules import normalize_slot
from .calls import target_of

# How many of a task's other runs a failure message lists.
SHOWN = 5


def task_name_of(task: Any) -> str:
    """The task name runs of ``task`` are recorded under: a guarded function, a Celery
    task whose body is one, or a task name (a str)."""
    if isinstance(task, str):
        if not task:
            raise TaskGuardError("a task name must not be empty")
        return task
    return target_of(task).name


def runs_for(
    task: Any, slot: datetime | str | None = None, *, key: str | None = None
) -> list[TaskRun]:
    """The runs recorded for ``task``, newest slot first, read from the ledger's database.

    ``task``: a guarded function, a Celery task whose body is one, or a task name. Its
    per-schedule runs (``"app.tasks.report[nightly-eu]"``, a beat entry's) are included.
    ``slot`` (an aware datetime or ISO-8601 string) or ``key`` narrows them down.
    """
    return list(_runs(task, slot, key))


def _runs(task: Any, slot: datetime | str | None, key: str | None) -> TaskRunQuerySet:
    if slot is not None and key is not None:
        raise TaskGuardError("runs_for: give slot= or key=, not both")
    # The calls that lost in Redis are counted there (one round trip) and folded into the
    # rows by cleanup_locks in production: folded now, so that the rows read true.
    get_backend().sweep(None, False)
    queryset = ledger.for_task(ledger.runs(), task_name_of(task))
    if slot is not None:
        queryset = queryset.filter(slot=normalize_slot(slot), key__isnull=True)
    if key is not None:
        queryset = queryset.filter(key=key)
    return queryset.order_by("-slot", "-id")


def assert_ran_once(
    task: Any, slot: datetime | str | None = None, *, key: str | None = None
) -> TaskRun:
    """Assert that ``task`` has exactly one run for ``slot`` (or ``key``), and that it
    succeeded; return it. The failure message shows what was recorded."""
    __tracebackhide__ = True  # pytest: the failure points at the test's line
    found = _runs_of_one(task, slot, key)
    if len(found) == 1 and found[0].state == RunState.SUCCEEDED:
        return found[0]
    raise AssertionError(_failure(task, slot, key, "to have run once (succeeded)", found))


def assert_state(
    task: Any, slot: datetime | str | None, state: str, *, key: str | None = None
) -> TaskRun:
    """Assert that ``task`` has exactly one run for ``slot`` (or ``key``, with ``slot``
    None) and that it is in ``state`` (a ``RunState`` or its value); return it."""
    __tracebackhide__ = True
    if state not in RunState.values:
        raise TaskGuardError(
            f"assert_state: {state!r} is not a state ({', '.join(RunState.values)})"
        )
    found = _runs_of_one(task, slot, key)
    if len(found) == 1 and found[0].state == state:
        return found[0]
    expected = f"to have one run in state {RunState(state).value!r}"
    raise AssertionError(_failure(task, slot, key, expected, found))


def assert_no_run(task: Any, slot: datetime | str | None = None, *, key: str | None = None) -> None:
    """Assert that nothing is recorded for ``task`` (for ``slot`` or ``key`` when given).

    A slot that was recorded and not run (``skipped``, ``missed``) has a run: check it
    with :func:`assert_state`.
    """
    __tracebackhide__ = True
    found = runs_for(task, slot, key=key)
    if found:
        raise AssertionError(_failure(task, slot, key, "to have no run", found))


def _runs_of_one(task: Any, slot: datetime | str | None, key: str | None) -> list[TaskRun]:
    if (slot is None) == (key is None):
        raise TaskGuardError("give the slot, or key=, of the run to check (one of them)")
    return runs_for(task, slot, key=key)


def _failure(
    task: Any, slot: datetime | str | None, key: str | None, expected: str, found: list[TaskRun]
) -> str:
    name = task_name_of(task)
    if key is not None:
        where = f"key {key!r}"
    else:
        where = "any slot" if slot is None else f"slot {normalize_slot(slot).isoformat()}"
    lines = [f"expected taskguard task {name!r} {expected} for {where}; "]
    if found:
        lines[0] += f"found {len(found)} run{'s' if len(found) > 1 else ''}:"
        lines.extend(describe(run) for run in found)
    else:
        lines[0] += "found no run."
        others = list(_runs(task, None, None)[:SHOWN])
        if others:
            lines.append(f"Its latest runs (newest first, at most {SHOWN}):")
            lines.extend(describe(run, transitions=False) for run in others)
        else:
            lines.append(f"No run of {name!r} is recorded at all.")
    return "\n".join(lines)


def describe(run: TaskRun, *, transitions: bool = True) -> str:
    """One run for a failure message: its slot or key, state, attempt, duplicates, error,
    and (``transitions``) its transition log."""
    what = (
        f"key {run.key!r} (claimed {run.slot.isoformat()})"
        if run.key is not None
        else f"slot {run.slot.isoformat()}"
    )
    text = (
        f"  - run {run.pk}: {run.task_name} {what}: {run.state}, attempt {run.attempt}, "
        f"duplicates {run.duplicates}"
    )
    if run.error:
        text += f", error {_short(run.error)!r}"
    if transitions:
        for step in ledger.transitions(run.pk):
            reason = f" ({_short(step.reason)})" if step.reason else ""
            text += f"\n      {step.from_state} -> {step.to_state}{reason}"
    return text


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
