"""Redis Sentinel: the lock client finds the master through Sentinel and follows a failover.

Every test runs a private master, its replica and one ``redis-server --sentinel``
(quorum 1, ``down-after-milliseconds 1000``); a failover is a real SIGKILL of
the master and a real promotion by the Sentinel.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from django.test import override_settings
from redis.sentinel import SentinelManagedConnection, SentinelManagedSSLConnection

from django_taskguard import current_run, once_per_schedule
from django_taskguard.checks import check_lock_redis
from django_taskguard.cleanup import cleanup_locks
from django_taskguard.locks import Acquired, run_key
from django_taskguard.locks.redis import RedisLock, build_client, claim_key
from django_taskguard.models import RunState, TaskRun

from .support.redis_server import RedisServer
from .support.redis_support import (
    SentinelSetup,
    checkout,
    guard_key,
    on_db,
    retries_of,
    sentinel_backend,
    unfinished_keys,
)
from .support.slots import BASE_SLOT
from .support.waiting import wait_for

# Barely depends on the database: scripts/test.sh runs it in the PostgreSQL pass only.
pytestmark = [pytest.mark.processes, pytest.mark.once]

SLOT = BASE_SLOT + timedelta(hours=21)
KEY = run_key("taskguard", "tests.sentinel", SLOT)
A, B = "a" * 32, "b" * 32


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[SentinelSetup]:
    setup = SentinelSetup(tmp_path)
    try:
        setup.start()
        yield setup
    finally:
        setup.stop()


def lock_reaches(lock: RedisLock, server: RedisServer, db: int) -> bool:
    """Take and free a probe key through ``lock``; True once it lands on ``server``."""
    probe = guard_key("tests.sentinel.probe", SLOT)
    if lock.acquire(probe, A, 3) is not Acquired.WON:
        return False  # still backing off after an error, or decided on the database
    landed = on_db(server, db, "get", probe) == A.encode()
    assert lock.release(probe, A)
    return landed


@pytest.mark.parametrize("factory_option", [True, False], ids=["cache-option", "global-setting"])
def test_sentinel_lock__acquire_lose_extend_release_on_the_master(sentinel, factory_option):
    master = sentinel.master
    with sentinel_backend(sentinel, factory_option=factory_option) as lock:
        assert lock.acquire(KEY, A, 3, "tests.sentinel") is Acquired.WON
        assert lock.acquire(KEY, B, 3, "tests.sentinel") is Acquired.LOST
        # on the master, in the cache's db, with the cache's password
        assert on_db(master, sentinel.db, "get", KEY) == A.encode()
        assert on_db(master, 0, "dbsize") == 0
        assert lock.holder(KEY) == A  # decoded
        assert not lock.extend(KEY, B, 30)
        assert lock.extend(KEY, A, 30)
        assert 29_000 < on_db(master, sentinel.db, "pttl", KEY) <= 30_000
        assert not lock.release(KEY, B)
        assert on_db(master, sentinel.db, "get", KEY) == A.encode()
        assert lock.take_duplicates(KEY) == 1
        assert lock.release(KEY, A)
        assert on_db(master, sentinel.db, "exists", KEY, claim_key(KEY)) == 0
        assert lock.errors == 0
        assert [message.id for message in check_lock_redis()] == []  # noeviction, reachable


def test_sentinel_lock__strict_timeouts_and_no_retries_everywhere(sentinel):
    with sentinel_backend(sentinel, REDIS_SOCKET_TIMEOUT=0.25) as lock:
        pool = lock.client.connection_pool
        assert pool.service_name == sentinel.service
        assert pool.connection_class is SentinelManagedConnection
        queries = [s.connection_pool for s in pool.sentinel_manager.sentinels]
        assert [q.connection_kwargs["port"] for q in queries] == [sentinel.port]
        for each in [pool, *queries]:  # the master's connections, then the Sentinel queries'
            connection = checkout(each)
            try:
                assert connection.socket_timeout == 0.25
                assert connection.socket_connect_timeout == 0.25
                assert retries_of(connection.retry) == 0
            finally:
                each.release(connection)


def test_sentinel_lock__tls_is_kept(tmp_path, settings):
    """A Sentinel pool that talks TLS to the master gives a lock client that does too."""
    caches = SentinelSetup(tmp_path).caches()  # not started: building connects to nothing
    caches["redis"]["OPTIONS"]["CONNECTION_POOL_KWARGS"] = {"ssl": True}
    settings.CACHES = caches
    client = build_client("redis", 0.5)
    assert client.connection_pool.connection_class is SentinelManagedSSLConnection


@pytest.mark.parametrize("broken", ["no-connection-factory", "no-sentinels"])
def test_checks__sentinel_cache_that_cannot_work_is_e010(tmp_path, broken):
    caches = SentinelSetup(tmp_path).caches(factory_option=broken != "no-connection-factory")
    if broken == "no-sentinels":
        del caches["redis"]["OPTIONS"]["SENTINELS"]
    with override_settings(CACHES=caches, TASKGUARD={"BACKEND": "redis", "REDIS_ALIAS": "redis"}):
        messages = check_lock_redis()
    assert [message.id for message in messages] == ["taskguard.E010"]
    assert "ImproperlyConfigured" in messages[0].msg
    assert "SentinelConnectionFactory" in str(messages[0].hint)


def test_sentinel_failover__lock_client_follows_the_new_master(sentinel, transactional_db):
    ran = []

    @once_per_schedule(name="tests.sentinel.follow")
    def job() -> str:
        ran.append(current_run().slot)
        return "ran"

    later = SLOT + timedelta(minutes=1)
    with sentinel_backend(sentinel) as lock:
        assert job.run_for_slot(SLOT) == "ran"  # on the first master
        new = sentinel.fail_over()  # holding nothing
        assert lock.acquire(KEY, A, 3, "tests.sentinel") is Acquired.WON
        assert on_db(new, sentinel.db, "get", KEY) == A.encode()
        assert lock.release(KEY, A)
        # The first slot's finished marker reached the new master (then this call is
        # counted there, and folded by cleanup_locks) or not (the row decides and counts).
        assert job.run_for_slot(SLOT) is None
        assert job.run_for_slot(later) == "ran"
        assert cleanup_locks().unrecorded_slots == 0
        assert unfinished_keys(new, sentinel.db) == []  # released; finished markers lapse
        assert lock.errors == 0  # the idle connection to the dead master was replaced, not used
    assert ran == [SLOT, later]
    runs = TaskRun.objects.order_by("slot")
    assert [(r.state, r.attempt, r.duplicates) for r in runs] == [
        (RunState.SUCCEEDED, 1, 1),
        (RunState.SUCCEEDED, 1, 0),
    ]


def test_sentinel_failover__calls_before_the_promotion_decide_on_the_database(
    sentinel, transactional_db, caplog
):
    ran = []

    @once_per_schedule(name="tests.sentinel.window")
    def job() -> str:
        ran.append(current_run().slot)
        return "ran"

    with sentinel_backend(sentinel) as lock:
        sentinel.master.kill()
        # The Sentinel still names the dead master: an outage like any other.
        assert job.run_for_slot(SLOT) == "ran"
        assert job.run_for_slot(SLOT) is None
        assert lock.errors > 0
        new = sentinel.promoted()
        assert lock_reaches(lock, new, sentinel.db)  # probed again: the new master answers
        assert job.run_for_slot(SLOT) is None  # the new master is empty; the row decides
    assert ran == [SLOT]
    run = TaskRun.objects.get()
    assert (run.state, run.attempt, run.duplicates) == (RunState.SUCCEEDED, 1, 2)
    logged = [r.getMessage() for r in caplog.records if r.name == "taskguard.locks"]
    assert sum("is unreachable" in m for m in logged) == 1  # once per outage
    assert sum("answers again after" in m for m in logged) == 1


@pytest.mark.parametrize("replicated", [True, False], ids=["key-replicated", "key-lost"])
def test_sentinel_failover__slot_held_across_it_runs_once(sentinel, transactional_db, replicated):
    """A failover while a slot runs: the lock key may or may not reach the new master.

    Replication is asynchronous. ``key-replicated``: the replica had the key
    (``WAIT``), so on the new master a second call loses in Redis and is counted
    on the claim record. ``key-lost``: the replica received the write but had
    not applied it when the master died (it was paused), so the new master has
    no key: a second call wins Redis, finds the row taken, and is counted on
    the row. Either way the row decides (G4): the body runs once.
    """
    runs = []

    @once_per_schedule(name="tests.sentinel.held", lease_seconds=10)
    def job() -> str:
        key = guard_key("tests.sentinel.held", SLOT)
        runs.append("outer")
        token = current_run().token
        if replicated:
            assert on_db(sentinel.master, 0, "wait", 1, 5000) == 1
        new = sentinel.fail_over()
        assert on_db(new, sentinel.db, "get", key) == (token.encode() if replicated else None)
        wait_for(lambda: lock_reaches(lock, new, sentinel.db), timeout=5, what="the new master")
        runs.append(job.run_for_slot(SLOT))  # while this attempt still holds the slot
        row = TaskRun.objects.get()
        if replicated:  # lost in Redis: counted on the claim record, folded at the finish
            assert on_db(new, sentinel.db, "hget", claim_key(key), "count") == b"1"
            assert row.duplicates == 0
        else:  # won the empty Redis, lost on the row: counted on the row
            assert on_db(new, sentinel.db, "exists", key) == 0
            assert row.duplicates == 1
        return "ran"

    with sentinel_backend(sentinel) as lock:
        if not replicated:
            # The replica takes our SET off the wire but applies nothing for 4 s (and
            # drops it when its master link dies): the master dies well before that, on a
            # loaded machine too, so the write is never replicated. (CLIENT UNPAUSE would
            # itself wait for the pause to end; the Sentinel promotes the replica after it.)
            on_db(sentinel.replica, 0, "client_pause", 4000, True)
        assert job.run_for_slot(SLOT) == "ran"
        # The new master was the replica that the key-lost case paused: on a loaded core the
        # Sentinel can flag it down for a moment after the promotion (a PING over 1 s), and
        # a client finds no master then. What follows is about the new master, not that.
        wait_for(
            lambda: sentinel.master_port() == sentinel.replica.port,
            timeout=20,
            what="the new master usable",
        )
        # After the failover, once more: it meets the finished marker on the new master
        # and is counted there (one round trip); cleanup_locks adds it to the row.
        assert job.run_for_slot(SLOT) is None
        assert TaskRun.objects.get().duplicates == 1
        assert cleanup_locks().unrecorded_slots == 0
        assert unfinished_keys(sentinel.replica, sentinel.db) == []  # released on the new master
    assert runs == ["outer", None]
    run = TaskRun.objects.get()
    assert (run.state, run.attempt, run.duplicates) == (RunState.SUCCEEDED, 1, 2)
    assert [t.to_state for t in run.transitions.order_by("id")] == [
        RunState.RUNNING,
        RunState.SUCCEEDED,
    ]
