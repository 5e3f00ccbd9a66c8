"""The ``TASKGUARD`` settings dict, read on every access.

Reading on access (instead of caching at import) keeps ``override_settings``
working in tests and in long-lived processes alike. Every key has one validator
(:data:`VALIDATORS`): the system check and the property that reads the key both call
it, so a value ``check`` refuses is refused where it is read too (gunicorn, Celery
workers and ``shell`` run no checks), in the check's words, never replaced by a default.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from functools import cached_property
from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed

DEFAULTS: dict[str, Any] = {
    "BACKEND": "auto",
    "REDIS_ALIAS": "default",
    "KEY_PREFIX": "taskguard",
    "LEASE_SECONDS": 30,
    "ON_REDIS_ERROR": "database",
    "DATABASE_ALIAS": "default",
    "SLOT_TOLERANCE_SECONDS": 5,
    "REDIS_SOCKET_TIMEOUT": 0.5,
    "STARTUP_CLEANUP": False,
    "PRUNE_AFTER_DAYS": 30,
    "BEAT_CLAIM": False,
    "RETRY_GRACE_SECONDS": 7200,
    "FINISHED_MARKER_SECONDS": 3600,
    "INSTANCE_NAME": None,
    "SCHEDULE_MODULES": [],
    "HEALTH_FAILURES": 3,
    "MONITOR_WINDOW_HOURS": 24,
    "HEALTH_TOKEN": None,
    "METRICS_TOKEN": None,
    "UPKEEP_INTERVAL_SECONDS": 60,
    "CHECKINS": {},
    "OPENTELEMETRY": False,
    "LATE_START_SECONDS": None,
    "LATE_START_RUNS": 3,
}

# Every number a user gives: (lowest, highest, unit). Checked where it is read
# (ImproperlyConfigured) and by ``manage.py check``, which not every process runs.
BOUNDS: dict[str, tuple[float, float, str]] = {
    "LEASE_SECONDS": (1, 86_400, "seconds"),
    "SLOT_TOLERANCE_SECONDS": (0, 3_600, "seconds"),
    "REDIS_SOCKET_TIMEOUT": (0.01, 60, "seconds"),
    "PRUNE_AFTER_DAYS": (1, 36_500, "days"),
    "RETRY_GRACE_SECONDS": (60, 604_800, "seconds"),
    "FINISHED_MARKER_SECONDS": (0, 604_800, "seconds"),
    "HEALTH_FAILURES": (1, 100, "runs"),
    "MONITOR_WINDOW_HOURS": (1, 720, "hours"),
    "UPKEEP_INTERVAL_SECONDS": (5, 3_600, "seconds"),
    "LATE_START_SECONDS": (1, 86_400, "seconds"),
    "LATE_START_RUNS": (1, 100, "runs"),
}

BACKENDS = ("auto", "redis", "database")
# A bearer token shorter than this is refused (E021): it would be guessable.
TOKEN_MIN_LENGTH = 16


def token_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be the token setting ``name`` (None: unset, or fine)."""
    if value is None:
        return None
    if not isinstance(value, str):
        return f"TASKGUARD[{name!r}] is a {type(value).__name__}; it must be None or a string"
    if len(value) < TOKEN_MIN_LENGTH:
        return (
            f"TASKGUARD[{name!r}] has {len(value)} characters; a token needs at least "
            f"{TOKEN_MIN_LENGTH}"
        )
    return None


