"""Lock backends: the fast path in front of the run ledger."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed

from ..conf import taskguard_settings
from ..process import per_process
from .base import Acquired, LockBackend, run_key
from .database import DatabaseLock
from .keys import enqueue_key

if TYPE_CHECKING:
    from .redis import RedisLock

__all__ = [
    "Acquired",
    "LockBackend",
    "claim_once",
    "claim_or_read",
    "delete_ledger_keys",
    "enqueue_key",
    "extend_claim",
    "forget_clients",
    "get_backend",
    "is_redis_cache",
    "redis_key_prefix",
    "release_claim",
    "run_key",
]


def is_redis_cache(alias: str) -> bool:
    """True when ``CACHES[alias]`` is a django-redis cache."""
    backend = str(getattr(settings, "CACHES", {}).get(alias, {}).get("BACKEND", ""))
    return backend.startswith("django_redis.")


def cache_problem(backend: str, alias: str) -> tuple[str, str] | None:
    """Why ``BACKEND`` ``backend`` cannot use ``CACHES[alias]``, as (check id, the check's
    words), or None. The database backend uses no cache."""
    if backend == "database":
        return None
    if alias not in getattr(settings, "CACHES", {}):
        return "taskguard.E014", f"TASKGUARD['REDIS_ALIAS'] is {alias!r}, which is not in CACHES"
    if backend == "redis" and not is_redis_cache(alias):
        words = f"TASKGUARD['BACKEND'] is 'redis' but CACHES[{alias!r}] is not a django-redis cache"
        return "taskguard.E002", words
    return None


def backend_name() -> str:
    """The backend in force: ``auto`` resolved to ``redis`` or ``database``."""
    name = taskguard_settings.BACKEND
    if name == "database":
        return name
    alias = taskguard_settings.REDIS_ALIAS
    problem = cache_problem(name, alias)
    if problem is not None:
        raise ImproperlyConfigured(problem[1])
    if name == "auto":
        return "redis" if is_redis_cache(alias) else "database"
    return name


def get_backend() -> LockBackend:
    """The lock backend in force, built once per process and settings."""
    return _cached.get()


def forget_backend() -> None:
    """Drop the cached backend (the settings changed)."""
    _cached.forget()


def forget_clients() -> None:
    """Drop the cached backend and close every cached Redis lock client (tests: the next
    call builds them again from the settings in force, with no backoff left over)."""
    forget_backend()
    try:
        from .redis import RedisLock
    except ImportError:  # pragma: no cover - without the [redis] extra nothing is cached
        return
    RedisLock.close_all()


def delete_ledger_keys() -> int:
    """Delete every key this ledger keeps in the ``REDIS_ALIAS`` Redis; return how many.

    Lock keys, claim records, finished markers, enqueue and beat records: everything
    under :func:`redis_key_prefix`, found by ``SCAN`` (never ``FLUSHDB``). 0 when
    ``REDIS_ALIAS`` is not a django-redis cache. For tests only: live runs' locks go too.
    """
    if not is_redis_cache(taskguard_settings.REDIS_ALIAS):
        return 0
    return _redis_lock().delete_ledger_keys()


def _settings_changed(*, setting: str, **kwargs: Any) -> None:
    if setting in ("TASKGUARD", "CACHES"):
        forget_backend()


setting_changed.connect(_settings_changed, dispatch_uid="taskguard-locks-reload")


def _build_backend() -> LockBackend:
    # What the lock reads late (ON_REDIS_ERROR: only once Redis fails) is read now, so
    # that a bad value stops the first guarded call, not the first outage.
    taskguard_settings.validate("ON_REDIS_ERROR", "KEY_PREFIX", "DATABASE_ALIAS")
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


_cached = per_process(_build_backend)  # the lock backend of this process and settings


def claim_once(key: str, value: str, ttl_seconds: int) -> bool:
    """Take ``key`` for ``value`` for ``ttl_seconds`` unless it exists; True when taken.

    ``SET NX EX`` on the ``REDIS_ALIAS`` cache's server, through the lock's own
    client (its timeout, no retries, Sentinel and TLS as the cache has them),
    whatever ``BACKEND`` says. Raises ``BackendUnavailable`` when Redis does
    not answer. The beat's ``BEAT_CLAIM`` uses it.
    """
    return _redis_lock().claim_once(key, value, ttl_seconds)


def claim_or_read(key: str, value: str, ttl_seconds: float) -> str | None:
    """Take ``key`` for ``value`` for ``ttl_seconds`` unless it exists: None when it is ours
    now, else its holder (``value`` too, if a caller took it before with the same value).

    Like :func:`claim_once`, on the ``REDIS_ALIAS`` server (``SET NX GET PX``). Celery's
    ``apply_once`` uses it.
    """
    return _redis_lock().claim_or_read(key, value, ttl_seconds)


def extend_claim(key: str, value: str, ttl_seconds: float) -> bool:
    """Make ``key`` live ``ttl_seconds`` more, only while it holds ``value``."""
    return _redis_lock().extend_claim(key, value, ttl_seconds)


def redis_key_prefix() -> str:
    """The prefix of this ledger's keys in the ``REDIS_ALIAS`` Redis (``KEY_PREFIX:<identity>``)."""
    return _redis_lock().key_prefix()


def release_claim(key: str, value: str) -> bool:
    """Delete ``key`` only while it holds ``value`` (compare-and-delete); True when deleted."""
    return _redis_lock().release_claim(key, value)


def _redis_lock() -> RedisLock:
    try:
        from .redis import RedisLock
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise ImproperlyConfigured(
            f"a taskguard Redis claim needs django-taskguard[redis]: {exc}"
        ) from exc
    return RedisLock.for_alias(taskguard_settings.REDIS_ALIAS)
