"""Fault injection against the Redis backend: real processes, real signals, real servers.

Every scenario counts executions with an unfenced O_APPEND log (``tests.support.proc.record``)
and checks the ledger; every child's stderr is checked for heartbeat crashes.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from collections import Counter
from datetime import timedelta
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from django_taskguard import once_per_schedule
from django_taskguard.locks import Acquired
from django_taskguard.locks.redis import claim_key
from django_taskguard.locks.redis_scripts import FINISHED_MARKER
from django_taskguard.models import RunState, TaskRun, TaskRunTransition
from django_taskguard.signals import run_abandoned

from .support.children import Child, executions, hold, python
from .support.proc import BASE_SLOT
from .support.redis_support import (
    child_redis_env,
    command,
    guard_key,
    redis_backend,
    unfinished_keys,
)
from .support.waiting import wait_for
from .test_race import assert_raced, release, start_racers, winners

pytestmark = [pytest.mark.processes, pytest.mark.once]

LEASE = 2.0


def assert_no_heartbeat_crash(stderr: str) -> None:
    assert "heartbeat crashed" not in stderr, stderr


def log_lines(log: Path) -> Counter[str]:
    return Counter(words[0] for words in executions(log))


def the_run(task: str) -> TaskRun:
    return TaskRun.objects.get(task_name=task)


def states_path(run: TaskRun) -> list[str]:
    return [t.to_state for t in run.transitions.order_by("id")]


def lease_over(task: str) -> bool:
    run = the_run(task)
    return run.lease_until is not None and run.lease_until < _db_now()


def _db_now():  # type: ignore[no-untyped-def]
    from django.utils import timezone

    return timezone.now() - timedelta(milliseconds=50)


# (a) ---------------------------------------------------------------------------


def test_redis_race__8_processes_200_slots_run_each_slot_once(child_env, redis_server, scratch):
    env = child_redis_env(child_env, redis_server)
    log = scratch / "executions.log"
    racers = start_racers(env, log, "tests.redis_race", 8, 200)
    outcomes = []
    for racer in racers:
        out, err = racer.communicate(timeout=300)
        assert racer.returncode == 0, err
        assert_no_heartbeat_crash(err)
        outcomes.append(json.loads(out.strip().splitlines()[-1]))
    executions = Counter(line.split()[0] for line in log.read_text().splitlines())
    assert len(executions) == 200 and set(executions.values()) == {1}
    assert sum(o["won"] for o in outcomes) == 200
    assert_raced(outcomes)
    # Losers make one Redis round trip, winners run the body: the wins are shared.
    assert len(winners(log)) >= 2, "one process won every slot"
    runs = TaskRun.objects.filter(task_name="tests.redis_race")
    assert set(runs.values_list("state", flat=True)) == {RunState.SUCCEEDED}
    # Every losing call is counted: on the row, or still on a Redis claim record
    # (a loser that came between the winner's fold and its release).
    with redis_backend(redis_server) as lock:
        pending = sum(r.duplicates for r in lock.unrecorded_claims())
    assert sum(runs.values_list("duplicates", flat=True)) + pending == 200 * 7


# (b) ---------------------------------------------------------------------------


def test_redis_kill__owner_sigkilled_abandon_never_runs_again(child_env, redis_server, scratch):
    env = child_redis_env(child_env, redis_server)
    log, task = scratch / "x.log", "tests.kill_abandon"
    owner = hold(env, log, task, lease=12.0, seconds=60)
    owner.started()
    # The next instance is started (Python and Django: several seconds on a loaded machine)
    # before the kill, and claims once it is released: well within the dead owner's lease.
    go = scratch / "go"
    loser = hold(env, log, task, lease=LEASE, seconds=0, go=go)
    wait_for(lambda: Path(f"{go}.ready").exists(), timeout=120, what="the next instance")
    owner.killed()
    go.touch()
    # While the dead owner's lease lasts, another instance loses on Redis alone.
    assert loser.outcome() == {"result": None}
    wait_for(lambda: lease_over(task))
    assert the_run(task).state == RunState.RUNNING  # expired, judged stale by the next claim
    assert hold(env, log, task, lease=LEASE, seconds=0).outcome() == {"result": None}
    run = the_run(task)
    assert (run.state, run.attempt) == (RunState.ABANDONED, 1)
    assert "on_stale=abandon" in run.transitions.last().reason
    assert log_lines(log) == Counter({"start": 1})


@pytest.mark.server  # the row decides: on PostgreSQL and MariaDB
def test_redis_kill__owner_sigkilled_retry_takes_over_once(child_env, redis_server, scratch):
    env = child_redis_env(child_env, redis_server)
    log, task = scratch / "x.log", "tests.kill_retry"
    owner = hold(env, log, task, lease=LEASE, seconds=60, on_stale="retry")
    first = owner.started()
    owner.killed()
    wait_for(lambda: lease_over(task))
    takers = [hold(env, log, task, lease=LEASE, seconds=0.2, on_stale="retry") for _ in range(3)]
    results = [t.outcome()["result"] for t in takers]
    assert sorted(results, key=str) == [None, None, "done"]
    run = the_run(task)
    assert (run.state, run.attempt) == (RunState.SUCCEEDED, 2)
    assert run.fence > int(first["fence"])  # type: ignore[call-overload]
    assert log_lines(log) == Counter({"start": 2, "end": 1})


# (c) ---------------------------------------------------------------------------


@pytest.mark.server  # the row decides: on PostgreSQL and MariaDB
def test_redis_pause__1_5x_lease_taken_over_late_finish_refused(child_env, redis_server, scratch):
    env = child_redis_env(child_env, redis_server)
    log, task = scratch / "x.log", "tests.pause_retry"
    owner = hold(env, log, task, lease=LEASE, seconds=6, on_stale="retry")
    owner.started()
    owner.signal(signal.SIGSTOP)
    try:
        time.sleep(1.5 * LEASE)
        wait_for(lambda: lease_over(task))  # by the database's clock, whatever the load
        taker = hold(env, log, task, lease=LEASE, seconds=0.2, on_stale="retry")
        assert taker.outcome() == {"result": "done"}
    finally:
        owner.signal(signal.SIGCONT)
    late = owner.outcome()
    assert late["result"] is None and "lost its lease" in str(late["lease_lost"])
    run = the_run(task)
    assert (run.state, run.attempt) == (RunState.SUCCEEDED, 2)
    assert states_path(run) == ["running", "retrying", "running", "succeeded"]
    # the paused owner never got past its check: one finished body, no overlap
    assert log_lines(log) == Counter({"start": 2, "end": 1, "leaselost": 1})


def test_redis_pause__3x_lease_abandoned_and_owner_refused(child_env, redis_server, scratch):
    env = child_redis_env(child_env, redis_server)
    log, task = scratch / "x.log", "tests.pause_abandon"
    owner = hold(env, log, task, lease=LEASE, seconds=8)
    owner.started()
    owner.signal(signal.SIGSTOP)
    try:
        time.sleep(3 * LEASE)
        assert hold(env, log, task, lease=LEASE, seconds=0).outcome() == {"result": None}
    finally:
        owner.signal(signal.SIGCONT)
    late = owner.outcome()
    assert late["result"] is None and "lost its lease" in str(late["lease_lost"])
    run = the_run(task)
    assert (run.state, run.attempt) == (RunState.ABANDONED, 1)
    assert states_path(run) == ["running", "abandoned"]
    assert log_lines(log) == Counter({"start": 1, "leaselost": 1})


def test_redis_pause__past_the_lease_nobody_took_over_still_a_loss(
    child_env, redis_server, scratch
):
    """Nobody took the slot while the owner was stopped, so the row would accept a
    renewal. The owner's body does not check during the pause; the heartbeat must not
    renew quietly and revive the lease: the body's check at its end raises."""
    env = child_redis_env(child_env, redis_server)
    log, task = scratch / "x.log", "tests.pause_alone"
    owner = hold(env, log, task, lease=LEASE, seconds=10)
    owner.started()
    owner.signal(signal.SIGSTOP)
    try:
        wait_for(lambda: lease_over(task))
        time.sleep(1.0)  # well past the lease by every clock
    finally:
        owner.signal(signal.SIGCONT)
    late = owner.outcome()
    assert late["result"] is None and "lost its lease" in str(late["lease_lost"]), late
    assert log_lines(log) == Counter({"start": 1, "leaselost": 1})
    run = the_run(task)
    assert (run.state, run.attempt) == (RunState.FAILED, 1)


