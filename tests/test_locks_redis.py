"""The Redis lock backend against a private redis-server: scripts, keys, outages, checks."""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from django_taskguard import once_per_schedule
from django_taskguard.checks import check_lock_redis
from django_taskguard.cleanup import cleanup_locks
from django_taskguard.exceptions import BackendUnavailable, TaskGuardError
from django_taskguard.locks import Acquired, claim_once, release_claim, run_key
from django_taskguard.locks.redis import RedisLock, claim_key
from django_taskguard.locks.redis_client import call
from django_taskguard.locks.redis_scripts import FINISHED_MARKER, pack
from django_taskguard.models import Ledger, RunState, TaskRun
from django_taskguard.signals import duplicate_suppressed

from .support.redis_server import RedisServer, free_port
from .support.redis_support import (
    TlsRedisServer,
    checkout,
    command,
    guard_key,
    redis_backend,
    redis_caches,
    retries_of,
)
from .support.runs import PutBack, busy_call
from .support.slots import BASE_SLOT
from .support.waiting import wait_for

pytestmark = pytest.mark.dialect

SLOT = BASE_SLOT + timedelta(hours=21)
KEY = run_key("taskguard", "tests.lock", SLOT)
# what the probing client itself sends (its handshake and INFO)
PROBE_COMMANDS = {"hello", "client|setinfo", "info"}


def test_redis_lock__acquire_counts_duplicates_and_release_compares_token(redis_server):
    with redis_backend(redis_server) as lock:
        assert lock.acquire(KEY, "a" * 32, 3, "tests.lock") is Acquired.WON
        assert lock.acquire(KEY, "a" * 32, 3, "tests.lock") is Acquired.WON  # idempotent
        assert lock.acquire(KEY, "b" * 32, 3, "tests.lock") is Acquired.LOST
        assert lock.acquire(KEY, "c" * 32, 3, "tests.lock") is Acquired.LOST
        assert lock.holder(KEY) == "a" * 32
        assert not lock.extend(KEY, "b" * 32, 3)
        assert not lock.release(KEY, "b" * 32)
        assert lock.holder(KEY) == "a" * 32
        assert lock.extend(KEY, "a" * 32, 30)
        assert 29_000 < command(redis_server, "pttl", KEY) <= 30_000
        assert lock.take_duplicates(KEY) == 2
        assert lock.take_duplicates(KEY) == 0
        assert lock.release(KEY, "a" * 32)
        assert lock.holder(KEY) is None
        assert list(lock.scan_run_keys()) == []


def test_redis_lock__acquire_sets_the_lease_it_is_given(redis_server):
    with redis_backend(redis_server) as lock:
        for lease in (30, 2.5):
            key = run_key("taskguard", "tests.lease", SLOT + timedelta(seconds=lease))
            assert lock.acquire(key, "a" * 32, lease, "tests.lease") is Acquired.WON
            ttl = command(redis_server, "pttl", key)
            assert lease * 1000 - 1000 < ttl <= lease * 1000, (lease, ttl)


@pytest.mark.django_db(transaction=True)
def test_redis_lock__keys_are_fixed_and_versionless(redis_server):
    with redis_backend(redis_server) as lock:
        key = lock.key("tests.lock", SLOT)
        lock.acquire(key, "a" * 32, 3, "tests.lock")
        keys = {k.decode() for k in command(redis_server, "keys", "*")}
        assert keys == {key, claim_key(key)}
        # KEY_PREFIX, then this ledger's identity (two projects on one Redis never meet).
        identity = Ledger.objects.get().identity
        assert key.startswith(f"taskguard:{identity.hex[:12]}:run:{{")
        assert key.endswith(f":{SLOT:%Y%m%dT%H%M%S}.000000Z}}")
        assert list(lock.scan_run_keys()) == [(key, "a" * 32)]