def number_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be the setting ``name`` (a bounded number), or None."""
    low, high, unit = BOUNDS[name]
    whole = unit in ("days", "runs", "hours")
    kinds = (int,) if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        noun = "a whole number" if whole else "a number"
        bounds = f"{noun} of {unit} from {low:g} to {high:g}"
        return f"TASKGUARD[{name!r}] is {value!r}; it must be {bounds}"
    return None


def lease_problem(value: Any, argument: str = "TASKGUARD['LEASE_SECONDS']") -> str | None:
    """Why ``value`` cannot be a lease length, or None (for settings and decorators alike)."""
    problem = number_problem("LEASE_SECONDS", value)
    return problem.replace("TASKGUARD['LEASE_SECONDS']", argument) if problem else None


ON_REDIS_ERROR_CHOICES = ("database", "fail")


def modules_problem(value: Any) -> str | None:
    """Why ``value`` cannot be ``SCHEDULE_MODULES`` (a list of dotted module paths), or None."""
    if isinstance(value, (list, tuple)) and all(
        isinstance(item, str) and item and all(part.isidentifier() for part in item.split("."))
        for item in value
    ):
        return None
    return (
        f"TASKGUARD['SCHEDULE_MODULES'] is {value!r}; it must be a list of dotted module "
        f"paths such as ['myproject.schedules']"
    )


def taskguard_problem(value: Any) -> str | None:
    """Why ``settings.TASKGUARD`` itself cannot be read, or None."""
    if isinstance(value, dict):
        return None
    return f"TASKGUARD is a {type(value).__name__}; it must be a dict"


def choice_problem(name: str, value: Any) -> str | None:
    """Why ``value`` is not one of the choices of ``BACKEND`` or ``ON_REDIS_ERROR``."""
    choices = BACKENDS if name == "BACKEND" else ON_REDIS_ERROR_CHOICES
    if isinstance(value, str) and value in choices:
        return None
    listed = ", ".join(repr(choice) for choice in choices[:-1])
    return f"TASKGUARD[{name!r}] is {value!r}; use {listed} or {choices[-1]!r}"


def flag_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be the on/off setting ``name`` (only True and False can)."""
    if isinstance(value, bool):
        return None
    return f"TASKGUARD[{name!r}] is {value!r}; it must be True or False"


def text_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be ``REDIS_ALIAS``, ``KEY_PREFIX`` or ``INSTANCE_NAME`` (1 to
    100 characters; ``INSTANCE_NAME`` may be None: the host name)."""
    if value is None and name == "INSTANCE_NAME":
        return None
    if isinstance(value, str) and 0 < len(value) <= 100:
        return None
    return f"TASKGUARD[{name!r}] is {value!r}; it must be a string of 1 to 100 characters"


def alias_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be ``DATABASE_ALIAS`` (a key of DATABASES). ``REDIS_ALIAS``
    must name a cache only where a backend uses it: ``locks.cache_problem``."""
    if isinstance(value, str) and value in django_settings.DATABASES:
        return None
    return f"TASKGUARD[{name!r}] is {value!r}, which is not in DATABASES"


def _number_or_token(name: str, value: Any) -> str | None:
    return token_problem(name, value) if name.endswith("_TOKEN") else number_problem(name, value)


def upkeep_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be ``UPKEEP_INTERVAL_SECONDS`` (None: the automatic upkeep is
    off, for those who run ``cleanup_locks`` from cron)."""
    if value is None:
        return None
    problem = number_problem(name, value)
    return f"{problem}, or None (no automatic upkeep)" if problem else None


def late_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be ``LATE_START_SECONDS`` (None: no lateness rule)."""
    if value is None:
        return None
    problem = number_problem(name, value)
    return f"{problem}, or None (no lateness rule)" if problem else None


def late_after_problem(value: Any, argument: str = "late_after=") -> str | None:
    """Why ``value`` cannot be a schedule's late-start bound (seconds, or a timedelta, in
    ``LATE_START_SECONDS``' bounds), or None (None is no bound of its own)."""
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if number_problem("LATE_START_SECONDS", seconds) is None:
        return None
    low, high, _unit = BOUNDS["LATE_START_SECONDS"]
    return (
        f"{argument} is {value!r}; it must be a number of seconds or a timedelta from "
        f"{low:g} to {high:g} seconds (how late after its slot a start counts as late), or None"
    )


def late_after_delta(value: float | timedelta | None) -> timedelta | None:
    """A checked (:func:`late_after_problem`) late-start bound as a timedelta."""
    if value is None or isinstance(value, timedelta):
        return value
    return timedelta(seconds=value)


OPENTELEMETRY_FLAGS = ("traces", "metrics", "ledger_metrics")
OPENTELEMETRY_KEYS = ("digest", "plain")


