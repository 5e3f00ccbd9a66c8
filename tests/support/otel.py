"""OpenTelemetry read back in tests: the SDK's in-memory exporters, handed to ``otel.install``
(the test's own providers: OpenTelemetry lets a process set its global ones only once)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from django_taskguard import otel

SETTINGS = {"traces": True, "metrics": True, "ledger_metrics": False, "key": "digest"}


@dataclass
class Recorded:
    tracer_provider: TracerProvider
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader

    def finished(self, name_part: str = "") -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if name_part in s.name]

    def points(self, name: str) -> dict[tuple[tuple[str, Any], ...], Any]:
        """The metric's data points by their sorted attributes."""
        data = self.metrics.get_metrics_data()
        found: dict[tuple[tuple[str, Any], ...], Any] = {}
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        for point in metric.data.data_points:
                            found[tuple(sorted(point.attributes.items()))] = point
        return found


def start(settings: dict[str, Any] | None = None) -> Recorded:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    otel.install(
        tracer_provider, MeterProvider(metric_readers=[reader]), {**SETTINGS, **(settings or {})}
    )
    return Recorded(tracer_provider, exporter, reader)


@contextmanager
def recording(settings: dict[str, Any] | None = None) -> Iterator[Recorded]:
    """:func:`start`, then ``otel.uninstall()``."""
    try:
        yield start(settings)
    finally:
        otel.uninstall()


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def events(span: ReadableSpan) -> list[str]:
    return [event.name for event in span.events]


def runs_of(recorded: Recorded, task: str) -> dict[str, int]:
    return {
        dict(key)["taskguard.result"]: point.value
        for key, point in recorded.points("taskguard.runs").items()
        if dict(key)["taskguard.task"] == task
    }
