"""The tests' Celery app with OpenTelemetry on, for real workers:
``celery -A tests.support.otel_celery_app worker -P prefork``.

Each pool process traces Celery (``CeleryInstrumentor``) and taskguard (``otel.install``)
into a provider of its own, whose exporter appends every finished span as one JSON line to
``TASKGUARD_TEST_SPAN_LOG``: the test reads the spans of another process there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from celery.signals import worker_process_init
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from tests.support.celery_app import app
from tests.support.proc import record

__all__ = ["app"]


class LineExporter(SpanExporter):
    """Every span as one JSON line, appended (O_APPEND) to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            record(self.path, json.dumps(json.loads(span.to_json())))
        return SpanExportResult.SUCCESS


@worker_process_init.connect(weak=False)
def _trace(**_: Any) -> None:
    from django_taskguard import otel

    provider = TracerProvider()
    provider.add_span_processor(
        SimpleSpanProcessor(LineExporter(os.environ["TASKGUARD_TEST_SPAN_LOG"]))
    )
    CeleryInstrumentor().instrument(tracer_provider=provider)
    settings = {"traces": True, "metrics": False, "ledger_metrics": False, "key": "digest"}
    otel.install(provider, None, settings)