# (d) ---------------------------------------------------------------------------


def test_redis_pause__half_lease_causes_no_lease_loss(child_env, redis_server, scratch):
    env = child_redis_env(child_env, redis_server)
    log, task, lease = scratch / "x.log", "tests.short_pause", 6.0
    owner = hold(env, log, task, lease=lease, seconds=5)
    owner.started()
    owner.signal(signal.SIGSTOP)
    time.sleep(0.5 * lease)
    owner.signal(signal.SIGCONT)
    assert owner.outcome() == {"result": "done"}
    assert "lost its lease" not in owner.stderr and "could not renew" not in owner.stderr
    run = the_run(task)
    assert (run.state, run.attempt) == (RunState.SUCCEEDED, 1)
    assert log_lines(log) == Counter({"start": 1, "end": 1})


# (e) ---------------------------------------------------------------------------


@pytest.mark.server  # the row decides: on PostgreSQL and MariaDB
def test_redis_restart_and_flush__mid_slot_no_second_run(child_env, redis_server, scratch):
    env = child_redis_env(child_env, redis_server)
    log, task = scratch / "x.log", "tests.redis_restart"
    # Held long enough for the two next instances to start and claim while it runs (each
    # starts Python and Django: several seconds on a loaded machine; 8 s ran out in CI).
    owner = hold(env, log, task, lease=3.0, seconds=30)
    owner.started()
    command(redis_server, "shutdown", nosave=True)
    assert redis_server.process is not None
    redis_server.process.wait(timeout=10)
    redis_server.start()  # empty: the script cache and every key are gone
    assert hold(env, log, task, lease=3.0, seconds=0).outcome() == {"result": None}
    command(redis_server, "flushall")
    assert hold(env, log, task, lease=3.0, seconds=0).outcome() == {"result": None}
    assert owner.outcome() == {"result": "done"}
    run = the_run(task)
    assert (run.state, run.duplicates) == (RunState.SUCCEEDED, 2)
    assert log_lines(log) == Counter({"start": 1, "end": 1})
    assert unfinished_keys(redis_server) == []  # the winner-after-flush released its key


