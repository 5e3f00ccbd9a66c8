"""Lock backends: the fast path in front of the run ledger."""

from __future__ import annotations

import os
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed

from ..conf import taskguard_settings
from .base import Acquired, LockBackend, run_key
from .database import DatabaseLock

__all__ = ["Acquired", "LockBackend", "get_backend", "is_redis_cache", "run_key"]


def is_redis_cache(alias: str) -> bool:
    """True when ``CACHES[alias]`` is a django-redis cache."""
    backend = str(getattr(settings, "CACHES", {}).get(alias, {}).get("BACKEND", ""))
    return backend.startswith("django_redis.")


def backend_name() -> str:
    """The backend in force: ``auto`` resolved to ``redis`` or ``database``."""
    name = taskguard_settings.BACKEND
    if name == "auto":
        return "redis" if is_redis_cache(taskguard_settings.REDIS_ALIAS) else "database"
    return name


_cached: tuple[int, LockBackend] | None = None


def get_backend() -> LockBackend:
    """The lock backend in force, built once per process and settings."""
    global _cached
    cached = _cached
    if cached is not None and cached[0] == os.getpid():
        return cached[1]
    backend = _build_backend()
    _cached = (os.getpid(), backend)
    return backend


def forget_backend() -> None:
    """Drop the cached backend (the settings changed)."""
    global _cached
    _cached = None


def _settings_changed(*, setting: str, **kwargs: Any) -> None:
    if setting in ("TASKGUARD", "CACHES"):
        forget_backend()


setting_changed.connect(_settings_changed, dispatch_uid="taskguard-locks-reload")


def _build_backend() -> LockBackend:
    name = backend_name()
    if name == "database":
        return DatabaseLock()
    if name == "redis":
        try:
            from .redis import RedisLock
        except ImportError as exc:  # pragma: no cover - depends on the extra
            raise ImproperlyConfigured(
                f"TASKGUARD BACKEND 'redis' needs django-taskguard[redis] (django-redis, "
                f"redis>=4.5): {exc}"
            ) from exc
        return RedisLock.for_alias(taskguard_settings.REDIS_ALIAS)
    raise ImproperlyConfigured(f"unknown TASKGUARD BACKEND {name!r} (auto, redis or database)")