def opentelemetry_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be ``OPENTELEMETRY``: False (off), True (traces and metrics) or a
    dict of ``traces``/``metrics`` (default True), ``ledger_metrics`` (default False) and
    ``key`` (``digest``, the default, or ``plain``)."""
    if isinstance(value, bool):
        return None
    shape = (
        f"TASKGUARD[{name!r}] is {value!r}; it must be True, False or a dict with the keys "
        f"{', '.join(repr(k) for k in (*OPENTELEMETRY_FLAGS, 'key'))}"
    )
    if not isinstance(value, dict):
        return shape
    for key, item in value.items():
        if key in OPENTELEMETRY_FLAGS and isinstance(item, bool):
            continue
        if key == "key" and item in OPENTELEMETRY_KEYS:
            continue
        return f"{shape} (True/False, and 'digest' or 'plain' for 'key'); {key!r} is {item!r}"
    return None


def checkins_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be ``CHECKINS`` (``django_taskguard.checkins.config``)."""
    from .checkins.config import problem as checkins_config_problem

    return checkins_config_problem(value)


# Every key's validator: (name, value) -> why the value cannot be it, or None.
VALIDATORS: dict[str, Callable[[str, Any], str | None]] = {
    **dict.fromkeys(("BACKEND", "ON_REDIS_ERROR"), choice_problem),
    "DATABASE_ALIAS": alias_problem,
    **dict.fromkeys(("REDIS_ALIAS", "KEY_PREFIX", "INSTANCE_NAME"), text_problem),
    **dict.fromkeys(("STARTUP_CLEANUP", "BEAT_CLAIM"), flag_problem),
    **dict.fromkeys((*BOUNDS, "HEALTH_TOKEN", "METRICS_TOKEN"), _number_or_token),
    "UPKEEP_INTERVAL_SECONDS": upkeep_problem,
    "LATE_START_SECONDS": late_problem,
    "OPENTELEMETRY": opentelemetry_problem,
    "CHECKINS": checkins_problem,
    "SCHEDULE_MODULES": lambda name, value: modules_problem(value),
}


def problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be ``TASKGUARD[name]``, or None: the check's words."""
    return VALIDATORS[name](name, value)


