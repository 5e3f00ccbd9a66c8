"""Guarded coroutine functions: real concurrency on one event loop, and in several processes.

Each test runs its own loop (``asyncio.run``). That the loop is never blocked is
shown by events, not by time: signal receivers that run inside the claim and the
finish wait for a ticker coroutine on the same loop to tick; were they on the
loop's thread, the ticker could not tick and they would time out. Tests that barely
depend on the database are marked ``once`` (scripts/test.sh runs them on PostgreSQL only).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
from asgiref.sync import iscoroutinefunction, sync_to_async
from django.db import connections

from django_taskguard import current_run, heartbeat, ledger, once_per_key, once_per_schedule
from django_taskguard.cleanup import cleanup_locks
from django_taskguard.context import ActiveRun, active_run
from django_taskguard.decorating import dotted_name
from django_taskguard.exceptions import LeaseLost
from django_taskguard.locks import Acquired, get_backend
from django_taskguard.models import RunState, TaskRun
from django_taskguard.registry import entries, unregister
from django_taskguard.signals import duplicate_suppressed, run_started, run_succeeded

from .support.children import python
from .support.redis_support import child_redis_env
from .support.runs import counted_duplicates
from .support.slots import BASE_SLOT
from .support.waiting import wait_for
from .test_race import assert_raced, go_file, release

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]

SLOT = BASE_SLOT + timedelta(hours=5)
T = TypeVar("T")
WAIT = 30.0  # seconds an event may take on a loaded machine before the test fails


class Ticker:
    """A coroutine that ticks on the loop; threads wait until it has ticked again."""

    def __init__(self) -> None:
        self.ticks = 0
        self.changed = threading.Condition()
        self.stop = False
        self.loop_thread = threading.get_ident()

    async def run(self) -> None:
        self.loop_thread = threading.get_ident()
        while not self.stop:
            with self.changed:
                self.ticks += 1
                self.changed.notify_all()
            await asyncio.sleep(0.001)

    def wait_ticks(self, more: int = 2) -> None:
        """From a worker thread: block until the loop has ticked ``more`` times (or fail)."""
        assert threading.get_ident() != self.loop_thread, "a blocking step ran on the loop"
        with self.changed:
            target = self.ticks + more
            assert self.changed.wait_for(lambda: self.ticks >= target, WAIT), "loop blocked"


async def in_thread(func: Callable[[], T]) -> T:
    """Run the blocking ``func`` in a worker thread and close that thread's connections."""

    def call() -> T:
        try:
            return func()
        finally:
            connections.close_all()

    return await sync_to_async(call, thread_sensitive=False)()


@contextmanager
def receiving(signal: Any, receiver: Any) -> Iterator[None]:
    signal.connect(receiver, weak=False)
    try:
        yield
    finally:
        signal.disconnect(receiver)


@pytest.mark.once
def test_async__decorators_return_coroutine_functions():
    @once_per_schedule(every=timedelta(minutes=1))
    async def scheduled() -> int:
        return 1

    @once_per_key(key="k:{n}")
    async def keyed(n: int) -> int:
        return n

    unregister(dotted_name(scheduled.__wrapped__))
    assert iscoroutinefunction(scheduled) and iscoroutinefunction(keyed)
    assert iscoroutinefunction(scheduled.run_for_slot)
    assert keyed.key_of(3) == "k:3" and scheduled.__wrapped__.__name__ == "scheduled"


@pytest.mark.smoke  # the version matrix's smoke set (scripts/matrix.sh)
def test_async__many_tasks_one_slot_one_runs_and_the_loop_keeps_ticking(lock_backend):
    """50 tasks on one loop call the same slot: one runs, 49 get None and are counted.
    The claim (duplicate_suppressed, run_started) and the finish (run_succeeded) run in
    worker threads, two claims at once at least, while the loop goes on."""
    ticker = Ticker()
    ran: list[ActiveRun] = []
    claims_in_flight = threading.Barrier(2, timeout=WAIT)  # two losers in their claims at once
    losers = Counter[int]()
    lock = threading.Lock()

    def on_duplicate(**kwargs: Any) -> None:
        with lock:
            losers[threading.get_ident()] += 1
            first_two = sum(losers.values()) <= 2
        if first_two:
            claims_in_flight.wait()
        ticker.wait_ticks()

    def on_step(**kwargs: Any) -> None:
        ticker.wait_ticks()

    @once_per_schedule(name="tests.async.many")
    async def body() -> str:
        run = current_run()
        ran.append(run)
        await asyncio.sleep(0.01)  # the others claim while this one runs
        assert current_run() is run
        return "ran"

    async def main() -> list[str | None]:
        ticking = asyncio.ensure_future(ticker.run())
        try:
            return await asyncio.gather(*(body.run_for_slot(SLOT) for _ in range(50)))
        finally:
            ticker.stop = True
            await ticking

    with (
        receiving(duplicate_suppressed, on_duplicate),
        receiving(run_started, on_step),
        receiving(run_succeeded, on_step),
    ):
        results = asyncio.run(main())

    assert results.count("ran") == 1 and results.count(None) == 49
    assert len(ran) == 1 and active_run() is None
    assert sum(losers.values()) == 49 and ticker.loop_thread not in losers
    run = TaskRun.objects.get(task_name="tests.async.many")
    assert (run.state, run.fence) == (RunState.SUCCEEDED, ran[0].fence)
    assert counted_duplicates("tests.async.many") == 49


