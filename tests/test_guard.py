"""Guarded calls against real processes: takeover, fencing, on_stale, overlap, pauses.

Children run ``python -m tests.support.proc tick`` (see ``tests/support/proc.py``): they log every
execution and every lease-checked tick to an O_APPEND file, which is the
unfenced record of what really ran and when.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection as db_connection
from django.db import transaction
from django.db.models import F
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_taskguard import current_run, once_per_schedule, pauses, registry
from django_taskguard.exceptions import DuplicateRun, LeaseLost, TaskGuardError
from django_taskguard.heartbeat import heartbeats
from django_taskguard.models import RunState, TaskRun, TaskRunTransition
from django_taskguard.owner import new_token
from django_taskguard.process import per_process
from django_taskguard.signals import (
    duplicate_suppressed,
    lease_lost,
    run_abandoned,
    run_failed,
    run_skipped,
    run_started,
    run_succeeded,
)

from .support import ROOT
from .support.children import python
from .support.proc import BASE_SLOT
from .support.runs import PutBack, busy_call, counted_duplicates
from .support.waiting import wait_for
from .test_race import release

pytestmark = pytest.mark.dialect

LEASE = 3.0  # seconds; renewed every LEASE / 3 while the body runs


@dataclass
class Line:
    kind: str
    pid: int
    attempt: int
    fence: int
    at: float


def read_log(log: Path) -> list[Line]:
    if not log.exists():
        return []
    lines = []
    for raw in log.read_text().splitlines():
        kind, pid, attempt, fence, at = raw.split()
        lines.append(Line(kind, int(pid), int(attempt), int(fence), float(at)))
    return lines


class Child:
    """One ``tests.support.proc tick`` process."""

    def __init__(self, env: dict[str, str], log: Path, task: str, **options: Any) -> None:
        argv = [python(), "-m", "tests.support.proc", "tick", "--task", task, "--log", str(log)]
        for name, value in options.items():
            argv += [f"--{name.replace('_', '-')}", str(value)]
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.pid = self.proc.pid

    def started(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait for the body to report that it runs (it holds the slot from then on)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    break
                data = json.loads(line)
                if "started" in data:
                    return data
        _, err = self.proc.communicate(timeout=10)
        raise AssertionError(f"child {self.pid} never started its body: {err}")

    def outcome(self, timeout: float = 120.0) -> dict[str, Any]:
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, err
        return dict(json.loads(out.strip().splitlines()[-1]))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=30)


def wait_stale(run_id: int) -> None:
    """Until the run's lease has expired by the database's clock."""
    wait_for(
        lambda: TaskRun.objects.stale().filter(pk=run_id).exists(),
        timeout=LEASE * 10,
        what=f"run {run_id} to go stale",
    )


def transitions(run_id: int) -> list[tuple[str, str, str]]:
    return list(
        TaskRun.objects.get(pk=run_id)
        .transitions.order_by("id")
        .values_list("from_state", "to_state", "reason")
    )


class Received:
    def __init__(self, sig) -> None:  # type: ignore[no-untyped-def]
        self.calls: list[dict[str, Any]] = []
        self.sig = sig
        sig.connect(self.receive, weak=False)

    def receive(self, sender: Any, **kwargs: Any) -> None:
        self.calls.append({"sender": sender, **kwargs})

    def close(self) -> None:
        self.sig.disconnect(self.receive)


@pytest.fixture
def received():
    opened: list[Received] = []

    def listen(sig) -> Received:  # type: ignore[no-untyped-def]
        opened.append(Received(sig))
        return opened[-1]

    yield listen
    for r in opened:
        r.close()


@pytest.mark.processes
def test_fenced_finish__refused_after_a_paused_owner_is_taken_over(child_env, scratch):
    """SIGSTOP an owner past its lease; a retry takes over; the resumed owner is fenced out."""
    log = scratch / "log"
    task = "tests.guard.takeover"
    a = Child(child_env, log, task, lease=LEASE, seconds=120, on_stale="retry")
    try:
        first = a.started()
        wait_for(lambda: any(x.kind == "tick" for x in read_log(log)), what="a first tick")
        os.kill(a.pid, signal.SIGSTOP)
        try:
            wait_stale(first["started"])
            b = Child(child_env, log, task, lease=LEASE, seconds=1.0, on_stale="retry")
            assert b.outcome() == {"result": "done"}
        finally:
            os.kill(a.pid, signal.SIGCONT)
        late = a.outcome()
    finally:
        a.kill()

    # The resumed owner's own check() told it; its failure was not recorded either.
    assert late["result"] is None and "lost its lease" in late["lease_lost"]
    run = TaskRun.objects.get(pk=first["started"])
    assert (run.state, run.attempt) == (RunState.SUCCEEDED, 2)
    assert run.fence is not None and run.fence > first["fence"]
    assert run.pid == b.pid
    steps = transitions(run.id)
    assert [(f, t) for f, t, _ in steps] == [
        (RunState.PENDING, RunState.RUNNING),
        (RunState.RUNNING, RunState.RETRYING),
        (RunState.RETRYING, RunState.RUNNING),
        (RunState.RUNNING, RunState.SUCCEEDED),
    ], "the late finish of attempt 1 must not be recorded"
    assert "expired" in steps[1][2] and "on_stale=retry" in steps[1][2]
    assert steps[2][2] == "taken over by attempt 2"

    lines = read_log(log)
    a_ticks = [x.at for x in lines if x.pid == a.pid and x.kind == "tick"]
    b_ticks = [x.at for x in lines if x.pid == b.pid and x.kind in ("start", "tick")]
    assert a_ticks and b_ticks
    assert max(a_ticks) < min(b_ticks), "the paused owner acted while the new owner was live"
    kinds_a = {x.kind for x in lines if x.pid == a.pid}
    assert "leaselost" in kinds_a and "end" not in kinds_a
    assert "signal" in kinds_a, "lease_lost was not sent in the fenced-out process"
    assert [x.attempt for x in lines if x.kind == "start"] == [1, 2]


@pytest.mark.processes
def test_on_stale__abandon_records_abandoned_after_a_sigkill_and_never_reruns(
    child_env, scratch, received
):
    log = scratch / "log"
    task = "tests.guard.abandon"
    a = Child(child_env, log, task, lease=LEASE, seconds=120, on_stale="abandon")
    first = a.started()
    a.kill()
    calls: list[int] = []

    @once_per_schedule(name=task, on_stale="abandon", lease_seconds=LEASE)
    def body() -> int:
        calls.append(1)
        return 1

    abandoned = received(run_abandoned)
    suppressed = received(duplicate_suppressed)
    # Still within the dead owner's lease: a plain duplicate, no verdict yet.
    assert body.run_for_slot(BASE_SLOT) is None
    run = TaskRun.objects.get(pk=first["started"])
    assert (run.state, run.duplicates) == (RunState.RUNNING, 1)

    wait_stale(run.id)
    assert body.run_for_slot(BASE_SLOT) is None
    run.refresh_from_db()
    assert (run.state, run.attempt, run.duplicates) == (RunState.ABANDONED, 1, 2)
    last = transitions(run.id)[-1]
    assert last[:2] == (RunState.RUNNING, RunState.ABANDONED)
    assert "expired" in last[2] and "on_stale=abandon" in last[2]
    assert [(c["sender"], c["run_id"], c["slot"]) for c in abandoned.calls] == [
        (task, run.id, BASE_SLOT)
    ]
    assert abandoned.calls[0]["reason"] == last[2]

    assert body.run_for_slot(BASE_SLOT) is None
    run.refresh_from_db()
    assert (run.state, run.duplicates) == (RunState.ABANDONED, 3)
    assert len(transitions(run.id)) == 2
    assert calls == [], "an abandoned slot must not run again"
    assert [c["state"] for c in suppressed.calls] == [
        RunState.RUNNING,
        RunState.ABANDONED,
        RunState.ABANDONED,
    ]
    assert [x.kind for x in read_log(log)] == ["start"] + ["tick"] * (len(read_log(log)) - 1)


@pytest.mark.processes
def test_on_stale__retry_after_a_sigkill_takes_over_exactly_once(child_env, scratch):
    """Three processes race for a dead owner's slot: one takeover, attempt 2, one more run."""
    log = scratch / "log"
    task = "tests.guard.retry"
    a = Child(child_env, log, task, lease=LEASE, seconds=120, on_stale="retry")
    first = a.started()
    a.kill()
    wait_stale(first["started"])
    go = scratch / "go"
    racers = [
        Child(child_env, log, task, lease=LEASE, seconds=0.5, on_stale="retry", go=go)
        for _ in range(3)
    ]
    release([r.proc for r in racers], go)
    outcomes = [r.outcome() for r in racers]

    assert sorted(str(o["result"]) for o in outcomes) == ["None", "None", "done"]
    starts = [x for x in read_log(log) if x.kind == "start"]
    assert (starts[0].pid, starts[0].attempt) == (a.pid, 1)
    assert len(starts) == 2, "the body must run exactly once more"
    winner = starts[1]
    assert winner.attempt == 2 and winner.fence > first["fence"]
    run = TaskRun.objects.get(pk=first["started"])
    assert (run.state, run.attempt, run.fence, run.duplicates) == (
        RunState.SUCCEEDED,
        2,
        winner.fence,
        2,
    )
    reasons = [r for _, _, r in transitions(run.id)]
    assert reasons.count("taken over by attempt 2") == 1
    assert len(reasons) == 4


