"""Healthchecks.io (or a self-hosted Healthchecks): slug-based pings with a project ping key.

``{ping_url}/{slug}/start?rid=<id>``, ``{ping_url}/{slug}?rid=<id>``,
``{ping_url}/{slug}/fail?rid=<id>``; the body is a short reason (Healthchecks shows it).
``create: True`` adds ``create=1`` (Healthchecks creates a missing check).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from .events import START, CheckIn
from .http import request


def send(
    options: dict[str, Any], checkin: CheckIn, checkin_id: str, slug: str, timeout: float
) -> None:
    base = f"{options['ping_url'].rstrip('/')}/{quote(slug, safe='')}"
    url = f"{base}/start" if checkin.event == START else base if checkin.ok else f"{base}/fail"
    query = {"rid": checkin_id}
    if options.get("create"):
        query["create"] = "1"
    body = f"{checkin.event} {checkin.task} slot {checkin.slot.isoformat()}: {checkin.state}"
    if checkin.reason:
        body += f" ({checkin.reason})"
    request(url, query=query, body=body.encode(), timeout=timeout)
