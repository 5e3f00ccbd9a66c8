"""Real processes racing for the same slots: every slot runs exactly once."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from pathlib import Path

from django_taskguard.models import RunState, TaskRun

from .conftest import python

PROCESSES = 8
SLOTS = 200


def start_racers(env: dict[str, str], log: Path, task: str, processes: int, slots: int):
    start_at = time.time() + 3.0  # every process imported Django and is waiting by then
    return [
        subprocess.Popen(
            [
                python(),
                "-m",
                "tests.proc",
                "race",
                "--task",
                task,
                "--log",
                str(log),
                "--slots",
                str(slots),
                "--start-at",
                str(start_at),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]


def test_race__8_processes_200_slots_run_each_slot_once(child_env, scratch):
    log = scratch / "executions.log"
    racers = start_racers(child_env, log, "tests.race", PROCESSES, SLOTS)
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

    runs = TaskRun.objects.filter(task_name="tests.race")
    assert runs.count() == SLOTS
    assert set(runs.values_list("state", flat=True)) == {RunState.SUCCEEDED}
    assert sum(runs.values_list("duplicates", flat=True)) == SLOTS * (PROCESSES - 1)
    fences = [int(line.split()[2]) for line in log.read_text().splitlines()]
    assert len(set(fences)) == SLOTS, "a fence was handed out twice"
