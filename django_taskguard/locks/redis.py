"""The Redis backend: one round trip decides a losing call; the database row still decides.

Keys are fixed and versionless on a raw redis-py client of our own (never
``cache.lock()``, never django-redis's ``KEY_PREFIX``/``VERSION``):

- ``{prefix}:run:{digest}:{slot}`` holds the winner's token with a lease (``PX``);
- ``{prefix}:dup:{digest}:{slot}`` is the slot's *claim record*, a hash with the
  task name, the winner's token and the count of losing calls. The winner
  folds the count into ``TaskRun.duplicates`` when it finishes; if the winner
  died between its Redis claim and its database row, ``cleanup_locks`` finds
  the record through :meth:`RedisLock.unrecorded_claims` and records the slot.

The django-redis cache named by ``REDIS_ALIAS`` is only used to find the
connection parameters (plain or Sentinel); the lock client has its own short
socket timeout (``REDIS_SOCKET_TIMEOUT``) and no automatic retries, because
a blind retry of ``SET NX`` after a lost reply locks the caller out of its
own slot. An acquire that errors is settled by reading the key back.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

import redis
from django.conf import settings
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.sentinel import SentinelConnectionPool

from ..conf import taskguard_settings
from ..exceptions import BackendUnavailable
from .base import Acquired, LockBackend, parse_run_key
from .redis_client import build_client, call_int, readable
from .redis_scripts import (
    ACQUIRE,
    EXTEND,
    FORGET_CLAIM,
    RELEASE,
    RELEASE_COUNTED,
    TAKE_DUPLICATES,
    Script,
    pack,
)

if TYPE_CHECKING:  # redis-py >= 5.1 only; annotations are never evaluated
    from redis.connection import ConnectionInterface

logger = logging.getLogger("taskguard.locks")

# How long a claim record outlives its last write: cleanup_locks must run
# within this window to record a slot whose winner died before its row.
CLAIM_RECORD_SECONDS = 86400
CLAIM_RECORD_MS = CLAIM_RECORD_SECONDS * 1000
# While Redis is unreachable, try it again at most this often (other calls
# go straight to ON_REDIS_ERROR instead of waiting for a socket timeout each).
PROBE_SECONDS = 1.0


def claim_key(run_key: str) -> str:
    """The claim record that goes with a lock key made by ``base.run_key``."""
    head, _, tail = run_key.rpartition(":run:")
    return f"{head}:dup:{tail}"


def lock_key(claim: str) -> str:
    head, _, tail = claim.rpartition(":dup:")
    return f"{head}:run:{tail}"


def _match(prefix: str, kind: str) -> str:
    escaped = "".join(f"\\{c}" if c in "*?[]\\" else c for c in prefix)
    return f"{escaped}:{kind}:*"


@dataclass(frozen=True)
class ClaimRecord:
    """A slot someone claimed in Redis whose lock is gone: the row may be missing."""

    key: str  # the claim record's key
    task_name: str
    slot: datetime
    duplicates: int  # losing calls counted in Redis, not yet in TaskRun.duplicates
    token: str  # the Redis winner's token ("" when the winner already finished)


class RedisLock(LockBackend):
    name = "redis"
    # One lock per process and alias; rebuilt after fork or a settings change.
    _instances: ClassVar[dict[tuple[str, float], RedisLock]] = {}

    def __init__(self, alias: str, client: redis.Redis, source: object = None) -> None:
        self.alias = alias
        self.client = client
        self.source = source
        self.pid = os.getpid()
        self.errors = 0  # Redis errors seen by this process (any command)
        self._state = threading.Lock()
        self._down_since: float | None = None
        self._probe_at = 0.0
        # Connections of the scripts' hot path, checked out without the pool's
        # bookkeeping (list.pop and append are atomic: no lock needed).
        self._idle: list[ConnectionInterface] = []
        self._idle_pid = self.pid

    @classmethod
    def for_alias(cls, alias: str) -> RedisLock:
        source = settings.CACHES.get(alias)
        timeout = taskguard_settings.REDIS_SOCKET_TIMEOUT
        lock = cls._instances.get((alias, timeout))
        if lock is None or lock.pid != os.getpid() or lock.source is not source:
            lock = cls(alias, build_client(alias, timeout), source)
            cls._instances[(alias, timeout)] = lock
        return lock

    @classmethod
    def close_all(cls) -> None:
        """Disconnect and forget every cached lock client of this process."""
        locks, cls._instances = list(cls._instances.values()), {}
        for lock in locks:
            idle, lock._idle = lock._idle, []
            for connection in idle:
                connection.disconnect()  # type: ignore[no-untyped-call]
            pool = lock.client.connection_pool
            pool.disconnect()
            if isinstance(pool, SentinelConnectionPool):  # and the Sentinel queries' own
                for sentinel in pool.sentinel_manager.sentinels:
                    sentinel.connection_pool.disconnect()

    # -- the hot path ---------------------------------------------------------

    def acquire(
        self,
        key: str,
        token: str,
        lease_seconds: float,
        task_name: str = "",
        *,
        count: bool = True,
    ) -> Acquired:
        # (`_down_since` tested inline: this is the hot path of every call)
        if self._down_since is not None and self._backing_off():
            return self._unavailable(task_name, None)
        args = (token, int(lease_seconds * 1000), CLAIM_RECORD_MS, task_name, int(count))
        try:
            won = self._eval(ACQUIRE, (key, claim_key(key)), args)
        except RedisError as exc:
            return self._settle(key, token, task_name, exc)
        if self._down_since is not None:
            self._up()
        return Acquired.WON if won == 1 else Acquired.LOST

    def _settle(self, key: str, token: str, task_name: str, exc: RedisError) -> Acquired:
        """The acquire's outcome is unknown: read back whether the key holds our token."""
        self.errors += 1
        try:
            holder = self.client.get(key)
        except RedisError as again:
            return self._unavailable(task_name, again)
        if holder == token:
            return Acquired.WON
        logger.warning(
            "taskguard Redis acquire of %s failed (%s: %s); deciding on the database",
            key,
            type(exc).__name__,
            exc,
        )
        return Acquired.BYPASSED

    def extend(self, key: str, token: str, lease_seconds: float) -> bool:
        return bool(self._quiet(EXTEND, (key,), (token, int(lease_seconds * 1000))))

    def release(self, key: str, token: str) -> bool:
        return bool(self._quiet(RELEASE, (key, claim_key(key)), (token,)))

    def release_counted(self, key: str, token: str) -> int:
        return int(self._quiet(RELEASE_COUNTED, (key, claim_key(key)), (token,)) or 0)

    def take_duplicates(self, key: str) -> int:
        return int(self._quiet(TAKE_DUPLICATES, (claim_key(key),), ()) or 0)

    # -- outage handling --------------------------------------------------------

    def _backing_off(self) -> bool:
        if self._down_since is None:
            return False
        with self._state:
            now = time.monotonic()
            if now < self._probe_at:
                return True
            self._probe_at = now + PROBE_SECONDS  # this caller probes; the others skip
            return False

    def _down(self, exc: BaseException | None) -> None:
        with self._state:
            self._probe_at = time.monotonic() + PROBE_SECONDS
            if self._down_since is not None:
                return
            self._down_since = time.monotonic()
        logger.warning(
            "taskguard Redis (CACHES[%r]) is unreachable (%s); ON_REDIS_ERROR=%r until it "
            "answers again (logged once per outage)",
            self.alias,
            exc,
            taskguard_settings.ON_REDIS_ERROR,
        )

    def _up(self) -> None:
        if self._down_since is None:
            return
        with self._state:
            since, self._down_since = self._down_since, None
        if since is not None:
            logger.warning(
                "taskguard Redis (CACHES[%r]) answers again after %.1f s",
                self.alias,
                time.monotonic() - since,
            )

    def _unavailable(self, task_name: str, exc: BaseException | None) -> Acquired:
        if exc is not None:
            self.errors += 1
            self._down(exc)
        if taskguard_settings.ON_REDIS_ERROR == "fail":
            raise BackendUnavailable(
                f"{task_name or 'the task'!r} did not run: the taskguard Redis "
                f"(CACHES[{self.alias!r}]) is unreachable ({exc or 'still down'}) and "
                f"TASKGUARD['ON_REDIS_ERROR'] is 'fail'"
            )
        return Acquired.BYPASSED

    def _eval(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One script call: one round trip, never retried.

        The command is packed here and sent on a connection of our own, not
        through ``Redis.execute_command`` and the pool's checkout, and its
        one-line integer reply is read without redis-py's parser (see
        :func:`redis_client.call_int`): that machinery costs about as much as
        the loopback round trip itself.
        """
        connection = self._checkout()
        try:
            # Connect here (a no-op when connected): redis-py does the handshake
            # (AUTH, SELECT, TLS), and a Sentinel connection asks for the master.
            connection.connect()  # type: ignore[no-untyped-call]
            try:
                return call_int(connection, pack("EVALSHA", script.sha, len(keys), *keys, *args))
            except NoScriptError:
                # The script cache is empty after a restart or failover: EVAL loads it.
                return call_int(connection, pack("EVAL", script.source, len(keys), *keys, *args))
        except ResponseError:
            raise  # the server answered: the connection is in step
        except BaseException:
            # A reply may still be on its way: never reuse this connection as is.
            connection.disconnect()  # type: ignore[no-untyped-call]
            raise
        finally:
            self._idle.append(connection)

    def _checkout(self) -> ConnectionInterface:
        """An idle connection of ours, or a new (unconnected) one from the client's pool."""
        if self._idle_pid != os.getpid():
            self._idle, self._idle_pid = [], os.getpid()  # forked: the sockets are the parent's
        try:
            connection = self._idle.pop()
        except IndexError:
            return self.client.connection_pool.make_connection()
        if readable(connection):
            # Readable while idle: the server closed it (or a reply is stray).
            # Start afresh rather than fail the next command.
            connection.disconnect()  # type: ignore[no-untyped-call]
        return connection

    def _quiet(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run a script whose failure must not stop the caller (the lease runs out anyway)."""
        if self._backing_off():
            return 0
        try:
            result = self._eval(script, keys, args)
        except RedisError as exc:
            self.errors += 1
            self._down(exc)
            return 0
        self._up()
        return result

    # -- reading, for cleanup_locks and the admin ------------------------------

    def _loud(self, what: str, exc: RedisError) -> BackendUnavailable:
        return BackendUnavailable(
            f"taskguard could not {what}: Redis (CACHES[{self.alias!r}]) is unreachable ({exc})"
        )

    def holder(self, key: str) -> str | None:
        try:
            value = self.client.get(key)
        except RedisError as exc:
            raise self._loud(f"read {key}", exc) from exc
        return None if value is None else str(value)

    def scan_run_keys(self) -> Iterator[tuple[str, str | None]]:
        """Every lock key under ``KEY_PREFIX`` and its token, by ``SCAN`` (never ``KEYS``)."""
        match = _match(taskguard_settings.KEY_PREFIX, "run")
        try:
            batch: list[str] = []
            for key in self.client.scan_iter(match=match, count=500):
                batch.append(str(key))
                if len(batch) == 500:
                    yield from zip(batch, self.client.mget(batch), strict=True)
                    batch = []
            if batch:
                yield from zip(batch, self.client.mget(batch), strict=True)
        except RedisError as exc:
            raise self._loud("scan the lock keys", exc) from exc

    def unrecorded_claims(self) -> Iterator[ClaimRecord]:
        """Claim records whose lock is gone: slots to check against the ledger.

        ``cleanup_locks`` (``cleanup_redis.record_claims``) records each: an
        ``abandoned`` row with ``duplicates`` when no ``TaskRun`` exists for
        (task_name, slot) (the Redis winner died before its row), else the
        count is added to the row; then :meth:`forget_claim`.
        """
        match = _match(taskguard_settings.KEY_PREFIX, "dup")
        try:
            for key in self.client.scan_iter(match=match, count=500):
                record = self._claim_record(str(key))
                if record is not None:
                    yield record
        except RedisError as exc:
            raise self._loud("scan the claim records", exc) from exc

    def _claim_record(self, key: str) -> ClaimRecord | None:
        pipe = self.client.pipeline(transaction=False)
        pipe.exists(lock_key(key))
        pipe.hgetall(key)
        held, fields = pipe.execute()
        parsed = parse_run_key(lock_key(key))
        if held or not fields or parsed is None or not fields.get("task"):
            return None
        return ClaimRecord(
            key=key,
            task_name=fields["task"],
            slot=parsed[1],
            duplicates=int(fields.get("count", 0)),
            token=fields.get("token", ""),
        )

    def forget_claim(self, record: ClaimRecord) -> bool:
        """Drop a claim record once the ledger holds it (counts added since stay)."""
        try:
            keys = (lock_key(record.key), record.key)
            return bool(self._eval(FORGET_CLAIM, keys, (record.duplicates,)))
        except RedisError as exc:
            raise self._loud(f"forget {record.key}", exc) from exc

    def sweep(self, task: str | None, dry_run: bool) -> tuple[int, int]:
        from ..cleanup_redis import sweep  # (moving into the locks package)

        return sweep(self, task, dry_run)

    def eviction_policy(self) -> str:
        """The server's ``maxmemory-policy`` (raises ``RedisError`` when unknown)."""
        return str(self.client.config_get("maxmemory-policy")["maxmemory-policy"])
