"""Celery enqueue de-duplication (``apply_once``) on a real broker, with real workers."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from django_taskguard.locks.keys import enqueue_key
from django_taskguard.models import RunState, TaskRun

from .support.children import python
from .support.redis_server import RedisServer
from .support.redis_support import child_redis_env, command, redis_backend
from .support.waiting import wait_for
from .test_celery_e2e import Cluster, rabbitmq_url  # noqa: F401 (a fixture)

# Enqueue de-duplication is decided in Redis before any row exists; the keyed claim the workers
# make is proven on both databases by test_keyed.py. One pass (PostgreSQL) is enough here.
pytestmark = [pytest.mark.processes, pytest.mark.once]

CHARGE = "tests.support.celery_keyed_tasks.charge"
QUEUE = "celery"  # the Redis broker's default queue: a list of messages


def enqueue_from(env: dict[str, str], log: Path, processes: int, keys: int, ttl: float = 3600):
    """``processes`` real processes ``apply_once`` keys 0..keys-1 at the same moment."""
    start_at = time.time() + 3.0
    argv = [python(), "-m", "tests.support.proc_keyed", "enqueue", "--log", str(log), "--keys",
            str(keys), "--start-at", str(start_at), "--ttl", str(ttl)]  # fmt: skip
    procs = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(processes)
    ]
    found = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        found.append(json.loads(out.strip().splitlines()[-1])["ids"])
    return found


def queued_ids(broker: RedisServer) -> list[str]:
    client = broker.client()
    try:
        return [json.loads(raw)["headers"]["id"] for raw in client.lrange(QUEUE, 0, -1)]
    finally:
        client.close()


def test_apply_once__8_concurrent_calls_publish_one_message_all_return_its_id(
    child_env, scratch, redis_server, tmp_path
):
    lock = RedisServer(tmp_path / "lock")
    lock.start()
    try:
        env = {
            **child_redis_env(child_env, lock),
            "TASKGUARD_TEST_BROKER_URL": redis_server.url,
        }
        found = enqueue_from(env, scratch / "exec.log", processes=8, keys=1)
        ids = {ids["0"] for ids in found}
        assert len(ids) == 1, f"8 calls returned {len(ids)} ids"
        assert queued_ids(redis_server) == list(ids), "not exactly one message was published"
    finally:
        lock.stop()


def rabbit_queued_ids(url: str) -> list[str]:
    """Take every message off the RabbitMQ queue (py-amqp basic_get); their task ids."""
    from kombu import Connection

    found = []
    with Connection(url) as connection:
        channel = connection.default_channel
        while (message := channel.basic_get(QUEUE, no_ack=True)) is not None:
            found.append(str(message.headers["id"]))
    return found


def test_apply_once__8_concurrent_calls_on_rabbitmq_publish_one_message(
    child_env,
    scratch,
    rabbitmq_url,  # noqa: F811 (the fixture imported from test_celery_e2e)
    tmp_path,
):
    lock = RedisServer(tmp_path / "lock")
    lock.start()
    try:
        env = {**child_redis_env(child_env, lock), "TASKGUARD_TEST_BROKER_URL": rabbitmq_url}
        found = enqueue_from(env, scratch / "exec.log", processes=8, keys=1)
        ids = {ids["0"] for ids in found}
        assert len(ids) == 1, f"8 calls returned {len(ids)} ids"
        assert rabbit_queued_ids(rabbitmq_url) == list(ids), "not exactly one message"
    finally:
        lock.stop()


def test_apply_once__real_workers_run_each_key_once_and_free_it(
    child_env, scratch, redis_server, tmp_path
):
    lock = RedisServer(tmp_path / "lock")
    lock.start()
    cluster = Cluster(child_env, scratch, redis_server.url, lock)
    try:
        log = scratch / "exec.log"
        found = enqueue_from(cluster.env, log, processes=8, keys=40)
        for key in map(str, range(40)):
            assert len({ids[key] for ids in found}) == 1, f"key {key}: several messages"
        assert len(queued_ids(redis_server)) == 40
        cluster.worker("w1", concurrency=2)
        cluster.worker("w2", concurrency=2)
        wait_for(
            lambda: (
                TaskRun.objects.filter(task_name=CHARGE, state=RunState.SUCCEEDED).count() == 40
            ),
            120,
            "every key to run",
        )
        runs = Counter(line.split()[1] for line in log.read_text().splitlines())
        assert len(runs) == 40 and set(runs.values()) == {1}, runs.most_common(3)
        # Each record is freed when its task ends: the keys may be sent again.
        with redis_backend(lock) as backend:
            prefix = backend.key_prefix()
        client = lock.client()
        try:
            wait_for(
                lambda: (
                    not any(
                        client.exists(enqueue_key(prefix, CHARGE, f"order:{n}")) for n in range(40)
                    )
                ),
                30,
                "the enqueue records to be freed",
            )
        finally:
            client.close()
    finally:
        cluster.kill_all()
        lock.stop()


def test_apply_once__a_lost_message_blocks_its_key_no_longer_than_ttl(
    transactional_db, scratch, redis_server, tmp_path
):
    from tests.support.celery_app import app
    from tests.support.celery_keyed_tasks import charge

    lock = RedisServer(tmp_path / "lock")
    lock.start()
    app.conf.broker_url = redis_server.url
    ttl = timedelta(seconds=20)  # far above any stall between two calls here
    try:
        with redis_backend(lock) as backend, app.connection_for_write() as connection:

            def send() -> str:
                return str(charge.apply_once((0, str(scratch / "x.log")), ttl=ttl,
                                             connection=connection).id)  # fmt: skip

            first = send()
            record = enqueue_key(backend.key_prefix(), CHARGE, "order:0")
            assert 0 < command(lock, "pttl", record) <= 20_000  # the bound: the record's TTL
            (raw,) = command(redis_server, "lrange", QUEUE, 0, -1)
            assert json.loads(raw)["headers"]["expires"] is not None  # it lapses with it
            command(redis_server, "delete", QUEUE)  # the broker lost the message
            assert send() == first and queued_ids(redis_server) == []  # still blocked
            # The record's TTL runs out (Redis's expiry, brought forward: the bound is above).
            command(lock, "pexpire", record, 1)
            wait_for(lambda: send() != first, 60, "the lost message's key to be free", every=0.1)
            assert len(queued_ids(redis_server)) == 1
    finally:
        lock.stop()


# --- issue 19: what apply_once must not do silently -------------------------------------


@pytest.fixture
def lock_redis(tmp_path) -> Iterator[RedisServer]:
    lock = RedisServer(tmp_path / "lock")
    lock.start()
    try:
        yield lock
    finally:
        lock.stop()


@contextmanager
def publishing(broker: RedisServer, lock: RedisServer) -> Iterator[tuple[Any, str]]:
    """This process sends through ``broker`` with ``lock`` as the lock Redis: (a broker
    connection, the ledger's key prefix there)."""
    from tests.support.celery_app import app

    app.conf.broker_url = broker.url
    with redis_backend(lock) as backend, app.connection_for_write() as connection:
        yield connection, backend.key_prefix()


def test_apply_once__a_caller_chosen_task_id_does_not_defeat_the_de_duplication(
    transactional_db, scratch, redis_server, lock_redis
):
    # Before (item 3): the record held the chosen id, so a second call with the same id
    # read itself back as the holder, believed it had won, and published again.
    from tests.support.celery_keyed_tasks import charge

    log = str(scratch / "x.log")
    with publishing(redis_server, lock_redis) as (connection, _):
        sent = [
            charge.apply_once((0, log), task_id=task_id, connection=connection).id
            for task_id in ("chosen", "chosen", "other")
        ]
    assert sent == ["chosen"] * 3
    assert queued_ids(redis_server) == ["chosen"], "published more than once"


@pytest.mark.parametrize("kind", ["countdown", "eta"])
def test_apply_once__a_delay_beyond_ttl_is_refused_at_the_call(
    transactional_db, scratch, redis_server, lock_redis, kind
):
    # Before (item 2): published with expires=ttl, so the worker discarded it unseen.
    from django.utils import timezone

    from django_taskguard.exceptions import TaskGuardError
    from tests.support.celery_keyed_tasks import charge

    beyond = timedelta(hours=1, seconds=1)  # the default ttl is one hour
    delay = {"countdown": beyond.total_seconds()} if kind == "countdown" else {
        "eta": timezone.now() + beyond}  # fmt: skip
    log = str(scratch / "x.log")
    with publishing(redis_server, lock_redis) as (connection, prefix):
        with pytest.raises(TaskGuardError, match="beyond ttl"):
            charge.apply_once((0, log), connection=connection, **delay)
        assert queued_ids(redis_server) == []
        assert command(lock_redis, "exists", enqueue_key(prefix, CHARGE, "order:0")) == 0
        # Within ttl it is sent.
        charge.apply_once((0, log), countdown=3599, connection=connection)
        assert len(queued_ids(redis_server)) == 1


def test_apply_once__a_message_that_expired_in_the_queue_is_recorded_and_frees_its_key(
    child_env, scratch, redis_server, lock_redis
):
    # Before (item 2): the worker discarded it (expires=ttl): no row, no signal, no log.
    from tests.support.celery_keyed_tasks import plain

    log = str(scratch / "x.log")
    name = "tests.support.celery_keyed_tasks.plain"
    cluster = Cluster(child_env, scratch, redis_server.url, lock_redis)
    try:
        with publishing(redis_server, lock_redis) as (connection, prefix):
            ttl = timedelta(seconds=3)
            first = plain.apply_once((log,), key="p:1", ttl=ttl, connection=connection).id
            record = enqueue_key(prefix, name, "p:1")
            # The worker is down longer than ttl: the record lapses, the message expires.
            wait_for(lambda: command(lock_redis, "exists", record) == 0, 30, "ttl to pass")
            cluster.worker("w1")
            wait_for(
                lambda: TaskRun.objects.filter(task_name=name, state=RunState.SKIPPED).exists(),
                90,
                "the expired message to be recorded",
            )
            run = TaskRun.objects.get(task_name=name)
            assert first in run.error and "expired" in run.error and "p:1" in run.error
            assert not Path(log).exists(), "the expired message ran"
            again = plain.apply_once((log,), key="p:1", ttl=ttl, connection=connection).id
            assert again != first  # the key is free: published anew
    finally:
        cluster.kill_all()


def test_apply_once__a_retry_beyond_the_messages_expiry_is_refused_where_it_is_decided(
    child_env, scratch, redis_server, lock_redis
):
    # Before (review of issue 19): a retry keeps its message's expiry (apply_once's ttl,
    # from the first publish); a retry countdown beyond it was sent, expired in the queue
    # and was recorded "expired ... the workers were down or busy", which was untrue.
    from tests.support.celery_keyed_tasks import once_retry_late

    log = scratch / "x.log"
    name = "tests.support.celery_keyed_tasks.once_retry_late"
    cluster = Cluster(child_env, scratch, redis_server.url, lock_redis)
    try:
        cluster.worker("w1")
        with publishing(redis_server, lock_redis) as (connection, prefix):
            ttl = timedelta(seconds=30)
            once_retry_late.apply_once((str(log), 60), key="l:1", ttl=ttl, connection=connection)
            record = enqueue_key(prefix, name, "l:1")
            wait_for(lambda: command(lock_redis, "exists", record) == 0, 60, "the key freed")
        found = [line.split()[0] for line in log.read_text().splitlines()]
        assert found == ["run", "refused"], found
        assert "comes after its apply_once message expires" in log.read_text()
        assert not TaskRun.objects.filter(task_name=name).exists()
    finally:
        cluster.kill_all()


def test_apply_once__a_refused_autoretry_ends_the_guarded_run_failed(
    child_env, scratch, redis_server, lock_redis
):
    # The guard records how the body ended before Celery's autoretry asks for the retry:
    # it asks OnceTask's rule too, so a retry that will be refused ends the run failed,
    # not retrying for a retry that never comes (which held the key until its deadline).
    from tests.support.celery_keyed_tasks import guarded_retry_late

    log = scratch / "x.log"
    name = "tests.support.celery_keyed_tasks.guarded_retry_late"
    cluster = Cluster(child_env, scratch, redis_server.url, lock_redis)
    try:
        cluster.worker("w1")
        with publishing(redis_server, lock_redis) as (connection, prefix):
            ttl = timedelta(seconds=30)
            guarded_retry_late.apply_once(
                (1, str(log)), key="late:1", ttl=ttl, connection=connection
            )
            record = enqueue_key(prefix, name, "late:1")
            wait_for(lambda: command(lock_redis, "exists", record) == 0, 60, "the key freed")
        run = TaskRun.objects.get(task_name=name)
        assert (run.state, run.attempt) == (RunState.FAILED, 1), (run.state, run.error)
        assert [line.split()[0] for line in log.read_text().splitlines()] == ["run"]
    finally:
        cluster.kill_all()


def test_apply_once__a_retry_that_expired_says_so(child_env, scratch, redis_server, lock_redis):
    # Before (review of issue 19): an expired retry was recorded "the workers were down or
    # busy" (a plain Task has no retry hook to refuse the countdown; it is recorded true).
    from django_taskguard.contrib.celery import apply_once
    from tests.support.celery_keyed_tasks import plain_retry_late

    log = scratch / "x.log"
    name = "tests.support.celery_keyed_tasks.plain_retry_late"
    cluster = Cluster(child_env, scratch, redis_server.url, lock_redis)
    try:
        cluster.worker("w1")
        with publishing(redis_server, lock_redis) as (connection, _):
            # The first message has 10 s to be taken (3 s was too short on a loaded machine:
            # it expired too, "down or busy"); its retry, 20 s later, cannot be in time.
            ttl = timedelta(seconds=10)
            apply_once(plain_retry_late, (str(log), 20), key="e:1", ttl=ttl, connection=connection)
            wait_for(
                lambda: TaskRun.objects.filter(task_name=name, state=RunState.SKIPPED).exists(),
                90,
                "the expired retry to be recorded",
            )
        errors = list(TaskRun.objects.filter(task_name=name).values_list("error", flat=True))
        # Each copy that expired is recorded (the Redis broker may deliver the countdown's
        # message twice when it is held past the visibility timeout).
        assert all("retry 1" in error and "down or busy" not in error for error in errors)
        assert [line.split()[0] for line in log.read_text().splitlines()] == ["run"]
    finally:
        cluster.kill_all()


def test_apply_once__reject_requeue_keeps_the_key_taken_while_the_message_is_requeued(
    child_env, scratch, redis_server, lock_redis
):
    # Before (item 4): task_postrun freed the record on Reject(requeue=True), so while the
    # requeued message ran a second apply_once published, and an unguarded body ran twice.
    from tests.support.celery_keyed_tasks import requeued

    log, gate = scratch / "r.log", scratch / "gate"
    cluster = Cluster(child_env, scratch, redis_server.url, lock_redis)
    try:
        cluster.worker("w1")
        with publishing(redis_server, lock_redis) as (connection, prefix):
            args = (str(log), str(gate))
            first = requeued.apply_once(args, key="r:1", connection=connection).id
            wait_for(lambda: "run" in log.read_text() if log.exists() else False, 90,
                     "the requeued message to run")  # fmt: skip
            again = requeued.apply_once(args, key="r:1", connection=connection).id
            assert again == first, "a second message was published while the first ran"
            gate.touch()
            record = enqueue_key(prefix, "tests.support.celery_keyed_tasks.requeued", "r:1")
            wait_for(lambda: command(lock_redis, "exists", record) == 0, 30, "the key freed")
        assert [line.split()[0] for line in log.read_text().splitlines()] == ["reject", "run"]
    finally:
        cluster.kill_all()


def test_apply_once__an_expiry_is_recorded_on_a_connection_the_server_closed(
    transactional_db, lock_redis
):
    # Before (review of issue 19): the worker's consumer thread wrote the expiry record on
    # its long-lived connection; once the server had closed it (idle timeout, restart),
    # the write failed and the expiry went unrecorded. Now Django's close_old_connections
    # runs first, as at the start of a request.
    import threading

    from celery.app.task import Context
    from django.db import connection, connections

    from django_taskguard.contrib.celery import enqueue
    from django_taskguard.contrib.celery.headers import ENQUEUE_HEADER
    from tests.support.celery_keyed_tasks import plain

    if connection.vendor != "postgresql":
        pytest.skip("ends a server-side session with pg_terminate_backend")
    header = {"key": "c:1", "ttl": 3, "keep": None}
    request = Context(id="gone-1", retries=0, headers={ENQUEUE_HEADER: header})
    pid: list[int] = []
    closed = threading.Event()

    def consumer() -> None:
        try:
            with connections["default"].cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                pid.append(cursor.fetchone()[0])
            closed.wait(60)
            enqueue.revoked(request=request, expired=True, sender=plain)
        finally:
            connections.close_all()

    with redis_backend(lock_redis):
        thread = threading.Thread(target=consumer)
        thread.start()
        wait_for(lambda: bool(pid), 30, "the consumer's connection")
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid[0]])
        closed.set()
        thread.join(60)
    run = TaskRun.objects.get(task_name=plain.name)
    assert run.state == RunState.SKIPPED and "gone-1" in run.error
