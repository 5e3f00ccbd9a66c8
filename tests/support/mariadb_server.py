"""A private MariaDB server for one test session (``TASKGUARD_TEST_DB=mariadb``).

``tests/settings.py`` starts it in the session's process, in a temporary directory
on a free port, and puts the port in ``TASKGUARD_TEST_MARIADB_PORT`` so that the
child processes the tests start (and settings imported again there) use it instead
of starting their own. It is killed when that process exits (atexit, and the
kernel's parent-death signal should the process be killed outright); a shared
server (the machine's on 3306) is never used. A missing ``mariadbd`` is a setup
error, never a skip.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PORT_VARIABLE = "TASKGUARD_TEST_MARIADB_PORT"
# Fast, not durable: the data lives for one test session.
SERVER_OPTIONS = (
    "--bind-address=127.0.0.1",
    "--skip-name-resolve",
    "--skip-log-bin",
    "--character-set-server=utf8mb4",
    "--collation-server=utf8mb4_unicode_ci",
    # Not UTC: the ledger must read the clock as UTC whatever the session's zone.
    "--default-time-zone=+05:30",
    "--max-connections=500",
    "--innodb-buffer-pool-size=128M",
    "--innodb-log-file-size=48M",
    "--innodb-flush-log-at-trx-commit=0",
    "--innodb-doublewrite=0",
    "--sync-binlog=0",
)


def port() -> int:
    """The private server's port: this session's, started on first use."""
    if PORT_VARIABLE not in os.environ:
        os.environ[PORT_VARIABLE] = str(_start())
    return int(os.environ[PORT_VARIABLE])


def _binary(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
    if found is None:
        raise RuntimeError(
            f"TASKGUARD_TEST_DB=mariadb needs {name} (apt-get install -y mariadb-server); "
            f"the MariaDB tests are never skipped"
        )
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """In the server's process: SIGKILL it when the test session's process dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def _start() -> int:
    install, server = _binary("mariadb-install-db"), _binary("mariadbd")
    directory = Path(tempfile.mkdtemp(prefix="taskguard-mariadb-"))
    data = directory / "data"
    user = ["--user=root"] if os.geteuid() == 0 else []
    base = ["--no-defaults", f"--datadir={data}", *user]
    subprocess.run(
        [install, *base, "--auth-root-authentication-method=normal", "--skip-test-db"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    chosen = _free_port()
    log = directory / "error.log"
    process = subprocess.Popen(
        [server, *base, f"--port={chosen}", f"--socket={directory / 'mysqld.sock'}",
         f"--pid-file={directory / 'mysqld.pid'}", f"--log-error={log}", *SERVER_OPTIONS],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )  # fmt: skip
    atexit.register(_stop, process, directory)
    _wait_until_serving(process, chosen, log)
    _load_time_zones(directory)
    return chosen


def _wait_until_serving(process: subprocess.Popen[bytes], chosen: int, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mariadbd exited with {process.returncode}: {_tail(log)}")
        try:
            with socket.create_connection(("127.0.0.1", chosen), timeout=0.5) as sock:
                if sock.recv(4):  # the server's greeting
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"mariadbd did not start on port {chosen}: {_tail(log)}")


def _load_time_zones(directory: Path) -> None:
    """Django needs the server's time zone tables for date lookups in a named zone
    (the admin's date hierarchy in TIME_ZONE): load them, as a site would."""
    zones = subprocess.run(
        [_binary("mariadb-tzinfo-to-sql"), "/usr/share/zoneinfo"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(
        [_binary("mariadb"), "--no-defaults", "-uroot", f"--socket={directory / 'mysqld.sock'}",
         "mysql"],
        input=zones,
        check=True,
        capture_output=True,
    )  # fmt: skip


def _tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-2000:]
    except OSError:
        return "(no log)"


def _stop(process: subprocess.Popen[bytes], directory: Path) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=30)
    shutil.rmtree(directory, ignore_errors=True)
