"""The test kit users test their own guarded functions with (django_taskguard.testing)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from django.db import transaction
from django.test import override_settings
from django.utils import timezone as dj_timezone

from django_taskguard import ledger, once_per_key, once_per_schedule, registry
from django_taskguard.exceptions import TaskGuardError
from django_taskguard.locks import get_backend
from django_taskguard.models import RunState, TaskRun
from django_taskguard.testing import (
    TaskguardTestCase,
    assert_no_run,
    assert_ran_once,
    assert_state,
    freeze_now,
    reset_locks,
    run_for_key,
    run_for_slot,
    runs_for,
)
from tests.support import celery_keyed_tasks, celery_tasks

from .support import ROOT
from .support.inner_session import run_session
from .support.redis_support import redis_backend
from .support.slots import BASE_SLOT

pytestmark = pytest.mark.dialect

UTC = timezone.utc
PARIS = ZoneInfo("Europe/Paris")  # the tests' TIME_ZONE
calls: list[str] = []


@once_per_schedule(every=timedelta(minutes=15), name="tests.kit.quarterly")
def quarterly(label: str = "") -> str:
    calls.append(label)
    return f"ran {label}"


@once_per_schedule(cron="0 21 * * *", name="tests.kit.nightly")
def nightly() -> str:
    return "nightly"


@once_per_schedule(name="tests.kit.broken")
def broken() -> None:
    raise ValueError("boom: the report server said no")


@once_per_key(key="order:{order_id}", name="tests.kit.charge")
def charge(order_id: int) -> int:
    return order_id * 10


def plain() -> None: ...


# A function with a schedule registers itself for run_schedules and the missed-slot sweep;
# these two are test subjects only, and other tests sync the registry: out they go.
registry.unregister("tests.kit.quarterly")
registry.unregister("tests.kit.nightly")


# --- running a guarded function ------------------------------------------------------


def test_run_for_slot__runs_once_then_counts_the_duplicate(taskguard):
    slot = BASE_SLOT + timedelta(hours=1)
    assert run_for_slot(quarterly, slot, "a") == "ran a"
    assert run_for_slot(quarterly, slot.isoformat(), label="b") is None
    run = assert_ran_once(quarterly, slot)
    assert (run.task_name, run.slot, run.duplicates) == ("tests.kit.quarterly", slot, 1)
    assert runs_for("tests.kit.quarterly") == [run] == runs_for(quarterly, slot.isoformat())


def test_run_for_slot__the_exception_propagates_and_is_recorded(taskguard):
    with pytest.raises(ValueError, match="boom"):
        taskguard.run_for_slot(broken, BASE_SLOT)
    run = taskguard.assert_state(broken, BASE_SLOT, RunState.FAILED)
    assert "boom" in run.error


def test_run_for_key__runs_once_per_key(taskguard):
    assert run_for_key(charge, 7) == 70
    assert run_for_key(charge, order_id=7) is None
    assert run_for_key(charge, 8) == 80
    run = assert_ran_once(charge, key="order:7")
    assert (run.key, run.duplicates) == ("order:7", 1)
    assert [r.key for r in runs_for(charge)] == ["order:8", "order:7"]  # newest first


def test_run_for__wrong_kind_of_function_is_a_clear_error(taskguard):
    with pytest.raises(TaskGuardError, match="@once_per_key function: run it with run_for_key"):
        run_for_slot(charge, BASE_SLOT, 1)
    with pytest.raises(TaskGuardError, match="@once_per_schedule function: run it with"):
        run_for_key(quarterly)
    with pytest.raises(TaskGuardError, match="is not a guarded function"):
        run_for_slot(plain, BASE_SLOT)
    with pytest.raises(TaskGuardError, match="timezone-aware"):
        run_for_slot(quarterly, datetime(2026, 3, 1, 12))
    assert_no_run(quarterly)


def test_run_for_slot__a_celery_task_runs_as_a_worker_runs_its_message(taskguard, tmp_path):
    log = tmp_path / "log"
    slot = BASE_SLOT + timedelta(hours=2)
    assert run_for_slot(celery_tasks.tick, slot, str(log), seconds=0) == "ticked"
    assert run_for_slot(celery_tasks.tick, slot, str(log), seconds=0) is None
    run = assert_ran_once(celery_tasks.tick, slot)
    assert (run.task_name, run.duplicates) == ("tests.support.celery_tasks.tick", 1)
    # The body saw the slot of the message, as current_run() tells it.
    assert log.read_text().split()[1:3] == ["tests.support.celery_tasks.tick", slot.isoformat()]


def test_run_for_key__a_keyed_celery_task(taskguard, tmp_path):
    log = str(tmp_path / "log")
    assert run_for_key(celery_keyed_tasks.charge, 3, log, seconds=0) == 3
    assert run_for_key(celery_keyed_tasks.charge, 3, log, seconds=0) is None
    assert_ran_once(celery_keyed_tasks.charge, key="order:3")


def test_taskguard_fixture__the_test_is_transactional(taskguard):
    assert not transaction.get_connection().in_atomic_block
    assert run_for_slot(quarterly, BASE_SLOT) == "ran "


def test_db_fixture__a_guarded_call_says_to_use_a_transactional_test(db):
    with pytest.raises(TaskGuardError, match=r"transaction=True\) or taskguard's `taskguard`"):
        run_for_slot(quarterly, BASE_SLOT)


# --- assertions and their messages ---------------------------------------------------


def test_assert_ran_once__a_failed_run_shows_state_attempt_error_and_transitions(taskguard):
    with pytest.raises(ValueError):
        run_for_slot(broken, BASE_SLOT)
    with pytest.raises(AssertionError) as failure:
        assert_ran_once(broken, BASE_SLOT)
    message = str(failure.value)
    assert message.startswith(
        f"expected taskguard task 'tests.kit.broken' to have run once (succeeded) for slot "
        f"{BASE_SLOT.isoformat()}; found 1 run:"
    )
    assert "failed, attempt 1, duplicates 0, error 'ValueError: boom: the report" in message
    assert "pending -> running (claimed)" in message
    assert "running -> failed" in message


def test_assert_ran_once__no_run_for_the_slot_lists_the_latest_runs(taskguard):
    run_for_slot(quarterly, BASE_SLOT)
    wrong = BASE_SLOT.replace(tzinfo=PARIS)  # the same wall time, another zone: no run
    with pytest.raises(AssertionError) as failure:
        assert_ran_once(quarterly, wrong)
    lines = str(failure.value).splitlines()
    assert lines[0].endswith("found no run.")
    assert lines[1] == "Its latest runs (newest first, at most 5):"
    assert f"slot {BASE_SLOT.isoformat()}: succeeded, attempt 1" in lines[2]
    with pytest.raises(AssertionError, match=r"No run of 'tests\.kit\.nightly' is recorded at all"):
        assert_ran_once(nightly, BASE_SLOT)


def test_assert_state_and_assert_no_run(taskguard):
    run_for_slot(quarterly, BASE_SLOT)
    assert assert_state(quarterly, BASE_SLOT, "succeeded").state == RunState.SUCCEEDED
    with pytest.raises(AssertionError, match="to have one run in state 'skipped'"):
        assert_state(quarterly, BASE_SLOT, RunState.SKIPPED)
    with pytest.raises(TaskGuardError, match="'done' is not a state"):
        assert_state(quarterly, BASE_SLOT, "done")
    assert_no_run(quarterly, BASE_SLOT + timedelta(minutes=15))
    assert_no_run(charge)
    with pytest.raises(AssertionError, match="to have no run for any slot; found 1 run"):
        assert_no_run(quarterly)
    with pytest.raises(TaskGuardError, match="one of them"):
        assert_ran_once(quarterly)


@pytest.mark.django_db(transaction=True, databases=["default", "ledger"])
def test_runs_for__reads_the_ledger_database(taskguard):
    with override_settings(TASKGUARD={"BACKEND": "database", "DATABASE_ALIAS": "ledger"}):
        run_for_slot(quarterly, BASE_SLOT)
        assert_ran_once(quarterly, BASE_SLOT)
    assert not TaskRun.objects.using("default").exists()
    assert_no_run(quarterly)


# --- freeze_now ----------------------------------------------------------------------


def test_freeze_now__a_cron_call_runs_the_latest_slot_of_the_frozen_day(taskguard):
    with freeze_now(datetime(2020, 3, 1, 23, 30, tzinfo=PARIS)) as clock:
        assert dj_timezone.now() == datetime(2020, 3, 1, 22, 30, tzinfo=UTC)
        assert nightly() == "nightly"
        assert nightly() is None
        clock.advance(timedelta(days=1))
        assert nightly() == "nightly"
    run = assert_ran_once(nightly, datetime(2020, 3, 1, 21, 0, tzinfo=PARIS))
    assert run.duplicates == 1
    assert_ran_once(nightly, datetime(2020, 3, 2, 21, 0, tzinfo=PARIS))
    # Not frozen: the database's clock, which stamps the run and judges its lease.
    assert abs(run.started_at - ledger.database_now()) < timedelta(hours=1)
    assert dj_timezone.now().year > 2020


def test_freeze_now__an_every_call_takes_the_epoch_aligned_slot(taskguard):
    @freeze_now(datetime(2020, 6, 1, 10, 7, 30, tzinfo=UTC))
    def at_10_07() -> str | None:
        return quarterly("first")

    assert at_10_07() == "ran first"
    with freeze_now(datetime(2020, 6, 1, 10, 14, 59, tzinfo=UTC)) as clock:
        assert quarterly("same slot") is None
        with freeze_now(datetime(2020, 6, 1, 10, 15, tzinfo=UTC)):  # the innermost wins
            assert quarterly("next") == "ran next"
        clock.move_to(datetime(2020, 6, 1, 10, 29, tzinfo=UTC))
        assert quarterly("next again") is None
    assert [run.slot.strftime("%H:%M") for run in runs_for(quarterly)] == ["10:15", "10:00"]


def test_freeze_now__frozen_in_the_future_runs_that_slot_on_the_real_database_clock(taskguard):
    with freeze_now(datetime(2031, 1, 1, 10, 7, tzinfo=UTC)):
        assert quarterly("future") == "ran future"
    run = assert_ran_once(quarterly, datetime(2031, 1, 1, 10, 0, tzinfo=UTC))
    assert abs(run.finished_at - ledger.database_now()) < timedelta(hours=1)


def test_freeze_now__an_async_test_runs_frozen_and_its_failure_fails():
    """On an ``async def`` test, ``@freeze_now`` keeps it a coroutine function, so Django's
    runner awaits it (with the clock frozen while it runs), and a failing test fails.

    Regression: the decorated test was a plain function returning an unawaited coroutine:
    it never ran, and passed (or, under ``filterwarnings = error``, was an error about the
    returned value, not the test's own failure)."""
    import unittest

    from asgiref.sync import iscoroutinefunction
    from django.test import SimpleTestCase

    frozen = datetime(2020, 6, 1, 10, 7, tzinfo=UTC)
    seen: list[datetime] = []

    class AsyncCase(SimpleTestCase):
        @freeze_now(frozen)
        async def test_passes(self) -> None:
            await asyncio.sleep(0)
            seen.append(dj_timezone.now())

        @freeze_now(frozen)
        async def test_fails(self) -> None:
            await asyncio.sleep(0)
            raise AssertionError("the async test body ran and failed")

    result = unittest.TestResult()
    unittest.TestSuite([AsyncCase("test_passes"), AsyncCase("test_fails")]).run(result)
    assert result.errors == [] and result.testsRun == 2
    assert [case.id().rsplit(".", 1)[-1] for case, _ in result.failures] == ["test_fails"]
    assert "the async test body ran and failed" in result.failures[0][1]
    assert seen == [frozen]  # it ran, frozen while awaited
    assert dj_timezone.now().year > 2020
    assert iscoroutinefunction(AsyncCase.test_passes)


def test_freeze_now__bad_input_is_refused():
    with pytest.raises(TaskGuardError, match="naive"):
        freeze_now(datetime(2026, 3, 1, 21))
    with pytest.raises(TaskGuardError, match="not str"):
        freeze_now("2026-03-01T21:00:00Z")  # type: ignore[arg-type]
    with pytest.raises(TaskGuardError, match="outside 1971-8999"):
        freeze_now(datetime(1, 1, 2, tzinfo=UTC))
    clock = freeze_now(datetime(2026, 3, 1, tzinfo=UTC))
    with pytest.raises(TaskGuardError, match="needs a timedelta"):
        clock.advance(60)  # type: ignore[arg-type]
    with pytest.raises(TaskGuardError, match="naive"):
        clock.move_to(datetime(2026, 3, 1))


# --- reset_locks ---------------------------------------------------------------------


def test_reset_locks__deletes_this_ledgers_redis_keys_and_nothing_else(taskguard, redis_server):
    client = redis_server.client()
    try:
        with redis_backend(redis_server, LEASE_SECONDS=30) as lock:
            prefix = lock.key_prefix()
            client.set("myapp:session:1", "kept")
            client.set("taskguard:0123456789ab:run:{other-ledger}", "kept")
            slot = BASE_SLOT + timedelta(hours=3)
            assert run_for_slot(quarterly, slot) == "ran "
            # The next test's database has no row, but the same ledger identity: the
            # finished marker left in Redis would answer its call ("finished": not run).
            TaskRun.objects.all().delete()
            assert run_for_slot(quarterly, slot) is None
            assert not TaskRun.objects.exists()  # (assert_no_run would fold the count)
            assert reset_locks() >= 1
            assert sorted(client.keys()) == [
                b"myapp:session:1",
                b"taskguard:0123456789ab:run:{other-ledger}",
            ]
            assert not client.keys(f"{prefix}:*")
            assert run_for_slot(quarterly, slot) == "ran "
            assert_ran_once(quarterly, slot)
    finally:
        client.close()


def test_reset_locks__the_database_backend_has_no_keys_and_caches_are_rebuilt(taskguard):
    before = get_backend()
    assert reset_locks() == 0
    assert get_backend() is not before


@pytest.mark.file_and_server
@pytest.mark.processes
def test_reset_locks__a_second_process_on_the_same_database_gets_its_own_identity(
    taskguard, child_env
):
    """``manage.py test --parallel`` clones one test database for every worker: without
    an identity of its own, each worker would use (and reset) the others' Redis keys."""
    ours = ledger.identity()
    probe = (
        "import django; django.setup()\n"
        "from django_taskguard import ledger\n"
        "from django_taskguard.testing import reset_locks\n"
        "before = ledger.identity(); reset_locks(); reset_locks()\n"
        "print(before, ledger.identity())"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=child_env, capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.split()
    assert before == ours  # the database's, which this process gave it
    assert after != ours  # the child's own, once, whatever the number of resets
    assert ledger.identity() == ours


class TaskguardTestCaseTests(TaskguardTestCase):
    def test_a_guarded_call_commits_and_is_asserted(self) -> None:
        assert run_for_slot(quarterly, BASE_SLOT) == "ran "
        assert_ran_once(quarterly, BASE_SLOT)


# --- the pytest plugin ---------------------------------------------------------------


@pytest.mark.file_and_server
@pytest.mark.processes
def test_pytest_plugin__imports_nothing_of_django_when_loaded():
    probe = (
        "import sys; import django_taskguard.testing.pytest_plugin; "
        "loaded = sorted(m for m in sys.modules if m == 'django' or m.startswith('django.')); "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, cwd=Path(ROOT))


# --- the plugin, between tests of a session ---------------------------------------

LEAK_TESTS = """
from datetime import datetime, timedelta, timezone

import pytest
from django.utils import timezone as dj_timezone

from django_taskguard import once_per_schedule, pauses, registry
from django_taskguard.testing import freeze_now

pauses.PAUSE_CACHE_SECONDS = 3600  # the cache outlives the flush between tests, always
SLOT = (dj_timezone.now() - timedelta(days=1)).replace(minute=0, second=0, microsecond=0)


@once_per_schedule(every=timedelta(hours=1), name="inner.job")
def job():
    return "ran"


@pytest.mark.django_db(transaction=True)
def test_1_runs_the_slot():
    assert job.run_for_slot(SLOT) == "ran"


@pytest.mark.django_db(transaction=True)
def test_2_the_same_slot_in_the_next_tests_empty_database_runs_again():
    assert job.run_for_slot(SLOT) == "ran"


@pytest.mark.django_db(transaction=True)
def test_3_a_paused_task_is_skipped():
    registry.sync()
    assert pauses.pause("inner.job", "test 3")
    assert job.run_for_slot(SLOT + timedelta(hours=1)) is None


@pytest.mark.django_db(transaction=True)
def test_4_the_pause_is_gone_with_its_database():
    assert job.run_for_slot(SLOT + timedelta(hours=1)) == "ran"
"""


@pytest.mark.file_and_server
@pytest.mark.processes
@pytest.mark.parametrize("backend", ["database", "redis"])
def test_django_db_transaction_alone__nothing_leaks_into_the_next_test(
    backend, tmp_path, redis_server
):
    # Before: under @pytest.mark.django_db(transaction=True) alone (documented as an
    # alternative to the taskguard fixture), test 2 found test 1's finished marker in Redis
    # (not run) and test 4 the paused-tasks cache of test 3 (skipped).
    redis = redis_server if backend == "redis" else None
    done = run_session(tmp_path / "session", {"test_leak.py": LEAK_TESTS}, redis=redis)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "4 passed" in done.stdout
