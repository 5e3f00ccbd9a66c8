"""Prometheus metrics, read from the ledger on scrape (``prometheus_client``, ``[prometheus]``).

Every instance of a site runs tasks, but one of them answers a scrape: so the
figures come from the ledger, the one place that saw every instance's runs,
never from counters in the scraped process. They are **gauges over a window**
(``MONITOR_WINDOW_HOURS``, default 24 hours of slots), not counters, because
``prune_runs`` deletes old rows: a count of rows would fall and look like a
counter reset. Lease losses are counted from the ledger for the same reason (a
``lease_lost`` receiver counts only in the process that lost the lease, and an
owner killed mid-run sends nothing): a run whose owner's lease lapsed is
recorded ``abandoned``.

The start lateness histogram (start less slot, of each slot's first attempt) comes from
the same scan. A scrape costs one reading of :mod:`figures` (shared with the OpenTelemetry
ledger gauges).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CollectorRegistry, GaugeHistogramMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from . import ledger
from .figures import DURATION_BUCKETS, LATENESS_BUCKETS, read
from .states import TIMED_STATES

__all__ = ["DURATION_BUCKETS", "LATENESS_BUCKETS", "LedgerCollector", "exposition"]


class LedgerCollector(Collector):
    """Reads the ledger on every collect; register it in any ``CollectorRegistry``."""

    def collect(self) -> Iterator[GaugeMetricFamily | GaugeHistogramMetricFamily]:
        figures = read()
        verdict, summary, names = figures.verdict, figures.summary, figures.names
        yield _gauge(
            "taskguard_window_seconds",
            "The window of slots the run gauges cover.",
            [],
            [([], figures.window.total_seconds())],
        )
        yield _gauge(
            "taskguard_upkeep_age_seconds",
            "Seconds since the upkeep (automatic, or cleanup_locks) last finished; absent "
            "when it never ran.",
            [],
            [] if figures.upkeep_age is None else [([], figures.upkeep_age)],
        )
        yield _gauge(
            "taskguard_last_success_timestamp_seconds",
            "When the task's latest succeeded slot finished (Unix time).",
            ["task"],
            [
                ([t.task], t.last_success.finished_at.timestamp())
                for t in verdict.tasks
                if t.last_success is not None and t.last_success.finished_at is not None
            ],
        )
        yield _gauge(
            "taskguard_task_healthy",
            "1 when check_schedules finds nothing wrong with the task (a paused task is healthy).",
            ["task"],
            [([t.task], float(t.healthy)) for t in verdict.tasks],
        )
        yield _gauge(
            "taskguard_task_paused",
            "1 while the task is paused.",
            ["task"],
            [([t.task], float(t.paused)) for t in verdict.tasks],
        )
        yield _gauge(
            "taskguard_runs",
            "Runs by state, of the slots in the window.",
            ["task", "state"],
            [([name, state], s.runs) for (name, state), s in sorted(summary.items())],
        )
        yield _per_task(
            names,
            "taskguard_duplicates_suppressed",
            "Calls that found their slot taken and did not run, of the slots in the window.",
            lambda name: figures.duplicates.get(name, 0),
        )
        yield _per_task(
            names,
            "taskguard_missed_slots",
            "Slots recorded missed (due, and no instance fired them), in the window.",
            figures.missed,
        )
        yield _per_task(
            names,
            "taskguard_lease_losses",
            "Runs recorded abandoned (their owner's lease lapsed: owner dead or cut off), "
            "in the window.",
            figures.lease_losses,
        )
        yield _durations(names, summary)
        yield _lateness(names, summary)


def _gauge(
    name: str, documentation: str, labels: list[str], samples: list[tuple[list[str], float]]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for values, value in samples:
        family.add_metric(values, value)
    return family


def _per_task(
    names: list[str], metric: str, documentation: str, value: Callable[[str], float]
) -> GaugeMetricFamily:
    return _gauge(metric, documentation, ["task"], [([name], float(value(name))) for name in names])


def _durations(
    names: list[str], summary: dict[tuple[str, str], ledger.StateSummary]
) -> GaugeHistogramMetricFamily:
    per_task: dict[str, list[Counts]] = {
        name: [
            (p.buckets, p.duration_count, p.duration_sum)
            for p in (summary[(name, state)] for state in TIMED_STATES if (name, state) in summary)
        ]
        for name in names
    }
    return _histogram(
        "taskguard_run_duration_seconds",
        "How long finished attempts (succeeded, failed) ran, of the slots in the window.",
        DURATION_BUCKETS,
        per_task,
    )


def _lateness(
    names: list[str], summary: dict[tuple[str, str], ledger.StateSummary]
) -> GaugeHistogramMetricFamily:
    timed: dict[str, list[Counts]] = {}  # per task, in one pass
    for (task, _), found in summary.items():
        if found.lateness_count:
            timed.setdefault(task, []).append(
                (found.lateness_buckets, found.lateness_count, found.lateness_sum)
            )
    return _histogram(
        "taskguard_start_lateness_seconds",
        "How long after its slot each slot's first attempt started (keyed runs left out), of "
        "the slots in the window.",
        LATENESS_BUCKETS,
        {name: timed.get(name, []) for name in names},
    )


# One state's share of a histogram: (counts at or below each bound, count, sum).
Counts = tuple[tuple[int, ...], int, float]


def _histogram(
    metric: str, documentation: str, bounds: Sequence[float], per_task: dict[str, list[Counts]]
) -> GaugeHistogramMetricFamily:
    """A gauge histogram per task, its parts (one per state) added up; a task with no part
    is left out."""
    family = GaugeHistogramMetricFamily(metric, documentation, labels=["task"])
    for name, parts in per_task.items():
        if not parts:
            continue
        below = [sum(counts[i] for counts, _, _ in parts) for i in range(len(bounds))]
        buckets = [(f"{bound:g}", float(n)) for bound, n in zip(bounds, below, strict=True)]
        buckets.append(("+Inf", float(sum(count for _, count, _ in parts))))
        family.add_metric([name], buckets, gsum_value=sum(total for _, _, total in parts))
    return family


def exposition(accept: str) -> tuple[bytes, str]:
    """The metrics in the format the ``Accept`` header asks for: (body, content type)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LedgerCollector())
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type