def test_redis_lock__noscript_after_script_flush_and_restart(redis_server):
    with redis_backend(redis_server) as lock:
        assert lock.acquire(KEY, "a" * 32, 3) is Acquired.WON
        command(redis_server, "script_flush")
        assert lock.acquire(KEY, "b" * 32, 3) is Acquired.LOST
        redis_server.restart()
        assert lock.acquire(KEY, "b" * 32, 3) is Acquired.WON
        command(redis_server, "script_flush")
        assert lock.extend(KEY, "b" * 32, 3)
        command(redis_server, "script_flush")
        assert lock.release(KEY, "b" * 32)
        assert lock.errors == 0


def test_redis_lock__client_has_own_timeout_and_no_retries(redis_server):
    with redis_backend(redis_server, REDIS_SOCKET_TIMEOUT=0.25) as lock:
        kwargs = lock.client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == 0.25
        assert retries_of(kwargs["retry"]) == 0
        connection_ = checkout(lock.client.connection_pool)
        try:
            assert retries_of(connection_.retry) == 0
        finally:
            lock.client.connection_pool.release(connection_)
        assert RedisLock.for_alias("redis") is lock  # cached per process


def test_redis_lock__new_client_after_fork(redis_server):
    with redis_backend(redis_server) as lock:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            try:
                child = RedisLock.for_alias("redis")
                ok = child is not lock and child.acquire(KEY, "c" * 32, 3) is Acquired.WON
                os.write(write, b"1" if ok else b"0")
            finally:
                os._exit(0)
        os.close(write)
        assert os.read(read, 1) == b"1"
        os.waitpid(pid, 0)
        assert lock.holder(KEY) == "c" * 32


def test_redis_lock__inherited_lock_opens_its_own_connection_after_fork(redis_server):
    """A lock object used across fork() must not share its idle socket with the parent."""
    with redis_backend(redis_server) as lock:
        assert lock.acquire(KEY, "p" * 32, 30) is Acquired.WON  # the parent's idle connection
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            try:
                other = guard_key("tests.lock.child", SLOT)
                results = {lock.acquire(other, "c" * 32, 30) for _ in range(2000)}
                own = all(c.pid == os.getpid() for c in lock._sockets.get().idle)  # made here
                ok = own and results == {Acquired.WON} and lock.errors == 0
                os.write(write, b"1" if ok else b"0")
            finally:
                os._exit(0)
        os.close(write)
        # Both at once: on a shared socket, replies would cross (wrong answers, errors).
        results = {lock.acquire(KEY, "q" * 32, 30) for _ in range(2000)}
        reported = os.read(read, 1)
        os.close(read)
        os.waitpid(pid, 0)
        assert reported == b"1"
        assert results == {Acquired.LOST}
        assert lock.errors == 0


def test_redis_lock__idle_connection_closed_by_the_server_is_replaced(redis_server, caplog):
    with redis_backend(redis_server) as lock:
        caplog.set_level(logging.INFO, logger="taskguard.locks")
        assert lock.acquire(KEY, "a" * 32, 3) is Acquired.WON
        # What a server-side idle `timeout` (or a proxy) does to a quiet connection.
        killed = command(redis_server, "client_kill_filter", _type="normal", skipme=True)
        assert killed >= 1
        assert lock.acquire(KEY, "b" * 32, 3) is Acquired.LOST
        assert lock.release(KEY, "a" * 32)
        assert lock.errors == 0
        assert caplog.records == []


def test_redis_lock__replies_through_redis_py(redis_server, tmp_path):
    """Replies read by redis-py's parser: an error keeps the connection in step; READONLY drops."""
    with redis_backend(redis_server) as lock:
        connection, _ = lock._checkout(lock._sockets.get())
        command(redis_server, "set", "tests:word", "x")
        with pytest.raises(ResponseError, match="not an integer"):
            call(connection, pack("INCR", "tests:word"))
        assert call(connection, pack("INCRBY", "tests:n", 41)) == 41
        assert call(connection, pack("INCR", "tests:n")) == 42
        with pytest.raises(NoScriptError):
            call(connection, pack("EVALSHA", "0" * 40, 0))
        assert call(connection, pack("GET", "tests:n")) == "42"  # decoded
        connection.disconnect()
    replica = RedisServer(tmp_path / "replica", "--replicaof", "127.0.0.1", str(redis_server.port))
    replica.start()
    try:
        with redis_backend(replica) as lock:
            connection, _ = lock._checkout(lock._sockets.get())
            with pytest.raises(RedisConnectionError, match="ReadOnlyError"):
                call(connection, pack("SET", "tests:n", 1))  # a demoted master after failover
            connection.disconnect()
    finally:
        replica.stop()


