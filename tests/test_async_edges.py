"""Guarded coroutines at the edges (issue 19): an event loop that ends mid-call, a claim
cancelled before its function started, the caller's transaction, a coroutine closed by the
garbage collector.

Held steps are held by signal receivers that wait on events, never by time.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import transaction

from django_taskguard import coroutines, heartbeat, once_per_key, once_per_schedule, signals
from django_taskguard.exceptions import TaskGuardError
from django_taskguard.locks import Acquired, get_backend
from django_taskguard.models import RunState, TaskRun
from django_taskguard.signals import run_started, run_succeeded

from .support.waiting import wait_for
from .test_async import SLOT, WAIT, in_thread, receiving

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]


def none_running() -> bool:
    return not TaskRun.objects.filter(state=RunState.RUNNING).exists()


def assert_given_back(run: TaskRun, why: str) -> None:
    """The run's last transition gave its slot or key back (``running -> pending``)."""
    assert (run.state, run.owner, run.lease_until) == (RunState.PENDING, "", None)
    last = run.transitions.order_by("id").last()
    assert last is not None and (last.from_state, last.to_state) == ("running", "pending")
    assert why in last.reason and "given back" in last.reason, last.reason


# --- item 1: every step that ends an attempt runs, even when the loop closes -------------


def test_async_loop_end__a_finish_queued_behind_busy_claims_is_still_recorded(lock_backend):
    """More claims than worker threads, each held inside its claim; the target call's
    function returns, and its finish waits in the queue when ``asyncio.run`` ends and
    cancels it. The finish still runs (recorded ``succeeded``, its lease no longer renewed),
    and no run is left ``running``.

    Regression: the cancelled finish never ran, and the heartbeat renewed the row's lease
    for as long as the process lived."""
    finish_behind_busy_claims(in_own_thread=True)


def finish_behind_busy_claims(*, in_own_thread: bool) -> None:
    """The scenario above; ``in_own_thread``: the finish is expected in a thread of its own
    (else on the loop's thread, when no thread could be started)."""
    blocked, go = threading.Semaphore(0), threading.Event()
    finished_in: list[str] = []
    in_body = threading.Event()
    ran: list[int] = []

    def hold(sender: str, **kwargs: Any) -> None:
        if sender == "tests.async.blocker":
            blocked.release()
            assert go.wait(WAIT)

    def finished(sender: str, **kwargs: Any) -> None:
        finished_in.append(threading.current_thread().name)

    @once_per_schedule(name="tests.async.target")
    async def target() -> str:
        in_body.set()
        await gate.wait()
        return "done"

    @once_per_schedule(name="tests.async.blocker")
    async def blocker() -> None:
        ran.append(1)

    size = coroutines._POOL_SIZE
    gate: asyncio.Event

    async def main() -> None:
        nonlocal gate
        gate = asyncio.Event()
        call = asyncio.ensure_future(target.run_for_slot(SLOT))
        await in_thread(lambda: in_body.wait(WAIT))
        # Fire and forget: each holds a worker thread in its claim (two wait in the queue).
        forgotten = [
            asyncio.ensure_future(blocker.run_for_slot(SLOT + timedelta(minutes=n + 1)))
            for n in range(size + 2)
        ]
        assert await in_thread(lambda: all(blocked.acquire(timeout=WAIT) for _ in range(size)))
        gate.set()
        for _ in range(20):  # loop turns (not time): the function returns, its finish is queued
            await asyncio.sleep(0)
        assert not call.done() and not finished_in  # the finish waits behind the held claims
        assert not any(task.done() for task in forgotten)

    with receiving(run_started, hold), receiving(run_succeeded, finished):
        asyncio.run(main())  # ends with every call still in flight, and cancels them
        go.set()
        wait_for(none_running, WAIT, "no run left running")
        # The row is written before run_succeeded is sent: wait for the receiver too.
        wait_for(lambda: finished_in, WAIT, "run_succeeded from the finish")
    assert ran == []
    run = TaskRun.objects.get(task_name="tests.async.target")
    assert (run.state, run.error) == (RunState.SUCCEEDED, "")
    assert finished_in  # run by the loop's fallback:
    assert ("taskguard-end" in finished_in[0]) is in_own_thread, finished_in
    wait_for(lambda: heartbeat.heartbeats.live() == 0, WAIT, "every heartbeat to stop")
    held = TaskRun.objects.filter(task_name="tests.async.blocker")
    assert held.count() == size  # the queued two never claimed
    for run in held:
        assert_given_back(run, "CancelledError")


