"""Cronitor's telemetry API: ``{url}/p/{api_key}/{monitor}?state=run|complete|fail``.

``series`` is the check-in id (Cronitor pairs a run with its end by it), ``message`` the
reason, ``env`` the ``environment`` setting, ``metric=duration:<seconds>`` the run's duration
when this process saw its start. ``url`` defaults to ``https://cronitor.link``.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from .events import START, CheckIn
from .http import request

DEFAULT_URL = "https://cronitor.link"


def send(
    options: dict[str, Any], checkin: CheckIn, checkin_id: str, slug: str, timeout: float
) -> None:
    base = options.get("url") or DEFAULT_URL
    url = f"{base.rstrip('/')}/p/{quote(options['api_key'], safe='')}/{quote(slug, safe='')}"
    state = "run" if checkin.event == START else "complete" if checkin.ok else "fail"
    query = {"state": state, "series": checkin_id}
    message = checkin.reason or (checkin.state if checkin.event != START else "")
    if message:
        query["message"] = message
    if options.get("environment"):
        query["env"] = options["environment"]
    if checkin.duration is not None and checkin.event != START:
        query["metric"] = f"duration:{checkin.duration:.3f}"
    request(url, query=query, timeout=timeout)
