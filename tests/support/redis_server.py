"""A private ``redis-server`` process, started on a free port.

A missing ``redis-server`` binary is a setup error, never a skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def real_clock_env() -> dict[str, str]:
    """This environment without libfaketime: under scripts/clock-runs.sh the suite's own
    processes run at a faked date, but redis-server does not start under libfaketime (and
    its clock only times TTLs, which are relative), so it keeps the real one."""
    return {
        key: value
        for key, value in os.environ.items()
        if key != "LD_PRELOAD" and not key.startswith("FAKETIME")
    }


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
            env=real_clock_env(),
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
