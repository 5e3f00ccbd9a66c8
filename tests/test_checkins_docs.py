"""The check-in payloads docs/monitoring.md shows are what the senders send.

Each ```json block right after a ``<!-- checkin-payload: SERVICE -->`` line is the list of
requests ``SERVICE`` got for one slot of ``reports.hourly`` (a start and its end), with what
changes from run to run (ids, timestamps, durations, the slot, the port) replaced by
placeholders. ``TASKGUARD_WRITE_PAYLOADS=1`` prints the blocks as they are now.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from django_taskguard import once_per_schedule, registry

from .support import ROOT
from .support.checkin_setup import CheckIns, running_checkins
from .support.slots import BASE_SLOT

pytestmark = pytest.mark.dialect

PAGE = ROOT / "docs" / "monitoring.md"
SHOWN_SLOT = "2026-11-24T09:00:00+00:00"
MARKER = re.compile(r"<!-- checkin-payload: (\w+) -->\n```json\n(.*?)\n```", re.DOTALL)
SENTRY_KEPT = ("type", "monitor_slug", "check_in_id", "status", "duration", "environment",
               "release", "monitor_config")  # fmt: skip


@pytest.fixture
def checkins(transactional_db: None) -> Iterator[CheckIns]:
    with running_checkins() as kit:
        yield kit


def shown(record: dict[str, Any]) -> dict[str, Any]:
    """A request as the docs show it."""
    service = record["service"]
    if service == "sentry":
        item = {key: record["item"].get(key) for key in SENTRY_KEPT}
        item["check_in_id"] = "<check-in id, hex>"
        if item["duration"] is not None:
            item["duration"] = "<seconds>"
        return item
    query = {key: _placeholder(key, value) for key, value in record["query"].items()}
    line = f"{record['method']} {record['path']}"
    if query:
        line += "?" + "&".join(f"{k}={v}" for k, v in query.items())
    if service == "webhook":
        body = {key: _placeholder(key, value) for key, value in record["json"].items()}
        headers = {k: record["headers"][k] for k in ("content-type", "authorization")}
        return {"request": line, "headers": headers, "body": body}
    result: dict[str, Any] = {"request": line}
    if record["body"]:
        result["body"] = record["body"]
    return result


def _placeholder(key: str, value: Any) -> Any:
    if key == "metric" and isinstance(value, str) and value.startswith("duration:"):
        return "duration:<seconds>"
    return {
        "rid": "<check-in id>",
        "series": "<check-in id>",
        "checkin_id": "<check-in id>",
        "run_id": "<run id>",
        "duration": "<seconds>" if value is not None else None,
    }.get(key, value)


def payloads(checkins: CheckIns) -> dict[str, list[dict[str, Any]]]:
    slot = BASE_SLOT.replace(hour=9)

    @once_per_schedule(every=timedelta(hours=1), name="reports.hourly")
    def hourly() -> None:
        pass

    registry.sync()
    hourly.run_for_slot(slot)
    checkins.settle()
    found: dict[str, list[dict[str, Any]]] = {}
    for record in checkins.receiver.records:
        text = json.dumps(shown(record))
        text = text.replace(slot.isoformat(), SHOWN_SLOT).replace(checkins.receiver.url, "")
        found.setdefault(record["service"], []).append(json.loads(text))
    return found


def test_docs__the_checkin_payloads_shown_are_sent(checkins: CheckIns) -> None:
    found = payloads(checkins)
    if os.environ.get("TASKGUARD_WRITE_PAYLOADS"):
        for service, requests in found.items():
            block = json.dumps(requests, indent=2)
            print(f"<!-- checkin-payload: {service} -->\n```json\n{block}\n```")
    documented = {name: json.loads(block) for name, block in MARKER.findall(PAGE.read_text())}
    assert set(documented) == {"sentry", "healthchecks", "cronitor", "webhook"}
    assert documented == found