@pytest.mark.processes
def test_lease__short_pause_well_under_the_lease_is_not_a_loss(child_env, scratch):
    log = scratch / "log"
    # A 6 s lease renewed every 2 s: a 0.5 s pause leaves 3.5 s to spare, under load too.
    child = Child(child_env, log, "tests.guard.pause", lease=6.0, seconds=3.0)
    try:
        info = child.started()
        time.sleep(0.3)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.5)
        os.kill(child.pid, signal.SIGCONT)
        assert child.outcome() == {"result": "done"}
    finally:
        child.kill()
    kinds = [x.kind for x in read_log(log)]
    assert "leaselost" not in kinds and "signal" not in kinds and kinds[-1] == "end"
    run = TaskRun.objects.get(pk=info["started"])
    assert (run.state, run.attempt) == (RunState.SUCCEEDED, 1)


@pytest.mark.processes
def test_overlap__skip_records_skipped_while_an_earlier_slot_runs_elsewhere(
    child_env, scratch, received
):
    log = scratch / "log"
    task = "tests.guard.overlap"
    holder = Child(child_env, log, task, lease=LEASE, seconds=120)
    calls: list[str] = []
    try:
        holder.started()

        @once_per_schedule(name=task, overlap="skip")
        def skipping() -> str:
            calls.append("skip-policy")
            return "ran"

        @once_per_schedule(name=task, overlap="allow")
        def allowing() -> str:
            calls.append("allow-policy")
            return "ran"

        skipped = received(run_skipped)
        later = BASE_SLOT + timedelta(minutes=1)
        assert skipping.run_for_slot(later) is None
        assert allowing.run_for_slot(BASE_SLOT + timedelta(minutes=2)) == "ran"
    finally:
        holder.kill()

    assert calls == ["allow-policy"]
    run = TaskRun.objects.get(task_name=task, slot=later)
    assert run.state == RunState.SKIPPED and run.finished_at is not None
    last = transitions(run.id)[-1]
    assert last[:2] == (RunState.RUNNING, RunState.SKIPPED)
    assert last[2].startswith("overlap:") and BASE_SLOT.isoformat() in last[2]
    assert run.error == last[2]  # the reason where the admin shows it
    assert [(c["sender"], c["slot"], c["reason"]) for c in skipped.calls] == [
        (task, later, last[2])
    ]