def test_redis_lock__outage_logged_once_and_recovery_once(redis_server, caplog):
    with redis_backend(redis_server, ON_REDIS_ERROR="database") as lock:
        redis_server.stop()
        caplog.set_level(logging.WARNING, logger="taskguard.locks")
        results = [lock.acquire(KEY, f"{i:032d}", 3) for i in range(20)]
        assert set(results) == {Acquired.BYPASSED}
        lock._probe_at = 0.0  # let the next call probe at once instead of in PROBE_SECONDS
        assert lock.acquire(KEY, "x" * 32, 3) is Acquired.BYPASSED
        assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1
        redis_server.start()
        lock._probe_at = 0.0
        assert lock.acquire(KEY, "y" * 32, 3) is Acquired.WON
        assert lock.acquire(KEY, "z" * 32, 3) is Acquired.LOST
        assert len([r for r in caplog.records if "answers again after" in r.getMessage()]) == 1


def test_redis_lock__fail_policy_refuses_to_run(redis_server, transactional_db, scratch):
    ran = []

    @once_per_schedule(name="tests.fail_policy")
    def body():
        ran.append(1)

    with redis_backend(redis_server, ON_REDIS_ERROR="fail"):
        redis_server.stop()
        with pytest.raises(BackendUnavailable, match="ON_REDIS_ERROR'] is 'fail'"):
            body.run_for_slot(SLOT)
    assert ran == []
    assert not TaskRun.objects.exists()


def test_redis_lock__database_policy_runs_once_on_the_database(redis_server, transactional_db):
    ran = []

    @once_per_schedule(name="tests.db_policy")
    def body():
        ran.append(1)
        return "ok"

    with redis_backend(redis_server, ON_REDIS_ERROR="database"):
        redis_server.stop()
        assert body.run_for_slot(SLOT) == "ok"
        assert body.run_for_slot(SLOT) is None
    assert ran == [1]
    run = TaskRun.objects.get()
    assert (run.state, run.duplicates) == (RunState.SUCCEEDED, 1)


def test_guard__loser_makes_one_redis_call_and_no_query(redis_server, transactional_db):
    @once_per_schedule(name="tests.loser")
    def body():
        return "ran"

    with redis_backend(redis_server) as lock:
        key = guard_key("tests.loser", SLOT)
        assert lock.acquire(key, "h" * 32, 30, "tests.loser") is Acquired.WON  # someone else
        body.run_for_slot(SLOT)  # warm up: the connection's handshake is not the call
        before = _calls(redis_server)
        with CaptureQueriesContext(connection) as queries:
            assert body.run_for_slot(SLOT) is None
        after = _calls(redis_server)
        assert len(queries) == 0, queries.captured_queries
        made = {name: after[name] - before.get(name, 0) for name in after}
        made = {name: n for name, n in made.items() if n and name not in PROBE_COMMANDS}
        # one EVALSHA round trip; the rest ran inside the script, in the server
        assert made == {"evalsha": 1, "set": 1, "hincrby": 1, "hsetnx": 1, "pexpire": 1}
        assert lock.take_duplicates(key) == 2