def test_async_loop_end__fire_and_forget_calls_leave_no_run_running(lock_backend):
    """300 fire-and-forget calls in one ``asyncio.run``, which ends while they are at every
    step: none is left ``running``, and every call whose function returned is recorded
    ``succeeded``.

    Regression: a few rows (2 of 300 in the issue) were left running for good."""
    returned: set[int] = set()
    lock = threading.Lock()

    @once_per_key(key="job:{n}", name="tests.async.forgotten")
    async def job(n: int) -> int:
        await asyncio.sleep(0)
        with lock:
            returned.add(n)
        return n

    def some_succeeded() -> bool:
        done = TaskRun.objects.filter(task_name="tests.async.forgotten", state="succeeded")
        return done.count() >= 30

    async def main() -> None:
        forgotten = [asyncio.ensure_future(job(n)) for n in range(300)]
        await in_thread(lambda: wait_for(some_succeeded, WAIT, "30 calls to succeed"))
        assert not all(task.done() for task in forgotten)

    asyncio.run(main())
    wait_for(none_running, WAIT, "no run left running")
    runs = TaskRun.objects.filter(task_name="tests.async.forgotten")
    states = dict(runs.values_list("key", "state"))
    assert returned and all(states[f"job:{n}"] == RunState.SUCCEEDED for n in returned)
    wait_for(lambda: heartbeat.heartbeats.live() == 0, WAIT, "every heartbeat to stop")


def test_async_loop_end__a_finish_already_running_in_the_pool_runs_once(lock_backend, caplog):
    """The call's function returned and its finish is running in a pool thread (held in a
    ``run_succeeded`` receiver) when ``asyncio.run`` ends: the loop cancels the step's task,
    but the step already runs; the fallback thread must not run it a second time.

    Mutation check: without ``_Once`` the fallback ran ``returned`` again, was fenced out
    (``LeaseLost``) and reported a lease lost for a run that had succeeded."""
    in_finish, go = threading.Event(), threading.Event()
    succeeded: list[str] = []
    lost: list[str] = []

    def hold(sender: str, **kwargs: Any) -> None:
        succeeded.append(threading.current_thread().name)
        in_finish.set()
        assert go.wait(WAIT)

    def lease_lost(sender: str, **kwargs: Any) -> None:
        lost.append(sender)

    @once_per_schedule(name="tests.async.finishing")
    async def target() -> str:
        return "done"

    async def main() -> None:
        call = asyncio.ensure_future(target.run_for_slot(SLOT))
        await in_thread(lambda: in_finish.wait(WAIT))  # the finish runs in a pool thread
        assert not call.done()

    with (
        receiving(run_succeeded, hold),
        receiving(signals.lease_lost, lease_lost),
        caplog.at_level(logging.ERROR, logger="taskguard"),
    ):
        asyncio.run(main())  # cancels the call while its finish runs
        go.set()
        wait_for(lambda: heartbeat.heartbeats.live() == 0, WAIT, "the heartbeat to stop")
        for thread in threading.enumerate():
            if thread.name == "taskguard-end":
                thread.join(WAIT)
    run = TaskRun.objects.get(task_name="tests.async.finishing")
    assert (run.state, run.attempt) == (RunState.SUCCEEDED, 1)
    assert len(succeeded) == 1 and "taskguard-end" not in succeeded[0]
    assert lost == [] and "could not end" not in caplog.text, caplog.text


def test_elsewhere__a_thread_that_cannot_start_runs_the_step_here(lock_backend, monkeypatch):
    """No thread can be started for a finish the closing loop cancelled: it runs on the
    loop's own thread instead, and no run is left ``running``.

    Regression: ``Thread.start()``'s ``RuntimeError`` was raised in the closing loop and the
    finish never ran (the heartbeat kept renewing the row)."""
    real = threading.Thread

    class NoEnd(real):  # type: ignore[misc,valid-type]
        def start(self) -> None:
            if self.name == "taskguard-end":
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(coroutines.threading, "Thread", NoEnd)
    finish_behind_busy_claims(in_own_thread=False)


def test_elsewhere__an_error_in_the_step_is_logged_not_printed(caplog, monkeypatch):
    """A step run in a thread of its own that raises is logged on the ``taskguard`` logger,
    not left to ``threading.excepthook``."""
    hooked: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", hooked.append)

    def broken() -> None:
        raise RuntimeError("database gone")

    with caplog.at_level(logging.ERROR, logger="taskguard"):
        coroutines._elsewhere(broken)
        for thread in threading.enumerate():
            if thread.name == "taskguard-end":
                thread.join(WAIT)
    assert hooked == []
    assert "database gone" in caplog.text and "could not end an attempt" in caplog.text


# --- item 7: a claim whose function never started gives its slot or key back --------------


