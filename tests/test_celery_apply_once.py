"""Celery enqueue de-duplication (``apply_once``) on a real broker, with real workers."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest

from django_taskguard.locks.keys import enqueue_key
from django_taskguard.models import RunState, TaskRun

from .conftest import RedisServer, python, wait_for
from .redis_support import child_redis_env, command, redis_backend
from .test_celery_e2e import Cluster, rabbitmq_url  # noqa: F401 (a fixture)

# Enqueue de-duplication is decided in Redis before any row exists; the keyed claim the workers
# make is proven on both databases by test_keyed.py. One pass (PostgreSQL) is enough here.
pytestmark = pytest.mark.once

CHARGE = "tests.celery_keyed_tasks.charge"
QUEUE = "celery"  # the Redis broker's default queue: a list of messages


def enqueue_from(env: dict[str, str], log: Path, processes: int, keys: int, ttl: float = 3600):
    """``processes`` real processes ``apply_once`` keys 0..keys-1 at the same moment."""
    start_at = time.time() + 3.0
    argv = [python(), "-m", "tests.proc_keyed", "enqueue", "--log", str(log), "--keys",
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
    from tests.celery_app import app
    from tests.celery_keyed_tasks import charge

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
            wait_for(lambda: send() != first, 60, "the lost message's key to be free", every=1.0)
            assert len(queued_ids(redis_server)) == 1
    finally:
        lock.stop()
