"""What the monitoring figures say, read from the ledger: one reading, two renderings.

The Prometheus collector (:mod:`metrics`) and the OpenTelemetry ledger gauges
(:mod:`otel.gauges`) render the same :class:`Figures`; neither queries the ledger
itself. A reading costs one range scan of the window's rows (the slot index; durations and start
lateness together), one
index probe per task for its last success, and the health verdict's probes per task.
Needs no optional package.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from . import health, ledger
from .conf import taskguard_settings
from .states import RunState

# Bucket bounds of the duration histogram, in seconds.
DURATION_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
# Bucket bounds of the start lateness histogram (start less slot), in seconds.
LATENESS_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


@dataclass(frozen=True)
class Figures:
    """The ledger's figures over the window of slots (``MONITOR_WINDOW_HOURS``)."""

    window: timedelta
    verdict: health.Verdict
    # Per (task, state), the runs of the window's slots (``ledger.window_summary``).
    summary: dict[tuple[str, str], ledger.StateSummary]
    names: list[str]  # every task: known to the health verdict or seen in the window
    duplicates: dict[str, int]  # per task: calls that found their slot taken
    upkeep_age: float | None  # seconds since the upkeep last finished (None: never)

    def runs(self, name: str, state: str) -> int:
        found = self.summary.get((name, state))
        return found.runs if found is not None else 0

    def missed(self, name: str) -> int:
        """Slots recorded missed (due, and no instance fired them)."""
        return self.runs(name, RunState.MISSED)

    def lease_losses(self, name: str) -> int:
        """Runs recorded abandoned (their owner's lease lapsed: owner dead or cut off)."""
        return self.runs(name, RunState.ABANDONED)


def read() -> Figures:
    """Read the figures from the ledger now."""
    window = timedelta(hours=taskguard_settings.MONITOR_WINDOW_HOURS)
    verdict = health.check()
    summary = ledger.window_summary(verdict.checked_at - window, DURATION_BUCKETS, LATENESS_BUCKETS)
    duplicates: dict[str, int] = {}  # per task, summed once (not a scan per task)
    for (name, _), found in summary.items():
        duplicates[name] = duplicates.get(name, 0) + found.duplicates
    return Figures(
        window=window,
        verdict=verdict,
        summary=summary,
        names=sorted({t.task for t in verdict.tasks} | {name for name, _ in summary}),
        duplicates=duplicates,
        upkeep_age=_upkeep_age(verdict),
    )


def _upkeep_age(verdict: health.Verdict) -> float | None:
    """The age of the latest upkeep: the verdict read it (one query when it did not)."""
    kept = (
        verdict.upkeep if verdict.upkeep is not None else health.upkeep_health(verdict.checked_at)
    )
    if kept.finished_at is None:
        return None
    return max((verdict.checked_at - kept.finished_at).total_seconds(), 0.0)
