"""Real processes racing for the same slots: every slot runs exactly once."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from django_taskguard.models import RunState, TaskRun

from .support.children import python

pytestmark = [pytest.mark.dialect, pytest.mark.processes, pytest.mark.smoke]

PROCESSES = 8
SLOTS = 200


def release(
    children: list[subprocess.Popen[str]],
    go: Path,
    *,
    count: int | None = None,
    timeout: float = 120.0,
) -> float:
    """Start ``children`` together: wait until ``count`` (each child) said it is ready, then
    create ``go``.

    Returns the wall-clock time of the start. A child that exits before it is ready
    fails the test with its stderr (a barrier that nobody reached is no race).
    """
    ready, count = Path(f"{go}.ready"), len(children) if count is None else count
    deadline = time.monotonic() + timeout
    while not ready.exists() or len(ready.read_text().splitlines()) < count:
        for child in children:
            if child.poll() is not None:
                _, err = child.communicate(timeout=10)
                raise AssertionError(f"child {child.pid} exited before the start: {err}")
        assert time.monotonic() < deadline, "the children were not ready in time"
        time.sleep(0.02)
    go.touch()
    return time.time()


def start_racers(
    env: dict[str, str], log: Path, task: str, processes: int, slots: int, *, go: bool = True
) -> list[subprocess.Popen[str]]:
    """Start ``processes`` racers for slots 0..``slots``-1 and release them together.

    ``go=False``: the caller releases them (``release(racers, go_file(log))``).
    """
    argv = [python(), "-m", "tests.support.proc", "race", "--task", task, "--log", str(log),
            "--slots", str(slots), "--go", str(go_file(log))]  # fmt: skip
    racers = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(processes)
    ]
    if go:
        release(racers, go_file(log))
    return racers


def go_file(log: Path) -> Path:
    return log.with_name(f"{log.name}.go")


def assert_raced(outcomes: list[dict[str, float]]) -> None:
    """Every racer was in its loop at one moment: the start barrier held.

    (Who wins which slot is not asserted: on SQLite, whose lock waits back off, one
    process can win every slot of a short race fairly.)
    """
    assert max(o["began"] for o in outcomes) < min(o["ended"] for o in outcomes), outcomes


def winners(log: Path) -> set[int]:
    """The distinct processes that ran a body (the second field of a race log line)."""
    return {int(line.split()[1]) for line in log.read_text().splitlines()}


@pytest.mark.file_and_server
@pytest.mark.processes
def test_race__8_processes_200_slots_run_each_slot_once(child_env, scratch):
    race_each_slot_once(child_env, scratch / "executions.log", "tests.race")


def race_each_slot_once(env: dict[str, str], log: Path, task: str) -> None:
    """8 processes race for 200 slots of ``task``: each slot ran once, the rest counted."""
    racers = start_racers(env, log, task, PROCESSES, SLOTS)
    outcomes = []
    for racer in racers:
        out, err = racer.communicate(timeout=300)
        assert racer.returncode == 0, err
        outcomes.append(json.loads(out.strip().splitlines()[-1]))

    executions = Counter(line.split()[0] for line in log.read_text().splitlines())
    assert len(executions) == SLOTS, "a slot was lost"
    assert set(executions.values()) == {1}, f"duplicate executions: {executions.most_common(3)}"
    assert sum(o["won"] for o in outcomes) == SLOTS
    assert sum(o["lost"] for o in outcomes) == SLOTS * (PROCESSES - 1)

    runs = TaskRun.objects.filter(task_name=task)
    assert runs.count() == SLOTS
    assert set(runs.values_list("state", flat=True)) == {RunState.SUCCEEDED}
    assert sum(runs.values_list("duplicates", flat=True)) == SLOTS * (PROCESSES - 1)
    fences = [int(line.split()[2]) for line in log.read_text().splitlines()]
    assert len(set(fences)) == SLOTS, "a fence was handed out twice"
    assert_raced(outcomes)
