"""One HTTP request of a check-in, with urllib from the standard library.

A redirect (any 3xx) is a failed check-in, never followed: following it would send the
request's secret headers (``Authorization``, an API key) and its ping key to wherever the
answer points, in clear text when it points from https to http, and would turn the POST
into a body-less GET that reports success while the check-in is lost."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from urllib.parse import urlencode

USER_AGENT = "django-taskguard check-ins"


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """No redirect is followed: the 3xx answer becomes an ``HTTPError``."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


_opener = urllib.request.build_opener(_RefuseRedirects)


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
    :class:`SendError` (a 3xx too: redirects are not followed)."""
    if query:
        url = f"{url}{'&' if '?' in url else '?'}{urlencode(query)}"
    sent = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    sent.add_header("User-Agent", USER_AGENT)
    for name, value in (headers or {}).items():
        sent.add_header(name, value)
    try:
        with _opener.open(sent, timeout=timeout) as answer:
            answer.read(1024)
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        if 300 <= exc.code < 400:
            raise SendError(f"HTTP {exc.code}: a redirect, not followed", exc.code) from None
        raise SendError(f"HTTP {exc.code}", exc.code) from None
    except (OSError, ValueError) as exc:  # URLError, timeouts, refused connections
        raise SendError(f"{type(exc).__name__}: {exc}") from None


def json_body(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), default=str).encode()