def test_guard__every_call_inside_atomic_is_refused(redis_server, transactional_db):
    @once_per_schedule(name="tests.atomic")
    def body():
        return "ran"

    with redis_backend(redis_server) as lock:
        key = guard_key("tests.atomic", SLOT)
        with transaction.atomic(), pytest.raises(TaskGuardError, match="open transaction"):
            body.run_for_slot(SLOT)
        assert lock.holder(key) is None, "it took no Redis lock"
        assert not TaskRun.objects.exists()
        # A call that would lose in Redis is refused too (it would count a
        # duplicate of a slot whose only claimant raised).
        assert lock.acquire(key, "h" * 32, 30, "tests.atomic") is Acquired.WON
        with transaction.atomic(), pytest.raises(TaskGuardError, match="open transaction"):
            body.run_for_slot(SLOT)
        assert lock.take_duplicates(key) == 0
        assert lock.release(key, "h" * 32)
        assert body.run_for_slot(SLOT) == "ran"


@pytest.mark.smoke  # the version matrix's smoke set (scripts/matrix.sh)
def test_guard__winner_folds_redis_duplicates_into_the_row(redis_server, transactional_db):
    seen = []

    @once_per_schedule(name="tests.fold")
    def body():
        seen.append(body.run_for_slot(SLOT))  # a losing call from inside the run
        seen.append(body.run_for_slot(SLOT))
        return "ran"

    with redis_backend(redis_server) as lock:
        assert body.run_for_slot(SLOT) == "ran"
        key = guard_key("tests.fold", SLOT)
        assert lock.holder(key) is None
        assert command(redis_server, "exists", claim_key(key)) == 0
    assert seen == [None, None]
    run = TaskRun.objects.get()
    assert (run.state, run.duplicates) == (RunState.SUCCEEDED, 2)


def test_redis_lock__acquire_without_count_loses_without_counting(redis_server):
    with redis_backend(redis_server) as lock:
        assert lock.acquire(KEY, "a" * 32, 3, "tests.lock") is Acquired.WON
        assert lock.acquire(KEY, "b" * 32, 3, "tests.lock", count=False) is Acquired.LOST
        assert lock.acquire(KEY, "a" * 32, 3, "tests.lock", count=False) is Acquired.WON
        assert lock.take_duplicates(KEY) == 0
        assert lock.release(KEY, "a" * 32)
        assert lock.acquire(KEY, "b" * 32, 3, "tests.lock", count=False) is Acquired.WON


def test_guard__put_back_call_is_not_counted_in_redis(redis_server, transactional_db):
    hints: list[float] = []

    @once_per_schedule(name="tests.busy", lease_seconds=3)
    def body():
        with pytest.raises(PutBack):
            busy_call("tests.busy", hints, slot=SLOT, lease=3)
        return "ran"

    with redis_backend(redis_server) as lock:
        assert body.run_for_slot(SLOT) == "ran"
        assert hints == [3]  # Redis said "held": the hint is the whole lease
        key = guard_key("tests.busy", SLOT)
        # The slot ended: the put-back call meets the finished marker, is not put
        # back, and is counted on the claim record (no query), folded in by cleanup.
        with CaptureQueriesContext(connection) as queries:
            assert busy_call("tests.busy", hints, slot=SLOT, lease=3) is None
        assert len(queries) == 0, queries.captured_queries
        assert lock.holder(key) is None
        assert command(redis_server, "hget", claim_key(key), "count") == b"1"
        assert TaskRun.objects.get().duplicates == 0
        assert cleanup_locks().unrecorded_slots == 0
        assert command(redis_server, "exists", claim_key(key)) == 0
    run = TaskRun.objects.get()
    assert (run.state, run.duplicates, len(hints)) == (RunState.SUCCEEDED, 1, 1)


def test_guard__redis_flushed_mid_slot_the_row_decides(redis_server, transactional_db):
    runs = []

    @once_per_schedule(name="tests.flush")
    def body():
        runs.append("outer")
        command(redis_server, "flushall")
        runs.append(body.run_for_slot(SLOT))  # wins Redis, must lose on the row
        return "ran"

    with redis_backend(redis_server):
        assert body.run_for_slot(SLOT) == "ran"
    assert runs == ["outer", None]
    run = TaskRun.objects.get()
    assert (run.state, run.duplicates) == (RunState.SUCCEEDED, 1)


