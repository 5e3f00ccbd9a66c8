"""Data schedules fired by real ``run_schedules`` copies: created, edited (arguments, then
interval), disabled, enabled again and deleted while two copies run; run now from this
process; ``--enqueue`` to a django.tasks backend.

Executions are counted outside the ledger: each appends ``TASK|VALUE SLOT PID TIME`` to a
log with O_APPEND (tests/support/data_targets.py ``echo``, tests/support/data_tasks.py).
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest

from django_taskguard import define_schedule, delete_schedule
from django_taskguard.data_schedules import run_now
from django_taskguard.exceptions import BackendUnavailable
from django_taskguard.ledger import schedules as store
from django_taskguard.models import RunState, TaskRun

from .support import data_targets, data_tasks  # noqa: F401  (register the schedules' targets)
from .support.children import executions
from .support.waiting import wait_for
from .test_run_schedules import Copy

pytestmark = [pytest.mark.dialect, pytest.mark.timeout(180)]

ECHO = "tests.support.data_targets.echo"
SECOND = timedelta(seconds=1)
T = TypeVar("T")


def _runs(log: Path) -> list[tuple[str, str, datetime, int]]:
    """``(task, value, slot, pid)`` of every execution, in order."""
    found = []
    for task_value, slot, pid, _at in executions(log):
        task, value = task_value.split("|", 1)
        found.append((task, value, datetime.fromisoformat(slot), int(pid)))
    return found


def _of(log: Path, task: str) -> list[tuple[datetime, str]]:
    return sorted((slot, value) for name, value, slot, _pid in _runs(log) if name == task)


def _off_grid(log: Path, task: str) -> list[tuple[datetime, str]]:
    """``task``'s slots off its schedule's whole-second grid: run now's."""
    return [(slot, value) for slot, value in _of(log, task) if slot.microsecond]


def _every(step: int, first: datetime, last: datetime) -> list[datetime]:
    """The epoch-aligned slots of a ``step``-second interval in ``[first, last]``."""
    start = int(first.timestamp()) + (-int(first.timestamp()) % step)
    if datetime.fromtimestamp(start, first.tzinfo) < first:
        start += step
    slots = []
    moment = start
    while moment <= last.timestamp():
        slots.append(datetime.fromtimestamp(moment, first.tzinfo))
        moment += step
    return slots