# (f) ---------------------------------------------------------------------------


def test_redis_down__whole_run_exactly_once_via_database(child_env, redis_server, scratch):
    env = child_redis_env(child_env, redis_server)
    redis_server.stop()
    log = scratch / "x.log"
    racers = start_racers(env, log, "tests.redis_down", 4, 30)
    outcomes = []
    for racer in racers:
        out, err = racer.communicate(timeout=300)
        outcomes.append(json.loads(out.strip().splitlines()[-1]))
        assert racer.returncode == 0, err
        assert_no_heartbeat_crash(err)
        assert err.count("is unreachable") == 1, err  # once per outage, not per call
    executions = Counter(line.split()[0] for line in log.read_text().splitlines())
    assert len(executions) == 30 and set(executions.values()) == {1}
    assert_raced(outcomes)
    runs = TaskRun.objects.filter(task_name="tests.redis_down")
    assert set(runs.values_list("state", flat=True)) == {RunState.SUCCEEDED}
    assert sum(runs.values_list("duplicates", flat=True)) == 30 * 3


# (g) ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["all", "write"])
def test_redis_stall__past_socket_timeout_no_self_lockout(redis_server, transactional_db, mode):
    ran = []

    @once_per_schedule(name="tests.stall")
    def body(tag: str) -> str:
        ran.append(tag)
        return tag

    slot, later = BASE_SLOT, BASE_SLOT + timedelta(minutes=1)
    with redis_backend(redis_server, REDIS_SOCKET_TIMEOUT=0.3, LEASE_SECONDS=LEASE) as lock:
        # CLIENT PAUSE ALL stalls every command (like DEBUG SLEEP, which Redis 7+
        # disables by default); WRITE stalls the scripts but lets the read-back through.
        command(redis_server, "client_pause", 1500, mode == "all")
        assert body.run_for_slot(slot, "stalled") == "stalled"  # decided on the database
        time.sleep(1.6)
        lock._probe_at = 0.0  # let the next call ask Redis at once
        assert body.run_for_slot(slot, "again") is None  # the row decides
        assert body.run_for_slot(later, "next") == "next"  # Redis works again
        # a token that landed after the stall holds the key for one lease at most; the
        # call that found the row finished left the finished marker (it lapses too)
        key = guard_key("tests.stall", slot)
        ttl = command(redis_server, "pttl", key)
        held = command(redis_server, "get", key)
        limit = (3600 if held == FINISHED_MARKER.encode() else LEASE) * 1000
        assert ttl == -2 or 0 < ttl <= limit, (held, ttl)  # -1 (never expires) is the bug
    assert ran == ["stalled", "next"]
    run = TaskRun.objects.get(slot=slot)
    assert (run.state, run.duplicates) == (RunState.SUCCEEDED, 1)


