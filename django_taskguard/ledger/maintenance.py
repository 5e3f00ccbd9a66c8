"""Maintenance reads and writes: stale runs, runs in flight, retention, task names."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime

from django.db import (
    transaction,
)
from django.db.models import Q, QuerySet
from django.db.models.lookups import LessThan

from ..models import TaskRun, TaskRunQuerySet, TaskRunTransition
from ..states import PRUNABLE_STATES, RunState
from .core import (
    RunRef,
    alias,
    connection,
    database_now,
    dialect,
    fetch_all,
    runs,
    slot_param,
    transitions,
    translated,
)
from .pending import HANDED_OUT

# -- maintenance -------------------------------------------------------------------


def stale_runs(
    *, task: str | None = None, among: QuerySet[TaskRun] | None = None, batch_size: int = 500
) -> Iterator[RunRef]:
    """Rows whose owner is presumed gone, by the database's clock, by ascending id:
    running past their lease, and retrying past the deadline of their retry.

    ``among`` limits them to a queryset's runs (read as a subquery).
    """
    queryset = for_task(runs().overdue(), task)
    if among is not None:
        queryset = queryset.filter(pk__in=among.order_by().values("pk"))
    return refs(queryset, batch_size)


def in_flight(
    *, task: str | None = None, among: QuerySet[TaskRun] | None = None, limit: int = 100
) -> list[tuple[str, datetime, str, datetime, float]]:
    """Live attempts (lease valid by the database's clock), soonest to expire first:
    ``(task, slot, owner, lease_until, seconds left)``."""
    queryset = for_task(runs().live(), task)
    if among is not None:
        queryset = queryset.filter(pk__in=among.order_by().values("pk"))
    with translated:
        now = database_now()
        found = queryset.order_by("lease_until").values_list(
            "task_name", "slot", "owner", "lease_until"
        )[:limit]
        return [
            (name, slot, owner, until, (until - now).total_seconds())
            for name, slot, owner, until in found
            if until is not None
        ]


def for_task(queryset: TaskRunQuerySet, task: str | None) -> TaskRunQuerySet:
    """Runs of ``task``: its own name, or one of its per-schedule names (``task[entry]``)."""
    if task is None:
        return queryset
    return queryset.filter(Q(task_name=task) | Q(task_name__startswith=f"{task}["))


def known_task_names(limit: int = 1000) -> list[str]:
    """Task names the ledger has runs of (for messages that suggest one)."""
    return task_names(limit)


def running_in_pid_space(space: str, batch_size: int = 500) -> Iterator[RunRef]:
    """Running rows whose owner's pid space is ``space`` (see ``owner.Owner``)."""
    return refs(runs().running().filter(owner__contains=f":{space}:"), batch_size)


def run_ref(run_id: int) -> tuple[RunRef, bool] | None:
    """One run and whether its lease is alive by the database's clock."""
    with translated:
        found = runs().filter(pk=run_id).with_lease().values(*REF_FIELDS, "lease_alive").first()
    if found is None:
        return None
    alive = bool(found.pop("lease_alive"))
    return RunRef(**found), alive


REF_FIELDS = (
    "id",
    "task_name",
    "slot",
    "state",
    "attempt",
    "fence",
    "owner",
    "lease_until",
    "key",
)


def refs(queryset: QuerySet[TaskRun], batch_size: int) -> Iterator[RunRef]:
    last = 0
    while True:
        with translated:
            batch = list(
                queryset.filter(pk__gt=last).order_by("pk").values(*REF_FIELDS)[:batch_size]
            )
        for values in batch:
            yield RunRef(**values)
        if len(batch) < batch_size:
            return
        last = batch[-1]["id"]


@translated
def last_transition(run_id: int) -> TaskRunTransition | None:
    return transitions(run_id).order_by("-at", "-id").first()


def prunable(before: datetime) -> TaskRunQuerySet:
    """Finished runs whose slot is older than ``before``; and ``pending`` rows (handed out
    or given back, and nobody started them: nothing ran) whose slot and hand-out or
    give-back are both older than ``before``, which the missed-slot sweep never ends (a
    key's row, an unscheduled task's slot). Deleting a key's row reopens the key, which is
    right, as nothing ran; a slot's is not reopened: a call for a slot that old is
    refused (``guard._refused_as_pruned``)."""
    finished = Q(state__in=PRUNABLE_STATES, slot__lt=before)
    given_back = Q(LessThan(HANDED_OUT, before), state=RunState.PENDING, slot__lt=before)
    queryset: TaskRunQuerySet = runs().filter(finished | given_back)
    return queryset


@translated
def count_prunable(before: datetime) -> tuple[int, int]:
    """How many runs, and transitions of theirs, :func:`prunable` finds."""
    queryset = prunable(before)
    pks = queryset.values("pk")
    return queryset.count(), TaskRunTransition.objects.using(alias()).filter(run__in=pks).count()


@translated
def prunable_ids(before: datetime, after_id: int, limit: int) -> list[int]:
    return list(
        prunable(before).filter(pk__gt=after_id).order_by("pk").values_list("pk", flat=True)[:limit]
    )


@translated
def delete_finished(ids: Sequence[int], before: datetime) -> tuple[int, int]:
    """Delete these runs if still finished (state re-checked), with their transitions.

    One short transaction; returns (runs, transitions) deleted.
    """
    d = dialect()
    params = [*ids, *PRUNABLE_STATES, RunState.PENDING.value, *[slot_param(before)] * 2]
    with transaction.atomic(using=alias()):
        return d.delete_runs(connection(), d.delete_finished(len(ids)), params)


@translated
def task_names(limit: int | None) -> list[str]:
    """Distinct task names (the first ``limit``; None: all) by a loose index scan on
    (task_name, slot), not a DISTINCT scan."""
    if limit is None:
        return [name for (name,) in fetch_all(dialect().task_names(limited=False), [])]
    return [name for (name,) in fetch_all(dialect().task_names(), [limit])]