@pytest.mark.once
def test_async__lease_renewed_while_awaiting_and_current_run_inside():
    @once_per_schedule(name="tests.async.lease", lease_seconds=2)
    async def body() -> dict[str, Any]:
        run = current_run()
        first_deadline = run.deadline
        row = await in_thread(lambda: run.run)  # the row: read off the loop
        while time.monotonic() < first_deadline + 0.7:  # outlive the first lease
            await asyncio.sleep(0.05)
        run.check()  # renewed meanwhile: no LeaseLost
        lease_until = await in_thread(lambda: TaskRun.objects.get(pk=run.id).lease_until)
        return {"renewed": run.deadline > first_deadline, "row": row.pk == run.id,
                "lease_until": lease_until, "first": row.lease_until, "slot": run.slot}  # fmt: skip

    outcome = asyncio.run(body.run_for_slot(SLOT))
    assert outcome["renewed"] and outcome["row"] and outcome["slot"] == SLOT
    assert outcome["lease_until"] > outcome["first"]
    assert TaskRun.objects.get(task_name="tests.async.lease").state == RunState.SUCCEEDED
    assert heartbeat.heartbeats.live() == 0


@pytest.mark.once
def test_async__lease_lost_when_taken_over_check_raises_and_finish_is_refused():
    """An operator abandons the running row: the next renewal is refused, ``check()`` in
    the coroutine raises ``LeaseLost``, and nothing more is recorded for the attempt."""

    def abandon(run_id: int) -> None:
        row = ledger.read_by_id(run_id)
        assert row is not None
        assert ledger.abandon(row, actor="tests", reason="taken away", lease="") is not None

    @once_per_schedule(name="tests.async.lost", lease_seconds=3)
    async def body() -> str:
        run = current_run()
        await in_thread(lambda: abandon(run.id))
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            run.check()
            await asyncio.sleep(0.05)
        return "not lost"

    with pytest.raises(LeaseLost, match="lost its lease"):
        asyncio.run(body.run_for_slot(SLOT))
    run = TaskRun.objects.get(task_name="tests.async.lost")
    assert (run.state, run.error) == (RunState.ABANDONED, "taken away")
    assert heartbeat.heartbeats.live() == 0


@pytest.mark.once
def test_async__exception_reaches_the_caller_and_is_recorded():
    @once_per_key(key="order:{n}")
    async def charge(n: int) -> int:
        await asyncio.sleep(0)
        raise ValueError(f"card {n} declined")

    with pytest.raises(ValueError, match="card 7 declined"):
        asyncio.run(charge(7))
    run = TaskRun.objects.get(key="order:7")
    assert run.state == RunState.FAILED and run.error == "ValueError: card 7 declined"
    assert asyncio.run(charge(7)) is None  # a failed key is over


@pytest.mark.once
def test_async__keyed_duplicates_on_one_loop_get_the_stored_result(lock_backend):
    calls = 0

    @once_per_key(key="doc:{n}", return_result=True)
    async def render(n: int) -> dict[str, int]:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        return {"n": n}

    async def main() -> list[Any]:
        first = await asyncio.gather(*(render(1) for _ in range(10)))
        return [*first, await render(1)]

    results = asyncio.run(main())
    assert calls == 1 and results.count({"n": 1}) >= 2  # the winner and the late caller
    assert results.count(None) + results.count({"n": 1}) == 11


@pytest.mark.once
def test_async__cancelled_while_running_is_recorded_and_raised(lock_backend):
    started = threading.Event()

    @once_per_schedule(name="tests.async.cancel")
    async def body() -> str:
        started.set()
        await asyncio.Event().wait()  # until cancelled
        return "never"

    async def main() -> None:
        task = asyncio.ensure_future(body.run_for_slot(SLOT))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())
    assert_cancelled_and_freed("tests.async.cancel")