# (h) ---------------------------------------------------------------------------

postgres_only = pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="pg_terminate_backend needs PostgreSQL (TASKGUARD_TEST_DB=postgres); "
    "SQLite has no server backend to kill",
)


# What a claim and a finish send on PostgreSQL, as pg_stat_activity shows them: their
# functions' calls (the values are bound apart from the text).
CLAIM_SENT = "%taskguard_claim_v1(%"
FINISH_SENT = "%taskguard_end_attempt_v1(%"


def _terminate_waiting(pattern: str, timeout: float = 30.0) -> None:
    """Kill the server backend that waits on a lock running a statement like ``pattern``.

    Of this test database only: the version matrix's pass runs beside this one."""
    from django.db import connections

    deadline = time.monotonic() + timeout
    with connections["default"].cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database() AND query LIKE %s AND pid <> pg_backend_pid()",
                [pattern],
            )
            pids = [row[0] for row in cursor.fetchall()]
            if pids:
                cursor.execute("SELECT pg_terminate_backend(%s)", [pids[0]])
                return
            time.sleep(0.05)
    raise AssertionError(f"no backend waited on {pattern!r}")


def _waiting(pattern: str) -> bool:
    """A server backend waits on a lock running a statement like ``pattern``."""
    from django.db import connections

    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database() AND query LIKE %s AND pid <> pg_backend_pid()",
            [pattern],
        )
        return bool(cursor.fetchone()[0])


def _blocker():  # type: ignore[no-untyped-def]
    import psycopg
    from django.db import connections

    settings = connections["default"].settings_dict
    return psycopg.connect(
        dbname=settings["NAME"], user=settings["USER"], host=settings["HOST"],
        port=settings["PORT"],
    )  # fmt: skip


@postgres_only
def test_redis_pg_kill__mid_claim_settled_by_reading_back(child_env, redis_server, scratch):
    env = child_redis_env(child_env, redis_server)
    log, task = scratch / "x.log", "tests.pg_claim"
    slot = BASE_SLOT
    with _blocker() as blocker:
        # An uncommitted row for the same slot: the child's INSERT waits on it.
        blocker.execute(
            "INSERT INTO taskguard_taskrun (task_name, slot, state, attempt, owner, created_at, "
            "error, duplicates) VALUES (%s, %s, 'pending', 1, 'blocker', now(), '', 0)",
            [task, slot],
        )
        owner = hold(env, log, task, lease=5.0, seconds=0.5)
        _terminate_waiting(CLAIM_SENT)
        blocker.rollback()
    assert owner.outcome() == {"result": "done"}
    assert "reading back" in owner.stderr
    run = the_run(task)
    assert (run.state, run.attempt) == (RunState.SUCCEEDED, 1)
    assert log_lines(log) == Counter({"start": 1, "end": 1})