# --- in-process: the call path, signals, errors --------------------------------------

SLOT = BASE_SLOT + timedelta(days=1)
# A claim as sent: the upsert (SQLite, MariaDB), or its function's call (PostgreSQL).
UPSERT = r"ON CONFLICT|ON DUPLICATE KEY|^SELECT \* FROM taskguard_claim_v1\("


def kwargs_of(calls: list[dict[str, Any]]) -> list[set[str]]:
    return [set(c) - {"signal"} for c in calls]


@pytest.mark.django_db(transaction=True)
def test_current_run__outside_a_guarded_call_raises():
    with pytest.raises(TaskGuardError, match="only available inside a guarded function"):
        current_run()


@pytest.mark.django_db(transaction=True)
def test_current_run__inside_gives_the_attempt_and_its_row(lock_backend):
    seen: list[tuple[Any, ...]] = []

    @once_per_schedule(name="tests.guard.current")
    def body() -> None:
        run = current_run()
        run.check()
        seen.append((run.task_name, run.slot, run.attempt, run.fence, run.run.state))

    body.run_for_slot(SLOT)
    row = TaskRun.objects.get()
    assert seen == [("tests.guard.current", SLOT, 1, row.fence, RunState.RUNNING)]
    with pytest.raises(TaskGuardError):
        current_run()


