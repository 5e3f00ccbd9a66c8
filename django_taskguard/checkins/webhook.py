"""A generic webhook: one JSON POST per check-in (:meth:`.events.CheckIn.payload`), with the
``headers`` of its settings; ``monitor`` is the task's slug."""

from __future__ import annotations

from typing import Any

from .events import CheckIn
from .http import json_body, request


def send(
    options: dict[str, Any], checkin: CheckIn, checkin_id: str, slug: str, timeout: float
) -> None:
    headers = {"Content-Type": "application/json", **options.get("headers", {})}
    body = json_body({**checkin.payload(checkin_id), "monitor": slug})
    request(options["url"], body=body, headers=headers, timeout=timeout)