@postgres_only
def test_redis_pg_kill__mid_claim_read_back_finds_another_owner_counted_once(
    child_env, redis_server, scratch
):
    """The claim's INSERT waits on another connection's row and is cut; that row is
    committed meanwhile: the read-back finds another owner's finished slot. The call
    does not run, and it is counted once, on the row, like any duplicate."""
    env = child_redis_env(child_env, redis_server)
    log, task = scratch / "x.log", "tests.pg_claim_other"
    with _blocker() as blocker:
        blocker.execute(
            "INSERT INTO taskguard_taskrun (task_name, slot, state, attempt, owner, created_at, "
            "started_at, finished_at, error, duplicates) VALUES "
            "(%s, %s, 'succeeded', 1, 'other', now(), now(), now(), '', 0)",
            [task, BASE_SLOT],
        )
        owner = hold(env, log, task, lease=5.0, seconds=0.5)
        _terminate_waiting(CLAIM_SENT)
        blocker.commit()
    assert owner.outcome() == {"result": None}
    run = the_run(task)
    assert (run.state, run.owner, run.duplicates) == (RunState.SUCCEEDED, "other", 1)
    assert not log.exists()


@postgres_only
def test_redis_pg_kill__a_claim_slower_than_its_lease_starts_lost(child_env, redis_server, scratch):
    """The claim waited longer than the lease (another connection's row): by the time it
    returns, its lease may be over by the database's clock. The attempt must count its
    lease from when it asked, so it is lost, not revived by its first renewal."""
    env = child_redis_env(child_env, redis_server)
    log, task = scratch / "x.log", "tests.pg_claim_slow"
    with _blocker() as blocker:
        blocker.execute(
            "INSERT INTO taskguard_taskrun (task_name, slot, state, attempt, owner, created_at, "
            "error, duplicates) VALUES (%s, %s, 'pending', 1, 'blocker', now(), '', 0)",
            [task, BASE_SLOT],
        )
        owner = hold(env, log, task, lease=LEASE, seconds=3 * LEASE)
        wait_for(lambda: _waiting(CLAIM_SENT))
        time.sleep(LEASE + 1.0)  # the claim waits past its whole lease
        blocker.rollback()
    late = owner.outcome()
    assert late["result"] is None and "lost its lease" in str(late["lease_lost"]), late
    assert log_lines(log) == Counter({"start": 1, "leaselost": 1})


@postgres_only
def test_redis_pg_kill__mid_finish_settled_by_reading_back(child_env, redis_server, scratch):
    env = child_redis_env(child_env, redis_server)
    log, task = scratch / "x.log", "tests.pg_finish"
    owner = hold(env, log, task, lease=6.0, seconds=1.0)
    started = owner.started()
    with _blocker() as blocker:
        blocker.execute(
            "SELECT 1 FROM taskguard_taskrun WHERE id = %s FOR UPDATE", [started["started"]]
        )
        _terminate_waiting(FINISH_SENT)
        time.sleep(0.3)
        blocker.commit()
    assert owner.outcome() == {"result": "done"}
    run = the_run(task)
    assert (run.state, run.attempt) == (RunState.SUCCEEDED, 1)
    assert states_path(run) == ["running", "succeeded"]
    assert log_lines(log) == Counter({"start": 1, "end": 1})


