"""What the check-in receivers got, in one vocabulary, for the end-to-end tests.

Every delivered check-in (answered 200) becomes ``(checkin_id, kind)``, ``kind`` being
``start``, ``ok`` or ``error``, whatever the service's wording: Sentry's ``in_progress``/
``ok``/``error`` (its ``check_in_id`` is the id without dashes), Healthchecks' ``/start``,
plain ping and ``/fail`` (``rid``), Cronitor's ``run``/``complete``/``fail`` (``series``).
The webhook says most (``event``, ``task``, ``slot``, ``run_id``, ``state``, ``checkin_id``):
:func:`expected` turns its records into what every other service must have got.
"""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import datetime
from typing import Any

from .checkin_receivers import Receiver

OTHERS = ("sentry", "healthchecks", "cronitor")
SENTRY = {"in_progress": "start", "ok": "ok", "error": "error"}
CRONITOR = {"run": "start", "complete": "ok", "fail": "error"}
OK_STATES = {"succeeded", "skipped"}  # an end the services see as healthy


def delivered(receiver: Receiver, service: str) -> list[dict[str, Any]]:
    return [record for record in receiver.of(service) if record["status"] == 200]


def kind_of(record: dict[str, Any]) -> tuple[str, str]:
    """``(checkin_id, kind)`` of one record of Sentry, Healthchecks or Cronitor."""
    service, query = record["service"], record["query"]
    if service == "sentry":
        item = record["item"]
        return str(uuid.UUID(item["check_in_id"])), SENTRY[item["status"]]
    if service == "healthchecks":
        path = record["path"]
        kind = "start" if path.endswith("/start") else "error" if path.endswith("/fail") else "ok"
        return str(uuid.UUID(query["rid"])), kind
    assert service == "cronitor", service
    return str(uuid.UUID(query["series"])), CRONITOR[query["state"]]


def monitor_of(record: dict[str, Any]) -> str:
    """The monitor a record of Sentry, Healthchecks or Cronitor checks in to."""
    if record["service"] == "sentry":
        return str(record["item"]["monitor_slug"])
    return str(record["path"]).removesuffix("/start").removesuffix("/fail")


def kinds(receiver: Receiver, service: str) -> Counter[tuple[str, str]]:
    """Every check-in ``service`` got, counted: ``(checkin_id, kind) -> n``."""
    return Counter(kind_of(record) for record in delivered(receiver, service))


class Hook:
    """One webhook check-in."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.event: str = body["event"]
        self.task: str = body["task"]
        self.slot = datetime.fromisoformat(body["slot"])
        self.run_id: int | None = body["run_id"]
        self.state: str = body["state"]
        self.attempt: int | None = body["attempt"]
        self.checkin_id = str(uuid.UUID(body["checkin_id"]))

    @property
    def kind(self) -> str:
        """What the other services show for it."""
        if self.event == "start":
            return "start"
        return "ok" if self.event == "end" and self.state in OK_STATES else "error"


def hooks(receiver: Receiver, task: str | None = None) -> list[Hook]:
    found = [Hook(record["json"]) for record in delivered(receiver, "webhook")]
    return [hook for hook in found if task in (None, hook.task)]


def expected(receiver: Receiver) -> Counter[tuple[str, str]]:
    """What every other service must have got: the webhook's check-ins, in their words."""
    return Counter((hook.checkin_id, hook.kind) for hook in hooks(receiver))


def tally(receiver: Receiver) -> dict[str, Counter[str]]:
    """Per service, how many check-ins of each kind (for reports and failure messages)."""
    counts = {"webhook": Counter(hook.event for hook in hooks(receiver))}
    for service in OTHERS:
        counts[service] = Counter(kind for _, kind in kinds(receiver, service).elements())
    return counts


def by_slot(found: list[Hook]) -> dict[datetime, Counter[str]]:
    """The webhook's events per slot: ``slot -> Counter(event)``."""
    slots: dict[datetime, Counter[str]] = {}
    for hook in found:
        slots.setdefault(hook.slot, Counter())[hook.event] += 1
    return slots
