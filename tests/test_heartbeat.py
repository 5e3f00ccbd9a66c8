"""The heartbeat under real faults: row locks held elsewhere, killed connections, late renewals.

Guarded calls run in threads of this process (they share its heartbeat); the
faults are real: another PostgreSQL connection holding a run's row with
``SELECT ... FOR UPDATE``, ``pg_terminate_backend`` on the renewing connection,
another SQLite connection holding the write lock. What happened is read from
the database (``pg_stat_activity``, the rows' leases) and from events, never
from elapsed time.
"""

from __future__ import annotations

import os
import queue
import signal
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection, connections

from django_taskguard import current_run, heartbeat, ledger, once_per_schedule
from django_taskguard.context import ActiveRun, active_run
from django_taskguard.exceptions import LeaseLost
from django_taskguard.locks.redis_scripts import FINISHED_MARKER
from django_taskguard.models import RunState, TaskRun
from django_taskguard.signals import lease_lost

from .support.redis_support import command, redis_backend
from .support.slots import BASE_SLOT
from .support.waiting import wait_for

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]

SLOT = BASE_SLOT + timedelta(hours=3)
TABLE = TaskRun._meta.db_table
postgres_only = pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL faults")
sqlite_only = pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's write lock")


class Call:
    """One guarded call in its own thread; its body holds until ``end()``.

    With ``checking``, the body calls ``current_run().check()`` in a loop and
    records a ``LeaseLost`` (then re-raises it).
    """

    def __init__(self, name: str, lease: float, *, checking: bool = False) -> None:
        self.name = name
        self.checking = checking
        self.ending = threading.Event()
        self.body_ended = threading.Event()
        self.raised: BaseException | None = None
        self.result: Any = None
        self.lease_lost: LeaseLost | None = None
        self._started: queue.Queue[ActiveRun] = queue.Queue()
        self.task = once_per_schedule(name=name, lease_seconds=lease)(self._body)
        self.thread = threading.Thread(target=self._call, name=name)
        self.thread.start()
        self.run: ActiveRun = self._started.get(timeout=60)

    def _body(self) -> str:
        run = current_run()
        self._started.put(run)
        try:
            while not self.ending.wait(0.05):
                if self.checking:
                    try:
                        run.check()
                    except LeaseLost as exc:
                        self.lease_lost = exc
                        raise
            return self.name
        finally:
            self.body_ended.set()

    def _call(self) -> None:
        try:
            self.result = self.task.run_for_slot(SLOT)
        except BaseException as exc:
            self.raised = exc
        finally:
            connections.close_all()  # this thread's connection

    def end(self) -> None:
        self.ending.set()

    def join(self) -> Any:
        self.thread.join(60)
        assert not self.thread.is_alive(), f"{self.name} did not return"
        if self.raised is not None:
            raise self.raised
        return self.result

    def lease_until(self) -> datetime | None:
        return TaskRun.objects.get(pk=self.run.id).lease_until


@pytest.fixture
def calls() -> Iterator[list[Call]]:
    """Calls to end (and join) after the test, whatever happened."""
    started: list[Call] = []
    yield started
    for call in started:
        call.end()
        call.thread.join(60)


class RowLock:
    """Another PostgreSQL connection holding rows with ``SELECT ... FOR UPDATE``."""

    def __init__(self, run_id: int) -> None:
        s = connection.settings_dict
        self.conn = psycopg.connect(
            dbname=s["NAME"],
            user=s["USER"],
            host=s["HOST"],
            port=s["PORT"],
            password=s.get("PASSWORD") or None,
        )
        self.pid = self.conn.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        self.conn.execute(f"SELECT id FROM {TABLE} WHERE id = %s FOR UPDATE", [run_id])

    def release(self) -> None:
        if not self.conn.closed:
            self.conn.rollback()
            self.conn.close()


@contextmanager
def row_locked(run_id: int) -> Iterator[RowLock]:
    lock = RowLock(run_id)
    try:
        yield lock
    finally:
        lock.release()


def blocked_by(lock: RowLock, *, younger_than: float | None = None) -> list[str]:
    """The statements waiting for a lock while ``lock`` holds its row (one snapshot).

    A second waiter for the row queues behind the first (it waits for the
    tuple lock the first one holds), so waiters are found by their wait, not
    by ``pg_blocking_pids``. ``younger_than``: only statements that started
    less than that many seconds ago.
    """
    assert not lock.conn.closed
    query = (
        "SELECT query FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() AND pid <> %s AND wait_event_type = 'Lock'"
    )
    params: list[Any] = [lock.pid]
    if younger_than is not None:
        query += " AND clock_timestamp() - query_start < make_interval(secs => %s)"
        params.append(younger_than)
    with connection.cursor() as cursor:
        cursor.execute(query, params)
        return [text for (text,) in cursor.fetchall()]


