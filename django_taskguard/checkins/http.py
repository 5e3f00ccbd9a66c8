"""One HTTP request of a check-in, with urllib from the standard library."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from urllib.parse import urlencode

USER_AGENT = "django-taskguard check-ins"


class SendError(Exception):
    """A check-in request that failed: ``status`` is the HTTP status, or None when no
    answer came (refused, timed out)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def request(
    url: str,
    *,
    query: dict[str, str] | None = None,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float,
) -> int:
    """Send one request (POST with ``body``, else GET); return its 2xx status or raise
    :class:`SendError`."""
    if query:
        url = f"{url}{'&' if '?' in url else '?'}{urlencode(query)}"
    sent = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    sent.add_header("User-Agent", USER_AGENT)
    for name, value in (headers or {}).items():
        sent.add_header(name, value)
    try:
        with urllib.request.urlopen(sent, timeout=timeout) as answer:
            answer.read(1024)
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        raise SendError(f"HTTP {exc.code}", exc.code) from None
    except (OSError, ValueError) as exc:  # URLError, timeouts, refused connections
        raise SendError(f"{type(exc).__name__}: {exc}") from None


def json_body(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), default=str).encode()
