"""The Redis lock's own client: django-redis's server, our timeouts, no retries.

The django-redis cache named by ``REDIS_ALIAS`` is only used to find the
connection parameters (plain or Sentinel). A blind retry of ``SET NX`` after a
lost reply locks the caller out of its own slot, so the lock client never
retries, and has its own short socket timeout.
"""

from __future__ import annotations

import select
from typing import TYPE_CHECKING, Any

import redis
from redis.backoff import NoBackoff
from redis.connection import SSLConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

if TYPE_CHECKING:  # redis-py >= 5.1 only; annotations are never evaluated
    from redis.connection import ConnectionInterface


# Connection kwargs that belong to the other pool or that the lock sets itself.
_OWN_KWARGS = {
    "connection_pool",  # a Sentinel pool's back-reference to itself
    "socket_timeout",
    "socket_connect_timeout",
    "retry",
    "retry_on_timeout",
    "retry_on_error",
    "decode_responses",
    "health_check_interval",
    "himport_registry",
    "maint_notifications_pool_handler",
    "maint_notifications_config",
}


def _portable(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k not in _OWN_KWARGS and not k.startswith("orig_")}


def build_client(alias: str, timeout: float) -> redis.Redis:
    """A client for the django-redis cache ``alias``'s server with our timeouts, no retries."""
    from django_redis import get_redis_connection

    base = get_redis_connection(alias, write=True)
    pool = base.connection_pool
    strict: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
    }
    if isinstance(pool, SentinelConnectionPool):
        return _sentinel_master(pool, strict)
    own_pool = redis.ConnectionPool(
        connection_class=pool.connection_class,
        **{**_portable(pool.connection_kwargs), **strict, "decode_responses": True},
    )
    return redis.Redis(connection_pool=own_pool)


def _sentinel_master(pool: SentinelConnectionPool, strict: dict[str, Any]) -> redis.Redis:
    """The master of ``pool``'s service, found through the same Sentinels (queried strictly)."""
    manager = pool.sentinel_manager
    addresses = [s.connection_pool.connection_kwargs for s in manager.sentinels]
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        [(a["host"], a["port"]) for a in addresses],
        min_other_sentinels=manager.min_other_sentinels,
        sentinel_kwargs={**_portable(manager.sentinel_kwargs), **strict},
        **{**_portable(pool.connection_kwargs), **strict, "decode_responses": True},
    )
    # A Sentinel pool turns ``ssl`` into its connection class and does not keep it
    # in connection_kwargs: pass it on, or the lock would talk plain TCP to a TLS master.
    ssl = issubclass(pool.connection_class, SSLConnection)
    # Always the master, even when the cache's pool reads from replicas (is_master=0).
    client: redis.Redis = sentinel.master_for(pool.service_name, ssl=ssl)  # type: ignore[no-untyped-call]
    return client


def readable(connection: ConnectionInterface) -> bool:
    """True when an idle connection's socket has something to read: EOF, or a stray reply.

    One ``poll`` (redis-py's ``can_read`` costs four system calls). eventlet's
    monkey-patching removes ``select.poll``, and Windows never had it: then
    ``select``. Any error also means "start afresh".
    """
    sock = getattr(connection, "_sock", None)
    if sock is None:
        return False  # not connected yet: the send connects
    try:
        poll = getattr(select, "poll", None)
        if poll is None:
            return bool(select.select([sock], [], [], 0)[0])
        poller = poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


def call_int(connection: ConnectionInterface, packed: bytes) -> int:
    """Send one packed command on a connected connection; return its integer reply.

    Every lock script answers an integer, so the reply is one line, ``:n`` or
    ``-ERROR ...``: it is read straight off the socket (TLS included), not
    through redis-py's parser. Failures come out as redis-py's exceptions:
    ``ResponseError`` (``NoScriptError``) when the server answered and the
    connection is in step, redis-py's ``ConnectionError``/``TimeoutError`` otherwise
    (the caller then disconnects).
    """
    sock = getattr(connection, "_sock", None)
    if sock is None:
        raise RedisConnectionError("the lock connection is not connected")
    try:
        sock.sendall(packed)
        reply = sock.recv(512)
        while not reply.endswith(b"\r\n"):
            more = sock.recv(512)
            if not more:
                raise RedisConnectionError("Connection closed by server.")
            reply += more
    except TimeoutError as exc:  # socket.timeout
        raise RedisTimeoutError("Timeout reading from the lock Redis") from exc
    except OSError as exc:
        raise RedisConnectionError(f"Error talking to the lock Redis: {exc}") from exc
    kind, body = reply[:1], reply[1:-2]
    if kind == b":" and b"\r\n" not in body:
        return int(body)
    if kind == b"-" and b"\r\n" not in body:
        message = body.decode("utf-8", "replace")
        if message.startswith("NOSCRIPT"):
            raise NoScriptError(message)
        if message.startswith(("READONLY", "LOADING", "MASTERDOWN")):
            # A demoted master (failover), a restarting server: reconnect, ask again later.
            raise RedisConnectionError(message)
        raise ResponseError(message)
    raise RedisConnectionError(f"unexpected reply from the lock Redis: {reply[:40]!r}")