def is_renewal(statement: str) -> bool:
    return "SET lease_until" in statement


def is_finish(statement: str) -> bool:
    # A change's UPDATE; a finish on PostgreSQL is its function's call.
    return "SET state" in statement or "taskguard_end_attempt_v1(" in statement


def renewal_failures(caplog: pytest.LogCaptureFixture, run_id: int) -> int:
    prefix = f"taskguard heartbeat could not renew run {run_id} "
    return sum(1 for r in caplog.records if r.getMessage().startswith(prefix))


def renewed_after(call: Call, since: datetime | None, times: int = 1) -> Callable[[], bool]:
    """A predicate: ``call``'s lease has moved on ``times`` times since it read ``since``."""
    seen = {since}

    def check() -> bool:
        seen.add(call.lease_until())
        return len(seen) > times

    return check


@postgres_only
def test_heartbeat__a_row_lock_on_one_run_starves_no_other_and_delays_no_return(calls, caplog):
    """Run A's row is held elsewhere for longer than A's renewal timeout.

    B, in the same process, keeps renewing; A's renewals time out and are
    retried; A is not lost (the block ends before its deadline); A's body ends
    while a renewal of A is still waiting, and A's finish goes to the database
    at once instead of waiting for that renewal.
    """
    lost: list[int] = []

    def receiver(sender: str, run: ActiveRun, **kwargs: Any) -> None:
        lost.append(run.id)

    lease_lost.connect(receiver, weak=False)
    try:
        # A: 30 s lease, renewed every 10 s, each renewal bounded to 3 s. B: 3 s lease.
        a = Call("tests.heartbeat.a", 30)
        calls.append(a)
        b = Call("tests.heartbeat.b", 3, checking=True)
        calls.append(b)
        with row_locked(a.run.id) as lock:
            wait_for(
                lambda: any(map(is_renewal, blocked_by(lock))), what="A's renewal to be blocked"
            )
            # B renews while A's renewal waits, and after it timed out and waits again.
            wait_for(renewed_after(b, b.lease_until(), times=2), what="B to renew twice")
            wait_for(
                lambda: renewal_failures(caplog, a.run.id) >= 1, what="A's renewal to time out"
            )
            wait_for(renewed_after(b, b.lease_until(), times=1), what="B to renew again")
            assert b.lease_lost is None and not b.run.lost.is_set()
            # A's body ends while a renewal of A has just begun waiting (it waits up to 3 s).
            wait_for(
                lambda: any(map(is_renewal, blocked_by(lock, younger_than=0.5))),
                what="a fresh renewal of A to be blocked",
            )
            a.end()
            assert a.body_ended.wait(30)
            both = wait_for(
                lambda: (lambda s: any(map(is_renewal, s)) and any(map(is_finish, s)))(
                    blocked_by(lock)
                ),
                timeout=20,
                what="A's finish to wait for the row while A's renewal still waits",
            )
            assert both
            assert not a.run.lost.is_set(), "the block ended before A's deadline"
        assert a.join() == "tests.heartbeat.a"
        b.end()
        assert b.join() == "tests.heartbeat.b"
    finally:
        lease_lost.disconnect(receiver)
    assert lost == []
    states = dict(TaskRun.objects.values_list("task_name", "state"))
    assert states == {
        "tests.heartbeat.a": RunState.SUCCEEDED,
        "tests.heartbeat.b": RunState.SUCCEEDED,
    }


@postgres_only
def test_heartbeat__a_block_past_the_deadline_loses_that_run_only(calls):
    """A's row is held past A's deadline: A (only) is lost; B keeps its lease throughout."""
    a = Call("tests.heartbeat.a", 3)
    calls.append(a)
    b = Call("tests.heartbeat.b", 3, checking=True)
    calls.append(b)
    with row_locked(a.run.id) as lock:
        assert a.run.lost.wait(30), "A's lease is lost past its deadline"
        assert "not renewed before its deadline" in a.run.lost_reason
        with pytest.raises(LeaseLost):
            a.run.check()
        # B renewed after A was lost, and has not lost its lease.
        wait_for(renewed_after(b, b.lease_until(), times=2), what="B to renew twice more")
        assert b.lease_lost is None and not b.run.lost.is_set()
        a.end()
        assert a.body_ended.wait(30)
        wait_for(lambda: any(map(is_finish, blocked_by(lock))), what="A's finish to be issued")
    assert a.join() == "tests.heartbeat.a"  # nobody took over: its late finish is recorded
    b.end()
    assert b.join() == "tests.heartbeat.b"
    run_a = TaskRun.objects.get(task_name="tests.heartbeat.a")
    assert run_a.state == RunState.SUCCEEDED
    assert "after its lease had expired" in run_a.transitions.order_by("id").last().reason  # type: ignore[union-attr]
    assert TaskRun.objects.get(task_name="tests.heartbeat.b").state == RunState.SUCCEEDED


