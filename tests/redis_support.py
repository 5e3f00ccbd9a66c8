"""Helpers for the Redis backend tests: settings that point taskguard at a private server."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from django.core.cache import caches
from django.test import override_settings

from django_taskguard.locks import get_backend
from django_taskguard.locks.redis import RedisLock

from .conftest import RedisServer


def redis_caches(server: RedisServer, **options: Any) -> dict[str, Any]:
    return {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "redis": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": server.url,
            "OPTIONS": options,
        },
    }


@contextlib.contextmanager
def redis_backend(server: RedisServer, **taskguard: Any) -> Iterator[RedisLock]:
    """Point TASKGUARD at ``server`` (BACKEND redis) for the block; yield the lock."""
    config = {"BACKEND": "redis", "REDIS_ALIAS": "redis", "LEASE_SECONDS": 3, **taskguard}
    with override_settings(CACHES=redis_caches(server), TASKGUARD=config):
        try:
            lock = get_backend()
            assert isinstance(lock, RedisLock) or config["BACKEND"] != "redis"
            yield lock  # type: ignore[misc]
        finally:
            RedisLock.close_all()
            caches["redis"].close()


def child_redis_env(env: dict[str, str], server: RedisServer) -> dict[str, str]:
    return {**env, "TASKGUARD_TEST_REDIS_URL": server.url, "TASKGUARD_TEST_BACKEND": "redis"}


def command(server: RedisServer, name: str, *args: Any, **kwargs: Any) -> Any:
    """Run one command on ``server`` through a short-lived client of its own."""
    client = server.client()
    try:
        return getattr(client, name)(*args, **kwargs)
    finally:
        client.close()
