"""Child processes of the guarantee tests, and the execution logs they write.

A child is ``python -m tests.support.proc SCENARIO`` (or ``proc_keyed``): it prints one
JSON line when its body starts and one with its outcome, and appends every execution to
an O_APPEND log (``proc.record``), counted outside the ledger.
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path


def python() -> str:
    return sys.executable


class Child:
    """One ``python -m tests.support.proc`` (or ``module``) process."""

    def __init__(self, env: dict[str, str], *args: str, module: str = "tests.support.proc") -> None:
        self.process = subprocess.Popen(
            [python(), "-m", module, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr = ""

    def started(self, timeout: float = 60.0) -> dict[str, object]:
        """Wait for the first line the child prints (the body has started)."""
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)  # readline can hang
        if not ready:
            self.process.kill()
            _, err = self.process.communicate(timeout=10)
            raise AssertionError(f"the child did not start its body in {timeout} s: {err}")
        line = self.process.stdout.readline()
        assert line, f"the child exited early: {self.process.stderr.read()}"  # type: ignore[union-attr]
        return dict(json.loads(line))

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def killed(self) -> None:
        """SIGKILL the child (if it is still alive) and reap it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        _, self.stderr = self.process.communicate(timeout=30)
        assert self.process.returncode == -signal.SIGKILL

    def outcome(self, timeout: float = 120.0) -> dict[str, object]:
        """The child's last line, once it has exited 0 without a heartbeat crash."""
        out, self.stderr = self.process.communicate(timeout=timeout)
        assert self.process.returncode == 0, self.stderr
        assert "heartbeat crashed" not in self.stderr, self.stderr
        return dict(json.loads(out.strip().splitlines()[-1]))


def hold(
    env: dict[str, str],
    log: Path,
    task: str,
    *,
    lease: float,
    seconds: float,
    on_stale: str = "abandon",
    slot: int = 0,
    go: Path | None = None,
) -> Child:
    """A child that claims ``task``'s slot ``slot`` and holds it ``seconds`` (``proc.hold``);
    ``go``: the claim waits for that file (``tests.test_race.release``)."""
    options = {"--task": task, "--log": str(log), "--lease": str(lease), "--seconds": str(seconds),
               "--on-stale": on_stale, "--slot": str(slot)}  # fmt: skip
    if go is not None:
        options["--go"] = str(go)
    return Child(env, "hold", *[part for pair in options.items() for part in pair])


def executions(log: Path) -> list[list[str]]:
    """Every line of an execution log (``proc.record``), split into words; none if no log."""
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def start(env: dict[str, str], out: Path, *args: str) -> subprocess.Popen[bytes]:
    """``python ARGS`` (this interpreter) with its output appended to ``out``: the one way an
    end-to-end test starts a copy, a worker or a consumer."""
    with out.open("ab") as stream:  # the child has its own copy of the descriptor
        return subprocess.Popen([python(), *args], env=env, stdout=stream, stderr=subprocess.STDOUT)


def stop(procs: list[subprocess.Popen[bytes]], signum: int = signal.SIGTERM) -> list[int]:
    """Send ``signum`` to each of ``procs``; their exit codes, each waited for 60 s at most."""
    for proc in procs:
        proc.send_signal(signum)
    return [proc.wait(timeout=60) for proc in procs]


def slots_of(task: str, done: list[tuple[str, str]]) -> list[datetime]:
    """The slots of ``task`` among ``done`` (task name, ISO slot) pairs."""
    return [datetime.fromisoformat(slot) for name, slot in done if name == task]


def window(slots: list[datetime], began: datetime, ended: datetime) -> list[datetime]:
    """The one-second slots from ``began`` (the copies or consumers are up) to just before
    ``ended``; fails unless every second of it is there, once."""
    second = timedelta(seconds=1)
    first = min(slot for slot in slots if slot >= began)
    last = max(slot for slot in slots if slot <= ended - 2 * second)
    kept = sorted(slot for slot in slots if first <= slot <= last)
    expected = int((last - first) / second) + 1
    assert kept == [first + n * second for n in range(expected)], "a slot was not run"
    return kept
