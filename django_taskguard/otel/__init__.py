"""OpenTelemetry spans and metrics (``TASKGUARD["OPENTELEMETRY"]``, extra ``[otel]``).

Imported only when the setting turns it on (``apps.ready`` calls :func:`install`). The
receivers listen to taskguard's signals (:mod:`django_taskguard.signals`): a span per
attempt from ``run_started`` to its end, made current while the function runs (a
function hook, :func:`django_taskguard.context.add_function_hook`), and the live metrics.
The tracer and meter come from the global providers, looked up lazily (a provider set
after :func:`install` is used); tests pass their own providers instead.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime
from typing import Any

from django.dispatch import Signal
from opentelemetry import metrics, trace
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider

from .. import __version__, ledger, signals
from ..conf import taskguard_settings
from ..context import ActiveRun, active_run, add_function_hook, remove_function_hook
from ..ledger import clip
from ..logfields import log_fields
from .gauges import register as register_gauges
from .meters import Meters
from .spans import Ended, Open, Spans, key_of

logger = logging.getLogger("taskguard.otel")

NAME = "django_taskguard"
REASON_MAX_LENGTH = 1000


class Receivers:
    """What one :func:`install` connected: the spans, the instruments, or both."""

    def __init__(self, spans: Spans, meters: Meters | None) -> None:
        # The attempts are tracked with or without traces (a no-op tracer then): an attempt's
        # end is counted once, with its duration.
        self.spans, self.meters = spans, meters

    def _end(self, run: ActiveRun, ended: Ended) -> None:
        """End ``run``'s span with the row's duplicate count as it stands now (the calls
        suppressed while it ran, on Redis folded into the row before the end's signal);
        read only for a span open here and traced, and left off when it cannot be read."""
        key = key_of(run)
        if not (self.spans.traced and self.spans.is_open(key)):
            self.spans.end(key, ended)  # the metrics count it (or nothing is open)
            return
        try:
            ended = replace(ended, duplicates=ledger.duplicates_of(run.id))
        except Exception as exc:
            logger.debug(
                "taskguard could not read run %s's duplicates for its span (%s)",
                run.id,
                exc,
                extra=log_fields("otel.duplicates_failed", run_id=run.id, reason=exc),
            )
        self.spans.end(key, ended)

    def started(self, sender: str, run: ActiveRun, **kwargs: Any) -> None:
        if self.meters is not None:
            self.meters.started(run)
        self.spans.start(run)

    def succeeded(self, sender: str, run: ActiveRun, **kwargs: Any) -> None:
        self._end(run, Ended("success", "succeeded"))

    def failed(
        self,
        sender: str,
        run: ActiveRun,
        exception: BaseException,
        state: str = "failed",
        **kw: Any,
    ) -> None:
        # Cut before formatting, as the ledger does: a huge message is never copied whole.
        reason = f"{type(exception).__name__}: {clip(str(exception), REASON_MAX_LENGTH)}"
        self._end(run, Ended("failure", state, reason, exception))

    def given_back(self, sender: str, run: ActiveRun, reason: str = "", **kwargs: Any) -> None:
        self._end(run, Ended("skip", run.claimed_from, reason))

    def lease_lost(self, sender: str, run: ActiveRun, **kwargs: Any) -> None:
        self._end(run, Ended("timeout", "lease_lost", run.lost_reason))

    def skipped(self, sender: str, slot: datetime, reason: str = "", **kwargs: Any) -> None:
        """A recorded ``skipped``: the end of the attempt running here, if it is that slot's
        (Celery's ``Ignore`` raised in the function); a call refused before any claim is
        not an attempt and has no span."""
        run = active_run()
        if run is not None and (run.task_name, run.slot) == (sender, slot):
            self._end(run, Ended("skip", "skipped", reason))

    def abandoned(
        self, sender: str, run_id: int, slot: datetime, reason: str = "", **kwargs: Any
    ) -> None:
        """The attempt running here was interrupted, or a run found dead (by upkeep, a later
        caller): a short span, since its owner can no longer say it."""
        ended = Ended("abandoned", "abandoned", reason)
        key = self.spans.find(lambda key, found: key[0] == run_id)
        if key is not None:
            self.spans.end(key, ended)
            return
        attributes = {"taskguard.run_id": run_id, "taskguard.slot": slot.isoformat()}
        self.spans.short(sender, "abandoned", attributes, ended)
        if self.meters is not None:
            self.meters.ended(sender, "abandoned", None)

    def missed(self, sender: str, slot: datetime, reason: str = "", **kwargs: Any) -> None:
        slots = kwargs.get("slots") or [slot]
        self.spans.missed(sender, slots, reason)
        if self.meters is not None:
            self.meters.ended(sender, "missed", None, count=int(kwargs.get("count") or len(slots)))

    def duplicate(self, sender: str, **kwargs: Any) -> None:
        if self.meters is not None:
            self.meters.duplicates.add(1, {"taskguard.task": sender})

    def checkin_failed(
        self, sender: Any = None, service: str = "", event: str = "", **kwargs: Any
    ) -> None:
        if self.meters is not None:
            attributes = {"taskguard.service": service, "taskguard.event": event}
            self.meters.checkin_failures.add(1, attributes)

    def counted(self, found: Open, ended: Ended) -> None:
        if self.meters is not None:
            self.meters.ended(found.task, ended.result, found.elapsed())


# signal -> the Receivers method connected to it
CONNECTIONS: dict[Signal, str] = {
    signals.run_started: "started",
    signals.run_succeeded: "succeeded",
    signals.run_failed: "failed",
    signals.run_given_back: "given_back",
    signals.lease_lost: "lease_lost",
    signals.run_skipped: "skipped",
    signals.run_abandoned: "abandoned",
    signals.run_missed: "missed",
    signals.duplicate_suppressed: "duplicate",
    signals.checkin_failed: "checkin_failed",
}

_installed: Receivers | None = None


def _failed(receiver: str) -> None:
    logger.exception(
        "taskguard's OpenTelemetry receiver %s failed",
        receiver,
        extra=log_fields("receiver.failed", reason=receiver),
    )


# A span or a count never fails or ends a task: each receiver's errors are logged.
_never_raises = signals.never_raising(_failed)


def install(
    tracer_provider: TracerProvider | None = None,
    meter_provider: MeterProvider | None = None,
    settings: dict[str, Any] | None = None,
) -> Receivers:
    """Connect the receivers ``settings`` (default: ``OPENTELEMETRY``) asks for; replaces
    an earlier install. The providers default to the global ones."""
    uninstall()
    wanted = settings if settings is not None else taskguard_settings.OPENTELEMETRY
    meters = None
    tracer = (
        trace.get_tracer(NAME, __version__, tracer_provider=tracer_provider)
        if wanted["traces"]
        else trace.NoOpTracer()
    )
    spans = Spans(tracer, plain_keys=wanted["key"] == "plain", traced=bool(wanted["traces"]))
    if wanted["metrics"] or wanted["ledger_metrics"]:
        meter = metrics.get_meter(NAME, __version__, meter_provider=meter_provider)
        meters = Meters(meter) if wanted["metrics"] else None
        if wanted["ledger_metrics"]:
            register_gauges(meter)
    receivers = Receivers(spans, meters)
    spans.ended = receivers.counted
    for signal, method in CONNECTIONS.items():
        receiver = _never_raises(getattr(receivers, method))
        signal.connect(receiver, weak=False, dispatch_uid=f"taskguard.otel.{method}")
    if wanted["traces"]:
        add_function_hook(spans.current)
    global _installed
    _installed = receivers
    return receivers


def installed() -> Receivers | None:
    """What :func:`install` connected, or None."""
    return _installed


def uninstall() -> None:
    """Disconnect what :func:`install` connected (open spans are left to their attempts)."""
    global _installed
    if _installed is None:
        return
    for signal, method in CONNECTIONS.items():
        signal.disconnect(dispatch_uid=f"taskguard.otel.{method}")
    remove_function_hook(_installed.spans.current)
    _installed = None
