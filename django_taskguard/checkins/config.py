"""The shape of ``TASKGUARD["CHECKINS"]``, checked where it is read and by ``manage.py check``.

Imports nothing but the standard library: ``conf`` calls :func:`problem` for every read of
the setting, and a site without check-ins must not pay for a sender's imports::

    TASKGUARD = {
        "CHECKINS": {
            "sentry": {},  # the sentry_sdk client the site already initialised
            "healthchecks": {"ping_url": "https://hc-ping.com/<ping key>"},
            "cronitor": {"api_key": "...", "environment": "production"},
            "webhook": {"url": "https://ops.example.com/taskguard", "headers": {...}},
            "timeout": 5,        # seconds per request
            "attempts": 3,       # tries per check-in (each carries the same id)
            "queue": 10_000,     # check-ins waiting to be sent per process; more are dropped
            "monitors": {"reports.nightly": "nightly-report", "cache.warm": False},
        }
    }
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

SENDERS = ("sentry", "healthchecks", "cronitor", "webhook")
# Every number: (lowest, highest, default).
NUMBERS: dict[str, tuple[float, float, float]] = {
    "timeout": (0.1, 60, 5),
    "attempts": (1, 10, 3),
    "queue": (1, 1_000_000, 10_000),
}
# The keys each sender's dict may hold, and which of them it must.
SENDER_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "sentry": (("max_runtime_minutes", "failure_issue_threshold", "recovery_threshold"), ()),
    "healthchecks": (("ping_url", "create"), ("ping_url",)),
    "cronitor": (("api_key", "url", "environment"), ("api_key",)),
    "webhook": (("url", "headers"), ("url",)),
}


def problem(value: Any) -> str | None:
    """Why ``value`` cannot be ``TASKGUARD["CHECKINS"]``, or None."""
    where = "TASKGUARD['CHECKINS']"
    if not isinstance(value, dict):
        return f"{where} is {value!r}; it must be a dict (see docs/monitoring.md)"
    for key, item in value.items():
        if key in SENDERS:
            trouble = _sender_problem(f"{where}[{key!r}]", key, item)
        elif key in NUMBERS:
            trouble = _number_problem(f"{where}[{key!r}]", key, item)
        elif key == "monitors":
            trouble = _monitors_problem(f"{where}['monitors']", item)
        else:
            known = ", ".join(repr(k) for k in (*SENDERS, *NUMBERS, "monitors"))
            trouble = f"{where} has the unknown key {key!r}; use {known}"
        if trouble is not None:
            return trouble
    if "sentry" in value and find_spec("sentry_sdk") is None:
        return (
            f"{where}['sentry'] needs sentry_sdk, which is not installed: "
            f'pip install "django-taskguard[sentry]"'
        )
    return None


def redacted(url: str) -> str:
    """``url`` without its secrets, to be said in a message: its host is kept, every path
    segment and query value (a ping key, an API key, a token) becomes ``***``, and a user
    and password before the host are dropped; a value with neither scheme nor path is
    hidden whole (it may be the key alone). ``hc-ping.com/<key>`` → ``hc-ping.com/***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    rest = rest.partition("#")[0]
    head, slash, tail = rest.partition("/")
    path, question, query = (tail if slash else head).partition("?")
    if not sep and not slash:
        return "***"  # no scheme nor path: it may be the key alone
    host = head.partition("?")[0].rpartition("@")[2]
    shown = f"{scheme}{sep}{host}"
    if slash:
        shown += "/" + "/".join("***" if segment else "" for segment in path.split("/"))
    if question:
        shown += "?" + "&".join(
            f"{pair.partition('=')[0]}=***" for pair in query.split("&") if pair
        )
    return shown


def _sender_problem(where: str, sender: str, value: Any) -> str | None:
    if not isinstance(value, dict):
        return f"{where} is {value!r}; it must be a dict of that sender's options"
    allowed, required = SENDER_KEYS[sender]
    for key in value:
        if key not in allowed:
            return f"{where} has the unknown key {key!r}; use {', '.join(map(repr, allowed))}"
    for key in required:
        if not isinstance(value.get(key), str) or not value[key]:
            return f"{where}[{key!r}] must be a non-empty string"
    for key in ("ping_url", "url"):
        url = value.get(key)
        if url is not None and not (
            isinstance(url, str) and url.startswith(("http://", "https://"))
        ):
            shown = redacted(url) if isinstance(url, str) else type(url).__name__
            return f"{where}[{key!r}] is {shown!r}; it must be an http:// or https:// URL"
    headers = value.get("headers", {})
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        return f"{where}['headers'] must be a dict of strings"
    for key in ("max_runtime_minutes", "failure_issue_threshold", "recovery_threshold"):
        number = value.get(key)
        if number is not None and (
            isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= 10_080
        ):
            return f"{where}[{key!r}] is {number!r}; it must be a whole number from 1 to 10080"
    for key in ("create",):
        if key in value and not isinstance(value[key], bool):
            return f"{where}[{key!r}] is {value[key]!r}; it must be True or False"
    environment = value.get("environment")
    if environment is not None and not isinstance(environment, str):
        return f"{where}['environment'] is {environment!r}; it must be a string"
    return None


def _number_problem(where: str, key: str, value: Any) -> str | None:
    low, high, _ = NUMBERS[key]
    whole = key != "timeout"
    kinds = (int,) if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        noun = "a whole number" if whole else "a number"
        return f"{where} is {value!r}; it must be {noun} from {low:g} to {high:g}"
    return None


def _monitors_problem(where: str, value: Any) -> str | None:
    """``monitors`` maps a task name to False (no check-ins), a slug for every sender, or a
    dict of sender -> slug or False."""
    if not isinstance(value, dict):
        return f"{where} is {value!r}; it must map task names to False, a slug or a dict"
    for task, item in value.items():
        if not isinstance(task, str) or not task:
            return f"{where} has the key {task!r}; keys are task names"
        if item is False or _slug_problem(item) is None:
            continue
        if isinstance(item, dict):
            for sender, slug in item.items():
                if sender not in SENDERS:
                    return f"{where}[{task!r}] has the unknown sender {sender!r}"
                if slug is not False and _slug_problem(slug) is not None:
                    return f"{where}[{task!r}][{sender!r}]: {_slug_problem(slug)}"
            continue
        return f"{where}[{task!r}] is {item!r}; it must be False, a slug or a dict"
    return None


def _slug_problem(value: Any) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= 200:
        return None
    return f"{value!r} is not a monitor slug (a string of 1 to 200 characters)"


def number(settings: dict[str, Any], key: str) -> float:
    """``settings[key]`` or its default (``timeout``, ``attempts``, ``queue``)."""
    return float(settings.get(key, NUMBERS[key][2]))