@postgres_only
def test_redis_pg_kill__mid_finish_of_a_taken_over_owner_is_refused(
    child_env, redis_server, scratch
):
    """A paused owner is taken over and the new attempt succeeds. The old owner resumes
    and finishes without checking; its finish is cut mid-statement: the read-back finds
    the state it wanted but another fence, and refuses it (``LeaseLost``).

    (Without the fence in that read-back this owner was told its run succeeded.)
    """
    env = child_redis_env(child_env, redis_server)
    log, task = scratch / "x.log", "tests.pg_finish_fenced"
    owner = Child(env, "hold", "--task", task, "--log", str(log), "--lease", str(LEASE),
                  "--seconds", "3", "--on-stale", "retry", "--no-check")  # fmt: skip
    owner.started()
    owner.signal(signal.SIGSTOP)
    try:
        time.sleep(3)  # past its body's own 3 s: it goes straight to its finish
        wait_for(lambda: lease_over(task))
        taker = hold(env, log, task, lease=LEASE, seconds=0.2, on_stale="retry")
        assert taker.outcome() == {"result": "done"}
        with _blocker() as blocker:
            # Its UPDATE matches no row (another fence), so a row lock would not stop it:
            # a table lock does (SHARE blocks every writer, no reader).
            blocker.execute("LOCK TABLE taskguard_taskrun IN SHARE MODE")
            owner.signal(signal.SIGCONT)
            _terminate_waiting(FINISH_SENT)
            blocker.commit()
    finally:
        owner.signal(signal.SIGCONT)
    late = owner.outcome()
    assert late["result"] is None and "refused" in str(late["lease_lost"]), late
    run = the_run(task)
    assert (run.state, run.attempt) == (RunState.SUCCEEDED, 2)
    assert states_path(run) == ["running", "retrying", "running", "succeeded"]


# (i) ---------------------------------------------------------------------------

SWARM = 120


def test_redis_swarm__120_processes_one_slot_one_winner(child_env, redis_server, scratch):
    """120 processes call one slot at once: one runs it, every other call is counted.

    How fast the losers were is printed, never asserted (2 shared cores): the
    speed bar is measured by ``bench/``.
    """
    env = child_redis_env(child_env, redis_server)
    log, results, go = scratch / "x.log", scratch / "results.jsonl", scratch / "go"
    parent = Child(env, "swarm", "--task", "tests.swarm", "--log", str(log), "--lease", "5",
                   "--seconds", "2", "--processes", str(SWARM), "--go", str(go),
                   "--results", str(results))  # fmt: skip
    # Every child has warmed up (one losing call) and waits: start them together.
    release([parent.process], go, count=SWARM, timeout=180)
    assert parent.outcome(timeout=180) == {"children": SWARM, "failed": 0}
    calls = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(calls) == SWARM
    (winner,) = [c for c in calls if c["won"]]
    losers = sorted(c["seconds"] for c in calls if not c["won"])
    print(
        f"{len(losers)} losers: median {statistics.median(losers) * 1000:.1f} ms, "
        f"max {losers[-1] * 1000:.1f} ms"
    )
    # The start was shared: losers called while the winner's body was running (2 s).
    during = [c for c in calls if not c["won"] and c["began"] < winner["ended"]]
    assert len(during) >= 2, "no loser met a live winner: the start barrier did not hold"
    assert log_lines(log) == Counter({"start": 1})
    run = the_run("tests.swarm")
    assert run.state == RunState.SUCCEEDED
    with redis_backend(redis_server) as lock:
        pending = sum(r.duplicates for r in lock.unrecorded_claims())
    assert run.duplicates + pending == SWARM - 1


# G3: a Redis winner killed before its database claim -----------------------------


def cleanup(*args: str) -> str:
    out = StringIO()
    call_command("cleanup_locks", *args, stdout=out)
    return out.getvalue().strip()


def cleanup_json(*args: str) -> dict[str, object]:
    """The counts of ``cleanup_locks --json`` (its lists of runs are other tests' business)."""
    found = dict(json.loads(cleanup("--json", *args)))
    return {name: found[name] for name in counts()}


def counts(**nonzero: int) -> dict[str, object]:
    return {**dict.fromkeys(["stale_runs", "released_locks", "orphan_keys"], 0),
            "unrecorded_slots": 0, "dry_run": False, **nonzero}  # fmt: skip


