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

from . import ledger

BATCH_SIZE = 1000


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
    """Delete finished runs whose slot is older than ``before``, with their transitions."""
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
        runs, transitions = ledger.delete_finished(ids)
        elapsed = time.monotonic() - started
        result.runs += runs
        result.transitions += transitions
        result.batches += 1
        result.longest_batch_seconds = max(result.longest_batch_seconds, elapsed)
        if progress is not None:
            progress(result)
