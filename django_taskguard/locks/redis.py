"""The Redis backend: one round trip decides a losing call; the database row still decides.

Keys (named in ``keys``) are fixed and versionless on a raw redis-py client of
our own (never ``cache.lock()``, never django-redis's ``KEY_PREFIX``/``VERSION``):

- ``{prefix}:run:{<digest>:<slot>}`` holds the winner's token with a lease (``PX``),
  then, once the slot finished, the marker ``=done`` for ``FINISHED_MARKER_SECONDS``
  (a late call meets it: ``Acquired.FINISHED``, one round trip, no query);
- ``{prefix}:dup:{<digest>:<slot>}`` is the slot's *claim record*, a hash with the
  task name, the winner's token and the count of losing calls. The winner
  folds the count into ``TaskRun.duplicates`` when it finishes; if the winner
  died between its Redis claim and its database row, ``cleanup_locks`` finds
  the record through :meth:`RedisLock.unrecorded_claims` and records the slot
  (and it folds the counts of late calls that met the marker).

The django-redis cache named by ``REDIS_ALIAS`` is only used to find the
connection parameters (plain, TLS, RESP3 or Sentinel); the lock client has its own short
socket timeout (``REDIS_SOCKET_TIMEOUT``) and no automatic retries, because
a blind retry of ``SET NX`` after a lost reply locks the caller out of its
own slot. An acquire that errors is settled by reading the key back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

import redis
from django.conf import settings
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.sentinel import SentinelConnectionPool

from .. import ledger
from ..conf import taskguard_settings
from ..exceptions import BackendUnavailable
from ..logfields import log_fields
from ..process import PerProcess, per_process
from .base import Acquired, LockBackend
from .keys import (
    CLAIM,
    RUN,
    SlotKey,
    check_prefix,
    claim_key,
    keyed_run_key,
    ledger_pattern,
    lock_key,
    run_key,
    scan_pattern,
)
from .redis_client import build_client, call, readable
from .redis_scripts import (
    ACQUIRE,
    CLAIM_ONCE,
    CLAIM_OR_READ,
    COMPARE_DELETE,
    EXTEND,
    FINISH,
    FINISHED_MARKER,
    FORGET_CLAIM,
    RELEASE,
    RELEASE_COUNTED,
    TAKE_DUPLICATES,
    Script,
    pack,
)
from .redis_sweep import ClaimRecord
from .redis_sweep import sweep as sweep_redis

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


# ACQUIRE's answer (0, 1, 2) as the outcome of the call.
_OUTCOMES = (Acquired.LOST, Acquired.WON, Acquired.FINISHED)


@dataclass
class Sockets:
    """A lock's connections in one process: ``idle`` ones are connected, ``closed`` ones
    had their socket dropped after an error (reconnected on their next checkout)."""

    idle: list[ConnectionInterface] = field(default_factory=list)
    closed: list[ConnectionInterface] = field(default_factory=list)


class RedisLock(LockBackend):
    name = "redis"
    # One lock per process and alias; rebuilt after fork or a settings change.
    _instances: ClassVar[PerProcess[dict[tuple[str, float], RedisLock]]] = per_process(dict)

    def __init__(self, alias: str, client: redis.Redis, source: object = None) -> None:
        self.alias = alias
        self.client = client
        self.source = source
        self.errors = 0  # Redis errors seen by this process (any command)
        self._state = threading.Lock()
        self._down_since: float | None = None
        self._probe_at = 0.0
        # Connections of the scripts' hot path, checked out without the pool's
        # bookkeeping (list.pop and append are atomic: no lock needed). A forked child
        # makes its own: it leaves the parent's sockets alone (dropped, never closed).
        self._sockets = per_process(Sockets)
        self._prefixes: dict[tuple[str, str], str] = {}

    def key_prefix(self) -> str:
        """``KEY_PREFIX`` and this ledger's identity: ``taskguard:<12 hex>``.

        Two projects on one Redis (staging and production, two sites) have two
        ledgers, so their keys never meet, whatever their ``KEY_PREFIX``. The
        identity is read from the ledger once per process and database.
        """
        wanted = (taskguard_settings.KEY_PREFIX, ledger.alias())
        try:
            return self._prefixes[wanted]
        except KeyError:
            prefix = self._prefixes[wanted] = f"{wanted[0]}:{ledger.identity()[:12]}"
            return prefix

    def key(self, task_name: str, slot: datetime) -> str:
        return run_key(self.key_prefix(), task_name, slot)

    def keyed(self, task_name: str, key: str) -> str:
        return keyed_run_key(self.key_prefix(), task_name, key)

    @classmethod
    def for_alias(cls, alias: str) -> RedisLock:
        check_prefix(taskguard_settings.KEY_PREFIX)
        taskguard_settings.FINISHED_MARKER_SECONDS  # noqa: B018 - refused here, not at finish
        source = settings.CACHES.get(alias)
        timeout = taskguard_settings.REDIS_SOCKET_TIMEOUT
        instances = cls._instances.get()
        lock = instances.get((alias, timeout))
        if lock is None or lock.source is not source:
            lock = instances[(alias, timeout)] = cls(alias, build_client(alias, timeout), source)
        return lock

    @classmethod
    def close_all(cls) -> None:
        """Disconnect and forget every cached lock client of this process."""
        instances = cls._instances.mine() or {}
        locks = list(instances.values())
        instances.clear()
        for lock in locks:
            lock.close()

    def close(self) -> None:
        """Disconnect this lock's connections (they reconnect on next use)."""
        sockets = self._sockets.mine()
        self._sockets.forget()
        for connection in sockets.idle if sockets else ():
            connection.disconnect()  # type: ignore[no-untyped-call]
        pool = self.client.connection_pool
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
        run_key: str = "",
    ) -> Acquired:
        # (`_down_since` tested inline: this is the hot path of every call)
        if self._down_since is not None and self._backing_off():
            return self._unavailable(task_name, None)
        args = (token, int(lease_seconds * 1000), CLAIM_RECORD_MS, task_name, int(count), run_key)
        try:
            won = self._eval(ACQUIRE, (key, claim_key(key)), args)
        except RedisError as exc:
            return self._settle(key, token, task_name, exc)
        if self._down_since is not None:
            self._up()
        return _OUTCOMES[won]

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
            extra=log_fields("redis.acquire_failed", task=task_name, reason=exc),
        )
        return Acquired.BYPASSED

    def extend(self, key: str, token: str, lease_seconds: float) -> bool:
        return bool(self._quiet(EXTEND, (key,), (token, int(lease_seconds * 1000))))

    def release(self, key: str, token: str) -> bool:
        return bool(self._quiet(RELEASE, (key, claim_key(key)), (token,)))

    def release_counted(self, key: str, token: str) -> int:
        return int(self._quiet(RELEASE_COUNTED, (key, claim_key(key)), (token,)) or 0)

    def finish(self, key: str, token: str, marker_seconds: float | None = None) -> int:
        """Leave the finished marker for ``FINISHED_MARKER_SECONDS`` (or ``marker_seconds``
        when shorter; 0: no marker, the key is deleted); return the duplicates.

        One round trip: if ``key`` holds ``token`` (or has lapsed) it is set to the
        marker, so a late call is answered by Redis alone (``Acquired.FINISHED``);
        the claim record's count is returned and the record deleted if it is
        this token's. Call it only once the row is recorded finished.
        """
        seconds = taskguard_settings.FINISHED_MARKER_SECONDS
        if marker_seconds is not None:
            seconds = min(seconds, marker_seconds)
        ms = int(seconds * 1000)
        return int(self._quiet(FINISH, (key, claim_key(key)), (token, ms)) or 0)

    def take_duplicates(self, key: str) -> int:
        return int(self._quiet(TAKE_DUPLICATES, (claim_key(key),), ()) or 0)

    # -- one-off claims (the beat's BEAT_CLAIM) ----------------------------------

    def claim_once(self, key: str, value: str, ttl_seconds: int) -> bool:
        """``SET key value NX EX ttl_seconds``: True when ``key`` is ours now.

        One round trip on the lock's own connections; raises
        ``BackendUnavailable`` when Redis does not answer.
        """
        if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or ttl_seconds < 1:
            raise ValueError(f"ttl_seconds must be a positive int, not {ttl_seconds!r}")
        try:
            return bool(self._eval(CLAIM_ONCE, (key,), (value, ttl_seconds)))
        except RedisError as exc:
            self.errors += 1
            raise self._loud(f"claim {key}", exc) from exc

    def claim_or_read(self, key: str, value: str, ttl_seconds: float) -> str | None:
        """Take ``key`` for ``value`` for ``ttl_seconds`` unless it exists: None when it is
        ours now, else its holder (which may be ``value`` too: taken before, by a caller
        that gave the same value). One round trip; ``BackendUnavailable`` on error."""
        if isinstance(ttl_seconds, bool) or not ttl_seconds > 0:
            raise ValueError(f"ttl_seconds must be positive, not {ttl_seconds!r}")
        try:
            held = self._eval(CLAIM_OR_READ, (key,), (value, max(1, int(ttl_seconds * 1000))))
            return None if held is None else str(held)
        except RedisError as exc:
            self.errors += 1
            raise self._loud(f"claim {key}", exc) from exc

    def extend_claim(self, key: str, value: str, ttl_seconds: float) -> bool:
        """Make ``key`` live ``ttl_seconds`` more, only while it holds ``value``."""
        try:
            ms = max(1, int(ttl_seconds * 1000))
            return bool(self._eval(EXTEND, (key,), (value, ms)))
        except RedisError as exc:
            self.errors += 1
            raise self._loud(f"extend {key}", exc) from exc

    def release_claim(self, key: str, value: str) -> bool:
        """Delete ``key`` only while it holds ``value`` (compare-and-delete); True if deleted."""
        try:
            return bool(self._eval(COMPARE_DELETE, (key,), (value,)))
        except RedisError as exc:
            self.errors += 1
            raise self._loud(f"release {key}", exc) from exc

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
            extra=log_fields("redis.unavailable", reason=exc),
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
                extra=log_fields("redis.available"),
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

        The command is packed here and sent on an idle connection of our own
        (``send_packed_command``/``read_response``), not through
        ``Redis.execute_command`` and the pool's checkout: that machinery costs
        about a third of a loopback round trip.
        """
        sockets = self._sockets.get()
        connection, connected = self._checkout(sockets)
        try:
            if not connected:
                # connect(), not the send's own connect: redis-py does the handshake
                # (HELLO, AUTH, SELECT, TLS), and a Sentinel connection asks for the master.
                connection.connect()  # type: ignore[no-untyped-call]
                connected = True
            try:
                reply = call(connection, pack("EVALSHA", script.sha, len(keys), *keys, *args))
            except NoScriptError:
                # The script cache is empty after a restart or failover: EVAL loads it.
                reply = call(connection, pack("EVAL", script.source, len(keys), *keys, *args))
        except ResponseError:
            if connected:  # the server answered a command: the connection is in step
                sockets.idle.append(connection)
                raise
            connection.disconnect()  # type: ignore[no-untyped-call]  # (refused in the handshake)
            sockets.closed.append(connection)
            raise
        except BaseException:
            # A reply may still be on its way: never reuse this socket (the
            # connection object is kept: the pool counts every one it made).
            connection.disconnect()  # type: ignore[no-untyped-call]
            sockets.closed.append(connection)
            raise
        sockets.idle.append(connection)
        return reply

    def _checkout(self, sockets: Sockets) -> tuple[ConnectionInterface, bool]:
        """A connection of ours and whether it is connected: an idle connected one, else
        a closed one, else a new one."""
        try:
            connection = sockets.idle.pop()
        except IndexError:
            try:
                return sockets.closed.pop(), False
            except IndexError:
                return self.client.connection_pool.make_connection(), False
        if readable(connection):
            # Readable while idle: the server closed it (or a reply is stray).
            # Start afresh rather than fail the next command.
            connection.disconnect()  # type: ignore[no-untyped-call]
            return connection, False
        return connection, True

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
        return None if value is None or value == FINISHED_MARKER else str(value)

    def scan_run_keys(self) -> Iterator[tuple[str, str | None]]:
        """Every lock key under ``KEY_PREFIX`` that holds a token, with it, by ``SCAN``.

        Finished markers are left out (they lapse on their own). The values are
        read 500 at a time by a pipeline of single-key ``GET``s, not one ``MGET``
        (whose keys would span hash slots).
        """
        match = scan_pattern(self.key_prefix(), RUN)
        try:
            batch: list[str] = []
            for key in self.client.scan_iter(match=match, count=500):
                batch.append(str(key))
                if len(batch) == 500:
                    yield from self._held(batch)
                    batch = []
            if batch:
                yield from self._held(batch)
        except RedisError as exc:
            raise self._loud("scan the lock keys", exc) from exc

    def delete_ledger_keys(self) -> int:
        """Delete every key under this ledger's prefix, by ``SCAN``; return how many.

        For tests between two test cases (``django_taskguard.testing.reset_locks``):
        the locks of live runs go too. Other ledgers' keys (other projects, other test
        databases) are never touched, and the database is never flushed. One ``DEL``
        per key in a pipeline, not one ``DEL`` of many (whose keys span hash slots).
        """
        deleted = 0
        try:
            batch: list[str] = []
            for key in self.client.scan_iter(match=ledger_pattern(self.key_prefix()), count=500):
                batch.append(str(key))
                if len(batch) == 500:
                    deleted += self._delete(batch)
                    batch = []
            if batch:
                deleted += self._delete(batch)
        except RedisError as exc:
            raise self._loud("delete this ledger's keys", exc) from exc
        return deleted

    def _delete(self, keys: list[str]) -> int:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.delete(key)
        return sum(int(n) for n in pipe.execute())

    def _held(self, keys: list[str]) -> Iterator[tuple[str, str | None]]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        for key, value in zip(keys, pipe.execute(), strict=True):
            if value != FINISHED_MARKER:
                yield key, value

    def unrecorded_claims(self) -> Iterator[ClaimRecord]:
        """Claim records whose lock is gone (or holds the finished marker): slots to check.

        A record on a finished slot holds the late calls counted after the
        winner's finish: cleanup adds them to the row.

        ``cleanup_locks`` (``redis_sweep.record_claims``) records each: an
        ``abandoned`` row with ``duplicates`` when no ``TaskRun`` exists for
        (task_name, slot) (the Redis winner died before its row), else the
        count is added to the row; then :meth:`forget_claim`.
        """
        match = scan_pattern(self.key_prefix(), CLAIM)
        try:
            for key in self.client.scan_iter(match=match, count=500):
                record = self._claim_record(str(key))
                if record is not None:
                    yield record
        except RedisError as exc:
            raise self._loud("scan the claim records", exc) from exc

    def claimed_task_names(self) -> set[str]:
        """Tasks of every claim record under this ledger's prefix (by ``SCAN``), held or not."""
        match = scan_pattern(self.key_prefix(), CLAIM)
        try:
            keys = [str(key) for key in self.client.scan_iter(match=match, count=500)]
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.hget(key, "task")
            return {str(name) for name in pipe.execute() if name}
        except RedisError as exc:
            raise self._loud("scan the claim records", exc) from exc

    def _claim_record(self, key: str) -> ClaimRecord | None:
        pipe = self.client.pipeline(transaction=False)
        pipe.get(lock_key(key))
        pipe.hgetall(key)
        holder, fields = pipe.execute()
        parsed = SlotKey.parse(key)
        held = holder is not None and holder != FINISHED_MARKER  # a marker: the lock is gone
        if held or not fields or parsed is None or not fields.get("task"):
            return None
        if parsed.slot is None and not fields.get("key"):
            return None  # a keyed run's record names its key; this one does not
        return ClaimRecord(
            key=key,
            task_name=fields["task"],
            slot=parsed.slot,
            run_key=fields.get("key"),
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
        """Record the claim records of unrecorded slots; remove orphan lock keys."""
        return sweep_redis(self, task, dry_run)

    def server_version(self) -> str:
        """The server's ``redis_version`` (raises ``RedisError`` when unknown)."""
        return str(self.client.info("server")["redis_version"])

    def eviction_policy(self) -> str:
        """The server's ``maxmemory-policy`` (raises ``RedisError`` when unknown)."""
        return str(self.client.config_get("maxmemory-policy")["maxmemory-policy"])
