"""The ledger's figures as OpenTelemetry observable gauges (``ledger_metrics``).

The same figures as the Prometheus ``metrics/`` endpoint (:mod:`django_taskguard.figures`,
one reading for both), read from the ledger when the metrics are collected: they are the
whole site's, so only one process should report them. One collection calls every gauge's
callback in turn; they share one reading, taken by the first and reused for
:data:`REUSE_SECONDS`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from .. import figures, ledger
from ..logfields import log_fields
from ..states import RunState

logger = logging.getLogger("taskguard.otel")

REUSE_SECONDS = 5.0


def settle() -> None:
    """Drop this thread's ledger connection after a failed reading (the next one reconnects)."""
    try:
        ledger.settle_connection()
    except Exception:
        logger.exception(
            "taskguard could not close the ledger connection",
            extra=log_fields("connection.close_failed"),
        )


Reader = Callable[[figures.Figures], Iterable[Observation]]


class Reading:
    """The latest reading of the ledger, shared by the callbacks of one collection."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken = -REUSE_SECONDS
        self._figures: figures.Figures | None = None

    def get(self) -> figures.Figures | None:
        with self._lock:
            if self._figures is None or time.monotonic() - self._taken >= REUSE_SECONDS:
                try:
                    self._figures = figures.read()
                except Exception:  # a collection must go on without the ledger's figures
                    logger.exception(
                        "taskguard could not read the ledger's figures",
                        extra=log_fields("otel.figures_failed"),
                    )
                    self._figures = None
                    settle()
                self._taken = time.monotonic()
            return self._figures


def _per_task(value: Callable[[figures.Figures, str], float]) -> Reader:
    return lambda f: [Observation(value(f, name), {"taskguard.task": name}) for name in f.names]


def _verdict(value: Callable[[figures.Figures], Iterable[tuple[str, float]]]) -> Reader:
    return lambda f: [Observation(v, {"taskguard.task": name}) for name, v in value(f)]


GAUGES: dict[str, tuple[str, str, Reader]] = {
    "taskguard.ledger.window": (
        "s",
        "The window of slots the run gauges cover.",
        lambda f: [Observation(f.window.total_seconds())],
    ),
    "taskguard.ledger.upkeep.age": (
        "s",
        "Seconds since the upkeep last finished; absent when it never ran.",
        lambda f: [] if f.upkeep_age is None else [Observation(f.upkeep_age)],
    ),
    "taskguard.ledger.last_success": (
        "s",
        "When the task's latest succeeded slot finished (Unix time).",
        _verdict(
            lambda f: [
                (t.task, t.last_success.finished_at.timestamp())
                for t in f.verdict.tasks
                if t.last_success is not None and t.last_success.finished_at is not None
            ]
        ),
    ),
    "taskguard.ledger.task.healthy": (
        "1",
        "1 when check_schedules finds nothing wrong with the task.",
        _verdict(lambda f: [(t.task, float(t.healthy)) for t in f.verdict.tasks]),
    ),
    "taskguard.ledger.task.paused": (
        "1",
        "1 while the task is paused.",
        _verdict(lambda f: [(t.task, float(t.paused)) for t in f.verdict.tasks]),
    ),
    "taskguard.ledger.runs": (
        "{run}",
        "Runs by state, of the slots in the window.",
        lambda f: [
            Observation(s.runs, {"taskguard.task": name, "taskguard.state": state})
            for (name, state), s in sorted(f.summary.items())
        ],
    ),
    "taskguard.ledger.duplicates": (
        "{call}",
        "Calls that found their slot taken and did not run, of the slots in the window.",
        _per_task(lambda f, name: f.duplicates.get(name, 0)),
    ),
    "taskguard.ledger.missed": (
        "{slot}",
        "Slots recorded missed in the window.",
        _per_task(lambda f, name: f.runs(name, RunState.MISSED)),
    ),
    "taskguard.ledger.lease_losses": (
        "{run}",
        "Runs recorded abandoned (their owner's lease lapsed) in the window.",
        _per_task(lambda f, name: f.runs(name, RunState.ABANDONED)),
    ),
}


def register(meter: Meter) -> None:
    """Create the observable gauges on ``meter``; they read the ledger on collection."""
    reading = Reading()
    for name, (unit, description, reader) in GAUGES.items():
        meter.create_observable_gauge(
            name, callbacks=[_callback(reading, reader)], unit=unit, description=description
        )


def _callback(
    reading: Reading, reader: Reader
) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def observe(options: CallbackOptions) -> Iterable[Observation]:
        found = reading.get()
        return [] if found is None else list(reader(found))

    return observe