def _retry(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``call``, again when SQLite refused its write transaction at once (a read-then-write
    transaction beside the copies' writers gets SQLITE_BUSY without the busy timeout)."""
    for _ in range(20):
        try:
            return call(*args, **kwargs)
        except BackendUnavailable:
            time.sleep(0.2)
    return call(*args, **kwargs)


def _loaded(out: Path) -> bool:
    """Whether the copy writing ``out`` has read its data schedules (its start-up is over)."""
    return out.exists() and b" data schedules" in out.read_bytes()


def _env(child_env: dict[str, str], log: Path, modules: str) -> dict[str, str]:
    return {
        **child_env,
        "TASKGUARD_TEST_SCHEDULE_MODULES": modules,
        "TASKGUARD_TEST_SCHEDULE_LOG": str(log),
    }


@pytest.mark.file_and_server
@pytest.mark.processes
def test_data_run_schedules__two_copies_follow_every_change_without_restart(child_env, scratch):
    log = scratch / "executions.log"
    env = _env(child_env, log, "tests.support.data_targets")
    copies = [Copy(env, scratch / "a.out"), Copy(env, scratch / "b.out")]
    pids = {copy.proc.pid for copy in copies}
    try:
        # Created once both copies run: a copy that starts after a schedule fires only its
        # newest slot, the older ones left to the sweep (docs/schedules.md, "Start-up"), which
        # records them missed only after their five minutes' grace.
        wait_for(
            lambda: _loaded(scratch / "a.out") and _loaded(scratch / "b.out"),
            timeout=120,
            what="both copies' start-up",
        )
        a = _retry(define_schedule, "a", ECHO, every=SECOND, args=["v1"])
        b = _retry(define_schedule, "b", ECHO, every=2 * SECOND, args=["b"])
        name_a, name_b = a.task_name, b.task_name
        wait_for(lambda: len(_of(log, name_a)) >= 3, timeout=60, what="a's first slots")
        a2 = _retry(define_schedule, "a", ECHO, every=SECOND, args=["v2"])  # the arguments
        wait_for(
            lambda: sum(value == "v2" for _, value in _of(log, name_a)) >= 3,
            timeout=30,
            what="a's slots with the new arguments",
        )
        b2 = _retry(define_schedule, "b", ECHO, every=3 * SECOND, args=["b"])  # the interval
        assert a2.changed_at is not None and b2.changed_at is not None
        wait_for(
            lambda: sum(slot > b2.changed_at for slot, _ in _of(log, name_b)) >= 2,
            timeout=30,
            what="b's slots on the new interval",
        )
        off = _retry(define_schedule, "a", ECHO, every=SECOND, args=["v2"], enabled=False)
        # Run now, asked from this process: one copy runs it, this process does not.
        c = _retry(define_schedule, "c", ECHO, every=timedelta(hours=1), args=["now"])
        assert "pending" in _retry(run_now, c, by="tester")
        wait_for(lambda: _off_grid(log, c.task_name), timeout=30, what="the run-now slot")
        on = _retry(define_schedule, "a", ECHO, every=SECOND, args=["v3"], enabled=True)
        assert off.changed_at is not None and on.changed_at is not None
        wait_for(
            lambda: sum(slot > on.changed_at for slot, _ in _of(log, name_a)) >= 3,
            timeout=30,
            what="a's slots after it was enabled again",
        )
        assert _retry(delete_schedule, "b", ECHO)
        tomb = store.get(name_b)
        assert tomb is not None and tomb.changed_at is not None
        wait_for(
            lambda: sum(slot > tomb.changed_at + 3 * SECOND for slot, _ in _of(log, name_a)) >= 3,
            timeout=30,
            what="a few seconds after the deletion",
        )
    finally:
        codes = [copy.stop() for copy in copies]
    assert codes == [0, 0]

    runs = _runs(log)
    counts = Counter((task, slot) for task, _value, slot, _pid in runs)
    assert set(counts.values()) == {1}, [key for key, n in counts.items() if n > 1]
    assert {pid for *_rest, pid in runs} <= pids  # never in this (the caller's) process
    assert len({pid for *_rest, pid in runs}) == 2  # both copies ran some

    done_a = _of(log, name_a)
    slots_a = [slot for slot, _ in done_a]
    assert slots_a[0] >= a.first_seen  # none before it was created
    # Disabled: nothing fired between the disable and the enable.
    assert not [slot for slot in slots_a if off.changed_at < slot <= on.changed_at]
    # None lost: every slot while enabled ran, or was recorded missed (a copy stalled past
    # its grace on a loaded SQLite: said in the ledger, never silently), but for a second's
    # margin at each change.
    last_a = slots_a[-1]
    before = _every(1, a.first_seen + SECOND, off.changed_at - SECOND)
    after = _every(1, on.changed_at + SECOND, last_a)
    missed_a = set(
        TaskRun.objects.filter(task_name=name_a, state=RunState.MISSED).values_list(
            "slot", flat=True
        )
    )
    assert set(before) | set(after) <= set(slots_a) | missed_a
    assert len(missed_a) <= 2, missed_a  # a stall, not a copy that stopped firing
    # Edits of the arguments take effect at the next slot; the versions that fired them.
    assert all(value == "v1" for slot, value in done_a if slot <= a2.changed_at - SECOND)
    assert all(value == "v2" for slot, value in done_a if a2.changed_at < slot <= off.changed_at)
    assert all(value == "v3" for slot, value in done_a if slot > on.changed_at)
    versions = dict(
        TaskRun.objects.filter(task_name=name_a).values_list("slot", "schedule_version")
    )
    assert all(
        versions[slot] == a2.version for slot in slots_a if a2.changed_at < slot <= off.changed_at
    )
    assert all(versions[slot] == on.version for slot in slots_a if slot > on.changed_at)

    slots_b = [slot for slot, _ in _of(log, name_b)]
    # The old interval up to the edit (none lost), the new one after it (none early).
    old = [slot for slot in slots_b if slot <= b2.changed_at]
    new = [slot for slot in slots_b if slot > b2.changed_at]
    assert old == _every(2, b.first_seen, b2.changed_at)[-len(old) :]
    assert set(_every(2, b.first_seen + SECOND, b2.changed_at)) <= set(old)
    assert new and all(int(slot.timestamp()) % 3 == 0 for slot in new)
    assert set(_every(3, b2.changed_at + SECOND, tomb.changed_at - SECOND)) <= set(new)
    assert all(slot <= tomb.changed_at for slot in new)  # deleted: nothing more

    # Once; an hourly slot of c's, when the test went past the hour, is on the grid.
    ((slot_c, value_c),) = _off_grid(log, c.task_name)
    assert value_c == "now"
    manual = TaskRun.objects.get(task_name=c.task_name, slot=slot_c)
    assert (manual.state, manual.schedule_version) == (RunState.SUCCEEDED, c.version)
    assert not TaskRun.objects.filter(task_name=name_a, state=RunState.MISSED).exists()


@pytest.mark.file_and_server
@pytest.mark.processes
def test_data_run_schedules__enqueue_hands_django_tasks_slots_to_the_backend(child_env, scratch):
    log = scratch / "executions.log"
    env = _env(child_env, log, "tests.support.data_tasks")
    copies = [
        Copy(env, scratch / "a.out", "--enqueue"),
        Copy(env, scratch / "b.out", "--enqueue"),
    ]
    try:
        target = "tests.support.data_tasks.tenant_job"
        d = _retry(define_schedule, "d", target, every=SECOND, args=["x"])
        assert d.target_kind == "django_tasks"
        wait_for(lambda: len(_of(log, d.task_name)) >= 5, timeout=60, what="enqueued slots")
        # Run now, asked from this process: recorded pending (never enqueued here, where the
        # Immediate backend would run it), then a copy hands it to the backend.
        m = _retry(define_schedule, "m", target, every=timedelta(hours=1), args=["manual"])
        assert "pending" in _retry(run_now, m, by="tester")
        assert _of(log, m.task_name) == []
        wait_for(lambda: _of(log, m.task_name), timeout=30, what="the run-now slot")
    finally:
        codes = [copy.stop() for copy in copies]
    assert codes == [0, 0]
    done = _of(log, d.task_name)
    slots = [slot for slot, _ in done]
    assert len(slots) == len(set(slots))  # one enqueue per slot across both copies
    assert {value for _, value in done} == {"x"}
    assert slots[0] >= d.first_seen
    rows = TaskRun.objects.filter(task_name=d.task_name, slot__in=slots)
    assert set(rows.values_list("schedule_version", flat=True)) == {1}
    assert set(rows.values_list("state", flat=True)) == {RunState.SUCCEEDED}
    out = (scratch / "a.out").read_text() + (scratch / "b.out").read_text()
    assert "enqueued (django.tasks result" in out
    assert os.getpid() not in {pid for *_rest, pid in _runs(log)}
    # Once (both copies may see it pending: the guard runs it once); an hourly slot that
    # came meanwhile is on the grid, the manual one off it.
    ((manual, value),) = [(slot, v) for slot, v in _of(log, m.task_name) if slot.microsecond]
    assert value == "manual"
    run = TaskRun.objects.get(task_name=m.task_name, slot=manual)
    assert (run.state, run.schedule_version) == (RunState.SUCCEEDED, 1)


def _sleep_past(moment: datetime, margin: timedelta) -> None:
    left = (moment + margin - datetime.now(moment.tzinfo)).total_seconds()
    if left > 0:
        time.sleep(left)


# server: a copy stopped mid-write holds SQLite's lock on the whole database (every write
# here would wait for it); PostgreSQL's and MariaDB's locks are per row.
@pytest.mark.server
@pytest.mark.processes
@pytest.mark.timeout(120)
def test_data_run_schedules__a_copy_stopped_across_changes_runs_only_each_versions_slots(
    child_env, scratch
):
    # One copy, SIGSTOPped while "s" (every 2 s) is disabled and enabled again and "e" goes
    # from every 3 s to every 2 s to every 4 s; SIGCONT: it learns of them all at once. Each
    # slot it runs is one the version in effect at the slot's time had (enabled), with that
    # version's arguments, recorded with that version.
    log = scratch / "executions.log"
    copy = Copy(_env(child_env, log, "tests.support.data_targets"), scratch / "a.out")
    try:
        s1 = _retry(define_schedule, "s", ECHO, every=2 * SECOND, args=["s1"])
        e1 = _retry(define_schedule, "e", ECHO, every=3 * SECOND, args=["e1"])
        wait_for(
            lambda: _of(log, s1.task_name) and _of(log, e1.task_name),
            timeout=60,
            what="the first slots",
        )
        copy.proc.send_signal(signal.SIGSTOP)
        try:
            off = _retry(define_schedule, "s", ECHO, every=2 * SECOND, args=["s1"], enabled=False)
            e2 = _retry(define_schedule, "e", ECHO, every=2 * SECOND, args=["e2"])
            _sleep_past(max(off.changed_at, e2.changed_at), 7 * SECOND)
            on = _retry(define_schedule, "s", ECHO, every=2 * SECOND, args=["s3"], enabled=True)
            e3 = _retry(define_schedule, "e", ECHO, every=4 * SECOND, args=["e3"])
            _sleep_past(max(on.changed_at, e3.changed_at), 3 * SECOND)
        finally:
            copy.proc.send_signal(signal.SIGCONT)
        last = max(on.changed_at, e3.changed_at)
        wait_for(
            lambda: any(slot > last + 4 * SECOND for slot, _ in _of(log, e1.task_name)),
            timeout=30,
            what="slots after the changes",
        )
    finally:
        assert copy.stop() == 0

    versions = dict(
        TaskRun.objects.filter(task_name__in=[s1.task_name, e1.task_name]).values_list(
            "slot", "schedule_version"
        )
    )

    def in_effect(history: list[Any], slot: datetime) -> Any:
        return [row for row in history if row.changed_at < slot][-1]

    ran = 0
    for name, history in ((s1.task_name, [s1, off, on]), (e1.task_name, [e1, e2, e3])):
        done = _of(log, name)
        assert len({slot for slot, _ in done}) == len(done)  # once each
        for slot, value in done:
            if slot <= s1.changed_at:
                continue
            row = in_effect(history, slot)
            assert row.enabled, (name, slot, "a slot of the disabled window ran")
            assert int(slot.timestamp()) % int(row.every.total_seconds()) == 0, (name, slot)
            assert (value, versions.get(slot)) == (row.args[0], row.version), (name, slot)
            ran += slot > e2.changed_at
    # Each version's own slots after the copy went on: the newest ones ran.
    after = [slot for slot, _ in _of(log, e1.task_name) if slot > e3.changed_at + SECOND]
    assert after and set(_every(4, e3.changed_at + 3 * SECOND, after[-1])) <= set(after)
    assert [slot for slot, _ in _of(log, s1.task_name) if slot > on.changed_at + SECOND]
    assert [slot for slot, value in _of(log, e1.task_name) if value == "e2"]  # v2's own time
    assert ran
