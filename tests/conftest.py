"""Shared fixtures: the test database for child processes, and private Redis servers.

Every Redis the suite talks to is started here on a free port, so a
developer's own Redis (or the machine's shared one) is never touched. A
missing ``redis-server`` binary is a setup error, never a skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import django
import pytest
from django.db import connections

ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``celery_beat`` tests only where django-celery-beat cannot be installed.

    Its releases (2.9) require Django below 6.1; on older Django a missing
    django-celery-beat is a setup error, and those tests fail at import.
    """
    if find_spec("django_celery_beat") or django.VERSION < (6, 1):
        return
    skip = pytest.mark.skip(reason="django-celery-beat 2.9 requires Django < 6.1")
    for item in items:
        if "celery_beat" in item.keywords:
            item.add_marker(skip)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_serving(process: subprocess.Popen[bytes], port: int) -> None:
    """Wait until the redis-server ``process`` answers PING on ``port`` (or fail loudly)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"redis-server on port {port} exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server did not start on port {port}")


class RedisServer:
    """A private ``redis-server`` process that tests may stop, kill, pause and restart."""

    def __init__(self, directory: Path, *extra: str, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise pytest.UsageError(
                "redis-server is not installed; the taskguard tests need a real one "
                "(apt-get install -y redis-server). It is never skipped."
            )
        self.binary = binary
        self.directory = directory
        self.extra = list(extra)  # more redis-server options (e.g. --replicaof)
        self.password = password
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        auth = (
            ["--requirepass", self.password, "--masterauth", self.password] if self.password else []
        )
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
                "--maxmemory-policy",
                "noeviction",
                *auth,
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until_serving(self.process, self.port)
        except BaseException:
            self.kill()  # never leave a server behind a failed start
            raise

    def client(self, db: int = 0):  # type: ignore[no-untyped-def]
        import redis

        return redis.Redis(
            host="127.0.0.1", port=self.port, db=db, password=self.password, socket_timeout=5
        )

    def kill(self) -> None:
        """SIGKILL the server (everything in memory is lost)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        self.kill()
        self.start()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh private Redis for one test."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def child_env(transactional_db: None) -> dict[str, str]:
    """Environment for real child processes that must use this test's database."""
    env = dict(os.environ)
    env["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["TASKGUARD_TEST_DB_NAME"] = str(connections["default"].settings_dict["NAME"])
    env["TASKGUARD_TEST_LEDGER_DB_NAME"] = str(connections["ledger"].settings_dict["NAME"])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def python() -> str:
    return sys.executable


def wait_for(predicate, timeout: float = 30.0, what: str = "condition", every: float = 0.05):  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until it returns a truthy value (returned); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="taskguard-") as directory:
        yield Path(directory)


@pytest.fixture(params=["database", "redis"])
def lock_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Run the test with each lock backend: the database alone, and a private Redis.

    Yields the backend's name. Under "redis", TASKGUARD points at a fresh
    redis-server (with the default lease) for the whole test.
    """
    if request.param == "database":
        yield "database"
        return
    from .redis_support import redis_backend

    server = RedisServer(tmp_path / "lock-redis")
    server.start()
    try:
        with redis_backend(server, LEASE_SECONDS=30):
            yield "redis"
    finally:
        server.stop()


def counted_duplicates(task_name: str | None = None, slot: object = None) -> int:
    """The duplicates of the (one) run, with those the lock Redis still holds folded in.

    A call that loses in Redis is counted on a claim record (one round trip);
    ``cleanup_locks`` folds those into the row. Under the database backend it
    changes nothing.
    """
    from django_taskguard.cleanup import cleanup_locks
    from django_taskguard.models import TaskRun

    cleanup_locks()
    runs = TaskRun.objects.all()
    if task_name is not None:
        runs = runs.filter(task_name=task_name)
    if slot is not None:
        runs = runs.filter(slot=slot)
    return int(runs.get().duplicates)
