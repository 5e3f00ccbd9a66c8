"""Helpers for the Redis backend tests: settings that point taskguard at private servers."""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from django.core.cache import caches
from django.test import override_settings
from redis.sentinel import MasterNotFoundError, Sentinel

from django_taskguard.locks import get_backend
from django_taskguard.locks.redis import RedisLock
from django_taskguard.locks.redis_scripts import FINISHED_MARKER

from .redis_server import RedisServer, free_port, real_clock_env, wait_until_serving
from .waiting import wait_for


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
def redis_backend(
    server: RedisServer, *, options: dict[str, Any] | None = None, **taskguard: Any
) -> Iterator[RedisLock]:
    """Point TASKGUARD at ``server`` (BACKEND redis) for the block; yield the lock.

    ``options``: the django-redis cache's ``OPTIONS``.
    """
    config = {"BACKEND": "redis", "REDIS_ALIAS": "redis", "LEASE_SECONDS": 3, **taskguard}
    with override_settings(CACHES=redis_caches(server, **(options or {})), TASKGUARD=config):
        try:
            lock = get_backend()
            assert isinstance(lock, RedisLock) or config["BACKEND"] != "redis"
            yield lock  # type: ignore[misc]
        finally:
            RedisLock.close_all()
            caches["redis"].close()


class TlsRedisServer(RedisServer):
    """A private ``redis-server`` that speaks TLS only (``--port 0``), with a CA made here.

    ``openssl`` makes a throwaway CA and a server certificate for 127.0.0.1 in
    ``directory``; clients must trust ``ca_file``.
    """

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.ca_file = directory / "ca.crt"

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def _certificates(self) -> list[str]:
        d = self.directory
        d.mkdir(parents=True, exist_ok=True)
        # Python 3.13 verifies strictly (VERIFY_X509_STRICT): a CA with its key usage, and a
        # server certificate naming the key that signed it.
        (d / "san.ext").write_text(
            "subjectAltName=IP:127.0.0.1\nauthorityKeyIdentifier=keyid,issuer\n"
            "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth\n"
        )
        for argv in (
            ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.crt", "-days", "1", "-subj", "/CN=taskguard test CA", "-addext",
             "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign"],
            ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
             "server.csr", "-subj", "/CN=127.0.0.1"],
            ["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "san.ext"],
        ):  # fmt: skip
            subprocess.run(["openssl", *argv], cwd=d, check=True, capture_output=True)
        return ["--tls-cert-file", str(d / "server.crt"), "--tls-key-file",
                str(d / "server.key"), "--tls-ca-cert-file", str(d / "ca.crt"),
                "--tls-auth-clients", "no"]  # fmt: skip

    def start(self) -> None:
        tls = self._certificates()
        self.process = subprocess.Popen(
            [self.binary, "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.directory),
             "--maxmemory-policy", "noeviction", *tls],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=real_clock_env(),
        )  # fmt: skip
        try:
            wait_for(self._answers, timeout=30, what="the TLS redis-server to answer")
        except BaseException:
            self.kill()  # never leave a server behind a failed start
            raise

    def _answers(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"TLS redis-server exited with {self.process.returncode}")
        try:
            return bool(self.client().ping())
        except Exception:
            return False

    def client(self, db: int = 0):  # type: ignore[no-untyped-def]
        import redis

        return redis.Redis(
            host="127.0.0.1", port=self.port, db=db, ssl=True,
            ssl_ca_certs=str(self.ca_file), socket_timeout=5,
        )  # fmt: skip


def guard_key(task_name: str, slot: datetime) -> str:
    """The lock key the guard uses for (task, slot) under the settings in force."""
    return get_backend().key(task_name, slot)


def child_redis_env(env: dict[str, str], server: RedisServer) -> dict[str, str]:
    return {**env, "TASKGUARD_TEST_REDIS_URL": server.url, "TASKGUARD_TEST_BACKEND": "redis"}


def command(server: RedisServer, name: str, *args: Any, **kwargs: Any) -> Any:
    """Run one command on ``server`` through a short-lived client of its own."""
    client = server.client()
    try:
        return getattr(client, name)(*args, **kwargs)
    finally:
        client.close()