def _lock_row(run_id: int, held: threading.Event, release: threading.Event) -> None:
    """Another connection holds the run's row (PostgreSQL) / the write lock (SQLite)."""
    try:
        with transaction.atomic():
            TaskRun.objects.filter(pk=run_id).update(duplicates=F("duplicates"))
            held.set()
            release.wait(60)
    finally:
        db_connection.close()


@pytest.mark.django_db(transaction=True)
def test_check__raises_lease_lost_after_the_deadline_and_stays_lost(received, lock_backend):
    """The heartbeat is stalled by a real lock; past the lease, check() raises, once and for all."""
    lost = received(lease_lost)
    outcome: dict[str, Any] = {}

    @once_per_schedule(name="tests.guard.stall", lease_seconds=2)
    def body() -> str:
        run = current_run()
        held, release = threading.Event(), threading.Event()
        blocker = threading.Thread(target=_lock_row, args=(run.id, held, release))
        blocker.start()
        try:
            assert held.wait(10)
            run.check()  # still within the lease
            time.sleep(2.5)
            with pytest.raises(LeaseLost, match="not renewed before its deadline"):
                run.check()
            stalled = TaskRun.objects.get(pk=run.id).lease_until
        finally:
            release.set()
            blocker.join(30)
        # The stalled renewal gave up at its own timeout (well inside the 2.5 s), and a
        # lost attempt is renewed no more: the row's lease never moved, the loss sticks.
        assert TaskRun.objects.get(pk=run.id).lease_until == stalled
        outcome["sticky"] = not run.lease_valid()
        with pytest.raises(LeaseLost):
            run.check()
        return "finished"

    assert body.run_for_slot(SLOT) == "finished"
    assert outcome["sticky"]
    assert len(lost.calls) == 1 and kwargs_of(lost.calls) == [{"sender", "run"}]
    assert lost.calls[0]["sender"] == "tests.guard.stall"
    run = TaskRun.objects.get()
    assert lost.calls[0]["run"].id == run.id
    # Nobody took over, so the late finish is recorded, and says it was late.
    assert run.state == RunState.SUCCEEDED
    assert "after its lease had expired" in transitions(run.id)[-1][2]


@pytest.mark.django_db(transaction=True)
def test_signals__started_succeeded_and_duplicate_with_documented_kwargs(received, lock_backend):
    started, succeeded = received(run_started), received(run_succeeded)
    duplicate = received(duplicate_suppressed)

    @once_per_schedule(name="tests.guard.signals")
    def body(x: int) -> int:
        return x * 2

    assert body.run_for_slot(SLOT, 21) == 42
    assert body.run_for_slot(SLOT, 21) is None
    assert kwargs_of(started.calls) == [{"sender", "run"}]
    assert kwargs_of(succeeded.calls) == [{"sender", "run", "result"}]
    assert succeeded.calls[0]["result"] == 42
    assert started.calls[0]["run"].slot == SLOT
    assert kwargs_of(duplicate.calls) == [{"sender", "slot", "state"}]
    assert duplicate.calls[0]["sender"] == "tests.guard.signals"
    # The row's state; with Redis the finished-slot marker decides without reading it.
    expected = "finished" if lock_backend == "redis" else RunState.SUCCEEDED
    assert duplicate.calls[0]["state"] == expected
    assert counted_duplicates() == 1