@pytest.mark.smoke  # the version matrix's smoke set (scripts/matrix.sh)
@pytest.mark.once
def test_async__wait_for_timeout_during_the_claim_raises_timeout_error_and_gives_back():
    """``asyncio.wait_for``'s timeout (0.5 s) passes while the claim is in its worker thread
    (a ``run_started`` receiver holds it 3 s): the caller gets its ``TimeoutError`` and the
    slot is given back (the function never started)."""
    ran: list[int] = []

    def hold(sender: str, **kwargs: Any) -> None:
        if sender == "tests.async.timeout":
            threading.Event().wait(3.0)  # well past the timeout

    @once_per_schedule(name="tests.async.timeout")
    async def body() -> None:
        ran.append(1)

    async def main() -> None:
        await asyncio.wait_for(body.run_for_slot(SLOT), timeout=0.5)

    with receiving(run_started, hold), pytest.raises(asyncio.TimeoutError):
        asyncio.run(main())
    assert ran == []
    assert_cancelled_and_freed("tests.async.timeout", given_back=True)


@pytest.mark.smoke  # the version matrix's smoke set (scripts/matrix.sh)
@pytest.mark.once
def test_async__a_timeout_in_the_function_raises_timeout_error_and_is_recorded():
    """``asyncio.timeout`` passes once the function runs (expired by hand when it started):
    the caller gets its ``TimeoutError``, the run is recorded interrupted."""
    started = threading.Event()

    @once_per_schedule(name="tests.async.timeout")
    async def body() -> None:
        started.set()
        await asyncio.Event().wait()  # never returns

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(None) as deadline:
            call = asyncio.ensure_future(body.run_for_slot(SLOT))
            await in_thread(lambda: started.wait(WAIT))
            deadline.reschedule(loop.time())
            await call

    with pytest.raises(TimeoutError):
        asyncio.run(main())
    assert_cancelled_and_freed("tests.async.timeout", given_back=False)


@pytest.mark.smoke  # the version matrix's smoke set (scripts/matrix.sh)
@pytest.mark.once
def test_async__cancelled_during_the_claim_gives_the_slot_back_and_never_runs(lock_backend):
    """Cancelled while its claim is in a worker thread: the claim is seen through, then
    the slot given back (nothing ran: the next call takes it); the function never starts."""
    in_claim, cancelled = threading.Event(), threading.Event()
    ran = []

    def hold_the_claim(**kwargs: Any) -> None:
        in_claim.set()
        assert cancelled.wait(WAIT)

    @once_per_schedule(name="tests.async.cancel_claim")
    async def body() -> None:
        ran.append(1)

    async def main() -> None:
        task = asyncio.ensure_future(body.run_for_slot(SLOT))
        while not in_claim.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.05)  # the cancellation is delivered while the claim still waits
        cancelled.set()
        await task

    with receiving(run_started, hold_the_claim), pytest.raises(asyncio.CancelledError):
        asyncio.run(main())
    assert ran == []
    assert_cancelled_and_freed("tests.async.cancel_claim", given_back=True)


@pytest.mark.once
def test_async__the_loop_closing_while_it_claims_leaves_no_live_attempt_behind(lock_backend):
    """asyncio.run ends with the call still claiming (a fire-and-forget task): the loop
    cancels the claim's step too, and nobody awaits it. The claiming thread ends the
    attempt itself (its slot given back: the function never started), instead of leaving
    it running with a live heartbeat."""
    in_claim, loop_gone = threading.Event(), threading.Event()
    ran = []

    def hold_the_claim(**kwargs: Any) -> None:
        in_claim.set()
        assert loop_gone.wait(WAIT)

    @once_per_schedule(name="tests.async.orphaned")
    async def body() -> None:
        ran.append(1)

    async def main() -> None:
        orphan = asyncio.ensure_future(body.run_for_slot(SLOT))  # never awaited
        while not in_claim.is_set():
            await asyncio.sleep(0.01)
        assert not orphan.done()

    with receiving(run_started, hold_the_claim):
        asyncio.run(main())
        loop_gone.set()

        def ended() -> bool:
            run = TaskRun.objects.filter(task_name="tests.async.orphaned").first()
            return run is not None and run.state != RunState.RUNNING

        wait_for(ended, WAIT, "the attempt nobody awaited to be ended")
    assert ran == []
    assert_cancelled_and_freed("tests.async.orphaned", given_back=True)


@pytest.mark.once
def test_async__refused_inside_the_transaction_of_the_sync_code_that_calls_it():
    """async_to_sync from inside atomic(): the claim would commit on its own while the
    caller's work could still roll back. Refused, as on the plain path."""
    from asgiref.sync import async_to_sync
    from django.db import transaction

    from django_taskguard.exceptions import TaskGuardError

    ran = []

    @once_per_schedule(name="tests.async.in_atomic")
    async def body() -> None:
        ran.append(1)

    with transaction.atomic(), pytest.raises(TaskGuardError, match="inside an open transaction"):
        async_to_sync(body.run_for_slot)(SLOT)
    assert ran == [] and not TaskRun.objects.filter(task_name="tests.async.in_atomic").exists()
    assert async_to_sync(body.run_for_slot)(SLOT) is None and ran == [1]  # outside: it runs


