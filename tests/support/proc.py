"""Entry point of the real child processes the tests start.

``python -m tests.support.proc SCENARIO [options]``; the database (and Redis, if any)
come from the environment that ``child_env`` builds. Every execution of a
guarded body appends one line to ``--log`` with O_APPEND: an unfenced side
effect that counts executions no matter what the ledger says.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import django

from tests.support.slots import BASE_SLOT


def record(log: str, line: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def wait_until(start_at: float) -> None:
    delay = start_at - time.time()
    if delay > 0:
        time.sleep(delay)


def barrier(args: argparse.Namespace) -> None:
    """Wait for the start: ``--go FILE`` (say ready in ``FILE.ready``, wait until FILE exists).

    A start on a wall-clock time is a guess: a process still importing Django on a loaded
    machine misses it and runs alone. The go file is an event the parent sends once every
    child has said it is ready (``tests.race.release``).
    """
    if not args.go:
        wait_until(args.start_at)
        return
    record(args.go + ".ready", str(os.getpid()))
    deadline = time.monotonic() + 120
    while not os.path.exists(args.go):
        if time.monotonic() > deadline:
            raise SystemExit("the go file never came")
        time.sleep(0.002)


def race(args: argparse.Namespace) -> dict[str, int]:
    """Fire slots 0..N-1 of one task as fast as possible; count wins and losses."""
    from django_taskguard import current_run, once_per_schedule

    @once_per_schedule(name=args.task)
    def body(index: int) -> int:
        run = current_run()
        record(args.log, f"{index} {os.getpid()} {run.fence} {time.time():.6f}")
        return index

    barrier(args)
    began = time.time()
    won = lost = 0
    for index in range(args.slots):
        slot = BASE_SLOT + timedelta(minutes=index)
        if body.run_for_slot(slot, index) is None:
            lost += 1
        else:
            won += 1
    return {"won": won, "lost": lost, "began": began, "ended": time.time()}


def async_race(args: argparse.Namespace) -> dict[str, float]:
    """On one event loop, ``--tasks`` coroutines per slot for slots 0..N-1, all at once."""
    import asyncio

    from django_taskguard import current_run, once_per_schedule

    @once_per_schedule(name=args.task)
    async def body(index: int) -> int:
        run = current_run()
        await asyncio.sleep(0)  # the other tasks run while this one holds its slot
        assert current_run() is run
        record(args.log, f"{index} {os.getpid()} {run.fence} {time.time():.6f}")
        return index

    async def fire_all() -> list[int | None]:
        slots = [BASE_SLOT + timedelta(minutes=index) for index in range(args.slots)]
        calls = [
            body.run_for_slot(slots[i], i) for i in range(args.slots) for _ in range(args.tasks)
        ]
        return await asyncio.gather(*calls)

    barrier(args)
    began = time.time()
    results = asyncio.run(fire_all())
    won = sum(1 for result in results if result is not None)
    return {"won": won, "lost": len(results) - won, "began": began, "ended": time.time()}


def hold(args: argparse.Namespace) -> dict[str, object]:
    """Claim one slot and run a body that sleeps ``--seconds`` (to be killed or paused);
    with ``--go``, the claim waits for it (see barrier)."""
    from django_taskguard import current_run, once_per_schedule
    from django_taskguard.exceptions import LeaseLost

    @once_per_schedule(name=args.task, on_stale=args.on_stale, lease_seconds=args.lease)
    def body() -> str:
        run = current_run()
        record(args.log, f"start {os.getpid()} {run.attempt} {run.fence}")
        print(json.dumps({"started": run.id, "fence": run.fence}), flush=True)
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
        if args.no_check:  # a body that never asks: only the fenced finish can refuse it
            record(args.log, f"end {os.getpid()} {run.attempt} {run.fence}")
            return "done"
        try:
            run.check()
        except LeaseLost:
            record(args.log, f"leaselost {os.getpid()} {run.attempt} {run.fence}")
            raise
        record(args.log, f"end {os.getpid()} {run.attempt} {run.fence}")
        return "done"

    barrier(args)
    return run_held(body, args.slot)


def run_held(body: Any, minutes: int) -> dict[str, object]:
    """Run ``body`` for slot ``minutes``; a refused (fenced) finish is reported, not raised."""
    from django_taskguard.exceptions import LeaseLost

    try:
        result = body.run_for_slot(BASE_SLOT + timedelta(minutes=minutes))
    except LeaseLost as exc:
        return {"result": None, "lease_lost": str(exc)}
    return {"result": result}


def tick(args: argparse.Namespace) -> dict[str, object]:
    """Hold one slot and tick until ``--seconds`` pass; each tick is guarded by ``check()``.

    Log lines: ``start|tick|leaselost|end|signal PID ATTEMPT FENCE TIME``. A tick's
    time is taken *before* ``current_run().check()`` passes, so a tick line says
    "this attempt verified its lease at TIME" even if the process is paused
    between the check and the write.
    """
    from django_taskguard import current_run, once_per_schedule
    from django_taskguard.context import ActiveRun
    from django_taskguard.exceptions import LeaseLost
    from django_taskguard.signals import lease_lost

    def line(kind: str, run: ActiveRun, stamp: float) -> None:
        record(args.log, f"{kind} {os.getpid()} {run.attempt} {run.fence} {stamp:.6f}")

    def on_lease_lost(sender: str, run: ActiveRun, **kwargs: object) -> None:
        line("signal", run, time.time())

    lease_lost.connect(on_lease_lost, weak=False)

    @once_per_schedule(name=args.task, on_stale=args.on_stale, lease_seconds=args.lease)
    def body() -> str:
        run = current_run()
        line("start", run, time.time())
        started = {"started": run.id, "attempt": run.attempt, "fence": run.fence}
        print(json.dumps(started), flush=True)
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            stamp = time.time()
            try:
                run.check()
            except LeaseLost:
                line("leaselost", run, time.time())
                raise
            line("tick", run, stamp)
            time.sleep(0.05)
        line("end", run, time.time())
        return "done"

    barrier(args)
    return run_held(body, args.slot)


def down(args: argparse.Namespace) -> dict[str, object]:
    """Call a guarded function with DATABASE_ALIAS pointing at a dead PostgreSQL port."""
    from django.test import override_settings

    from django_taskguard import once_per_schedule

    @once_per_schedule(name=args.task, every=timedelta(minutes=1))
    def body() -> str:
        record(args.log, f"ran {os.getpid()}")
        return "ran"

    outcome: dict[str, object] = {}
    config = {"BACKEND": args.backend, "REDIS_ALIAS": "redis", "DATABASE_ALIAS": "down"}
    with override_settings(TASKGUARD=config):
        for label, call in (("run_for_slot", lambda: body.run_for_slot(BASE_SLOT)), ("call", body)):
            try:
                outcome[label] = {"result": call()}
            except Exception as exc:
                outcome[label] = {"error": type(exc).__name__, "message": str(exc)}
    return outcome


def database_lost(args: argparse.Namespace) -> dict[str, object]:
    """Run one slot (the ledger's identity is known, connections are open), wait for the
    go file (meanwhile the test cuts the database off), then call the next slot."""
    from django_taskguard import once_per_schedule

    @once_per_schedule(name=args.task)
    def body() -> str:
        record(args.log, f"ran {os.getpid()}")
        return "ran"

    print(json.dumps({"first": body.run_for_slot(BASE_SLOT)}), flush=True)
    barrier(args)
    try:
        return {"result": body.run_for_slot(BASE_SLOT + timedelta(minutes=1))}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}


def swarm(args: argparse.Namespace) -> dict[str, int]:
    """Fork ``--processes`` callers of one slot, release them at ``--start-at``, time each call."""
    from django.db import connections

    from django_taskguard import once_per_schedule
    from django_taskguard.locks import get_backend

    @once_per_schedule(name=args.task, lease_seconds=args.lease)
    def body() -> int:
        record(args.log, f"start {os.getpid()}")
        time.sleep(args.seconds)
        return os.getpid()

    # Someone holds a warm-up slot, so that every child can make one losing call
    # (imports, connections, first-call paths) before the timed one.
    warm = BASE_SLOT - timedelta(days=1)
    lock = get_backend()
    lock.acquire(lock.key(args.task, warm), "warm-up-holder", 120, args.task)
    connections.close_all()
    children = [_swarm_child(args, body, warm) for _ in range(args.processes)]
    failed = sum(1 for pid in children if os.waitpid(pid, 0)[1] != 0)
    return {"children": len(children), "failed": failed}


def _swarm_child(args: argparse.Namespace, body, warm: datetime) -> int:  # type: ignore[no-untyped-def]
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        assert body.run_for_slot(warm) is None  # warm up on a slot someone else holds
        barrier(args)
        began, at = time.monotonic(), time.time()
        result = body.run_for_slot(BASE_SLOT + timedelta(minutes=args.slot))
        took = time.monotonic() - began
        line = {"pid": os.getpid(), "won": result is not None, "seconds": took,
                "began": at, "ended": time.time()}  # fmt: skip
        record(args.results, json.dumps(line))
        code = 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def claim_then_die(args: argparse.Namespace) -> dict[str, object]:
    """Win the Redis claim of a slot, then die by SIGKILL before the database claim."""
    import signal
    import uuid

    from django_taskguard.locks import get_backend

    slot = BASE_SLOT + timedelta(minutes=args.slot)
    lock = get_backend()
    acquired = lock.acquire(
        lock.key(args.task, slot), uuid.uuid4().hex, args.lease or 2.0, args.task
    )
    print(json.dumps({"acquired": acquired.value}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    return {}


def caller(args: argparse.Namespace) -> dict[str, object]:
    """An APScheduler-style caller: call one guarded every-2-second function once per slot,
    ``--delay`` seconds after the slot begins, until ``--seconds`` pass. The body of the
    slot written in the ``--go`` file (ISO-8601) sleeps until the process is killed."""
    from django_taskguard import current_run, once_per_schedule

    every = 2.0

    @once_per_schedule(
        name=args.task, every=timedelta(seconds=every), grace=timedelta(seconds=1),
        lease_seconds=args.lease,
    )  # fmt: skip
    def body() -> str:
        slot = current_run().slot.isoformat()
        record(args.log, f"ran {os.getpid()} {slot}")
        if args.go and os.path.exists(args.go) and Path(args.go).read_text().strip() == slot:
            record(args.log, f"hang {os.getpid()} {slot}")
            print(json.dumps({"hang": slot}), flush=True)
            time.sleep(3600)
        return "ran"

    print(json.dumps({"caller": os.getpid()}), flush=True)
    deadline = time.monotonic() + args.seconds
    calls = 0
    while time.monotonic() < deadline:
        now = time.time()
        time.sleep((now // every + 1) * every - now + args.delay)
        body()
        calls += 1
    return {"calls": calls}


SCENARIOS = {
    "race": race,
    "async_race": async_race,
    "hold": hold,
    "tick": tick,
    "down": down,
    "database_lost": database_lost,
    "swarm": swarm,
    "claim_then_die": claim_then_die,
    "caller": caller,
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--task", default="tests.race")
    parser.add_argument("--log", required=True)
    parser.add_argument("--slots", type=int, default=200)
    parser.add_argument("--tasks", type=int, default=5, help="`async_race`: tasks per slot")
    parser.add_argument("--slot", type=int, default=0)
    parser.add_argument("--start-at", type=float, default=0.0)
    parser.add_argument("--go", default="", help="start when this file exists (see barrier)")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--lease", type=float, default=None)
    parser.add_argument("--on-stale", default="abandon")
    parser.add_argument("--backend", default="database", help="the lock backend of `down`")
    parser.add_argument("--no-check", action="store_true", help="`hold` never calls check()")
    parser.add_argument("--processes", type=int, default=100)
    parser.add_argument("--results", default="")
    parser.add_argument("--delay", type=float, default=0.1, help="`caller`: after the slot")
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    outcome = SCENARIOS[args.scenario](args)
    print(json.dumps(outcome), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