def renewing_backends() -> list[int]:
    """Idle backends (other than ours) whose last statement was a renewal or its commit.

    The guarded call's own connection runs in autocommit (its last statement
    is the claim); only a renewal ends with ``COMMIT``.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND state = 'idle' "
            "AND (query = 'COMMIT' OR query LIKE %s)",
            ["%SET lease_until%"],
        )
        return [pid for (pid,) in cursor.fetchall()]


@postgres_only
def test_heartbeat__renewing_connection_terminated_the_renewal_is_retried(calls, caplog):
    """``pg_terminate_backend`` on the renewing connection: one renewal fails, a new
    connection renews, the run keeps its lease."""
    a = Call("tests.heartbeat.a", 6, checking=True)  # renewed every 2 s, deadline 6 s
    calls.append(a)
    victims = wait_for(renewing_backends, what="a renewal on the heartbeat's connection")
    with connection.cursor() as cursor:
        for pid in victims:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    wait_for(lambda: renewal_failures(caplog, a.run.id) >= 1, what="the renewal to fail")
    failed_at = a.lease_until()
    wait_for(renewed_after(a, failed_at), what="a renewal on a new connection")
    assert set(renewing_backends()).isdisjoint(victims)
    assert a.lease_lost is None and not a.run.lost.is_set()
    a.end()
    assert a.join() == "tests.heartbeat.a"
    assert TaskRun.objects.get().state == RunState.SUCCEEDED
    # No run is live any more: the renewers close their connections (and end).
    wait_for(lambda: not renewing_backends(), what="the heartbeat's connections to close")


@contextmanager
def backend_stopped(pid: int) -> Iterator[None]:
    """SIGSTOP one PostgreSQL backend of this machine's server: it hangs, neither
    answering nor refusing (its own statement timeout cannot fire), until SIGCONT."""
    host = connection.settings_dict["HOST"]
    if host not in ("127.0.0.1", "localhost", "::1"):
        pytest.skip("the PostgreSQL server is not on this machine")
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert b"postgres" in cmdline, cmdline
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@postgres_only
def test_heartbeat__a_hung_renewal_is_lost_at_the_deadline_and_not_waited_for(calls):
    """The renewing connection's server process stops (SIGSTOP) mid-run: A is declared
    lost at its deadline while that renewal still hangs, and A's call ends (its finish on
    its own connection) without waiting for it; the renewal, answered late, changes nothing."""
    a = Call("tests.heartbeat.a", 3)  # renewed every second; deadline 3 s after the last
    calls.append(a)
    (victim,) = wait_for(renewing_backends, what="a renewal on the heartbeat's connection")
    with backend_stopped(victim):
        assert a.run.lost.wait(30), "A is declared lost at its deadline"
        assert "a renewal was still waiting for the database" in a.run.lost_reason
        a.end()
        assert a.join() == "tests.heartbeat.a"
        run = TaskRun.objects.get()
        assert run.state == RunState.SUCCEEDED  # nobody took over: its late finish counts
        assert victim in renewing_backends(), "the hung renewal has not come back yet"
        resumed = ledger.database_now()
    # The hung renewal is answered now, and refused (the run is finished): once its
    # backend has moved on (idle again, or closed with the idle renewer), nothing changed.
    wait_for(lambda: moved_on(victim, resumed), what="the late renewal to be answered")
    assert TaskRun.objects.get().lease_until == run.lease_until
    assert TaskRun.objects.get().state == RunState.SUCCEEDED


def moved_on(pid: int, since: datetime) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT state, state_change FROM pg_stat_activity WHERE pid = %s", [pid])
        found = cursor.fetchone()
    return found is None or (found[0] == "idle" and found[1] > since)


@sqlite_only
def test_heartbeat__sqlite_write_lock_times_the_renewal_out(calls, caplog):
    """Another connection holds SQLite's write lock: the renewal gives up after its busy
    timeout (not the connection's 30 s), is retried, and renews once the lock is gone."""
    a = Call("tests.heartbeat.a", 12, checking=True)  # renewed every 4 s, bounded to 1.2 s
    calls.append(a)
    before = a.lease_until()
    blocker = sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        wait_for(
            lambda: renewal_failures(caplog, a.run.id) >= 1,
            timeout=20,
            what="the renewal to time out while the write lock is held",
        )
        assert a.lease_until() == before
    finally:
        blocker.rollback()
        blocker.close()
    wait_for(renewed_after(a, before), what="a renewal once the lock is gone")
    assert a.lease_lost is None and not a.run.lost.is_set()
    a.end()
    assert a.join() == "tests.heartbeat.a"
    assert TaskRun.objects.get().state == RunState.SUCCEEDED


def test_heartbeat__late_renewal_after_the_finish_is_refused(redis_server):
    """A renewal in flight when the attempt ends changes nothing: the ledger refuses it
    (state, fence), and Redis neither revives a released key nor touches the marker."""
    with redis_backend(redis_server) as lock:
        seen: list[ActiveRun] = []

        @once_per_schedule(name="tests.heartbeat.late")
        def body() -> str:
            seen.append(current_run())
            return "done"

        assert body.run_for_slot(SLOT) == "done"
        run = seen[0]
        key = lock.key("tests.heartbeat.late", SLOT)
        assert command(redis_server, "get", key) == FINISHED_MARKER.encode()
        marker_ttl = command(redis_server, "pttl", key)
        assert marker_ttl > 60_000
        # The row: finished, so no renewal (with or without bounds) touches it.
        assert ledger.renew(run.id, run.fence, 3, 0.5) is None
        assert ledger.renew(run.id, run.fence, 3) is None
        # A late renewal through the heartbeat itself: refused, not lost, nothing extended.
        beat = heartbeat.Beat(run, lock, key, stopped=True)
        heartbeat.renew(beat)
        assert not run.lost.is_set() and beat.next_at == float("inf")
        # A late extend: the marker is no token; a released key is not revived.
        assert not lock.extend(key, run.token, 3)
        assert command(redis_server, "get", key) == FINISHED_MARKER.encode()
        assert command(redis_server, "pttl", key) > 60_000
        command(redis_server, "delete", key)
        assert not lock.extend(key, run.token, 3)
        assert command(redis_server, "exists", key) == 0
    row = TaskRun.objects.get()
    assert row.state == RunState.SUCCEEDED and row.finished_at is not None


def test_heartbeat__start_failure_is_recorded_and_leaves_no_state(monkeypatch):
    """The heartbeat cannot start its thread: the function never started, so the slot is
    given back (recorded why), the error reaches the caller, and nothing is left behind
    (the next call of that slot runs it)."""
    fresh = heartbeat.Heartbeats()
    monkeypatch.setattr("django_taskguard.guard.heartbeats", fresh)
    ran: list[int] = []

    @once_per_schedule(name="tests.heartbeat.start")
    def body() -> str:
        ran.append(1)
        return "ran"

    def refuse(target: Callable[[], None], name: str) -> None:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patch:
        patch.setattr(heartbeat, "start_thread", refuse)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            body.run_for_slot(SLOT)
    assert ran == [] and active_run() is None and fresh.live() == 0
    run = TaskRun.objects.get()
    assert run.state == RunState.PENDING
    assert "can't start new thread" in run.transitions.order_by("id").last().reason  # type: ignore[union-attr]
    assert body.run_for_slot(SLOT) == "ran"
    assert ran == [1] and fresh.live() == 0
    assert TaskRun.objects.get().state == RunState.SUCCEEDED


def test_renewal_timeout__bounded_and_well_under_the_interval():
    assert heartbeat.renewal_timeout(1) == 0.5
    assert heartbeat.renewal_timeout(30) == 3.0
    assert heartbeat.renewal_timeout(86_400) == 5.0
    for lease in (5, 10, 30, 60, 3600):
        assert heartbeat.renewal_timeout(lease) <= lease / 3 / 1.5


def test_renew__timeout_applies_to_the_renewal_only():
    """A bounded renewal renews like an unbounded one and leaves the connection's
    own timeouts as they were."""
    row = ledger.claim("tests.heartbeat.bounded", SLOT, "h:1:a", 5, abandon_is_final=True)
    before = own_timeouts()
    assert ledger.renew(row.id, row.fence, 60, 0.5) is not None
    assert own_timeouts() == before
    assert ledger.renew(row.id, row.fence + 1000, 60, 0.5) is None
    assert own_timeouts() == before


def own_timeouts() -> list[Any]:
    statements = {
        "postgresql": ["SHOW statement_timeout", "SHOW lock_timeout"],
        "mysql": ["SELECT @@max_statement_time", "SELECT @@innodb_lock_wait_timeout"],
        "sqlite": ["PRAGMA busy_timeout"],
    }[connection.vendor]
    with connection.cursor() as cursor:
        found = []
        for statement in statements:
            cursor.execute(statement)
            found.append(cursor.fetchone()[0])  # type: ignore[index]
        return found