def test_redis_gap__winner_killed_before_its_row_is_recorded_by_cleanup_locks(
    child_env, redis_server, scratch
):
    env = child_redis_env(child_env, redis_server)
    log, task = scratch / "x.log", "tests.gap"
    # a lease long enough for the losers' interpreters to start on a busy machine
    dying = Child(env, "claim_then_die", "--task", task, "--log", str(log), "--lease", "30")
    assert dying.started() == {"acquired": "won"}
    dying.killed()  # it killed itself right after its Redis claim
    losers = [hold(env, log, task, lease=LEASE, seconds=0) for _ in range(2)]
    assert [loser.outcome() for loser in losers] == [{"result": None}] * 2
    assert not TaskRun.objects.exists()  # the losers wrote nothing; nobody recorded the slot
    abandoned: list[dict[str, object]] = []
    run_abandoned.connect(lambda **kw: abandoned.append(kw), weak=False, dispatch_uid="gap")
    try:
        with redis_backend(redis_server) as lock:
            held = guard_key(task, BASE_SLOT)
            record = claim_key(held)
            # The dead winner's lease still runs: nothing can tell it from a live winner
            # before its insert, so neither its key nor its record is touched.
            assert cleanup_json("--dry-run") == counts(dry_run=True)
            assert cleanup_json() == counts()
            assert lock.client.exists(held) and lock.client.exists(record)
            lock.client.pexpire(held, 1)  # its lease lapses (30 s in real time)
            wait_for(lambda: not lock.client.exists(held))
            assert cleanup("--dry-run") == (
                "Would abandon 0 stale runs, would release 0 locks, would remove 0 orphan keys, "
                "would record 1 slot whose Redis winner died."
            )
            with pytest.raises(CommandError, match=r"no run of a task named 'tests\.other'"):
                cleanup_json("--task", "tests.other")  # no row, no claim record: a typo
            assert not TaskRun.objects.exists() and lock.client.exists(record)
            # No row either, but a claim record names it: --task records its slot.
            assert cleanup_json("--task", task) == counts(unrecorded_slots=1)
            assert not lock.client.exists(record)
            assert cleanup_json() == counts()  # idempotent
    finally:
        run_abandoned.disconnect(dispatch_uid="gap")
    run = the_run(task)
    assert (run.state, run.attempt, run.fence, run.owner) == (RunState.ABANDONED, 0, None, "")
    assert (run.duplicates, run.started_at) == (2, None)
    assert run.finished_at is not None
    (transition,) = run.transitions.all()
    assert (transition.from_state, transition.to_state) == (RunState.PENDING, RunState.ABANDONED)
    assert "died before recording its claim" in transition.reason
    assert "2 calls found the slot taken" in transition.reason
    assert transition.owner.startswith("cleanup@")
    assert [(a["sender"], a["run_id"]) for a in abandoned] == [(task, run.id)]
    # on_stale="retry": the next call takes the recorded slot over, with a fence.
    taker = hold(env, log, task, lease=LEASE, seconds=0, on_stale="retry")
    assert taker.outcome() == {"result": "done"}
    run = the_run(task)
    assert (run.state, run.attempt, run.duplicates) == (RunState.SUCCEEDED, 1, 2)
    assert run.fence is not None
    assert states_path(run) == ["abandoned", "retrying", "running", "succeeded"]
    assert log_lines(log) == Counter({"start": 1, "end": 1})
    with redis_backend(redis_server) as lock:
        assert list(lock.unrecorded_claims()) == []


def test_redis_gap__cleanup_locks_task_records_a_task_known_to_redis(
    redis_server, transactional_db
):
    task = "tests.gap_task"
    with redis_backend(redis_server) as lock:
        key = guard_key(task, BASE_SLOT)
        assert lock.acquire(key, "dead", 30.0, task) is Acquired.WON
        assert lock.acquire(key, "loser", 30.0, task) is Acquired.LOST
        lock.client.pexpire(key, 1)  # the winner is dead: its lease lapses
        wait_for(lambda: not lock.client.exists(key))
        assert cleanup_json("--task", task) == counts(unrecorded_slots=1)
    run = the_run(task)
    assert (run.state, run.duplicates) == (RunState.ABANDONED, 1)