@pytest.mark.django_db(transaction=True)
def test_body_exception__recorded_failed_with_the_error_and_propagates(received, lock_backend):
    failed = received(run_failed)

    @once_per_schedule(name="tests.guard.fails")
    def body() -> None:
        raise ValueError("disk full")

    with pytest.raises(ValueError, match="disk full"):
        body.run_for_slot(SLOT)
    run = TaskRun.objects.get()
    assert run.state == RunState.FAILED and run.finished_at is not None
    assert run.error == "ValueError: disk full"
    assert transitions(run.id)[-1] == (RunState.RUNNING, RunState.FAILED, "ValueError: disk full")
    assert kwargs_of(failed.calls) == [{"sender", "run", "exception", "state"}]
    assert isinstance(failed.calls[0]["exception"], ValueError)
    assert failed.calls[0]["state"] == RunState.FAILED
    assert body.run_for_slot(SLOT) is None, "a failed slot is not run again"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_body_interrupted__recorded_abandoned_sends_run_abandoned_not_run_failed(
    received, interrupt, lock_backend
):
    failed, abandoned = received(run_failed), received(run_abandoned)

    @once_per_schedule(name="tests.guard.interrupted")
    def body() -> None:
        raise interrupt()

    with pytest.raises(interrupt):
        body.run_for_slot(SLOT)
    run = TaskRun.objects.get()
    reason = f"interrupted ({interrupt.__name__})"
    assert run.state == RunState.ABANDONED and run.finished_at is not None
    assert transitions(run.id)[-1] == (RunState.RUNNING, RunState.ABANDONED, reason)
    assert failed.calls == []
    assert kwargs_of(abandoned.calls) == [{"sender", "run_id", "slot", "reason"}]
    assert abandoned.calls[0]["run_id"] == run.id
    assert abandoned.calls[0]["reason"] == reason
    assert body.run_for_slot(SLOT) is None, "an abandoned slot is not run again (on_stale=abandon)"


@pytest.mark.django_db(transaction=True)
def test_body_interrupted__the_interrupt_survives_a_failing_receiver(caplog, lock_backend):
    def broken(**kwargs: Any) -> None:
        raise RuntimeError("receiver bug")

    @once_per_schedule(name="tests.guard.interrupted_receiver")
    def body() -> None:
        raise SystemExit(3)

    run_abandoned.connect(broken)
    try:
        with pytest.raises(SystemExit) as info:
            body.run_for_slot(SLOT)
    finally:
        run_abandoned.disconnect(broken)
    assert info.value.code == 3, "a SystemExit, not the receiver's RuntimeError"
    assert TaskRun.objects.get().state == RunState.ABANDONED
    assert "could not record that run" in caplog.text


def alone_elsewhere(request: pytest.FixtureRequest) -> bool:
    """Run this test again in a pytest process of its own and check that it passed there;
    True when it did (the caller returns). A fork in C copies one thread of a process
    whose other threads (xdist's, a heartbeat's) may be waiting for the GIL at that moment:
    the child then waits forever to hand the GIL to a thread it does not have. In a
    process of its own the test's thread is the only one."""
    if os.environ.get("TASKGUARD_TEST_ALONE") == request.node.nodeid:
        return False
    env = {**os.environ, "TASKGUARD_TEST_ALONE": request.node.nodeid}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr
    return True


@pytest.mark.processes
def test_new_token__unique_in_children_forked_without_python_hooks(request):
    """uWSGI forks its workers in C: Python's at-fork hooks never run there."""
    if alone_elsewhere(request):
        return
    libc_fork = ctypes.PyDLL(None).fork  # PyDLL: the GIL stays held across the fork
    parent = new_token()
    tokens = [parent, new_token()]
    for _ in range(2):
        read, write = os.pipe()
        pid = libc_fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            try:
                os.write(write, f"{new_token()} {new_token()}".encode())
            finally:
                os._exit(0)
        os.close(write)
        tokens += os.read(read, 100).decode().split()
        os.close(read)
        os.waitpid(pid, 0)
    assert len(set(tokens)) == len(tokens) == 6
    assert len({token[:16] for token in tokens}) == 3, "each process draws its own random part"


