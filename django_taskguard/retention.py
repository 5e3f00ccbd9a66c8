"""Retention: delete finished runs and their transitions, a batch at a time.

Each batch is one short transaction on a bounded list of primary keys, so no
lock is held for long and a prune can run beside live traffic. The ``DELETE``
re-checks the state, so a run that left a finished state meanwhile (an
``abandoned`` run taken over under ``on_stale="retry"``) is kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from django.db import connections, transaction

from .conf import taskguard_settings
from .models import TaskRun, TaskRunQuerySet, TaskRunTransition
from .states import TERMINAL_STATES, RunState

RUN = TaskRun._meta.db_table
TRANSITION = TaskRunTransition._meta.db_table
# Finished for good: no attempt is live and none is running. Never running,
# pending or retrying.
PRUNABLE_STATES = tuple(sorted(TERMINAL_STATES | {RunState.ABANDONED}))
BATCH_SIZE = 1000


@dataclass
class PruneResult:
    runs: int = 0
    transitions: int = 0
    batches: int = 0
    longest_batch_seconds: float = 0.0
    dry_run: bool = False
    durations: list[float] = field(default_factory=list, repr=False)


def prunable(before: datetime) -> TaskRunQuerySet:
    """Finished runs whose slot is older than ``before``."""
    queryset: TaskRunQuerySet = TaskRun.objects.filter(state__in=PRUNABLE_STATES, slot__lt=before)
    return queryset


def prune_runs(
    before: datetime,
    *,
    dry_run: bool = False,
    batch_size: int = BATCH_SIZE,
    progress: Callable[[PruneResult], None] | None = None,
) -> PruneResult:
    """Delete finished runs whose slot is older than ``before``, with their transitions."""
    result = PruneResult(dry_run=dry_run)
    queryset = prunable(before)
    if dry_run:
        result.runs = queryset.count()
        result.transitions = TaskRunTransition.objects.filter(run__in=queryset.values("pk")).count()
        return result
    last = 0
    while True:
        ids = list(
            queryset.filter(pk__gt=last).order_by("pk").values_list("pk", flat=True)[:batch_size]
        )
        if not ids:
            return result
        last = ids[-1]
        started = time.monotonic()
        runs, transitions = _delete_batch(ids)
        elapsed = time.monotonic() - started
        result.runs += runs
        result.transitions += transitions
        result.batches += 1
        result.longest_batch_seconds = max(result.longest_batch_seconds, elapsed)
        if progress is not None:
            progress(result)


def _delete_batch(ids: list[int]) -> tuple[int, int]:
    """One short transaction: the runs (state re-checked), then their transitions."""
    alias = taskguard_settings.DATABASE_ALIAS
    marks = ", ".join(["%s"] * len(ids))
    states = ", ".join(["%s"] * len(PRUNABLE_STATES))
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {RUN} WHERE id IN ({marks}) AND state IN ({states}) RETURNING id",
            [*ids, *PRUNABLE_STATES],
        )
        deleted = [row[0] for row in cursor.fetchall()]
        if not deleted:
            return 0, 0
        marks = ", ".join(["%s"] * len(deleted))
        cursor.execute(f"DELETE FROM {TRANSITION} WHERE run_id IN ({marks})", deleted)
        return len(deleted), max(cursor.rowcount, 0)
