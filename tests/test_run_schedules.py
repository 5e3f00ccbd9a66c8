"""``run_schedules`` in real processes: copies that all fire every slot, clocks that
disagree, copies killed and restarted under each catch-up policy.

Executions are counted outside the ledger: every run of a body appends ``TASK SLOT PID
TIME`` to a log file with O_APPEND (tests/support/schedule_jobs.py). A child's clock is moved
with ``TASKGUARD_TEST_CLOCK_OFFSET`` (tests/support/scheduler_child.py replaces
``django.utils.timezone.now`` in that process only; the database's clock is not moved).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.utils import timezone as django_timezone

from django_taskguard import once_per_schedule, registry
from django_taskguard.models import RunState, TaskRun, TaskSchedule
from django_taskguard.registry import unregister

from .support.children import executions, python
from .support.waiting import wait_for

pytestmark = pytest.mark.dialect

SECOND = timedelta(seconds=1)


class Copy:
    """One ``run_schedules`` process."""

    def __init__(self, env: dict[str, str], out: Path, *args: str, **extra: str) -> None:
        self.out = out.open("ab")
        self.proc = subprocess.Popen(
            [python(), "-m", "tests.support.scheduler_child", "--sweep-every", "1", *args],
            env={**env, **extra},
            stdout=self.out,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self.out.close()
        return code

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.out.close()


def schedule_env(child_env: dict[str, str], log: Path, prefix: str, **extra: str) -> dict[str, str]:
    return {
        **child_env,
        "TASKGUARD_TEST_SCHEDULE_MODULES": "tests.support.schedule_jobs",
        "TASKGUARD_TEST_SCHEDULE_LOG": str(log),
        "TASKGUARD_TEST_SCHEDULE_PREFIX": prefix,
        **extra,
    }


def slots_run(log: Path) -> list[tuple[str, datetime]]:
    """``(task, slot)`` of every execution, in order (tests/support/schedule_jobs.py)."""
    return [(task, datetime.fromisoformat(slot)) for task, slot, _pid, _at in executions(log)]


def slots_between(first: datetime, last: datetime) -> list[datetime]:
    count = int((last - first) / SECOND)
    return [first + n * SECOND for n in range(count + 1)]


@pytest.mark.file_and_server
@pytest.mark.processes
def test_run_schedules__three_copies_two_clocks_apart_run_each_slot_once(child_env, scratch):
    """Three copies, one 1.5 s ahead and one 1.5 s behind, two one-second schedules."""
    log = scratch / "executions.log"
    env = schedule_env(child_env, log, "tests.three", TASKGUARD_TEST_SCHEDULES="2")
    env["TASKGUARD_TEST_GRACE"] = "5"
    copies = [
        Copy(env, scratch / "a.out"),
        Copy(env, scratch / "b.out", TASKGUARD_TEST_CLOCK_OFFSET="1.5"),
        Copy(env, scratch / "c.out", TASKGUARD_TEST_CLOCK_OFFSET="-1.5"),
    ]
    seconds = float(os.environ.get("TASKGUARD_SCHEDULER_TEST_SECONDS", "30"))
    wait_for(lambda: len(slots_run(log)) >= 2 * seconds, timeout=seconds + 60, what="slots")
    assert [copy.stop() for copy in copies] == [0, 0, 0]

    done = slots_run(log)
    counts = Counter(done)
    assert set(counts.values()) == {1}, f"run twice: {[k for k, v in counts.items() if v > 1]}"
    for task in ("tests.three.0", "tests.three.1"):
        slots = sorted(slot for name, slot in done if name == task)
        assert slots == slots_between(slots[0], slots[-1]), f"{task}: a slot was not run"
        runs = TaskRun.objects.filter(task_name=task, slot__gte=slots[0], slot__lte=slots[-1])
        assert set(runs.values_list("state", flat=True)) == {RunState.SUCCEEDED}
        assert runs.count() == len(slots)
    assert not TaskRun.objects.filter(state=RunState.MISSED).exists()
    # The copies all fired: the losers are counted, not hidden.
    assert sum(TaskRun.objects.values_list("duplicates", flat=True)) > 0


# "latest" on both databases; the other two policies' slot arithmetic is the database's
# only through the same claim, so they run in the PostgreSQL pass only (CI time).
@pytest.mark.processes
@pytest.mark.parametrize(
    "catchup",
    [
        pytest.param("none", marks=pytest.mark.once),
        pytest.param("all", marks=pytest.mark.once),
        "latest",
    ],
)
def test_run_schedules__every_copy_killed_then_one_restarted(child_env, scratch, catchup):
    log = scratch / "executions.log"
    task = f"tests.kill-{catchup}.0"
    env = schedule_env(child_env, log, f"tests.kill-{catchup}", TASKGUARD_TEST_CATCHUP=catchup)
    first = [Copy(env, scratch / "a.out"), Copy(env, scratch / "b.out")]
    wait_for(lambda: len(slots_run(log)) >= 2, timeout=60, what="two slots before the kill")
    for copy in first:
        copy.kill()
    killed_after = max(slot for _, slot in slots_run(log))
    # Nothing fires for a few slots (margin: at least 4 whole seconds).
    time.sleep(5)
    restarted = Copy(env, scratch / "c.out")
    wait_for(
        lambda: max(slot for _, slot in slots_run(log)) > killed_after + 6 * SECOND,
        timeout=60,
        what="slots after the restart",
    )
    if catchup != "all":  # the sweep (every second, grace 2 s) records the gap
        wait_for(
            lambda: TaskRun.objects.filter(task_name=task, state=RunState.MISSED).count() >= 4,
            timeout=30,
            what="missed rows",
        )
    assert restarted.stop() == 0

    done = sorted(slot for name, slot in slots_run(log) if name == task)
    assert len(done) == len(set(done)), "a slot ran twice"
    after = [slot for slot in done if slot > killed_after]
    down = TaskRun.objects.filter(task_name=task, slot__gt=killed_after, slot__lt=after[0])
    rows = {run.slot: run.state for run in TaskRun.objects.filter(task_name=task)}
    if catchup == "all":
        # Every slot of the gap runs once, in order (the log is in execution order).
        assert after == slots_between(after[0], after[-1])
        assert after[0] == killed_after + SECOND
        in_order = [slot for name, slot in slots_run(log) if name == task]
        assert in_order == sorted(in_order)
        assert not [slot for slot, state in rows.items() if state == RunState.MISSED]
    else:
        gap = slots_between(killed_after + SECOND, after[0] - SECOND)
        assert len(gap) >= 4
        assert {run.slot for run in down} == set(gap), "every slot of the gap has a row"
        assert set(down.values_list("state", flat=True)) == {RunState.MISSED}
        # After the restart: the latest slot only, then every slot.
        assert after == slots_between(after[0], after[-1])


@pytest.mark.file_and_server
@pytest.mark.processes
@pytest.mark.parametrize(("stop_timeout", "finishes"), [("20", True), ("1", False)])
def test_run_schedules__sigterm_stops_firing_and_waits_for_running_calls(
    child_env, scratch, stop_timeout, finishes
):
    """A 4 s body is running when SIGTERM comes: it finishes (recorded succeeded) within
    --stop-timeout 20; with --stop-timeout 1 the copy exits non-zero and the run is left
    running, for cleanup_locks to record abandoned when its lease lapses."""
    log = scratch / "executions.log"
    env = schedule_env(
        child_env, log, f"tests.term-{stop_timeout}", TASKGUARD_TEST_BODY_SECONDS="4"
    )
    copy = Copy(env, scratch / "a.out", "--stop-timeout", stop_timeout)
    wait_for(lambda: len(slots_run(log)) >= 2, timeout=60, what="bodies started")
    signalled = datetime.now(timezone.utc)
    code = copy.stop()
    done = slots_run(log)
    assert max(slot for _, slot in done) <= signalled, "a slot was fired after SIGTERM"
    states = set(TaskRun.objects.filter(task_name__startswith=f"tests.term-{stop_timeout}")
                 .values_list("state", flat=True))  # fmt: skip
    if finishes:
        assert code == 0
        assert states == {RunState.SUCCEEDED}
    else:
        assert code != 0
        assert RunState.RUNNING in states
    assert "SIGTERM, no new fires" in (scratch / "a.out").read_text()


@pytest.mark.file_and_server
@pytest.mark.processes
def test_run_schedules__a_fast_copy_runs_no_slot_early_and_takes_none_from_on_time_copies(
    child_env, scratch
):
    """A copy whose clock is 10 s fast (SLOT_TOLERANCE_SECONDS is 5): each slot it finds due
    is ahead of the database's clock, so it is refused and recorded `skipped`, never run
    early; the on-time copy takes those rows over when their slots come and runs each once.

    Before: the fast copy judged slots on its own clock and ran every slot 10 s early."""
    log = scratch / "executions.log"
    task = "tests.fast.0"
    env = schedule_env(child_env, log, "tests.fast", TASKGUARD_TEST_GRACE="5")
    # Rows that were refused at some point (taken over or not).
    refusals = TaskRun.objects.filter(task_name=task, transitions__to_state=RunState.SKIPPED)
    on_time = Copy(env, scratch / "on-time.out")
    try:
        wait_for(lambda: len(slots_run(log)) >= 2, timeout=60, what="the on-time copy firing")
        fast = Copy(env, scratch / "fast.out", TASKGUARD_TEST_CLOCK_OFFSET="10")
        try:
            wait_for(lambda: refusals.count() >= 3, timeout=60, what="the fast copy's refusals")
        finally:
            assert fast.stop() == 0
        refused = set(refusals.values_list("slot", flat=True))
        wait_for(
            lambda: refused <= {slot for _, slot in slots_run(log)},
            timeout=60,
            what="the refused slots run on time",
        )
    finally:
        assert on_time.stop() == 0

    lines = [line.split() for line in log.read_text().splitlines()]
    ran = [(datetime.fromisoformat(slot), float(at)) for _task, slot, _pid, at in lines]
    early = [(slot, at) for slot, at in ran if at < slot.timestamp()]
    assert not early, f"slots run before they were due: {early}"
    assert len({slot for slot, _ in ran}) == len(ran), "a slot ran twice"
    taken = TaskRun.objects.filter(task_name=task, slot__in=refused)
    assert set(taken.values_list("state", flat=True)) == {RunState.SUCCEEDED}
    for run in taken:
        steps = [(t.from_state, t.to_state) for t in run.transitions.order_by("at", "id")]
        assert steps[:2] == [("pending", "skipped"), ("skipped", "running")]
    assert "ahead of the database's clock" in (scratch / "fast.out").read_text()


@pytest.mark.django_db(transaction=True)
def test_run_schedules__the_projects_own_handlers_receive_the_schedulers_records():
    """The command never reconfigures the project's logging: a handler the project put on
    the root logger (at WARNING, Django's default) receives the scheduler's warnings."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    root = logging.getLogger()
    root.addHandler(handler)
    name = "tests.logging.job"

    @once_per_schedule(every=SECOND, name=name, grace=2 * SECOND)
    def job() -> None: ...

    try:
        registry.sync()
        TaskSchedule.objects.filter(task_name=name).update(  # deployed 10 s ago, never fired
            first_seen=django_timezone.now() - 10 * SECOND, swept_until=None
        )
        call_command("run_schedules", "--once", "--task", name, stdout=StringIO())
    finally:
        root.removeHandler(handler)
        unregister(name)
    said = [r.getMessage() for r in records if r.name == "taskguard.scheduler"]
    assert any(message.startswith("missed slots recorded") for message in said), said
    assert logging.getLogger("taskguard.scheduler").propagate
