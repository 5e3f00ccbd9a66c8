"""The ``TASKGUARD`` settings dict, read on every access.

Reading on access (instead of caching at import) keeps ``override_settings``
working in tests and in long-lived processes alike.
"""

from __future__ import annotations

from datetime import timedelta
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


class Settings:
    """Typed view over ``settings.TASKGUARD`` with defaults.

    Values are read on first access and kept until Django's ``setting_changed``
    signal (sent by ``override_settings``) says ``TASKGUARD`` changed: the
    guarded call reads several of them and is on a hot path.
    """

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}

    def raw(self) -> dict[str, Any]:
        """The user's dict itself (read-only; not copied)."""
        value = getattr(django_settings, "TASKGUARD", None)
        return value if isinstance(value, dict) else {}

    def _get(self, name: str) -> Any:
        try:
            return self._cache[name]
        except KeyError:
            value = self._cache[name] = self.raw().get(name, DEFAULTS[name])
            return value

    def for_claim(self) -> tuple[float, timedelta]:
        """``(LEASE_SECONDS, retention horizon)``: read by every guarded call."""
        try:
            claim: tuple[float, timedelta] = self._cache["(claim)"]
        except KeyError:
            horizon = timedelta(days=self.PRUNE_AFTER_DAYS)
            claim = self._cache["(claim)"] = (self.LEASE_SECONDS, horizon)
        return claim

    def reload(self) -> None:
        self._cache.clear()

    def _number(self, name: str) -> float:
        try:
            value: float = self._cache[name]
        except KeyError:
            value = self.raw().get(name, DEFAULTS[name])
            problem = number_problem(name, value)
            if problem is not None:
                raise ImproperlyConfigured(problem) from None
            self._cache[name] = value
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
        value = self._get("INSTANCE_NAME")
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 100):
            raise ImproperlyConfigured(
                f"TASKGUARD['INSTANCE_NAME'] is {value!r}; it must be a string of 1 to 100 "
                f"characters, or None (the host name)"
            )
        return value

    @property
    def RETRY_GRACE_SECONDS(self) -> float:
        return float(self._number("RETRY_GRACE_SECONDS"))

    @property
    def SCHEDULE_MODULES(self) -> list[str]:
        """Modules imported to find ``@once_per_schedule`` functions (with the apps' tasks/jobs)."""
        value = self._get("SCHEDULE_MODULES")
        problem = modules_problem(value)
        if problem is not None:
            raise ImproperlyConfigured(problem)
        return list(value)

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
    def HEALTH_TOKEN(self) -> str | None:
        return self._token("HEALTH_TOKEN")

    @property
    def METRICS_TOKEN(self) -> str | None:
        return self._token("METRICS_TOKEN")

    def _token(self, name: str) -> str | None:
        value = self._get(name)
        problem = token_problem(name, value)
        if problem is not None:
            raise ImproperlyConfigured(problem)
        return None if value is None else str(value)


taskguard_settings = Settings()


def _reload(*, setting: str, **kwargs: Any) -> None:
    if setting in ("TASKGUARD", "CACHES", "DATABASES"):
        taskguard_settings.reload()


setting_changed.connect(_reload, dispatch_uid="taskguard-settings-reload")
