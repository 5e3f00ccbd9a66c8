"""The live OpenTelemetry metrics: what this process's attempts, sweeps and check-ins did.

Counters and histograms count in the process that saw the event (an OpenTelemetry
pipeline sums them over processes); the ledger's own view is :mod:`.gauges`.
"""

from __future__ import annotations

from datetime import datetime, timezone

from opentelemetry.metrics import Meter

from ..context import ActiveRun

# Bucket bounds (seconds) advised for the duration and lateness histograms.
DURATION_BOUNDS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
LATENESS_BOUNDS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
# The results after which the function ran to an end: their duration is recorded.
TIMED_RESULTS = frozenset({"success", "failure"})


class Meters:
    """The instruments, made once from one meter."""

    def __init__(self, meter: Meter) -> None:
        self.runs = meter.create_counter(
            "taskguard.runs", unit="{run}", description="Attempts ended, and slots missed."
        )
        self.duplicates = meter.create_counter(
            "taskguard.duplicates",
            unit="{call}",
            description="Calls that found their slot or key taken and did not run.",
        )
        self.checkin_failures = meter.create_counter(
            "taskguard.checkin.failures",
            unit="{checkin}",
            description="Check-ins not delivered after their tries, or dropped.",
        )
        self.duration = meter.create_histogram(
            "taskguard.run.duration",
            unit="s",
            description="From the claim to the end of attempts whose function ran to an end.",
            explicit_bucket_boundaries_advisory=DURATION_BOUNDS,
        )
        self.lateness = meter.create_histogram(
            "taskguard.start.lateness",
            unit="s",
            description="Start minus slot, of the first attempts of scheduled runs.",
            explicit_bucket_boundaries_advisory=LATENESS_BOUNDS,
        )

    def started(self, run: ActiveRun) -> None:
        """Lateness of a scheduled run's first attempt (a keyed run has no schedule)."""
        if run.attempt != 1 or run.key is not None:
            return
        late = (datetime.now(timezone.utc) - run.slot).total_seconds()
        self.lateness.record(max(late, 0.0), {"taskguard.task": run.task_name})

    def ended(self, task: str, result: str, seconds: float | None, count: int = 1) -> None:
        self.runs.add(count, {"taskguard.task": task, "taskguard.result": result})
        if seconds is not None and result in TIMED_RESULTS:
            self.duration.record(seconds, {"taskguard.task": task})
