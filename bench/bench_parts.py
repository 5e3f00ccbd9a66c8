"""Where a guarded winner's time goes, beside the floor's (a script, not a test).

    python bench/bench_parts.py [--rounds 1500] [--prepare-threshold 5]

The same setup as ``bench_guard.py`` (a private redis-server, PostgreSQL), then the floor
and a guarded winning call alternated in a shuffled order, each part timed: the floor's
``SET NX``, ``INSERT``, ``UPDATE`` and ``EVALSHA``; the winner's two statements (timed by
an ``execute_wrapper``), its two Redis script calls, and what is left (Python: the
decorator, the guard, the signals, Django's cursor wrapper, the driver's adaptation).
Prints the median of each part.
"""

from __future__ import annotations

import argparse
import collections
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_guard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--prepare-threshold", type=int, default=None)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="taskguard-bench-")
    server, port = bench_guard.start_redis(directory)
    try:
        bench_guard.configure(port, "postgresql", args.prepare_threshold)
        run(args.rounds, port)
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)


def run(rounds: int, port: int) -> None:
    import redis
    from django.db import connection

    from django_taskguard import once_per_schedule
    from django_taskguard.locks import run_key
    from django_taskguard.locks.keys import claim_key
    from django_taskguard.locks.redis import RedisLock
    from django_taskguard.locks.redis_scripts import RELEASE
    from django_taskguard.models import TaskRun

    tag = uuid.uuid4().hex[:8]
    base = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(days=2)
    guarded = once_per_schedule(name=f"bench.parts.{tag}")(lambda: 1)
    raw = redis.Redis(port=port)
    raw.script_load(RELEASE.source)
    connection.ensure_connection()
    cursor = connection.connection.cursor()
    table = TaskRun._meta.db_table
    clock = time.perf_counter
    name = f"bench.parts.floor.{tag}"

    def floor(i: int) -> dict[str, float]:
        key, token = run_key("bench", name, base + timedelta(seconds=i)), uuid.uuid4().hex
        at = connection.ops.adapt_datetimefield_value(base + timedelta(seconds=i))
        t0 = clock()
        raw.set(key, token, nx=True, px=30000)
        t1 = clock()
        cursor.execute(
            f"INSERT INTO {table} (task_name, slot, state, attempt, owner, created_at, error, "
            "duplicates) VALUES (%s, %s, 'running', 1, %s, now(), '', 0) ON CONFLICT DO NOTHING",
            (name, at, token),
        )
        t2 = clock()
        cursor.execute(
            f"UPDATE {table} SET state = 'succeeded', finished_at = now() "
            "WHERE task_name = %s AND slot = %s",
            (name, at),
        )
        t3 = clock()
        raw.evalsha(RELEASE.sha, 2, key, claim_key(key), token)
        t4 = clock()
        return {
            "floor: SET NX": t1 - t0,
            "floor: INSERT": t2 - t1,
            "floor: UPDATE": t3 - t2,
            "floor: EVALSHA": t4 - t3,
            "floor": t4 - t0,
        }

    statements: list[float] = []
    scripts: list[float] = []
    counts: collections.Counter[int] = collections.Counter()

    def timed_statement(execute: Callable[..., Any], sql: str, *rest: Any) -> Any:
        began = clock()
        try:
            return execute(sql, *rest)
        finally:
            statements.append(clock() - began)

    script_call = RedisLock._eval

    def timed_script(self: RedisLock, *args: Any) -> Any:
        began = clock()
        try:
            return script_call(self, *args)
        finally:
            scripts.append(clock() - began)

    RedisLock._eval = timed_script  # type: ignore[method-assign]

    def winner(i: int) -> dict[str, float]:
        statements.clear()
        scripts.clear()
        began = clock()
        with connection.execute_wrapper(timed_statement):
            guarded.run_for_slot(base + timedelta(seconds=i))
        took = clock() - began
        counts[len(statements)] += 1
        claim, finish = statements[-2], statements[-1]
        left = took - sum(statements) - sum(scripts)
        return {
            "winner: claim statement": claim,
            "winner: finish statement": finish,
            "winner: 2 Redis scripts": sum(scripts),
            "winner: the rest (Python)": left,
            "winner": took,
        }

    parts: dict[str, list[float]] = collections.defaultdict(list)
    calls = [floor, winner]
    order = random.Random(20261126)
    for i in range(-50, rounds):
        order.shuffle(calls)
        for call in calls:
            for part, seconds in call(i + 50).items():
                if i >= 0:
                    parts[part].append(seconds)
    threshold = connection.settings_dict["OPTIONS"].get("prepare_threshold")
    print(f"{rounds} rounds, prepare_threshold {threshold}; statements per winner: {dict(counts)}")
    for part, samples in sorted(parts.items()):
        print(f"  {part:28} median {statistics.median(samples) * 1e6:8.1f} us")
    ratio = statistics.median(parts["winner"]) / statistics.median(parts["floor"])
    print(f"winner/floor = {ratio:.2f}")
    TaskRun.objects.filter(task_name__endswith=tag).delete()


if __name__ == "__main__":
    main()
