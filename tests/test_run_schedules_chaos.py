"""``run_schedules`` under chaos, in real processes on PostgreSQL: three copies, 200
one-second schedules with bodies of mixed length, one copy SIGKILLed, one SIGSTOPped past
its lease, the database connections of the third terminated.

Executions are counted outside the ledger (tests/support/schedule_jobs.py appends ``TASK SLOT PID
TIME`` to a file with O_APPEND). ``TASKGUARD_SCHEDULER_CHAOS_SECONDS`` (default 60) is how
long the chaos lasts; the test takes about 20 s more.
"""

from __future__ import annotations

import io
import os
import signal
import time
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from django.db import connection

from django_taskguard.models import RunState, TaskRun
from django_taskguard.owner import Owner

from .support.children import start
from .support.waiting import wait_for
from .test_run_schedules import schedule_env, slots_run
from .test_run_schedules_batch import postgres_only

pytestmark = [pytest.mark.processes, pytest.mark.once]


@postgres_only
@pytest.mark.once
@pytest.mark.timeout(600)
def test_run_schedules__chaos__every_due_slot_once_or_recorded_none_left_running(
    child_env, scratch
):
    """Three copies, 200 one-second schedules with bodies of mixed length, for
    ``TASKGUARD_SCHEDULER_CHAOS_SECONDS`` (60): one copy is SIGKILLed, one SIGSTOPped past
    its lease, and the database connections of the third are terminated. Every due slot
    ran once, or has a row that says truly why not; no slot ran twice; after the leases
    of the dead lapse and ``cleanup_locks`` runs, none is left running."""
    from django.core.management import call_command

    seconds = float(os.environ.get("TASKGUARD_SCHEDULER_CHAOS_SECONDS", "60"))
    lease = 5.0
    log = scratch / "executions.log"
    env = schedule_env(
        child_env, log, "tests.chaos", TASKGUARD_TEST_SCHEDULES="200",
        TASKGUARD_TEST_BODY_MIX=",".join(["1.5"] + ["0.3"] * 3 + ["0.05"] * 6 + ["0"] * 10),
        TASKGUARD_TEST_LEASE=str(lease),
    )  # fmt: skip
    args = ["-m", "tests.support.scheduler_child", "--sweep-every", "1", "--max-workers", "16"]
    killed, stopped, cut = (
        start({**env, "PGAPPNAME": f"{APP}-{name}"}, scratch / f"{name}.out", *args)
        for name in ("killed", "stopped", "cut")
    )
    copies = [killed, stopped, cut]
    try:
        wait_for(lambda: len(slots_run(log)) >= 200, 120, "the copies firing")
        began = datetime.now().astimezone()
        at = time.monotonic()

        def until(fraction: float) -> None:
            time.sleep(max(at + seconds * fraction - time.monotonic(), 0))

        until(0.2)
        killed.kill()
        until(0.35)
        stopped.send_signal(signal.SIGSTOP)
        time.sleep(lease + 4)  # past its lease: the others abandon what it held
        stopped.send_signal(signal.SIGCONT)
        until(0.65)
        assert _terminate_backends(f"{APP}-cut") > 0, "no connection of the copy"
        until(1.0)
        ended = datetime.now().astimezone()
        window = _slots(began + timedelta(seconds=3), ended - timedelta(seconds=5))
        names = [f"tests.chaos.{n}" for n in range(200)]
        # Every slot of the window gets its row (run, or recorded by the sweep).
        wait_for(
            lambda: (
                TaskRun.objects.filter(task_name__in=names, slot__in=window).count()
                == len(names) * len(window)
            ),
            60,
            "a row for every due slot",
            every=1,
        )
        for copy in (stopped, cut):
            copy.send_signal(signal.SIGTERM)
            copy.wait(60)
    finally:
        for copy in copies:
            if copy.poll() is None:
                copy.kill()
                copy.wait(10)
    time.sleep(lease + 2)  # the leases of the SIGKILLed copy's runs lapse
    call_command("cleanup_locks", stdout=io.StringIO())
    _check_chaos(log, names, window, dead={killed.pid, stopped.pid})


# The copies' application name, this run's own: another run of the suite on the same server
# (a version matrix pass) must never have its connections terminated.
APP = f"taskguard-chaos-{os.getpid()}"


def _terminate_backends(application: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = %s",
            [application],
        )
        return int(cursor.fetchone()[0])


def _slots(first: datetime, last: datetime) -> list[datetime]:
    start = first.replace(microsecond=0) + timedelta(seconds=1)
    return [start + timedelta(seconds=n) for n in range(int((last - start).total_seconds()) + 1)]


def _check_chaos(log: Path, names: list[str], window: list[datetime], dead: set[int]) -> None:
    ran: dict[tuple[str, datetime], list[int]] = {}
    for line in log.read_text().splitlines():
        task, slot, pid, _at = line.split()
        ran.setdefault((task, datetime.fromisoformat(slot)), []).append(int(pid))
    twice = {key: pids for key, pids in ran.items() if len(pids) > 1}
    assert not twice, f"run twice: {list(twice.items())[:5]}"
    assert not TaskRun.objects.filter(state=RunState.RUNNING).exists(), "left running"
    wrong = []
    states: Counter[str] = Counter()
    for run in TaskRun.objects.filter(task_name__in=names, slot__in=window):
        pids = ran.get((run.task_name, run.slot), [])
        states[run.state] += 1
        owner = Owner.parse(run.owner)
        owner_pid = owner.pid if owner is not None else None
        if run.state == RunState.SUCCEEDED:
            ok = len(pids) == 1
        elif run.state == RunState.MISSED:  # no copy claimed it in time
            ok = not pids
        elif run.state in (RunState.ABANDONED, RunState.FAILED):
            # Its owner died or was stopped past its lease (its body may have started).
            ok = owner_pid in dead or bool(pids and pids[0] in dead)
        else:
            ok = False
        if not ok:
            wrong.append((run.task_name, run.slot, run.state, run.owner, run.error[:80], pids))
    assert not wrong, f"{len(wrong)} slots recorded wrongly ({dict(states)}): {wrong[:5]}"
    assert states[RunState.SUCCEEDED] > len(names) * len(window) / 2, dict(states)