class SentinelSetup:
    """A private master, its replica and one Sentinel watching them (quorum 1).

    The service name is unique per setup: django-redis keeps its connection
    pools for the whole process, keyed by ``LOCATION``.
    """

    password = "taskguard-sentinel"
    db = 3  # not 0, so that a lost ``db`` would show

    def __init__(self, directory: Path) -> None:
        fast = ("--repl-diskless-sync-delay", "0")  # the replica syncs at once, not in 5 s
        self.directory = directory
        self.master = RedisServer(directory / "master", *fast, password=self.password)
        self.replica = RedisServer(
            directory / "replica",
            *fast,
            "--replicaof",
            "127.0.0.1",
            str(self.master.port),
            password=self.password,
        )
        self.port = free_port()
        self.service = f"taskguard-{uuid.uuid4().hex[:12]}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.master.start()
        self.replica.start()
        wait_for(self._replica_in_sync, timeout=10, what="the replica's first sync")
        # known-replica: the Sentinel knows the replica at once, not after its first INFO (10 s)
        config = self.directory / "sentinel.conf"
        config.write_text(
            f"port {self.port}\n"
            "bind 127.0.0.1\n"
            f"dir {self.directory}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel auth-pass {self.service} {self.password}\n"
            f"sentinel known-replica {self.service} 127.0.0.1 {self.replica.port}\n"
            f"sentinel down-after-milliseconds {self.service} 1000\n"
            f"sentinel failover-timeout {self.service} 5000\n"
        )
        log = (self.directory / "sentinel.log").open("wb")
        with log:
            self.process = subprocess.Popen(
                [self.master.binary, str(config), "--sentinel"],
                stdout=log,
                stderr=log,
                env=real_clock_env(),
            )
        try:
            wait_until_serving(self.process, self.port)
        except RuntimeError as exc:
            output = (self.directory / "sentinel.log").read_text(errors="replace")
            raise RuntimeError(f"redis-server --sentinel did not start: {exc}\n{output}") from exc
        # The Sentinel flags the master down if a PING of its takes over 1 s (a loaded core):
        # wait until it names the master as usable, as a client would see it.
        wait_for(lambda: self.master_port() == self.master.port, timeout=20, what="a usable master")

    def _replica_in_sync(self) -> bool:
        return bool(command(self.replica, "info", "replication")["master_link_status"] == "up")

    def master_port(self) -> int | None:
        """The master's port as a Sentinel client sees it now (None: no usable master).

        The same question the lock client asks (redis-py's ``discover_master``): a
        master that the Sentinel still flags down does not count, even if
        ``SENTINEL GET-MASTER-ADDR-BY-NAME`` already names the new one.
        """
        sentinels = Sentinel([("127.0.0.1", self.port)], sentinel_kwargs={"socket_timeout": 5})  # type: ignore[no-untyped-call]
        try:
            _, port = sentinels.discover_master(self.service)  # type: ignore[no-untyped-call]
        except MasterNotFoundError:
            return None
        finally:
            for sentinel in sentinels.sentinels:  # (Sentinel.close() is redis-py >= 5)
                sentinel.close()
        return int(port)

    def fail_over(self) -> RedisServer:
        """SIGKILL the master; wait until the Sentinel serves the replica as master; return it."""
        self.master.kill()
        return self.promoted()

    def promoted(self) -> RedisServer:
        """Wait until the Sentinel serves the replica as master (the master is dead); return it."""
        wait_for(
            lambda: self.master_port() == self.replica.port,
            timeout=15,
            what="the Sentinel to promote the replica",
        )
        return self.replica

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.replica.kill()
        self.master.kill()

    def caches(self, *, factory_option: bool = True) -> dict[str, Any]:
        """CACHES with a django-redis alias ``redis`` that finds its master through Sentinel.

        ``factory_option=False`` leaves the connection factory to the global
        ``DJANGO_REDIS_CONNECTION_FACTORY`` setting (the caller sets it).
        """
        options: dict[str, Any] = {
            "CLIENT_CLASS": "django_redis.client.SentinelClient",
            "CONNECTION_FACTORY": "django_redis.pool.SentinelConnectionFactory",
            "SENTINELS": [("127.0.0.1", self.port)],
            "PASSWORD": self.password,
        }
        if not factory_option:
            del options["CONNECTION_FACTORY"]
        return {
            "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
            "redis": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": f"redis://{self.service}/{self.db}",
                "OPTIONS": options,
            },
        }


@contextlib.contextmanager
def sentinel_backend(
    setup: SentinelSetup, *, factory_option: bool = True, **taskguard: Any
) -> Iterator[RedisLock]:
    """Point TASKGUARD at ``setup``'s Sentinel (BACKEND redis) for the block; yield the lock."""
    config = {"BACKEND": "redis", "REDIS_ALIAS": "redis", "LEASE_SECONDS": 3, **taskguard}
    overrides: dict[str, Any] = {"CACHES": setup.caches(factory_option=factory_option)}
    if not factory_option:
        overrides["DJANGO_REDIS_CONNECTION_FACTORY"] = "django_redis.pool.SentinelConnectionFactory"
    with override_settings(TASKGUARD=config, **overrides):
        try:
            lock = get_backend()
            assert isinstance(lock, RedisLock)
            yield lock
        finally:
            RedisLock.close_all()
            caches["redis"].close()


def unfinished_keys(server: RedisServer, db: int = 0) -> list[str]:
    """Keys on ``server``'s database ``db`` but finished-slot markers (which lapse alone)."""
    client = server.client(db=db)
    try:
        marker = FINISHED_MARKER.encode()
        return sorted(
            key.decode()
            for key in client.scan_iter()
            if client.type(key) != b"string" or client.get(key) != marker
        )
    finally:
        client.close()


def on_db(server: RedisServer, db: int, name: str, *args: Any) -> Any:
    """Run one command on ``server``'s database ``db`` through a short-lived client."""
    client = server.client(db=db)
    try:
        return getattr(client, name)(*args)
    finally:
        client.close()


def retries_of(retry: Any) -> int:
    """How many times a redis-py ``Retry`` retries (``get_retries()`` is redis-py >= 5)."""
    getter = getattr(retry, "get_retries", None)
    return int(getter() if getter is not None else retry._retries)


def checkout(pool: Any) -> Any:
    """A connection from a redis-py pool (redis-py < 5 requires a command name)."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("PING")
