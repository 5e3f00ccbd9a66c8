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
from datetime import datetime, timedelta

from . import ledger
from .conf import taskguard_settings
from .exceptions import TaskGuardError

BATCH_SIZE = 1000
# Guarded calls judge a slot's age on their own clock, prune on the database's:
# prune keeps this much more, so that a clock that is a little behind never
# sees a pruned slot as young enough to run.
CLOCK_MARGIN = timedelta(hours=1)


@dataclass
class PruneResult:
    runs: int = 0
    transitions: int = 0
    batches: int = 0
    longest_batch_seconds: float = 0.0
    dry_run: bool = False
    durations: list[float] = field(default_factory=list, repr=False)


def prune_runs(
    before: datetime,
    *,
    dry_run: bool = False,
    batch_size: int = BATCH_SIZE,
    progress: Callable[[PruneResult], None] | None = None,
) -> PruneResult:
    """Delete finished runs whose slot is older than ``before``, with their transitions
    (and ``pending`` rows nobody started, older than ``before``: ``ledger.maintenance.prunable``).

    ``before`` may not be later than the retention horizon (``PRUNE_AFTER_DAYS``
    ago by the database's clock, less :data:`CLOCK_MARGIN`): guarded calls
    refuse only slots older than it, so a younger pruned slot would run again.
    Raises ``BackendUnavailable`` (``NotMigrated``) when the database fails.
    """
    days = taskguard_settings.PRUNE_AFTER_DAYS
    horizon = ledger.database_now() - timedelta(days=days) - CLOCK_MARGIN
    if before > horizon:
        raise TaskGuardError(
            f"cannot prune runs younger than PRUNE_AFTER_DAYS "
            f"({taskguard_settings.PRUNE_AFTER_DAYS}): before={before.isoformat()} is after "
            f"{horizon.isoformat()}"
        )
    result = PruneResult(dry_run=dry_run)
    if dry_run:
        result.runs, result.transitions = ledger.count_prunable(before)
        return result
    last = 0
    while True:
        ids = ledger.prunable_ids(before, last, batch_size)
        if not ids:
            return result
        last = ids[-1]
        started = time.monotonic()
        runs, transitions = ledger.delete_finished(ids, before)
        elapsed = time.monotonic() - started
        result.runs += runs
        result.transitions += transitions
        result.batches += 1
        result.longest_batch_seconds = max(result.longest_batch_seconds, elapsed)
        if progress is not None:
            progress(result)