def test_async_cancel__a_keyed_call_cancelled_in_its_claim_gives_the_key_back(lock_backend):
    """An ASGI client disconnect cancels a keyed call while its claim is in a worker thread:
    the function never starts, so the key is given back (recorded why), and the next call
    with that key runs it, under the default ``on_stale="abandon"`` too.

    Regression: recorded ``abandoned``, and that key never ran again."""
    in_claim, cancelled = threading.Event(), threading.Event()
    ran: list[int] = []

    def hold_the_first_claim(**kwargs: Any) -> None:
        if not in_claim.is_set():
            in_claim.set()
            assert cancelled.wait(WAIT)

    @once_per_key(key="order:{n}", name="tests.async.charge")
    async def charge(n: int) -> int:
        ran.append(n)
        return n * 10

    async def disconnected() -> None:
        task = asyncio.ensure_future(charge(7))
        await in_thread(lambda: in_claim.wait(WAIT))
        task.cancel()
        await asyncio.sleep(0.05)  # the cancellation is delivered while the claim still waits
        cancelled.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    with receiving(run_started, hold_the_first_claim):
        asyncio.run(disconnected())
        assert ran == []
        assert_given_back(TaskRun.objects.get(task_name="tests.async.charge"), "CancelledError")
        assert heartbeat.heartbeats.live() == 0
        assert asyncio.run(charge(7)) == 70  # the next call takes the key
    assert ran == [7]
    run = TaskRun.objects.get(task_name="tests.async.charge")
    assert (run.state, run.attempt, run.duplicates) == (RunState.SUCCEEDED, 1, 0)
    lock = get_backend()
    key = lock.key_for("tests.async.charge", SLOT, "order:7")
    assert lock.acquire(key, "probe", 5, "tests.async.charge", run_key="order:7") in (
        Acquired.FINISHED,
        Acquired.BYPASSED,
    )


# --- item 8: asyncio.run inside the caller's transaction is refused -----------------------


def test_async__asyncio_run_inside_atomic_is_refused():
    """``asyncio.run(guarded())`` from sync code inside ``transaction.atomic()``: the claim
    would commit on its own and survive the caller's rollback. Refused, as the plain path
    and ``async_to_sync`` are.

    Regression: it ran, and its row stayed after the rollback."""
    ran: list[int] = []

    @once_per_schedule(name="tests.async.run_in_atomic")
    async def body() -> None:
        ran.append(1)

    with pytest.raises(TaskGuardError, match="inside an open transaction"), transaction.atomic():
        asyncio.run(body.run_for_slot(SLOT))
    assert ran == [] and not TaskRun.objects.filter(task_name="tests.async.run_in_atomic").exists()
    assert asyncio.run(body.run_for_slot(SLOT)) is None and ran == [1]  # outside: it runs


# --- item 11: a coroutine closed by the garbage collector ---------------------------------


def test_async__a_coroutine_closed_by_the_garbage_collector_is_recorded_quietly(caplog):
    """A call's task is dropped with its loop while the function awaits; the garbage
    collector closes the coroutine from another context. The attempt is recorded, and
    nothing is printed as an ignored exception (pytest turns one into an error here).

    Regression: ``ValueError: <Token ...> was created in a different Context``."""
    in_body = threading.Event()

    @once_per_schedule(name="tests.async.collected")
    async def body() -> None:
        in_body.set()
        await asyncio.Event().wait()  # never resumed

    loop = asyncio.new_event_loop()
    task = loop.create_task(body.run_for_slot(SLOT))
    loop.run_until_complete(in_thread(lambda: in_body.wait(WAIT)))
    loop.close()  # the task is never resumed nor cancelled
    del task
    gc.collect()

    def ended() -> bool:
        run = TaskRun.objects.filter(task_name="tests.async.collected").first()
        return run is not None and run.state != RunState.RUNNING

    wait_for(ended, WAIT, "the collected call's attempt to be ended")
    run = TaskRun.objects.get(task_name="tests.async.collected")
    assert run.state == RunState.ABANDONED and "GeneratorExit" in run.error
    wait_for(lambda: heartbeat.heartbeats.live() == 0, WAIT, "its heartbeat to stop")


def test_handoff__a_claim_given_up_on_sends_no_run_started(lock_backend):
    """The coroutine gave up waiting (cancelled, the loop closing) before its claim was
    made: no claim is made; after it was made, before it was opened: it is given back
    without ``run_started`` (``run_given_back`` ends it), and the next call takes it.

    Regression: a given-up claim was opened anyway, sent ``run_started``, and then only the
    give-back, with no ending signal for the ``run_started`` it had sent."""
    from django_taskguard.guard import REFUSED, Policy, begin

    name = "tests.async.given_up"
    started: list[str] = []
    given: list[str] = []

    def claim() -> Any:
        return begin(name, SLOT, Policy())

    early = coroutines._Handoff(claim)
    early.give_up()
    with (
        receiving(run_started, lambda sender, **kw: started.append(sender)),
        receiving(signals.run_given_back, lambda sender, **kw: given.append(kw["reason"])),
    ):
        assert early.open() is REFUSED
        assert not TaskRun.objects.filter(task_name=name).exists()

        def claim_then_gone() -> Any:
            claimed = claim()
            late.give_up()  # the coroutine goes away while the claim is made
            return claimed

        late = coroutines._Handoff(claim_then_gone)
        assert late.open() is REFUSED
    assert started == [] and len(given) == 1 and "CancelledError" in given[0]
    assert_given_back(TaskRun.objects.get(task_name=name), "CancelledError")
