"""The demo never leaves processes behind: an instance gives up when no demo starts it, and the
demo stops every instance it spawned when one of them fails to start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management.base import CommandError
from example.management.commands import demo

MANAGE = Path(__file__).resolve().parents[1] / "manage.py"
# A stand-in for an instance that started and waits for the go file (as a real one does).
WAITING = "import time; print('ready', flush=True); time.sleep(600)"
STAND_INS = {
    "dies": "import sys; sys.stderr.write('boom'); sys.exit(3)",
    "hangs": "import time; time.sleep(600)",  # never says ready
}


def test_demo_instance__gives_up_when_the_go_file_never_appears(tmp_path):
    done = subprocess.run(
        [sys.executable, str(MANAGE), "demo_instance", "--name", "instance-1", "--log",
         str(tmp_path / "log"), "--go", str(tmp_path / "never"), "--deadline", "2"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "instance-1: no go file" in done.stderr, done.stderr
    assert "the demo that started this instance is gone" in done.stderr


class Spawner(demo.Command):
    """The demo, its first instance replaced by a stand-in that fails to start."""

    def __init__(self, first: str) -> None:
        super().__init__()
        self.first = first
        self.spawned: list[subprocess.Popen[str]] = []

    def _spawn(self, name: str, log: Path, ticks: int, go: Path) -> subprocess.Popen[str]:
        code = self.first if not self.spawned else WAITING
        process = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.spawned.append(process)
        return process


@pytest.mark.parametrize("first", sorted(STAND_INS))
def test_demo__an_instance_that_fails_to_start_stops_every_instance(first, tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "READY_TIMEOUT", 5.0)
    command = Spawner(STAND_INS[first])
    with pytest.raises(CommandError, match="instance"):
        command._run(tmp_path / "executions.log", 4, 3)
    assert len(command.spawned) == 4
    assert [process.poll() is not None for process in command.spawned] == [True] * 4