@pytest.mark.processes
def test_per_process__a_child_forked_without_python_hooks_makes_its_own_value(request):
    """Every fork-safe value of the package (the token prefix, the pid space, the lock
    backend, the Redis lock's sockets, the heartbeats, the coroutine pool) is one of these."""
    if alone_elsewhere(request):
        return
    made: list[int] = []

    def make() -> list[int]:
        made.append(os.getpid())
        return [os.getpid()]

    value = per_process(make)
    mine = value.get()
    assert value.get() is mine and made == [os.getpid()]
    parent_heartbeats = heartbeats._mine.get()
    libc_fork = ctypes.PyDLL(None).fork  # PyDLL: the GIL stays held across the fork
    read, write = os.pipe()
    pid = libc_fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            theirs = value.get()
            fresh = theirs is not mine and theirs == [os.getpid()] and value.get() is theirs
            own = value.mine() is theirs and heartbeats._mine.get() is not parent_heartbeats
            os.write(write, b"1" if fresh and own and made[-1] == os.getpid() else b"0")
        finally:
            os._exit(0)
    os.close(write)
    reported = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert reported == b"1"
    assert value.get() is mine and made == [os.getpid()], "the parent keeps its own"


@pytest.mark.django_db(transaction=True)
def test_on_duplicate__raise_raises_duplicate_run(lock_backend):
    @once_per_schedule(name="tests.guard.raise", on_duplicate="raise")
    def body() -> str:
        return "ok"

    assert body.run_for_slot(SLOT) == "ok"
    with pytest.raises(DuplicateRun) as info:
        body.run_for_slot(SLOT)
    assert (info.value.task_name, info.value.slot, info.value.state) == (
        "tests.guard.raise",
        SLOT,
        "finished" if lock_backend == "redis" else RunState.SUCCEEDED,
    )
    assert counted_duplicates() == 1


@pytest.mark.django_db(transaction=True)
def test_on_busy__a_put_back_call_is_no_duplicate_until_it_finds_the_slot_ended(lock_backend):
    hints: list[float] = []

    @once_per_schedule(name="tests.guard.busy", lease_seconds=LEASE)
    def body() -> str:
        with pytest.raises(PutBack):
            busy_call("tests.guard.busy", hints, slot=SLOT, lease=LEASE)
        with pytest.raises(TaskGuardError, match="must raise"):
            busy_call("tests.guard.busy", hints, raises=False, slot=SLOT, lease=LEASE)
        assert TaskRun.objects.get().duplicates == 0
        return "ok"

    assert body.run_for_slot(SLOT) == "ok"
    assert len(hints) == 2 and all(0 < hint <= LEASE for hint in hints)
    assert (
        busy_call("tests.guard.busy", hints, slot=SLOT, lease=LEASE) is None
    )  # the slot ended: a duplicate
    assert len(hints) == 2
    run = TaskRun.objects.get()
    assert (run.state, run.attempt, counted_duplicates()) == (RunState.SUCCEEDED, 1, 1)


@pytest.mark.django_db(transaction=True)
def test_claim__inside_transaction_atomic_is_an_error_and_writes_nothing(lock_backend):
    calls: list[int] = []

    @once_per_schedule(name="tests.guard.atomic")
    def body() -> None:
        calls.append(1)

    with transaction.atomic(), pytest.raises(TaskGuardError, match="open transaction"):
        body.run_for_slot(SLOT)
    assert calls == []
    assert not TaskRun.objects.exists()
    assert not TaskRunTransition.objects.exists()


