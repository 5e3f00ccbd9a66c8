"""The Redis lock's own client: django-redis's server, our timeouts, no retries.

The django-redis cache named by ``REDIS_ALIAS`` is only used to find the
connection parameters (plain, TLS or Sentinel): its own connection factory
builds a pool of ours from the cache's ``LOCATION`` and ``OPTIONS``. A blind
retry of ``SET NX`` after a lost reply locks the caller out of its own slot, so
the lock client never retries, and has its own short socket timeout.

Only redis-py's and django-redis's public API is used here (a test walks the
package for private attribute names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MasterDownError, ReadOnlyError
from redis.retry import Retry

if TYPE_CHECKING:  # redis-py >= 5.1 only; annotations are never evaluated
    from redis.connection import ConnectionInterface


def build_client(alias: str, timeout: float) -> redis.Redis:
    """A client of our own for the django-redis cache ``alias``'s server: ``timeout``, no retries.

    Built by the cache's own connection factory (``CONNECTION_FACTORY`` or
    ``DJANGO_REDIS_CONNECTION_FACTORY``), so whatever the cache's ``OPTIONS``
    say (``PASSWORD``, ``CONNECTION_POOL_KWARGS`` such as ``ssl_ca_certs`` or
    ``protocol``, ``SENTINELS`` and ``SENTINEL_KWARGS``) holds for the lock
    too; only the timeouts, the retries and the decoding are ours. The pool is
    new (not the factory's process-wide cached one) and always the master's.
    """
    from django_redis import get_redis_connection
    from django_redis.pool import get_connection_factory

    config: dict[str, Any] = settings.CACHES[alias]
    options: dict[str, Any] = dict(config.get("OPTIONS") or {})
    client_class = options.get("REDIS_CLIENT_CLASS", "redis.client.Redis")
    if client_class not in ("redis.client.Redis", "redis.Redis"):
        raise ImproperlyConfigured(
            f"CACHES[{alias!r}] uses REDIS_CLIENT_CLASS {client_class!r}; the taskguard lock "
            f"needs a plain redis.Redis client (for Redis Cluster, use a cluster proxy; see "
            f"docs/redis.md)"
        )
    # The cache's own client next: django-redis refuses what cannot work (for
    # example SentinelClient without the Sentinel connection factory).
    get_redis_connection(alias, write=True)  # builds a client; connects to nothing
    strict: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
    }
    pool_kwargs = {**(options.get("CONNECTION_POOL_KWARGS") or {}), **strict}
    pool_kwargs["decode_responses"] = True
    options.update(
        CONNECTION_POOL_KWARGS=pool_kwargs,
        SOCKET_TIMEOUT=timeout,
        SOCKET_CONNECT_TIMEOUT=timeout,
        SENTINEL_KWARGS={**(options.get("SENTINEL_KWARGS") or {}), **strict},
    )
    # By keyword: django-redis 6 (the last for Django 4.2) takes (path, options), 7 (options).
    factory = get_connection_factory(options=options)
    params = factory.make_connection_params(_master_url(_write_location(config["LOCATION"])))
    return redis.Redis(connection_pool=factory.get_connection_pool(params))


def _write_location(location: Any) -> str:
    """The server django-redis writes to: the first of ``LOCATION`` (a list or comma-separated)."""
    first = location[0] if isinstance(location, (list, tuple)) else str(location).split(",")[0]
    return str(first).strip()


def _master_url(url: str) -> str:
    """``url`` without ``is_master``: the lock always talks to a Sentinel service's master."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "is_master"]
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), parts.fragment))


def readable(connection: ConnectionInterface) -> bool:
    """True when an idle, connected connection has something to read: EOF, or a stray reply.

    redis-py's ``can_read(timeout=0)``: one non-blocking poll, plus a peek when
    the socket is readable, to tell a close from a stray reply. Any error also
    means "start afresh".
    """
    try:
        return bool(connection.can_read(timeout=0))
    except Exception:  # whatever it is, this socket is not to be trusted
        return True


def call(connection: ConnectionInterface, packed: bytes) -> Any:
    """Send one packed command on ``connection`` and return its reply (redis-py's parser).

    ``ResponseError`` (``NoScriptError``) means the server answered and the
    connection is in step. ``READONLY`` (a demoted master after a failover) and
    ``LOADING`` (a restarting server) come out as ``ConnectionError``
    (``MASTERDOWN`` too): the
    caller drops the connection and the call is settled as for any outage.
    """
    connection.send_packed_command([packed], check_health=False)  # type: ignore[no-untyped-call]
    try:
        return connection.read_response()
    except (ReadOnlyError, MasterDownError) as exc:
        raise RedisConnectionError(f"{type(exc).__name__}: {exc}") from exc
