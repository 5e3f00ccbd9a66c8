"""``@once_per_key``: one run per (task, key), on the database and on Redis."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection

from django_taskguard import current_run, once_per_key
from django_taskguard.exceptions import DuplicateRun, InvalidKey, InvalidSchedule
from django_taskguard.locks import get_backend
from django_taskguard.locks.keys import SlotKey, key_digest
from django_taskguard.models import RunState, TaskRun
from django_taskguard.signals import run_failed, run_succeeded
from django_taskguard.testing import freeze_now

from .support.children import Child, python
from .support.redis_support import child_redis_env, command, redis_backend
from .support.waiting import wait_for

pytestmark = pytest.mark.dialect

PROCESSES = 8
KEYS = 500


# -- the decorator ---------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_once_per_key__winner_returns_result_duplicate_returns_none():
    calls = []

    @once_per_key(key="order:{order_id}", name="tests.keyed.charge")
    def charge(order_id: int, amount: int = 5) -> int:
        calls.append(order_id)
        assert current_run().key == f"order:{order_id}"
        return amount

    assert charge(1) == 5
    assert charge(1, amount=7) is None
    assert charge(order_id=2, amount=7) == 7
    assert calls == [1, 2]
    run = TaskRun.objects.get(key="order:1")
    assert run.task_name == "tests.keyed.charge"
    assert run.state == RunState.SUCCEEDED
    assert run.duplicates == 1


@pytest.mark.django_db(transaction=True)
def test_once_per_key__defaults_and_callable_keys():
    @once_per_key(key="{tenant}:{order_id}", name="tests.keyed.defaults")
    def by_format(order_id: int, tenant: str = "acme") -> str:
        return current_run().key or ""

    @once_per_key(key=lambda order, **kw: f"o-{order['id']}", name="tests.keyed.callable")
    def by_callable(order: dict[str, int], note: str = "") -> str:
        return current_run().key or ""

    assert by_format(3) == "acme:3"
    assert by_format(3, tenant="other") == "other:3"
    assert by_callable({"id": 9}) == "o-9"
    assert by_callable({"id": 9}, note="again") is None
    assert by_format.key_of(3) == "acme:3"


@pytest.mark.django_db(transaction=True)
def test_once_per_key__on_duplicate_raise_names_the_key():
    @once_per_key(key="{n}", name="tests.keyed.raise", on_duplicate="raise")
    def body(n: int) -> int:
        return n

    assert body(1) == 1
    with pytest.raises(DuplicateRun, match="key '1'") as raised:
        body(1)
    assert raised.value.key == "1"
    assert raised.value.state == RunState.SUCCEEDED


def test_once_per_key__bad_arguments_are_refused_at_decoration():
    with pytest.raises(InvalidSchedule, match="not a parameter"):
        once_per_key(key="order:{order}")(lambda order_id: order_id)
    with pytest.raises(InvalidSchedule, match="positions"):
        once_per_key(key="order:{}")(lambda order_id: order_id)
    with pytest.raises(InvalidSchedule, match="keep="):
        once_per_key(key="{x}", keep=timedelta(seconds=-1))
    with pytest.raises(InvalidSchedule, match="keep="):
        once_per_key(key="{x}", keep=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidSchedule, match="on_stale"):
        once_per_key(key="{x}", on_stale="later")  # type: ignore[arg-type]
    with pytest.raises(InvalidSchedule, match="needs key="):
        once_per_key(lambda: None)
    with pytest.raises(InvalidSchedule, match="needs key="):
        once_per_key()


@pytest.mark.django_db(transaction=True)
def test_once_per_key__keys_are_bounded_and_refused_clearly():
    @once_per_key(key="{value}", name="tests.keyed.bounds")
    def body(value: str) -> str:
        return value

    with pytest.raises(InvalidKey, match="at most 255"):
        body("x" * 256)
    with pytest.raises(InvalidKey, match="empty"):
        body("")
    with pytest.raises(InvalidKey, match="NUL"):
        body("a\x00b")
    with pytest.raises(InvalidKey, match="surrogate"):
        body("a\udc80b")
    weird = "é ' \" ; -- {} " + "x" * 240
    assert body(weird) == weird
    assert TaskRun.objects.get(task_name="tests.keyed.bounds").key == weird
    assert not TaskRun.objects.filter(task_name="tests.keyed.bounds").exclude(key=weird).exists()


@pytest.mark.django_db(transaction=True)
def test_once_per_key__keep_zero_frees_the_key_when_finished_none_blocks_it():
    runs: list[int] = []

    @once_per_key(key="{n}", name="tests.keyed.keep0", keep=timedelta(0))
    def free(n: int) -> int:
        runs.append(current_run().fence)
        return n

    @once_per_key(key="{n}", name="tests.keyed.keepnone")
    def forever(n: int) -> int:
        return n

    assert free(1) == 1
    assert free(1) == 1
    assert len(runs) == 2 and runs[0] < runs[1]
    assert TaskRun.objects.filter(task_name="tests.keyed.keep0").count() == 1
    assert forever(1) == 1
    assert forever(1) is None


@pytest.mark.django_db(transaction=True)
def test_once_per_key__keep_zero_key_is_free_once_the_row_is_terminal(lock_backend):
    # Before: a call made while run_succeeded receivers still ran (the row already
    # succeeded) was refused on Redis (the lock was freed only after the signal) and ran
    # on the database backend. The key is free once the row is terminal, on both.
    runs: list[int] = []
    again: list[int | None] = []

    @once_per_key(key="{n}", name="tests.keyed.keep0.signal", keep=timedelta(0))
    def free(n: int) -> int:
        runs.append(n)
        return n

    def on_succeeded(sender: str, run: object, result: object, **kwargs: object) -> None:
        if sender == "tests.keyed.keep0.signal" and len(runs) == 1:
            assert TaskRun.objects.get(key="1").state == RunState.SUCCEEDED
            again.append(free(1))

    run_succeeded.connect(on_succeeded, weak=False)
    try:
        assert free(1) == 1
    finally:
        run_succeeded.disconnect(on_succeeded)
    assert again == [1], f"{lock_backend}: the call made after the row succeeded ran"
    assert runs == [1, 1]


@pytest.mark.django_db(transaction=True)
def test_once_per_key__keep_zero_failed_key_is_free_once_the_row_is_terminal(lock_backend):
    # The same for a failure: a call made while run_failed receivers still run.
    runs: list[int] = []
    again: list[object] = []

    @once_per_key(key="{n}", name="tests.keyed.keep0.failed", keep=timedelta(0))
    def flaky(n: int) -> int:
        runs.append(n)
        if len(runs) == 1:
            raise ValueError("first call fails")
        return n

    def on_failed(sender: str, run: object, exception: object, **kwargs: object) -> None:
        if sender == "tests.keyed.keep0.failed" and len(runs) == 1:
            assert TaskRun.objects.get(key="1").state == RunState.FAILED
            again.append(flaky(1))

    run_failed.connect(on_failed, weak=False)
    try:
        with pytest.raises(ValueError, match="first call fails"):
            flaky(1)
    finally:
        run_failed.disconnect(on_failed)
    assert again == [1], f"{lock_backend}: the call made after the row failed ran"
    assert runs == [1, 1]


@pytest.mark.django_db(transaction=True)
def test_once_per_key__a_frozen_clock_runs_any_number_of_keys(lock_backend):
    # Before: a keyed row's slot is its claim's time; under freeze_now every key of the
    # task claimed the same instant and the 6th raised TaskGuardError ("5 claims ... at
    # the same microsecond").
    @once_per_key(key="{n}", name="tests.keyed.frozen")
    def body(n: int) -> int:
        return n

    with freeze_now(datetime(2026, 3, 1, 21, tzinfo=dt_timezone.utc)):
        assert [body(n) for n in range(25)] == list(range(25))
        assert body(7) is None
    runs = TaskRun.objects.filter(task_name="tests.keyed.frozen")
    assert runs.count() == 25 == len({run.slot for run in runs})


@pytest.mark.django_db(transaction=True)
def test_once_per_key__a_failed_key_stays_failed_until_keep_runs_out():
    @once_per_key(key="{n}", name="tests.keyed.failed", keep=timedelta(seconds=2))
    def body(n: int) -> int:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        body(1)
    assert body(1) is None  # still within keep
    finished = TaskRun.objects.get(key="1").finished_at
    assert finished is not None
    TaskRun.objects.filter(key="1").update(finished_at=finished - timedelta(seconds=3))
    with pytest.raises(ValueError, match="boom"):
        body(1)


@pytest.mark.django_db(transaction=True)
def test_once_per_key__slot_rows_and_keyed_rows_of_one_task_do_not_meet():
    @once_per_key(key="{n}", name="tests.keyed.mixed")
    def body(n: int) -> int:
        return n

    results = [body(n) for n in range(50)]
    assert results == list(range(50))
    slots = TaskRun.objects.filter(task_name="tests.keyed.mixed").values_list("slot", flat=True)
    assert len(set(slots)) == 50


# -- the Redis fast path -----------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_once_per_key__redis_loser_makes_no_query_and_keys_are_hashed(
    redis_server, django_assert_num_queries
):
    with redis_backend(redis_server) as lock:

        @once_per_key(key="user text {n}", name="tests.keyed.fast")
        def body(n: int) -> int:
            return n

        assert body(1) == 1
        with django_assert_num_queries(0):
            assert body(1) is None  # the finished marker answers
        keys = {k.decode() for k in command(redis_server, "keys", "*")}
        assert len(keys) == 2  # the lock key (the finished marker) and its claim record
        key = body_key = lock.keyed("tests.keyed.fast", "user text 1")
        assert body_key in keys
        parsed = SlotKey.parse(key)
        assert parsed is not None and parsed.slot is None
        assert parsed.keyed == key_digest("user text 1")
        assert "user text" not in key
        assert key.startswith(lock.key_prefix() + ":")
    # The loser's count reaches the row through the sweep.
    with redis_backend(redis_server):
        call_command("cleanup_locks", stdout=StringIO())
    assert TaskRun.objects.get(key="user text 1").duplicates == 1


@pytest.mark.django_db(transaction=True)
def test_once_per_key__redis_marker_lasts_no_longer_than_keep(redis_server):
    with redis_backend(redis_server, FINISHED_MARKER_SECONDS=3600):

        @once_per_key(key="{n}", name="tests.keyed.marker", keep=timedelta(seconds=30))
        def body(n: int) -> int:
            return n

        assert body(1) == 1
        key = get_backend().keyed("tests.keyed.marker", "1")
        assert 0 < command(redis_server, "pttl", key) <= 30_000

        @once_per_key(key="{n}", name="tests.keyed.marker0", keep=timedelta(0))
        def free(n: int) -> int:
            return n

        assert free(1) == 1
        assert free(1) == 1
        assert not command(redis_server, "exists", get_backend().keyed("tests.keyed.marker0", "1"))


# -- real processes ----------------------------------------------------------------


def _race(env: dict[str, str], log: Path, task: str) -> list[dict[str, int]]:
    start_at = time.time() + 3.0  # every process imported Django and is waiting by then
    argv = [python(), "-m", "tests.support.proc_keyed", "race", "--task", task, "--log", str(log),
            "--keys", str(KEYS), "--start-at", str(start_at)]  # fmt: skip
    racers = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(PROCESSES)
    ]
    outcomes = []
    for racer in racers:
        out, err = racer.communicate(timeout=600)
        assert racer.returncode == 0, err
        outcomes.append(json.loads(out.strip().splitlines()[-1]))
    return outcomes


def _check_race(log: Path, outcomes: list[dict[str, int]], task: str) -> None:
    lines = log.read_text().splitlines()
    executions = Counter(line.split()[0] for line in lines)
    assert len(executions) == KEYS, "a key was lost"
    assert set(executions.values()) == {1}, f"duplicate executions: {executions.most_common(3)}"
    assert len({o["first"] for o in outcomes}) > 1, "the processes did not shuffle"
    assert sum(o["won"] for o in outcomes) == KEYS
    assert sum(o["lost"] for o in outcomes) == KEYS * (PROCESSES - 1)
    assert len({line.split()[1] for line in lines}) > 1, "one process won every key"
    runs = TaskRun.objects.filter(task_name=task)
    assert runs.count() == KEYS
    assert set(runs.values_list("state", flat=True)) == {RunState.SUCCEEDED}
    assert len({int(line.split()[2]) for line in lines}) == KEYS, "a fence was handed out twice"


@pytest.mark.processes
def test_once_per_key__8_processes_500_keys_each_runs_once_on_the_database(child_env, scratch):
    log = scratch / "executions.log"
    outcomes = _race(child_env, log, "tests.keyed.race")
    _check_race(log, outcomes, "tests.keyed.race")
    runs = TaskRun.objects.filter(task_name="tests.keyed.race")
    assert sum(runs.values_list("duplicates", flat=True)) == KEYS * (PROCESSES - 1)


@pytest.mark.processes
def test_once_per_key__8_processes_500_keys_each_runs_once_on_redis(
    child_env, redis_server, scratch
):
    log = scratch / "executions.log"
    outcomes = _race(child_redis_env(child_env, redis_server), log, "tests.keyed.race_redis")
    _check_race(log, outcomes, "tests.keyed.race_redis")


def _hold(env: dict[str, str], log: Path, task: str, key: str, seconds: float, **opts: str):
    """A ``proc_keyed hold`` child, once its body has started, and its run's id."""
    extra = [arg for name, value in opts.items() for arg in (f"--{name}", value)]
    child = Child(env, "hold", "--task", task, "--log", str(log), "--key", key,
                  "--seconds", str(seconds), "--lease", "2", *extra,
                  module="tests.support.proc_keyed")  # fmt: skip
    return child, child.started()["started"]


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["database", "redis"])
def test_once_per_key__sigkill_mid_run_then_cleanup_abandons_it(
    child_env, scratch, redis_server, backend
):
    env = child_redis_env(child_env, redis_server) if backend == "redis" else child_env
    log = scratch / "exec.log"
    victim, run_id = _hold(env, log, "tests.keyed.killed", "k1", 120)
    victim.killed()
    wait_for(lambda: TaskRun.objects.stale().filter(pk=run_id).exists(), 30, "lease expiry")
    with redis_backend(redis_server, BACKEND=backend):
        out = StringIO()
        call_command("cleanup_locks", "--json", stdout=out)
    assert json.loads(out.getvalue())["stale_runs"] == 1
    found = json.loads(out.getvalue())["runs"]
    assert [r.get("key") for r in found] == ["k1"]
    assert TaskRun.objects.get(pk=run_id).state == RunState.ABANDONED

    again, _ = _hold_or_none(env, log, "tests.keyed.killed", "k1")
    assert again is None  # on_stale=abandon: at most once
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["start"]