@pytest.mark.processes
def test_database_down__backend_unavailable_and_the_body_does_not_run(child_env, scratch):
    """DATABASE_ALIAS points at a PostgreSQL port nothing listens on: fail closed.

    Run in a real child process: pytest-django forbids connections to the
    "down" alias (not a test database) from inside a test.
    """
    log = scratch / "log"
    done = subprocess.run(
        [
            python(),
            "-m",
            "tests.support.proc",
            "down",
            "--task",
            "tests.guard.down",
            "--log",
            str(log),
        ],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    for label in ("run_for_slot", "call"):
        assert outcome[label]["error"] == "BackendUnavailable", outcome
        assert "'tests.guard.down' did not run" in outcome[label]["message"]
        assert "unreachable" in outcome[label]["message"]
    assert not log.exists(), "the body ran although the database was down"
    assert not TaskRun.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_duplicate_call__is_one_database_statement(lock_backend):
    """A call that finds its slot taken costs one statement: the upsert (none on Redis).

    PostgreSQL: exactly one query (the claim's function, whose ``INSERT .. ON CONFLICT DO
    UPDATE .. RETURNING`` is a data-modifying CTE, in autocommit): one round trip.
    SQLite: the same single upsert statement inside the short transaction
    that ``ledger.claim`` opens, after it moves the fence counter on (SQLite has
    no sequence; its one writer at a time makes the counter safe), so Django
    captures four entries: ``BEGIN``, the counter's ``UPDATE``, the upsert,
    ``COMMIT`` (SQLite is in-process, so these are library calls, not network
    round trips). MariaDB: one compound statement (``BEGIN NOT ATOMIC``) that runs the
    upsert (``ON DUPLICATE KEY UPDATE``) in a transaction of its own and returns the row:
    one round trip. Nothing else on any: no read-back, no transition row.
    """

    @once_per_schedule(name="tests.guard.cost")
    def body() -> str:
        return "ran"

    assert body.run_for_slot(SLOT) == "ran"
    with CaptureQueriesContext(db_connection) as queries:
        assert body.run_for_slot(SLOT) is None
    statements = [q["sql"] for q in queries.captured_queries]
    upserts = [s for s in statements if re.search(UPSERT, s)]
    if lock_backend == "redis":
        # It met the finished-slot marker: one Redis round trip, no database query;
        # the count waits on a claim record until it is folded into the row.
        assert statements == []
        assert counted_duplicates() == 1
        return
    if db_connection.vendor == "postgresql":
        assert len(statements) == 1
        assert statements[0].startswith("SELECT * FROM taskguard_claim_v1(")
    elif db_connection.vendor == "mysql":
        assert len(statements) == 1
        assert statements[0].startswith("BEGIN NOT ATOMIC")
    else:
        assert [statements[0], statements[3]] == ["BEGIN", "COMMIT"]
        assert statements[1].startswith("UPDATE taskguard_ledger SET fence = fence + 1")
        assert len(statements) == 4
    assert len(upserts) == 1 and upserts[0] in statements
    assert TaskRun.objects.get().duplicates == 1


@pytest.mark.django_db(transaction=True)
def test_run_started__a_raising_receiver_gives_the_slot_back(lock_backend):
    """The function never started: the slot is given back (recorded why), not burnt.

    Regressions: the row stayed 'running' until its lease lapsed; then it was recorded
    'failed', and the slot never ran although nothing had."""
    calls: list[int] = []

    def refuse(sender: str, **kwargs: Any) -> None:
        if sender == "tests.guard.receiver":
            raise RuntimeError("receiver says no")

    @once_per_schedule(name="tests.guard.receiver")
    def body() -> None:
        calls.append(1)

    run_started.connect(refuse)
    try:
        with pytest.raises(RuntimeError, match="receiver says no"):
            body.run_for_slot(SLOT)
    finally:
        run_started.disconnect(refuse)
    assert calls == []
    run = TaskRun.objects.get()
    assert (run.state, run.attempt, run.owner) == (RunState.PENDING, 0, "")
    last = run.transitions.order_by("id").last()
    assert last is not None and (last.from_state, last.to_state) == ("running", "pending")
    assert "RuntimeError: receiver says no" in last.reason and "given back" in last.reason
    assert body.run_for_slot(SLOT) is None and calls == [1]  # the next call takes the slot
    run = TaskRun.objects.get()
    assert (run.state, run.attempt, run.duplicates) == (RunState.SUCCEEDED, 1, 0)


@pytest.mark.django_db(transaction=True, databases=["default", "mirror"])
def test_database_alias__current_run_row_is_read_through_it():
    """Regression: ``current_run().run`` read through "default", not DATABASE_ALIAS."""
    from django.db import connections

    seen: dict[str, Any] = {}

    @once_per_schedule(name="tests.guard.alias")
    def body() -> None:
        with CaptureQueriesContext(connections["mirror"]) as mirror:
            seen["state"] = current_run().run.state
        seen["mirror_reads"] = [q["sql"] for q in mirror.captured_queries]

    settings = {"BACKEND": "database", "DATABASE_ALIAS": "mirror"}
    with (
        override_settings(TASKGUARD=settings),
        CaptureQueriesContext(connections["mirror"]) as whole,
    ):
        body.run_for_slot(SLOT)
    assert seen["state"] == RunState.RUNNING
    assert len(seen["mirror_reads"]) == 1 and "taskguard_taskrun" in seen["mirror_reads"][0]
    assert any(re.search(UPSERT, q["sql"]) for q in whole.captured_queries)
    assert TaskRun.objects.get().state == RunState.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_give_back__the_next_claim_takes_the_slot_with_a_larger_fence(lock_backend):
    """``Attempt.give_back``: the row is pending again and the lock free; the next claim is
    attempt 1 again with a new, larger fence, and the given-back attempt is fenced out."""
    from django_taskguard import ledger
    from django_taskguard.guard import Attempt, Policy, begin

    first = begin("tests.guard.give_back", SLOT, Policy())
    assert isinstance(first, Attempt) and first.open()
    assert first.give_back("cancelled before the function started") is True
    run = TaskRun.objects.get()
    assert (run.state, run.attempt, run.owner, run.lease_until) == (RunState.PENDING, 0, "", None)
    assert [(t.from_state, t.to_state, t.reason) for t in run.transitions.order_by("id")][-1] == (
        "running",
        "pending",
        "cancelled before the function started",
    )
    assert first.give_back("again") is False  # fenced: it no longer owns the row

    second = begin("tests.guard.give_back", SLOT, Policy())
    assert isinstance(second, Attempt)
    assert second.active.attempt == 1 and second.active.fence > first.active.fence
    old = first.active
    refused = ledger.finish(old.id, old.attempt, old.fence, old.owner, RunState.SUCCEEDED, "late")
    assert refused is None
    assert second.run(lambda: "ran", (), {}) == "ran"
    run = TaskRun.objects.get()
    assert (run.state, run.attempt, run.fence) == (RunState.SUCCEEDED, 1, second.active.fence)


@pytest.mark.django_db(transaction=True)
def test_pause__a_paused_slot_keeps_its_reason_as_its_error():
    """Regression (issue 33): the skipped row's error was empty (the reason only in its
    transition), unlike every other skipped row; the admin shows the error as why."""

    @once_per_schedule(name="tests.guard.paused", every=timedelta(hours=1))
    def body() -> str:
        return "ran"

    registry.sync()
    try:
        assert pauses.pause("tests.guard.paused", "maintenance")
        assert body.run_for_slot(SLOT) is None
    finally:
        registry.unregister("tests.guard.paused")
        pauses.forget()
    run = TaskRun.objects.get()
    assert (run.state, run.error) == (RunState.SKIPPED, "paused: maintenance")
    assert run.transitions.order_by("id").last().reason == run.error  # type: ignore[union-attr]


@pytest.mark.django_db(transaction=True)
def test_give_back__the_pause_check_raising_gives_the_slot_back(monkeypatch):
    """The paused-task check raises after the claim, before the function: the slot is
    given back (its error in the reason) and the error reaches the caller.

    Regression: the lock was freed but the row stayed 'running' until its lease lapsed,
    and cleanup then recorded it 'abandoned' (under on_stale="abandon": for good)."""
    ran: list[int] = []

    @once_per_schedule(name="tests.guard.pause_check")
    def body() -> None:
        ran.append(1)

    def broken(task_name: str) -> None:
        raise RuntimeError("pause cache unreadable")

    with monkeypatch.context() as patch:
        patch.setattr("django_taskguard.guard.paused_reason", broken)
        with pytest.raises(RuntimeError, match="pause cache unreadable"):
            body.run_for_slot(SLOT)
    assert ran == []
    run = TaskRun.objects.get()
    assert (run.state, run.attempt, run.lease_until) == (RunState.PENDING, 0, None)
    assert "pause cache unreadable" in run.transitions.order_by("id").last().reason  # type: ignore[union-attr]
    body.run_for_slot(SLOT)
    assert ran == [1] and TaskRun.objects.get().state == RunState.SUCCEEDED