class Settings:
    """Typed view over ``settings.TASKGUARD`` with defaults.

    Values are read on first access and kept until Django's ``setting_changed``
    signal (sent by ``override_settings``) says ``TASKGUARD`` changed: the
    guarded call reads several of them and is on a hot path.
    """

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}

    def raw(self) -> dict[str, Any]:
        """The user's dict itself (read-only; not copied); ``ImproperlyConfigured`` when
        ``TASKGUARD`` is not a dict."""
        value = getattr(django_settings, "TASKGUARD", {})
        trouble = taskguard_problem(value)
        if trouble is not None:
            raise ImproperlyConfigured(trouble)
        return value

    def _get(self, name: str) -> Any:
        """``TASKGUARD[name]`` (or its default), validated once per settings change."""
        try:
            return self._cache[name]
        except KeyError:
            value = self.raw().get(name, DEFAULTS[name])
            trouble = problem(name, value)
            if trouble is not None:
                raise ImproperlyConfigured(trouble) from None
            self._cache[name] = value
            return value

    def validate(self, *names: str) -> None:
        """Read ``names`` now (``ImproperlyConfigured`` if one is invalid), for a value
        that is otherwise read late (``ON_REDIS_ERROR``: only once Redis fails)."""
        for name in names:
            self._get(name)

    @cached_property
    def for_claim(self) -> tuple[float, timedelta]:
        """``(LEASE_SECONDS, retention horizon)``: read by every guarded call."""
        return self.LEASE_SECONDS, timedelta(days=self.PRUNE_AFTER_DAYS)

    def reload(self) -> None:
        self._cache.clear()
        self.__dict__.pop("for_claim", None)

    def _number(self, name: str) -> float:
        value: float = self._get(name)
        return value

    @property
    def BACKEND(self) -> str:
        return str(self._get("BACKEND"))

    @property
    def REDIS_ALIAS(self) -> str:
        return str(self._get("REDIS_ALIAS"))

    @property
    def KEY_PREFIX(self) -> str:
        return str(self._get("KEY_PREFIX"))

    @property
    def LEASE_SECONDS(self) -> float:
        return float(self._number("LEASE_SECONDS"))

    @property
    def ON_REDIS_ERROR(self) -> str:
        return str(self._get("ON_REDIS_ERROR"))

    @property
    def DATABASE_ALIAS(self) -> str:
        return str(self._get("DATABASE_ALIAS"))

    @property
    def SLOT_TOLERANCE_SECONDS(self) -> float:
        return float(self._number("SLOT_TOLERANCE_SECONDS"))

    @property
    def REDIS_SOCKET_TIMEOUT(self) -> float:
        return float(self._number("REDIS_SOCKET_TIMEOUT"))

    @property
    def STARTUP_CLEANUP(self) -> bool:
        return bool(self._get("STARTUP_CLEANUP"))

    @property
    def PRUNE_AFTER_DAYS(self) -> int:
        return int(self._number("PRUNE_AFTER_DAYS"))

    @property
    def BEAT_CLAIM(self) -> bool:
        return bool(self._get("BEAT_CLAIM"))

    @property
    def INSTANCE_NAME(self) -> str | None:
        """What owners name this process's instance (None: the host name)."""
        value: str | None = self._get("INSTANCE_NAME")
        return value

    @property
    def RETRY_GRACE_SECONDS(self) -> float:
        return float(self._number("RETRY_GRACE_SECONDS"))

    @property
    def SCHEDULE_MODULES(self) -> list[str]:
        """Modules imported to find ``@once_per_schedule`` functions (with the apps' tasks/jobs)."""
        return list(self._get("SCHEDULE_MODULES"))

    @property
    def FINISHED_MARKER_SECONDS(self) -> float:
        """How long a finished slot's lock key answers late calls (0: deleted at once)."""
        return float(self._number("FINISHED_MARKER_SECONDS"))

    @property
    def HEALTH_FAILURES(self) -> int:
        """A task whose last this many finished runs all failed is unhealthy."""
        return int(self._number("HEALTH_FAILURES"))

    @property
    def MONITOR_WINDOW_HOURS(self) -> int:
        """The recent window health (missed slots) and metrics (runs, durations) look at."""
        return int(self._number("MONITOR_WINDOW_HOURS"))

    @property
    def UPKEEP_INTERVAL_SECONDS(self) -> float | None:
        """Seconds between two upkeeps across the fleet (None: no automatic upkeep)."""
        value = self._get("UPKEEP_INTERVAL_SECONDS")
        return None if value is None else float(value)

    @property
    def LATE_START_SECONDS(self) -> float | None:
        """A slot started later than this after its time is late (None: no lateness rule)."""
        value = self._get("LATE_START_SECONDS")
        return None if value is None else float(value)

    @property
    def LATE_START_RUNS(self) -> int:
        """A task whose last this many started runs all started late is unhealthy."""
        return int(self._number("LATE_START_RUNS"))

    @property
    def OPENTELEMETRY(self) -> dict[str, Any]:
        """The OpenTelemetry switches, every key filled in (all off when it is False)."""
        value = self._get("OPENTELEMETRY")
        if isinstance(value, bool):
            flags: dict[str, Any] = {"traces": value, "metrics": value, "ledger_metrics": False}
            return {**flags, "key": "digest"}
        return {"traces": True, "metrics": True, "ledger_metrics": False, "key": "digest", **value}

    @property
    def CHECKINS(self) -> dict[str, Any]:
        """The check-in senders' settings, as given (validated by ``checkins.config``)."""
        value: dict[str, Any] = self._get("CHECKINS")
        return value

    @property
    def HEALTH_TOKEN(self) -> str | None:
        return self._token("HEALTH_TOKEN")

    @property
    def METRICS_TOKEN(self) -> str | None:
        return self._token("METRICS_TOKEN")

    def _token(self, name: str) -> str | None:
        value = self._get(name)
        return None if value is None else str(value)


taskguard_settings = Settings()


def _reload(*, setting: str, **kwargs: Any) -> None:
    if setting in ("TASKGUARD", "CACHES", "DATABASES"):
        taskguard_settings.reload()


setting_changed.connect(_reload, dispatch_uid="taskguard-settings-reload")
