"""One span per attempt, from its claim to its end; a short span per missed slot and per
run abandoned by someone else than its owner.

Spans are kept per attempt (run id, attempt, fence) while it runs, at most
:data:`MAX_OPEN` at once. Every path ends them: the signal of the attempt's end; or, when
its end was never recorded (the database failed while recording it), the moment its
``ActiveRun`` is dropped (result ``error``).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from ..context import ActiveRun
from ..locks.keys import key_digest
from ..logfields import log_fields

logger = logging.getLogger("taskguard.otel")

# Attempts with an open span in this process; a claim beyond it gets no span (logged).
MAX_OPEN = 10_000
# Missed slots of one sweep signal that get a span each (the counter counts them all).
MAX_MISSED_SPANS = 100
# Results whose span status is ERROR.
ERROR_RESULTS = frozenset({"failure", "error", "timeout", "abandoned", "missed"})

Key = tuple[int, int, int]  # run id, attempt, fence


@dataclass
class Open:
    """An attempt's span while it runs."""

    span: Span
    task: str
    started: float  # time.monotonic() at the claim
    finalizer: weakref.finalize[Any, Any]

    def elapsed(self) -> float:
        return time.monotonic() - self.started


@dataclass(frozen=True)
class Ended:
    """What an attempt's end says: its result, the row's state, why."""

    result: str
    state: str
    reason: str = ""
    exception: BaseException | None = None
    duplicates: int | None = None  # the row's count at the end (None: not read)


def key_of(run: ActiveRun) -> Key:
    return (run.id, run.attempt, run.fence)


class Spans:
    """The attempts' spans of this process, through one tracer."""

    def __init__(
        self,
        tracer: Tracer,
        plain_keys: bool,
        ended: Callable[[Open, Ended], None] | None = None,
        traced: bool = True,
    ) -> None:
        self.tracer = tracer
        self.traced = traced  # False: a no-op tracer (the attempts are tracked for metrics)
        self.plain_keys = plain_keys
        self.ended = ended  # told of every attempt that ends (the metrics), on every path
        self._open: dict[Key, Open] = {}
        self._lock = threading.Lock()
        self._full_logged = False

    def start(self, run: ActiveRun) -> None:
        """Open ``run``'s span, a child of the span current here (the carrying task's)."""
        with self._lock:
            if key_of(run) in self._open:
                return
            if len(self._open) >= MAX_OPEN:
                if not self._full_logged:
                    logger.warning(
                        "taskguard: %d attempts have an open span; no more",
                        MAX_OPEN,
                        extra=log_fields("otel.spans_full"),
                    )
                    self._full_logged = True
                return
        span = self.tracer.start_span(
            f"taskguard {run.task_name}", kind=SpanKind.INTERNAL, attributes=self.attributes(run)
        )
        span.add_event("taskguard.running", {"taskguard.state": "running"})
        finalizer = weakref.finalize(run, self._orphaned, key_of(run))
        finalizer.atexit = False
        with self._lock:
            self._open[key_of(run)] = Open(span, run.task_name, time.monotonic(), finalizer)

    def attributes(self, run: ActiveRun) -> dict[str, str | int]:
        found: dict[str, str | int] = {
            "taskguard.task": run.task_name,
            "taskguard.slot": run.slot.isoformat(),
            "taskguard.run_id": run.id,
            "taskguard.attempt": run.attempt,
            "taskguard.fence": run.fence,
            "taskguard.owner": run.owner,
            "taskguard.state": "running",
        }
        if run.key is not None:
            found["taskguard.key"] = run.key if self.plain_keys else key_digest(run.key)
        return found

    def end(self, key: Key, ended: Ended) -> Open | None:
        """End the attempt's span (None: it has none open here, or no longer)."""
        with self._lock:
            found = self._open.pop(key, None)
        if found is None:
            return None
        found.finalizer.detach()
        close(found.span, ended)
        if self.ended is not None:
            self.ended(found, ended)
        return found

    def is_open(self, key: Key) -> bool:
        """Whether the attempt has a span open here (that records its end)."""
        with self._lock:
            return key in self._open

    def find(self, match: Callable[[Key, Open], bool]) -> Key | None:
        """The first open attempt that ``match`` accepts."""
        with self._lock:
            return next((key for key, found in self._open.items() if match(key, found)), None)

    def current(self, run: ActiveRun) -> Callable[[], None] | None:
        """Make ``run``'s span current here (a function hook): its undo, for the same context.

        The undo does nothing in another context (a closed coroutine's ``finally`` run by
        the garbage collector): the attachment was never seen there.
        """
        with self._lock:
            found = self._open.get(key_of(run))
        if found is None:
            return None
        attached = trace.set_span_in_context(found.span)
        token = otel_context.attach(attached)

        def undo() -> None:
            if otel_context.get_current() is attached:
                otel_context.detach(token)

        return undo

    def short(self, task: str, what: str, attributes: dict[str, Any], ended: Ended) -> None:
        """A span for something no attempt of this process saw end (missed, abandoned)."""
        span = self.tracer.start_span(
            f"taskguard {task} {what}",
            kind=SpanKind.INTERNAL,
            attributes={"taskguard.task": task, **attributes},
        )
        close(span, ended)

    def missed(self, task: str, slots: Sequence[datetime], reason: str) -> None:
        for slot in slots[-MAX_MISSED_SPANS:]:
            attributes = {"taskguard.slot": slot.isoformat()}
            self.short(task, "missed", attributes, Ended("missed", "missed", reason))

    def _orphaned(self, key: Key) -> None:
        """The attempt is gone and its end was never signalled: it was not recorded."""
        reason = "the attempt ended and its end was not recorded (see the log)"
        try:
            self.end(key, Ended("error", "unknown", reason))
        except Exception:  # a finalizer must not raise
            logger.exception(
                "taskguard could not end the span of run %s",
                key[0],
                extra=log_fields("otel.span_end_failed", run_id=key[0], reason=reason),
            )


def close(span: Span, ended: Ended) -> None:
    """Say how it ended on ``span`` (attributes, an event, the status) and end it."""
    attributes: dict[str, str] = {"taskguard.state": ended.state}
    if ended.reason:
        attributes["taskguard.reason"] = ended.reason
    span.add_event(f"taskguard.{ended.state}", attributes)
    span.set_attributes({**attributes, "taskguard.result": ended.result})
    if ended.duplicates is not None:
        span.set_attribute("taskguard.duplicates", ended.duplicates)
    if ended.exception is not None:
        span.record_exception(ended.exception)
    if ended.result in ERROR_RESULTS:
        span.set_status(Status(StatusCode.ERROR, ended.reason or ended.result))
    span.end()
