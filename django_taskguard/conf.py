"""The ``TASKGUARD`` settings dict, read on every access.

Reading on access (instead of caching at import) keeps ``override_settings``
working in tests and in long-lived processes alike.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings as django_settings
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
}

BACKENDS = ("auto", "redis", "database")
ON_REDIS_ERROR_CHOICES = ("database", "fail")


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

    def for_claim(self) -> tuple[float, str]:
        """``(LEASE_SECONDS, KEY_PREFIX)``: read together by every guarded call."""
        try:
            claim: tuple[float, str] = self._cache["(claim)"]
        except KeyError:
            claim = self._cache["(claim)"] = (self.LEASE_SECONDS, self.KEY_PREFIX)
        return claim

    def reload(self) -> None:
        self._cache.clear()

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
        return float(self._get("LEASE_SECONDS"))

    @property
    def ON_REDIS_ERROR(self) -> str:
        return str(self._get("ON_REDIS_ERROR"))

    @property
    def DATABASE_ALIAS(self) -> str:
        return str(self._get("DATABASE_ALIAS"))

    @property
    def SLOT_TOLERANCE_SECONDS(self) -> float:
        return float(self._get("SLOT_TOLERANCE_SECONDS"))

    @property
    def REDIS_SOCKET_TIMEOUT(self) -> float:
        return float(self._get("REDIS_SOCKET_TIMEOUT"))

    @property
    def STARTUP_CLEANUP(self) -> bool:
        return bool(self._get("STARTUP_CLEANUP"))

    @property
    def PRUNE_AFTER_DAYS(self) -> int:
        return int(self._get("PRUNE_AFTER_DAYS"))

    @property
    def BEAT_CLAIM(self) -> bool:
        return bool(self._get("BEAT_CLAIM"))


taskguard_settings = Settings()


def _reload(*, setting: str, **kwargs: Any) -> None:
    if setting in ("TASKGUARD", "CACHES", "DATABASES"):
        taskguard_settings.reload()


setting_changed.connect(_reload, dispatch_uid="taskguard-settings-reload")
