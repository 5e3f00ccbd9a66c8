"""Child processes of the ``@once_per_key`` tests: ``python -m tests.support.proc_keyed SCENARIO``.

Like :mod:`tests.support.proc`: the database (and Redis) come from the environment
``child_env`` builds, and every execution of a guarded body appends a line to
``--log`` with O_APPEND, counted outside the ledger.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import django

from tests.support.proc import record, wait_until


def race(args: argparse.Namespace) -> dict[str, int]:
    """Call keys 0..N-1 of one task, in this process's own shuffled order."""
    from django_taskguard import current_run, once_per_key

    @once_per_key(key="order:{order_id}", name=args.task)
    def charge(order_id: int) -> int:
        run = current_run()
        record(args.log, f"{order_id} {os.getpid()} {run.fence} {run.key}")
        return order_id

    order = list(range(args.keys))
    random.Random(os.getpid()).shuffle(order)
    wait_until(args.start_at)
    won = lost = 0
    for order_id in order:
        if charge(order_id) is None:
            lost += 1
        else:
            won += 1
    return {"won": won, "lost": lost, "first": order[0]}


def hold(args: argparse.Namespace) -> dict[str, object]:
    """Claim one key and run a body that sleeps ``--seconds`` (to be killed, or to have
    Redis flushed under it)."""
    from django_taskguard import current_run, once_per_key

    @once_per_key(key="{name}", name=args.task, on_stale=args.on_stale, lease_seconds=args.lease)
    def body(name: str) -> str:
        run = current_run()
        record(args.log, f"start {os.getpid()} {run.attempt} {run.fence}")
        print(json.dumps({"started": run.id, "fence": run.fence}), flush=True)
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
        record(args.log, f"end {os.getpid()} {run.attempt} {run.fence}")
        return "done"

    return {"result": body(args.key)}


def enqueue(args: argparse.Namespace) -> dict[str, object]:
    """``apply_once`` keys 0..N-1 of ``tests.support.celery_keyed_tasks.charge`` in a shuffled
    order (from ``--start-at``); report each key's task id."""
    from datetime import timedelta

    from tests.support.celery_app import app
    from tests.support.celery_keyed_tasks import charge

    order = list(range(args.keys))
    random.Random(os.getpid()).shuffle(order)
    ids = {}
    with app.connection_for_write() as connection:
        connection.ensure_connection()
        wait_until(args.start_at)
        for order_id in order:
            result = charge.apply_once(
                (order_id, args.log),
                {"seconds": args.seconds},
                ttl=timedelta(seconds=args.ttl),
                connection=connection,
            )
            ids[str(order_id)] = result.id
    return {"ids": ids}


SCENARIOS = {"race": race, "hold": hold, "enqueue": enqueue}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--task", default="tests.keyed.race")
    parser.add_argument("--log", required=True)
    parser.add_argument("--keys", type=int, default=500)
    parser.add_argument("--key", default="k")
    parser.add_argument("--start-at", type=float, default=0.0)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--lease", type=float, default=None)
    parser.add_argument("--on-stale", default="abandon")
    parser.add_argument("--ttl", type=float, default=3600.0)
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    outcome = SCENARIOS[args.scenario](args)
    print(json.dumps(outcome), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