def test_redis_gap__cleaners_at_once_record_each_slot_and_loser_once(child_env, redis_server):
    env = child_redis_env(child_env, redis_server)
    task, slots = "tests.gap_many", 150
    with redis_backend(redis_server) as lock:
        for index in range(slots):  # winners that never write their row, 1-3 losers each
            key = guard_key(task, BASE_SLOT + timedelta(minutes=index))
            assert lock.acquire(key, f"dead{index}", 1.0, task) is Acquired.WON
            for loser in range(index % 3 + 1):
                assert lock.acquire(key, f"loser{loser}", 1.0, task) is Acquired.LOST
        wait_for(lambda: not list(lock.scan_run_keys()))
        assert len(list(lock.unrecorded_claims())) == slots
    cleaners = [
        subprocess.Popen([python(), "-m", "django", "cleanup_locks", "--json"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]  # fmt: skip
    reports = []
    for cleaner in cleaners:
        out, err = cleaner.communicate(timeout=120)
        assert cleaner.returncode == 0, err
        reports.append(json.loads(out))
    assert sum(report["unrecorded_slots"] for report in reports) == slots
    runs = TaskRun.objects.filter(task_name=task).order_by("slot")
    assert set(runs.values_list("state", flat=True)) == {RunState.ABANDONED}
    assert [run.duplicates for run in runs] == [index % 3 + 1 for index in range(slots)]
    assert TaskRunTransition.objects.filter(run__task_name=task).count() == slots
    with redis_backend(redis_server) as lock:
        assert list(lock.unrecorded_claims()) == []


# soak ----------------------------------------------------------------------------


CHAOS = ["flushall", "restart", "script_flush", "kill", "pause"]


def inflict(server, chaos: str) -> None:  # type: ignore[no-untyped-def]
    """Put ``chaos`` on ``server``; when this returns, the fault has hit (a killed server
    is started again afterwards, in ``recover``)."""
    if chaos == "restart":
        server.restart()
    elif chaos == "kill":
        server.kill()
    elif chaos == "pause":  # every command stalls past the lock client's socket timeout
        command(server, "client_pause", 1500, True)
    else:
        command(server, chaos)


def recover(server, chaos: str) -> None:  # type: ignore[no-untyped-def]
    if chaos == "kill":
        time.sleep(0.5)
        server.start()


SOAK_SECONDS = float(os.environ.get("TASKGUARD_SOAK_SECONDS", "10"))


@pytest.mark.soak
@pytest.mark.timeout(SOAK_SECONDS + 600)  # a long soak is not a hang
def test_redis_soak__racers_under_redis_chaos_run_each_slot_once(child_env, redis_server, scratch):
    """Racers under each kind of Redis chaos in turn, each landing mid-run.

    Every kind runs at least once, however short ``TASKGUARD_SOAK_SECONDS`` is; the
    kinds cycle in a fixed order, so a CI run is the same run every time.
    """
    seconds = SOAK_SECONDS
    env = child_redis_env(child_env, redis_server)
    deadline = time.monotonic() + seconds
    rounds, slots = 0, 200
    while rounds < len(CHAOS) or time.monotonic() < deadline:
        log, task = scratch / f"soak-{rounds}.log", f"tests.soak.{rounds}"
        racers = start_racers(env, log, task, 4, slots)
        chaos = CHAOS[rounds % len(CHAOS)]
        wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= 5)  # noqa: B023
        inflict(redis_server, chaos)
        landed = len(log.read_text().splitlines())
        recover(redis_server, chaos)
        for racer in racers:
            _, err = racer.communicate(timeout=300)
            assert racer.returncode == 0, err
            assert_no_heartbeat_crash(err)
        assert landed < slots, f"{chaos} landed after the racers had finished"
        executions = Counter(line.split()[0] for line in log.read_text().splitlines())
        assert len(executions) == slots and set(executions.values()) == {1}, (chaos, executions)
        runs = TaskRun.objects.filter(task_name=task)
        assert set(runs.values_list("state", flat=True)) == {RunState.SUCCEEDED}
        print(f"soak round {rounds}: {chaos} after {landed} of {slots} slots")
        rounds += 1
    print(f"soak: {rounds} rounds in {seconds:.0f} s")