def _hold_or_none(env: dict[str, str], log: Path, task: str, key: str, **opts: str):
    extra = [arg for name, value in opts.items() for arg in (f"--{name}", value)]
    out = subprocess.run(
        [python(), "-m", "tests.support.proc_keyed", "hold", "--task", task, "--log", str(log),
         "--key", key, "--seconds", "0.2", "--lease", "2", *extra],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["result"], out


@pytest.mark.processes
def test_once_per_key__sigkill_mid_run_taken_over_once_under_retry(child_env, scratch):
    log = scratch / "exec.log"
    victim, run_id = _hold(child_env, log, "tests.keyed.retry", "k1", 120, **{"on-stale": "retry"})
    victim.killed()
    wait_for(lambda: TaskRun.objects.stale().filter(pk=run_id).exists(), 30, "lease expiry")
    first, _ = _hold_or_none(child_env, log, "tests.keyed.retry", "k1", **{"on-stale": "retry"})
    second, _ = _hold_or_none(child_env, log, "tests.keyed.retry", "k1", **{"on-stale": "retry"})
    assert (first, second) == ("done", None)
    run = TaskRun.objects.get(pk=run_id)
    assert run.state == RunState.SUCCEEDED and run.attempt == 2
    kinds = [line.split()[0] for line in log.read_text().splitlines()]
    assert kinds == ["start", "start", "end"]


@pytest.mark.processes
def test_once_per_key__redis_flushed_mid_run_no_second_run(child_env, redis_server, scratch):
    env = child_redis_env(child_env, redis_server)
    log = scratch / "exec.log"
    owner, run_id = _hold(env, log, "tests.keyed.flush", "k1", 8)
    command(redis_server, "flushall")  # mid-run: the body is sleeping
    late, _ = _hold_or_none(env, log, "tests.keyed.flush", "k1")
    assert owner.process.poll() is None, "the flush and the late call did not land mid-run"
    _, err = owner.process.communicate(timeout=60)
    assert owner.process.returncode == 0, err
    assert late is None
    kinds = [line.split()[0] for line in log.read_text().splitlines()]
    assert kinds == ["start", "end"], "the key ran twice after the flush"
    assert TaskRun.objects.get(pk=run_id).state == RunState.SUCCEEDED
    assert connection.vendor in ("sqlite", "postgresql", "mysql")


@pytest.mark.django_db(transaction=True)
def test_once_per_key__redis_winner_dead_before_its_row_is_recorded_abandoned(redis_server):
    with redis_backend(redis_server) as lock:
        key = lock.keyed("tests.keyed.unrecorded", "order:1")
        assert (
            lock.acquire(key, "a" * 32, 0.3, "tests.keyed.unrecorded", run_key="order:1").value
            == "won"
        )
        assert (
            lock.acquire(key, "b" * 32, 0.3, "tests.keyed.unrecorded", run_key="order:1").value
            == "lost"
        )
        wait_for(lambda: not command(redis_server, "exists", key), 10, "the lease to lapse")
        out = StringIO()
        call_command("cleanup_locks", "--json", stdout=out)
    assert json.loads(out.getvalue())["unrecorded_slots"] == 1
    run = TaskRun.objects.get(task_name="tests.keyed.unrecorded")
    assert (run.key, run.state, run.duplicates) == ("order:1", RunState.ABANDONED, 1)


def test_once_per_key__key_of_binds_like_a_call():
    def body(a: int, b: int = 2, *, c: str = "z") -> None: ...

    guarded = once_per_key(key="{a}-{b}-{c}", name="tests.keyed.bind")(body)
    assert guarded.key_of(1) == "1-2-z"
    assert guarded.key_of(1, 3, c="y") == "1-3-y"
    assert guarded.key_of(b=5, a=4) == "4-5-z"
    with pytest.raises(InvalidKey, match="cannot bind"):
        guarded.key_of(1, a=1)
    with pytest.raises(InvalidKey, match="cannot bind"):
        guarded.key_of(1, 2, 3)
    with pytest.raises(InvalidKey, match="cannot bind"):
        guarded.key_of(1, d=4)
    with pytest.raises(InvalidKey, match="cannot bind"):
        guarded.key_of()

    def spread(*args: int, **kwargs: int) -> None: ...

    loose = once_per_key(key="{x}", name="tests.keyed.spread")(spread)
    assert loose.key_of(x=7) == "7"


@pytest.mark.django_db(transaction=True)
def test_once_per_key__two_keys_claimed_at_the_same_microsecond_both_get_a_row():
    from django.utils import timezone

    from django_taskguard import ledger

    at = timezone.now()
    first = ledger.claim("tests.keyed.same_us", at, "h:1:s:" + "a" * 32, 30,
                         abandon_is_final=True, key="a")  # fmt: skip
    second = ledger.claim("tests.keyed.same_us", at, "h:1:s:" + "b" * 32, 30,
                          abandon_is_final=True, key="b")  # fmt: skip
    assert first.owner.endswith("a" * 32) and second.owner.endswith("b" * 32)
    slots = dict(TaskRun.objects.filter(task_name="tests.keyed.same_us").values_list("key", "slot"))
    assert slots["b"] - slots["a"] == timedelta(microseconds=1)


@pytest.mark.django_db(transaction=True)
def test_once_per_key__after_a_flush_the_marker_comes_back_only_without_keep(redis_server):
    with redis_backend(redis_server):

        @once_per_key(key="{n}", name="tests.keyed.back")
        def forever(n: int) -> int:
            return n

        @once_per_key(key="{n}", name="tests.keyed.kept", keep=timedelta(hours=1))
        def kept(n: int) -> int:
            return n

        assert forever(1) == 1 and kept(1) == 1
        command(redis_server, "flushall")
        assert forever(1) is None and kept(1) is None  # the rows decide
        backend = get_backend()
        assert command(redis_server, "get", backend.keyed("tests.keyed.back", "1")) == b"=done"
        assert not command(redis_server, "exists", backend.keyed("tests.keyed.kept", "1"))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("backend", ["database", "redis"])
def test_once_per_key__return_result_gives_duplicates_the_stored_result(
    redis_server, backend, caplog
):
    with redis_backend(redis_server, BACKEND=backend):

        @once_per_key(key="{n}", name=f"tests.keyed.result.{backend}", return_result=True)
        def charge(n: int) -> dict[str, object]:
            return {"charge": f"ch_{n}", "amount": n * 100, "note": "é\x00"}

        @once_per_key(key="{n}", name=f"tests.keyed.big.{backend}", return_result=True)
        def big(n: int) -> object:
            return "x" * (64 * 1024) if n else {1, 2}  # too big; not JSON

        first = charge(3)
        assert first == {"charge": "ch_3", "amount": 300, "note": "é\x00"}
        assert charge(3) == first  # the duplicate gets the winner's result
        assert charge(3) == first
        assert big(1) is not None and big(1) is None
        assert big(0) == {1, 2} and big(0) is None
    assert "more than 65536" in caplog.text and "not JSON" in caplog.text
    assert TaskRun.objects.get(task_name=f"tests.keyed.big.{backend}", key="1").result is None


@pytest.mark.django_db(transaction=True)
def test_once_per_key__return_result_is_none_while_the_key_runs_or_failed():
    from django_taskguard import ledger

    @once_per_key(key="{n}", name="tests.keyed.result_failed", return_result=True)
    def fails(n: int) -> int:
        raise ValueError("no")

    with pytest.raises(ValueError):
        fails(1)
    assert fails(1) is None
    assert ledger.result_of("tests.keyed.result_failed", "1") is None
    with pytest.raises(InvalidSchedule, match="return_result"):
        once_per_key(key="{n}", return_result="yes")  # type: ignore[arg-type]
