"""``run_schedules``' own edges, on the batch path and the one-by-one path alike: more
due slots than workers, a duplicate or a body that raises in a worker, a batch claim
whose reply is lost, signals, a ``--once`` that waits for a hung body, a clock stepped
back. The chaos test (three copies under SIGKILL, SIGSTOP and a terminated connection)
is at the end.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from django.db import connection

from django_taskguard import once_per_schedule
from django_taskguard.claim import claim_many
from django_taskguard.context import ActiveRun
from django_taskguard.models import RunState, TaskRun
from django_taskguard.registry import Entry, entries, unregister
from django_taskguard.scheduler import Scheduler

from .support.children import python, start
from .support.tcp_proxy import TcpProxy
from .support.waiting import wait_for
from .test_run_schedules import schedule_env, slots_run

pytestmark = pytest.mark.dialect

PATHS = [pytest.param([], id="batch"), pytest.param(["--no-batch"], id="one-by-one")]

postgres_only = pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="the batch claim is one statement on PostgreSQL only (elsewhere: one by one)",
)


def once(env: dict[str, str], out: Path, *args: str, timeout: float = 240) -> int:
    """``run_schedules --once``: fire the latest slot of each schedule, wait, exit."""
    with out.open("ab") as sink:
        done = subprocess.run(
            [python(), "-m", "tests.support.scheduler_child", "--once", *args],
            env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout, check=False,
        )  # fmt: skip
    return done.returncode


def fire_twice(env: dict[str, str], out: Path, *args: str) -> datetime:
    """Register the schedules (a first ``--once``: no slot before registration fires),
    then fire their next slot with a second; return that slot."""
    assert once(env, out, *args) == 0, out.read_text()
    time.sleep(1.5)  # the next one-second slot is after the registration (margin 0.5 s)
    assert once(env, out, *args) == 0, out.read_text()
    return max(TaskRun.objects.values_list("slot", flat=True))


# -- 1. more due slots than workers can start within a lease ----------------------------


@pytest.mark.file_and_server
@pytest.mark.processes
@pytest.mark.parametrize("path", PATHS)
def test_run_schedules__more_due_than_workers__every_body_starts_within_its_lease(
    child_env, scratch, path
):
    """30 schedules due at one slot, 2 workers, 1 s bodies that first check their lease,
    a 10 s lease: 15 s of work. Each runs once and is recorded succeeded (the batch claim
    used to claim all 30 at once: the last ten started with their lease lapsed, and
    ``current_run().check()`` raised LeaseLost)."""
    log = scratch / "executions.log"
    env = schedule_env(
        child_env, log, "tests.busy", TASKGUARD_TEST_SCHEDULES="30",
        TASKGUARD_TEST_BODY_SECONDS="1", TASKGUARD_TEST_LEASE="10",
        TASKGUARD_TEST_CHECK_LEASE="1",
    )  # fmt: skip
    slot = fire_twice(env, scratch / "out", "--max-workers", "2", *path)

    runs = TaskRun.objects.filter(task_name__startswith="tests.busy.", slot=slot)
    assert Counter(runs.values_list("state", flat=True)) == {RunState.SUCCEEDED: 30}, [
        (run.task_name, run.state, run.error) for run in runs if run.state != "succeeded"
    ]
    ran = Counter(task for task, at in slots_run(log) if at == slot)
    assert ran == {f"tests.busy.{n}": 1 for n in range(30)}


@pytest.mark.processes
@pytest.mark.once
@pytest.mark.parametrize("path", PATHS)
def test_run_schedules__catchup_none__no_body_starts_past_its_grace(child_env, scratch, path):
    """The same 30 under ``catchup="none"``, grace 2 s: the slots that no worker could
    start within their grace are recorded missed; none starts later."""
    log = scratch / "executions.log"
    env = schedule_env(
        child_env, log, "tests.grace", TASKGUARD_TEST_SCHEDULES="30",
        TASKGUARD_TEST_BODY_SECONDS="1", TASKGUARD_TEST_LEASE="10",
        TASKGUARD_TEST_CATCHUP="none", TASKGUARD_TEST_GRACE="2",
    )  # fmt: skip
    slot = fire_twice(env, scratch / "out", "--max-workers", "2", *path)

    starts = {task: at for task, s, at in _starts(log) if s == slot}
    # The guard judges lateness just before the body starts: 2 s of margin for that step.
    assert not {t: at for t, at in starts.items() if at - slot.timestamp() > 2 + 2}, starts
    rows = dict(
        TaskRun.objects.filter(task_name__startswith="tests.grace.", slot=slot).values_list(
            "task_name", "state"
        )
    )
    assert len(rows) == 30
    assert {t for t, s in rows.items() if s == RunState.SUCCEEDED} == set(starts)
    assert {t for t, s in rows.items() if s != RunState.SUCCEEDED} == {
        t for t, s in rows.items() if s == RunState.MISSED
    }


@pytest.mark.file_and_server
@pytest.mark.processes
@pytest.mark.parametrize("path", PATHS)
def test_run_schedules__sigterm_gives_back_the_claims_not_started(child_env, scratch, path):
    """SIGTERM while 30 due schedules wait for 2 workers: the two running finish, no
    other starts (the claims the batch made are given back): no row is left running,
    and every row is a body that ran."""
    log = scratch / "executions.log"
    env = schedule_env(
        child_env, log, "tests.queued", TASKGUARD_TEST_SCHEDULES="30",
        TASKGUARD_TEST_BODY_SECONDS="1", TASKGUARD_TEST_EVERY=str(TEN_MINUTES),
    )  # fmt: skip
    assert once(env, scratch / "out") == 0  # registers the schedules
    copy = start(
        _moved_on(env), scratch / "a.out",
        "-m", "tests.support.scheduler_child", "--max-workers", "2", "--stop-timeout", "20", *path,
    )  # fmt: skip
    try:
        wait_for(lambda: slots_run(log), 60, "the first bodies")
        copy.send_signal(signal.SIGTERM)
        signalled = time.time()
        assert copy.wait(timeout=60) == 0, (scratch / "a.out").read_text()
    finally:
        if copy.poll() is None:
            copy.kill()
            copy.wait(10)
    ran = Counter(task for task, _slot in slots_run(log))
    runs = TaskRun.objects.filter(task_name__startswith="tests.queued.")
    assert not runs.filter(state=RunState.RUNNING).exists()
    assert set(runs.values_list("state", flat=True)) == {RunState.SUCCEEDED}
    assert Counter(runs.values_list("task_name", flat=True)) == ran
    # A worker that took its job as the signal came may start it just after; the next
    # one would start a 1 s body later.
    after = [task for task, _slot, at in _starts(log) if at > signalled + 1.5]
    assert not after, f"{len(after)} bodies started after SIGTERM"


@pytest.mark.file_and_server
@pytest.mark.processes
@pytest.mark.parametrize("path", PATHS)
def test_run_schedules__the_copy_that_claimed_killed__the_other_runs_the_rest(
    child_env, scratch, path
):
    """Two copies, 30 schedules due at one slot, 2 workers each, 1 s bodies: the copy that
    started first is SIGKILLed. It held no more claims than it could start, so the other
    copy runs every slot but those (the batch claim used to hold all 30: 28 never ran
    while the other copy sat idle)."""
    log = scratch / "executions.log"
    env = schedule_env(
        child_env, log, "tests.killone", TASKGUARD_TEST_SCHEDULES="30",
        TASKGUARD_TEST_BODY_SECONDS="1", TASKGUARD_TEST_EVERY=str(TEN_MINUTES),
    )  # fmt: skip
    assert once(env, scratch / "out") == 0  # registers the schedules
    shifted = _moved_on(env)
    command = ["-m", "tests.support.scheduler_child", "--max-workers", "2", *path]
    copies = {}
    for name in ("a", "b"):
        copy = start(shifted, scratch / f"{name}.out", *command)
        copies[copy.pid] = copy
    try:
        first = int(wait_for(lambda: _first_pid(log), 60, "a body"))
        copies[first].kill()
        copies[first].wait(10)
        # The other copy works through the rest, 2 at a time (about 15 s).
        done = TaskRun.objects.filter(task_name__startswith="tests.killone.", state="succeeded")
        wait_for(lambda: done.count() >= 30 - 4, 120, "the other copy's runs", every=0.5)
        time.sleep(3)  # margin: nothing more is coming
    finally:
        for copy in copies.values():
            if copy.poll() is None:
                copy.kill()
                copy.wait(10)
    ran = Counter(task for task, _slot in slots_run(log))
    assert max(ran.values()) == 1
    lost = 30 - len(ran)
    in_flight = 2 + 2  # the killed copy's workers, and as many claims queued at most
    assert lost <= in_flight, f"{lost} slots never ran"


TEN_MINUTES = 600


def _moved_on(env: dict[str, str]) -> dict[str, str]:
    """A child whose clock is moved on to just past the next slot of a ten-minute
    schedule, so that it fires that slot now; its slot tolerance lets it (a copy whose
    clock is ahead of the database's refuses slots more than the tolerance early)."""
    now = time.time()
    ahead = TEN_MINUTES - now % TEN_MINUTES + 1
    return {
        **env,
        "TASKGUARD_TEST_CLOCK_OFFSET": str(ahead),
        "TASKGUARD_TEST_SLOT_TOLERANCE": str(TEN_MINUTES + 60),
    }


def _first_pid(log: Path) -> int | None:
    lines = log.read_text().splitlines() if log.exists() else []
    return int(lines[0].split()[2]) if lines else None


def _starts(log: Path) -> list[tuple[str, datetime, float]]:
    lines = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    return [(task, datetime.fromisoformat(slot), float(at)) for task, slot, _pid, at in lines]


# -- 2. a worker survives any job ---------------------------------------------------------


@pytest.fixture
def scheduled(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Make ``@once_per_schedule`` entries for this test; unregister them after."""
    made: list[str] = []

    def make(name: str, body, **options) -> Entry:  # type: ignore[no-untyped-def]
        once_per_schedule(every=timedelta(hours=1), name=name, **options)(body)
        made.append(name)
        return entries()[name]

    yield make
    for name in made:
        unregister(name)


def _settle(scheduler: Scheduler) -> None:
    assert scheduler.dispatcher.settle(60), "the batch claims never settled"
    assert scheduler.pool.drain(60), "the jobs never finished"


def _every_worker_alive(scheduler: Scheduler, workers: int) -> None:
    """``workers`` jobs that wait for each other all run: no worker died."""
    barrier = threading.Barrier(workers + 1)
    for _ in range(workers):
        scheduler.pool.submit(lambda: barrier.wait(30) and None)
    barrier.wait(30)  # BrokenBarrierError when a worker is gone


def _close(scheduler: Scheduler) -> None:
    scheduler.dispatcher.close()
    scheduler.pool.close()
    scheduler.writer.close()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("batch", [True, False], ids=["batch", "one-by-one"])
def test_scheduler__a_duplicate_that_raises__strands_no_won_slot_kills_no_worker(scheduled, batch):
    """``on_duplicate="raise"``: one of four schedules finds its slot taken (DuplicateRun);
    the three this copy won run, and every worker is still there."""
    ran: list[str] = []
    made = [
        scheduled(f"tests.dupraise.{n}", lambda n=n: ran.append(f"tests.dupraise.{n}"),
                  on_duplicate="raise")
        for n in range(4)
    ]  # fmt: skip
    slot = made[0].schedule.latest_slot(datetime.now().astimezone())
    assert made[0].fire(slot)  # taken: the scheduler's call of it is a duplicate
    ran.clear()
    scheduler = Scheduler(made, max_workers=2, batch=batch)
    try:
        scheduler.fire([(entry, [slot]) for entry in made])
        _settle(scheduler)
        assert sorted(ran) == [f"tests.dupraise.{n}" for n in (1, 2, 3)]
        _every_worker_alive(scheduler, 2)
    finally:
        _close(scheduler)
    rows = dict(TaskRun.objects.filter(slot=slot).values_list("task_name", "state"))
    assert set(rows.values()) == {RunState.SUCCEEDED}
    assert TaskRun.objects.get(task_name="tests.dupraise.0").duplicates == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("batch", [True, False], ids=["batch", "one-by-one"])
def test_scheduler__a_body_calling_sys_exit__is_recorded_kills_no_worker(scheduled, batch):
    """The guard records a body's SystemExit as the process going away (abandoned, with
    the error); the worker that ran it goes on."""

    def leave() -> None:
        sys.exit(3)

    made = [scheduled(f"tests.exit.{n}", leave) for n in range(2)]
    slot = made[0].schedule.latest_slot(datetime.now().astimezone())
    scheduler = Scheduler(made, max_workers=2, batch=batch)
    try:
        scheduler.fire([(entry, [slot]) for entry in made])
        _settle(scheduler)
        _every_worker_alive(scheduler, 2)
    finally:
        _close(scheduler)
    runs = TaskRun.objects.filter(slot=slot)
    assert [(run.state, "SystemExit" in run.error) for run in runs] == [
        (RunState.ABANDONED, True)
    ] * 2


@postgres_only
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("why", ["stopping", "lease"])
def test_dispatch__a_claim_that_cannot_start_is_given_back(scheduled, why):
    """A batch claim re-checked as its body would start: when the copy is stopping it is
    given back (the row pending again, nothing ran); when too little of its lease is
    left it is given back and fired the one-task way (claimed anew, run once)."""
    ran: list[str] = []
    entry = scheduled("tests.giveback", lambda: ran.append("ran"))
    slot = entry.schedule.latest_slot(datetime.now().astimezone())
    active = claim_many(slot, [(entry.task_name, 30.0)])[entry.task_name]  # type: ignore[index]
    assert isinstance(active, ActiveRun)
    scheduler = Scheduler([entry], max_workers=1)
    try:
        if why == "stopping":
            scheduler.stopping.set()
        else:
            active.deadline = time.monotonic() + 5  # 5 s of its 30 s lease left
        scheduler.dispatcher.pool.submit(
            functools.partial(scheduler.dispatcher.start_claimed, entry, active)
        )
        _settle(scheduler)
    finally:
        _close(scheduler)
    run = TaskRun.objects.get(task_name="tests.giveback")
    given = run.transitions.get(from_state=RunState.RUNNING, to_state=RunState.PENDING)
    assert "never started" in given.reason
    if why == "stopping":
        assert (ran, run.state) == ([], RunState.PENDING)
    else:
        assert (ran, run.state) == (["ran"], RunState.SUCCEEDED)


# -- 3. a batch claim whose reply is lost ---------------------------------------------------


@pytest.mark.file_and_server
@pytest.mark.processes
@postgres_only
@pytest.mark.parametrize(
    ("path", "marker"),
    [
        pytest.param([], b"float8[]", id="batch"),  # only the batch claim has it
        pytest.param(["--no-batch"], b"taskguard_claim_v1(", id="one-by-one"),
    ],
)
def test_run_schedules__claim_reply_lost__read_back_and_run(child_env, scratch, path, marker):
    """The claim commits on the server and its reply never comes back (a TCP proxy in
    front of PostgreSQL throws it away and cuts the connection): the copy reads back,
    finds its rows, and runs them, each once."""
    log = scratch / "executions.log"
    env = schedule_env(child_env, log, "tests.lost", TASKGUARD_TEST_SCHEDULES="4")
    assert once(env, scratch / "out", *path) == 0  # registers the schedules
    time.sleep(1.5)  # the next one-second slot is after the registration
    with TcpProxy(int(connection.settings_dict["PORT"] or 5432)) as proxy:
        proxy.lose_reply(marker)
        code = once({**env, "TASKGUARD_PG_PORT": str(proxy.port)}, scratch / "out", *path)
        assert proxy.lost == [marker], "the fault never happened"
    assert code == 0, (scratch / "out").read_text()
    assert "reading back" in (scratch / "out").read_text()
    slot = max(TaskRun.objects.values_list("slot", flat=True))
    runs = TaskRun.objects.filter(task_name__startswith="tests.lost.", slot=slot)
    assert Counter(runs.values_list("state", flat=True)) == {RunState.SUCCEEDED: 4}
    assert Counter(task for task, at in slots_run(log) if at == slot) == {
        f"tests.lost.{n}": 1 for n in range(4)
    }


# -- 7. signals --------------------------------------------------------------------------


@pytest.mark.file_and_server
@pytest.mark.processes
def test_run_schedules__a_burst_of_signals_always_ends_the_process(child_env, scratch):
    """Four copies each get SIGTERM and SIGINT without a pause for a second: every one
    exits (the handler used to take the stop event's lock, and a signal that came while
    the main thread held it deadlocked the copy)."""
    env = schedule_env(child_env, scratch / "log", "tests.burst")
    outs = [scratch / f"{n}.out" for n in range(4)]
    command = ["-m", "tests.support.scheduler_child", "--sweep-every", "1"]
    copies = [start(env, out, *command) for out in outs]
    try:
        for out in outs:
            wait_for(lambda out=out: "fired tests.burst" in out.read_text(), 60, "a fire")
        for copy in copies:
            _burst(copy.pid, seconds=1.0)
        hung = []
        for copy in copies:
            try:
                copy.wait(timeout=30)
            except subprocess.TimeoutExpired:
                hung.append(copy.pid)
        assert not hung, f"{len(hung)} of {len(copies)} copies did not exit"
    finally:
        for copy in copies:
            if copy.poll() is None:
                copy.kill()
                copy.wait(10)


def _burst(pid: int, seconds: float) -> None:
    """Signal ``pid`` over and over for ``seconds`` (until it is gone)."""
    until = time.monotonic() + seconds
    sent = 0
    while time.monotonic() < until:
        try:
            os.kill(pid, signal.SIGINT if sent % 2 else signal.SIGTERM)
        except ProcessLookupError:
            return
        sent += 1


@pytest.mark.file_and_server
@pytest.mark.processes
def test_run_schedules__a_second_sigterm_exits_at_once(child_env, scratch):
    """The first SIGTERM waits for the running call (up to --stop-timeout); a second
    exits now, non-zero."""
    log = scratch / "executions.log"
    env = schedule_env(child_env, log, "tests.twice", TASKGUARD_TEST_BODY_SECONDS="60")
    out = scratch / "a.out"
    copy = start(env, out, "-m", "tests.support.scheduler_child", "--stop-timeout", "120")
    try:
        wait_for(lambda: slots_run(log), 60, "the body started")
        copy.send_signal(signal.SIGTERM)
        wait_for(lambda: "SIGTERM, no new fires" in out.read_text(), 30, "the stop logged")
        assert copy.poll() is None  # waiting for the 60 s body
        copy.send_signal(signal.SIGTERM)
        assert copy.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if copy.poll() is None:
            copy.kill()
            copy.wait(10)


# -- 12. --once with a hung body; a clock stepped back ------------------------------------


@pytest.mark.file_and_server
@pytest.mark.processes
def test_run_schedules_once__a_hung_body_is_waited_for_once_timeout_only(child_env, scratch):
    log = scratch / "executions.log"
    env = schedule_env(child_env, log, "tests.hung", TASKGUARD_TEST_BODY_SECONDS="600")
    out = scratch / "out"
    # Registers the schedule. No slot before the registration fires, but a slow start can see
    # the next second's slot come due after it: that body hangs too, so this call is bounded.
    assert once(env, out, "--once-timeout", "3", timeout=120) in (0, 1), out.read_text()
    time.sleep(1.5)
    assert once(env, out, "--once-timeout", "3", timeout=120) == 1
    assert slots_run(log), "the body never started"
    assert "calls still running after 3s" in out.read_text()


@pytest.mark.django_db
def test_scheduler__clock_stepped_back__logged(scheduled, caplog):
    made = [scheduled("tests.clockback", lambda: None)]
    scheduler = Scheduler(made, max_workers=1)
    try:
        now = datetime.now().astimezone()
        scheduler.first_due(now)
        scheduler.due(now)
        with caplog.at_level(logging.WARNING, logger="taskguard.scheduler"):
            assert scheduler.due(now - timedelta(minutes=5)) == []
            assert scheduler.due(now - timedelta(minutes=4)) == []  # catching up: no new line
        assert caplog.text.count("clock went back") == 1
        assert "clock went back 300.0s" in caplog.text
    finally:
        _close(scheduler)