def _calls(server) -> dict[str, int]:
    stats = command(server, "info", "commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


def _lock_checks():
    from django_taskguard.checks import check_lock_redis

    return {message.id for message in check_lock_redis()}


def test_checks__eviction_policy_warnings(redis_server):
    with redis_backend(redis_server):
        assert _lock_checks() == set()
        command(redis_server, "config_set", "maxmemory-policy", "allkeys-lru")
        assert _lock_checks() == {"taskguard.W010"}
        redis_server.stop()
        assert _lock_checks() == {"taskguard.W011"}
    with redis_backend(redis_server, BACKEND="database"):
        assert _lock_checks() == set()


def _lock_connections(server) -> list[dict[str, str]]:
    """The server's clients whose last command was a lock script."""
    clients = command(server, "client_list")
    return [c for c in clients if c["cmd"] in ("evalsha", "eval")]


@pytest.mark.parametrize("protocol", [2, 3])
def test_redis_lock__speaks_the_cache_protocol(redis_server, protocol):
    """RESP3 for real: a cache with ``protocol: 3`` gives a lock client that says HELLO 3."""
    options = {"CONNECTION_POOL_KWARGS": {"protocol": protocol}}
    with redis_backend(redis_server, options=options) as lock:
        assert lock.acquire(KEY, "a" * 32, 3, "tests.lock") is Acquired.WON
        assert lock.acquire(KEY, "b" * 32, 3, "tests.lock") is Acquired.LOST
        assert [c["resp"] for c in _lock_connections(redis_server)] == [str(protocol)]
        assert lock.holder(KEY) == "a" * 32
        assert lock.extend(KEY, "a" * 32, 30)
        assert lock.release_counted(KEY, "a" * 32) == 1
        assert lock.holder(KEY) is None
        assert lock.claim_once("tests:claim", "me", 60)
        assert lock.errors == 0


@pytest.mark.file_and_server
@pytest.mark.processes
def test_redis_lock__over_tls(tmp_path):
    """TLS for real: a rediss:// cache with its CA; every lock operation goes over it."""
    server = TlsRedisServer(tmp_path / "tls")
    server.start()
    try:
        options = {"CONNECTION_POOL_KWARGS": {"ssl_ca_certs": str(server.ca_file)}}
        with redis_backend(server, options=options) as lock:
            assert lock.acquire(KEY, "a" * 32, 3, "tests.lock") is Acquired.WON
            assert lock.acquire(KEY, "b" * 32, 3, "tests.lock") is Acquired.LOST
            assert lock.extend(KEY, "a" * 32, 30)
            assert not lock.release(KEY, "b" * 32)
            assert lock.release_counted(KEY, "a" * 32) == 1
            assert server.client().exists(KEY) == 0
            assert lock.acquire(KEY, "d" * 32, 3, "tests.lock") is Acquired.WON
            assert lock.finish(KEY, "d" * 32) == 0
            assert lock.acquire(KEY, "e" * 32, 3, "tests.lock") is Acquired.FINISHED
            assert lock.errors == 0
        # The same cache without the CA: the server's certificate is refused.
        with redis_backend(server) as lock:
            assert lock.acquire(KEY, "c" * 32, 3, "tests.lock") is Acquired.BYPASSED
            assert lock.errors == 2  # the acquire, then its read-back
    finally:
        server.stop()


def test_claim_once__set_once_then_compare_and_delete(redis_server):
    with redis_backend(redis_server, BACKEND="database"):
        assert claim_once("tg:beat:x", "beat-1", 60)
        assert not claim_once("tg:beat:x", "beat-2", 60)
        assert 55 <= command(redis_server, "ttl", "tg:beat:x") <= 60
        assert not release_claim("tg:beat:x", "beat-2")
        assert command(redis_server, "get", "tg:beat:x") == b"beat-1"
        assert release_claim("tg:beat:x", "beat-1")
        assert claim_once("tg:beat:x", "beat-2", 60)
        with pytest.raises(ValueError, match="positive int"):
            claim_once("tg:beat:y", "beat-1", 0)
        redis_server.stop()
        with pytest.raises(BackendUnavailable, match="unreachable"):
            claim_once("tg:beat:z", "beat-1", 60)


def test_redis_lock__every_script_runs_on_a_cluster_node(tmp_path, db):
    """Each script's keys share one hash slot: a cluster-mode node runs them (no CROSSSLOT)."""
    # (the cluster bus needs a port of its own: port + 10000 may not exist)
    bus = ("--cluster-port", str(free_port()))
    server = RedisServer(tmp_path / "cluster", "--cluster-enabled", "yes", *bus)
    server.start()
    try:
        command(server, "execute_command", "CLUSTER", "ADDSLOTSRANGE", "0", "16383")
        wait_for(
            lambda: b"cluster_state:ok" in command(server, "execute_command", "CLUSTER", "INFO")
        )
        with pytest.raises(ResponseError, match="same slot"):  # CROSSSLOT: the node does check
            command(server, "eval", "return 1", 2, "tests:a", "tests:b")
        with redis_backend(server) as lock:
            key = lock.key("tests.lock", SLOT)  # this ledger's keys: the sweep scans for them
            assert lock.acquire(key, "a" * 32, 3, "tests.lock") is Acquired.WON
            assert lock.acquire(key, "b" * 32, 3, "tests.lock") is Acquired.LOST
            assert lock.extend(key, "a" * 32, 30)
            assert not lock.release(key, "b" * 32)
            assert lock.release_counted(key, "a" * 32) == 1
            assert lock.acquire(key, "d" * 32, 3, "tests.lock") is Acquired.WON
            assert lock.acquire(key, "e" * 32, 3, "tests.lock") is Acquired.LOST
            assert lock.take_duplicates(key) == 1
            assert lock.release(key, "d" * 32)
            assert lock.acquire(key, "f" * 32, 3, "tests.lock") is Acquired.WON
            assert lock.finish(key, "f" * 32) == 0
            assert lock.acquire(key, "g" * 32, 3, "tests.lock") is Acquired.FINISHED
            assert [record.duplicates for record in lock.unrecorded_claims()] == [1]
            assert list(lock.scan_run_keys()) == []
            assert lock.errors == 0
    finally:
        server.stop()


def test_redis_lock__key_prefix_with_a_brace_is_refused(redis_server):
    with pytest.raises(ImproperlyConfigured, match="brace"):  # noqa: SIM117
        with redis_backend(redis_server, KEY_PREFIX="tg{app}"):
            pass


# The finished-slot marker --------------------------------------------------------


def test_redis_lock__finish_leaves_a_marker_that_answers_late_calls(redis_server):
    with redis_backend(redis_server) as lock:
        assert lock.acquire(KEY, "a" * 32, 3, "tests.lock") is Acquired.WON
        assert lock.acquire(KEY, "b" * 32, 3, "tests.lock") is Acquired.LOST
        assert lock.finish(KEY, "a" * 32) == 1  # the live loser, collected
        assert command(redis_server, "get", KEY) == FINISHED_MARKER.encode()
        assert 3_590_000 < command(redis_server, "pttl", KEY) <= 3_600_000
        assert command(redis_server, "exists", claim_key(KEY)) == 0
        assert lock.holder(KEY) is None  # a marker is no token
        assert list(lock.scan_run_keys()) == []
        # Late calls: FINISHED, and always counted (a put-back call too).
        assert lock.acquire(KEY, "c" * 32, 3, "tests.lock") is Acquired.FINISHED
        assert lock.acquire(KEY, "d" * 32, 3, "tests.lock", count=False) is Acquired.FINISHED
        assert command(redis_server, "hgetall", claim_key(KEY)) == {
            b"task": b"tests.lock",
            b"count": b"2",
        }
        # No token ever matches the marker.
        assert not lock.extend(KEY, "a" * 32, 30)
        assert not lock.release(KEY, "a" * 32)
        assert lock.release_counted(KEY, "a" * 32) == 0
        assert lock.finish(KEY, "a" * 32) == 0  # again: the marker stays, the count too
        assert command(redis_server, "get", KEY) == FINISHED_MARKER.encode()
        assert command(redis_server, "hget", claim_key(KEY), "count") == b"2"
        assert lock.errors == 0


def test_redis_lock__finish_after_the_lease_lapsed_still_marks(redis_server):
    with redis_backend(redis_server) as lock:
        assert lock.acquire(KEY, "a" * 32, 0.2, "tests.lock") is Acquired.WON
        wait_for(lambda: command(redis_server, "exists", KEY) == 0, what="the lease to lapse")
        assert lock.finish(KEY, "a" * 32) == 0
        assert command(redis_server, "get", KEY) == FINISHED_MARKER.encode()


def test_redis_lock__finish_leaves_another_holder_alone(redis_server):
    with redis_backend(redis_server) as lock:
        assert lock.acquire(KEY, "a" * 32, 0.2, "tests.lock") is Acquired.WON
        assert lock.acquire(KEY, "x" * 32, 3, "tests.lock") is Acquired.LOST
        wait_for(lambda: command(redis_server, "exists", KEY) == 0, what="the lease to lapse")
        assert lock.acquire(KEY, "b" * 32, 30, "tests.lock") is Acquired.WON  # took over
        assert lock.finish(KEY, "a" * 32) == 0  # not a's record any more
        assert lock.holder(KEY) == "b" * 32
        assert lock.finish(KEY, "b" * 32) == 1  # b's record holds the count
        assert command(redis_server, "get", KEY) == FINISHED_MARKER.encode()


def test_redis_lock__finish_without_marker_deletes_the_lock(redis_server):
    with redis_backend(redis_server, FINISHED_MARKER_SECONDS=0) as lock:
        assert lock.acquire(KEY, "a" * 32, 3, "tests.lock") is Acquired.WON
        assert lock.acquire(KEY, "b" * 32, 3, "tests.lock") is Acquired.LOST
        assert lock.finish(KEY, "a" * 32) == 1
        assert command(redis_server, "exists", KEY, claim_key(KEY)) == 0
        assert lock.acquire(KEY, "c" * 32, 3, "tests.lock") is Acquired.WON


@pytest.mark.parametrize("value", [-1, 604801, "3600", True, None])
def test_redis_lock__bad_finished_marker_seconds_is_refused(redis_server, value):
    with pytest.raises(ImproperlyConfigured, match="FINISHED_MARKER_SECONDS"):  # noqa: SIM117
        with redis_backend(redis_server, FINISHED_MARKER_SECONDS=value):
            pass


def test_guard__late_call_after_the_slot_finished_costs_one_round_trip(
    redis_server, transactional_db
):
    seen: list[str] = []

    def suppressed(sender: str, state: str, **kwargs: object) -> None:
        seen.append(state)

    @once_per_schedule(name="tests.late")
    def body():
        return "ran"

    with redis_backend(redis_server) as lock:
        key = guard_key("tests.late", SLOT)
        assert body.run_for_slot(SLOT) == "ran"
        assert command(redis_server, "get", key) == FINISHED_MARKER.encode()
        duplicate_suppressed.connect(suppressed)
        try:
            before = _calls(redis_server)
            with CaptureQueriesContext(connection) as queries:
                assert body.run_for_slot(SLOT) is None
                assert body.run_for_slot(SLOT) is None
            after = _calls(redis_server)
        finally:
            duplicate_suppressed.disconnect(suppressed)
        assert len(queries) == 0, queries.captured_queries
        made = {name: after[name] - before.get(name, 0) for name in after}
        made = {name: n for name, n in made.items() if n and name not in PROBE_COMMANDS}
        assert made == {"evalsha": 2, "set": 2, "hincrby": 2, "hsetnx": 2, "pexpire": 2}
        assert len(seen) == 2
        assert TaskRun.objects.get().duplicates == 0
        assert cleanup_locks().as_dict()["unrecorded_slots"] == 0  # folded, not abandoned
        assert TaskRun.objects.get().duplicates == 2
        assert command(redis_server, "exists", claim_key(key)) == 0
        assert command(redis_server, "get", key) == FINISHED_MARKER.encode()  # it lapses
        assert cleanup_locks().as_dict()["orphan_keys"] == 0
        assert lock.errors == 0


def test_checks__redis_cluster_client_class_is_e010(redis_server):
    """The lock is a plain redis-py client: a cache built on RedisCluster is refused."""
    options = {"REDIS_CLIENT_CLASS": "redis.cluster.RedisCluster"}
    caches = redis_caches(redis_server, **options)
    taskguard = {"BACKEND": "redis", "REDIS_ALIAS": "redis"}
    with override_settings(CACHES=caches, TASKGUARD=taskguard):
        messages = check_lock_redis()
    assert [message.id for message in messages] == ["taskguard.E010"]
    assert "needs a plain redis.Redis client" in messages[0].msg


@pytest.mark.parametrize(
    ("taskguard", "expected"),
    [
        pytest.param({"KEY_PREFIX": "tg{x}"}, ["taskguard.E010"], id="brace-in-prefix"),
        pytest.param({"FINISHED_MARKER_SECONDS": -1}, [], id="bad-marker-is-E012-only"),
    ],
)
def test_checks__lock_settings_refused_where_the_lock_is_built(redis_server, taskguard, expected):
    config = {"BACKEND": "redis", "REDIS_ALIAS": "redis", **taskguard}
    with override_settings(CACHES=redis_caches(redis_server), TASKGUARD=config):
        assert [message.id for message in check_lock_redis()] == expected


def test_redis_lock__connections_dropped_on_errors_are_reused(redis_server):
    """A pool counts every connection it made: the lock reuses its closed ones, never leaks."""
    options = {"CONNECTION_POOL_KWARGS": {"max_connections": 3}}
    other = run_key("taskguard", "tests.lock.other", SLOT)
    with redis_backend(redis_server, options=options) as lock:
        assert lock.acquire(KEY, "a" * 32, 30) is Acquired.WON
        redis_server.stop()
        for index in range(10):
            lock._probe_at = 0.0  # probe at once instead of in PROBE_SECONDS
            assert lock.acquire(other, f"{index:032d}", 30) is Acquired.BYPASSED
        redis_server.start()
        lock._probe_at = 0.0
        assert lock.acquire(other, "b" * 32, 30) is Acquired.WON
        assert lock.acquire(other, "c" * 32, 30) is Acquired.LOST


@pytest.mark.django_db(transaction=True)
def test_guard__a_flushed_marker_is_put_back_by_the_next_late_call(redis_server):
    # Redis forgot the finished slot (FLUSHALL): the next call wins Redis, finds the row
    # finished (one query), and leaves the marker again, so later ones cost no query.
    with redis_backend(redis_server) as lock:
        job = once_per_schedule(name="tests.remarked")(lambda: "ran")
        assert job.run_for_slot(SLOT) == "ran"
        command(redis_server, "flushall")
        assert job.run_for_slot(SLOT) is None
        assert command(redis_server, "get", lock.key("tests.remarked", SLOT)) == b"=done"
        seen: list[str] = []
        duplicate_suppressed.connect(
            lambda state, **_: seen.append(state), weak=False, dispatch_uid="tests.remarked"
        )
        try:
            with CaptureQueriesContext(connection) as queries:
                assert job.run_for_slot(SLOT) is None
        finally:
            duplicate_suppressed.disconnect(dispatch_uid="tests.remarked")
        assert len(queries) == 0
        assert seen == ["finished"]