@pytest.mark.once
def test_async__a_task_spawned_inside_learns_the_attempt_ended():
    """A task the coroutine spawns inherits current_run(); after the call ended, check()
    says the attempt holds no lease any more (it did not pass until the old deadline)."""
    seen: list[str] = []
    go = asyncio.Event

    @once_per_schedule(name="tests.async.spawned")
    async def body() -> asyncio.Task[None]:
        started = go()

        async def later() -> None:
            await started.wait()
            try:
                current_run().check()
                seen.append("passed")
            except LeaseLost as exc:
                seen.append(str(exc))

        started_task = asyncio.ensure_future(later())
        body.gate = started  # type: ignore[attr-defined]
        return started_task

    async def main() -> None:
        spawned = await body.run_for_slot(SLOT)
        body.gate.set()  # type: ignore[attr-defined]
        await spawned

    asyncio.run(main())
    assert len(seen) == 1 and "has ended" in seen[0], seen


def assert_cancelled_and_freed(task_name: str, *, given_back: bool = False) -> None:
    """Cancelled in its function: recorded interrupted; before it (``given_back``): the
    slot is pending again, the reason logged. Either way no heartbeat, and the lock free."""
    run = TaskRun.objects.get(task_name=task_name)
    reason = run.transitions.order_by("id").last().reason  # type: ignore[union-attr]
    if given_back:
        assert (run.state, run.attempt, run.owner) == (RunState.PENDING, 0, "")
        assert "CancelledError" in reason and "given back" in reason, reason
    else:
        assert run.state == RunState.ABANDONED
        assert reason == "interrupted (CancelledError)"
    assert heartbeat.heartbeats.live() == 0
    lock = get_backend()
    key = lock.key_for(task_name, SLOT, None)
    probe = lock.acquire(key, "probe", 5, task_name)  # BYPASSED: the row is the lock
    assert probe in (Acquired.WON, Acquired.BYPASSED), "the lock was not freed"
    lock.release(key, "probe")


@pytest.mark.once
def test_async__run_schedules_fires_a_coroutine_function():
    """The scheduler's threads have no loop: a registered coroutine function is run to its end."""
    seen: list[ActiveRun] = []

    @once_per_schedule(name="tests.async.fired", every=timedelta(minutes=1))
    async def tick() -> None:
        await asyncio.sleep(0)
        seen.append(current_run())

    try:
        assert entries()["tests.async.fired"].fire(SLOT) is True
    finally:
        unregister("tests.async.fired")
    assert len(seen) == 1 and seen[0].slot == SLOT
    assert TaskRun.objects.get(task_name="tests.async.fired").state == RunState.SUCCEEDED


PROCESSES, SLOTS, TASKS = 4, 20, 5


@pytest.mark.file_and_server
@pytest.mark.processes
@pytest.mark.parametrize("backend", ["database", "redis"])
def test_async_race__processes_each_with_a_loop_of_tasks_run_each_slot_once(
    backend, child_env, scratch, request
):
    """4 processes, each a loop with 5 tasks on each of 20 slots: every slot runs once."""
    env = child_env
    if backend == "redis":
        env = child_redis_env(child_env, request.getfixturevalue("redis_server"))
    log, task = scratch / "executions.log", f"tests.async_race.{backend}"
    argv = [python(), "-m", "tests.support.proc", "async_race", "--task", task, "--log", str(log),
            "--slots", str(SLOTS), "--tasks", str(TASKS), "--go", str(go_file(log))]  # fmt: skip
    racers = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(PROCESSES)
    ]
    release(racers, go_file(log))
    outcomes = []
    for racer in racers:
        out, err = racer.communicate(timeout=300)
        assert racer.returncode == 0, err
        outcomes.append(json.loads(out.strip().splitlines()[-1]))

    executions = Counter(line.split()[0] for line in Path(log).read_text().splitlines())
    assert len(executions) == SLOTS and set(executions.values()) == {1}, executions
    assert sum(o["won"] for o in outcomes) == SLOTS
    assert sum(o["lost"] for o in outcomes) == SLOTS * (PROCESSES * TASKS - 1)
    assert_raced(outcomes)
    if backend == "redis":
        with _redis(request):
            cleanup_locks()  # fold the duplicates counted in Redis into the rows
    runs = TaskRun.objects.filter(task_name=task)
    assert set(runs.values_list("state", flat=True)) == {RunState.SUCCEEDED}
    assert sum(runs.values_list("duplicates", flat=True)) == SLOTS * (PROCESSES * TASKS - 1)


@contextmanager
def _redis(request: pytest.FixtureRequest) -> Iterator[None]:
    from .support.redis_support import redis_backend

    with redis_backend(request.getfixturevalue("redis_server")):
        yield
