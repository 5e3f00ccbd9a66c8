"""The schedule registry, the catch-up policy, pause/resume, the missed-slot sweep and backfill,
in this process (the scheduler's real processes are in test_run_schedules.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import modify_settings, override_settings
from django.utils import timezone

from django_taskguard import ledger, once_per_schedule, registry
from django_taskguard.checks import check_settings
from django_taskguard.exceptions import InvalidSchedule
from django_taskguard.missed import sweep_missed
from django_taskguard.models import RunState, TaskRun, TaskSchedule
from django_taskguard.pauses import forget
from django_taskguard.testing import freeze_now

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]
SECOND = timedelta(seconds=1)


@pytest.fixture(autouse=True)
def clean_registry() -> Iterator[None]:
    before = set(registry.entries())
    forget()
    yield
    for name in set(registry.entries()) - before:
        registry.unregister(name)
    forget()


def now_second():  # type: ignore[no-untyped-def]
    return timezone.now().replace(microsecond=0)


def seen_since(name: str, seconds: float) -> None:
    """Make the stored schedule of ``name`` first seen ``seconds`` ago (as if deployed then)."""
    TaskSchedule.objects.filter(task_name=name).update(
        first_seen=timezone.now() - timedelta(seconds=seconds), swept_until=None
    )


def every_second(name: str, calls: list[str], **options):  # type: ignore[no-untyped-def]
    @once_per_schedule(every=SECOND, name=name, **options)
    def job() -> str:
        calls.append(name)
        return "ran"

    return job


# -- the registry ------------------------------------------------------------------


def test_once_per_schedule__registers_in_memory_only():
    every_second("tests.reg.memory", [])
    entry = registry.entries()["tests.reg.memory"]
    assert entry.policy.catchup == "latest" and entry.policy.grace == timedelta(minutes=5)
    assert not TaskSchedule.objects.exists(), "nothing is written at decoration time"


def test_once_per_schedule__no_schedule_is_not_registered():
    @once_per_schedule(name="tests.reg.noschedule")
    def job() -> None: ...

    assert "tests.reg.noschedule" not in registry.entries()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"catchup": "some"}, "catchup= must be one of latest, none, all"),
        ({"grace": timedelta(0)}, "grace= must be a timedelta from 0:00:01 to 7 days"),
        ({"grace": 5}, "grace= must be a timedelta"),
        ({"max_catchup": 0}, "max_catchup= must be a whole number from 1 to 10000"),
        ({"max_catchup": 10_001}, "max_catchup= must be a whole number from 1 to 10000"),
        ({"pause_after_failures": 0}, "pause_after_failures= must be a whole number from 1"),
    ],
)
def test_once_per_schedule__catchup_arguments_bounded(options, message):
    with pytest.raises(InvalidSchedule, match=message):
        every_second("tests.reg.bad", [], **options)


def test_once_per_schedule__catchup_all_without_schedule_refused():
    with pytest.raises(InvalidSchedule, match="need a schedule that run_schedules fires"):
        once_per_schedule(catchup="all")
    with pytest.raises(InvalidSchedule, match="need a schedule that run_schedules fires"):
        once_per_schedule(max_catchup=3)


def test_once_per_schedule__stamped_slot_later_than_grace_recorded_missed():
    """No schedule (a beat stamps the slot): catchup='none' and grace= still apply."""
    from django_taskguard import decorators

    calls: list[str] = []

    @once_per_schedule(name="tests.catchup.stamped", catchup="none", grace=2 * SECOND)
    def job() -> None:
        calls.append("ran")

    late = now_second() - 30 * SECOND

    def stamped() -> decorators.CallContext:
        return decorators.CallContext(slot=late)

    decorators.SLOT_SOURCES.insert(0, stamped)
    try:
        assert job() is None
    finally:
        decorators.SLOT_SOURCES.remove(stamped)
    assert calls == []
    assert TaskRun.objects.get(task_name="tests.catchup.stamped").state == RunState.MISSED


def test_register__two_functions_one_name_latest_kept_and_said(caplog):
    every_second("tests.reg.twice", [])

    @once_per_schedule(every=SECOND, name="tests.reg.twice")
    def clash() -> None: ...

    assert registry.entries()["tests.reg.twice"].func is clash.__wrapped__
    assert "two schedules are named 'tests.reg.twice'" in caplog.text


def test_sync__saves_schedules_and_keeps_first_seen_and_pause():
    every_second("tests.reg.sync", [], catchup="all", grace=timedelta(seconds=30), max_catchup=7)
    registry.sync()
    row = TaskSchedule.objects.get(task_name="tests.reg.sync")
    assert (row.every, row.cron, row.catchup, row.max_catchup) == (SECOND, "", "all", 7)
    assert row.grace == timedelta(seconds=30)
    first_seen = row.first_seen
    call_command("pause_task", "tests.reg.sync", "--reason", "maintenance", stdout=StringIO())
    registry.sync()
    row.refresh_from_db()
    assert row.paused and row.paused_reason == "maintenance" and row.first_seen == first_seen


def test_sync__cron_schedule_stored_and_rebuilt():
    @once_per_schedule(cron="30 2 * * 1", name="tests.reg.cron")
    def job() -> None: ...

    registry.sync()
    row = TaskSchedule.objects.get(task_name="tests.reg.cron")
    assert (row.cron, row.every, row.cron_day_or) == ("30 2 * * 1", None, True)


@override_settings(
    TASKGUARD={"BACKEND": "database", "SCHEDULE_MODULES": ["tests.support.schedule_jobs"]}
)
def test_discover__imports_schedule_modules():
    assert "tests.sched.0" in registry.discover()


@override_settings(TASKGUARD={"BACKEND": "database", "SCHEDULE_MODULES": ["tests.nowhere"]})
def test_discover__missing_module_is_improperly_configured():
    with pytest.raises(ImproperlyConfigured, match=r"'tests\.nowhere', which cannot be imported"):
        registry.discover()


@override_settings(TASKGUARD={"SCHEDULE_MODULES": "tests.support.schedule_jobs"})
def test_check_settings__schedule_modules_must_be_a_list():
    assert [e.id for e in check_settings()] == ["taskguard.E020"]


# -- catch-up and misfire grace ------------------------------------------------------


def test_fire__catchup_none_late_slot_recorded_missed_not_run():
    calls: list[str] = []
    every_second("tests.catchup.none", calls, catchup="none", grace=2 * SECOND)
    entry = registry.entries()["tests.catchup.none"]
    late = now_second() - 10 * SECOND
    assert entry.fire(late) is False
    run = TaskRun.objects.get(task_name="tests.catchup.none")
    assert run.state == RunState.MISSED and "catchup='none'" in run.error
    assert calls == []
    # A slot in time runs.
    assert entry.fire(now_second()) is True


def test_fire__catchup_latest_late_slot_runs():
    calls: list[str] = []
    every_second("tests.catchup.latest", calls)
    assert registry.entries()["tests.catchup.latest"].fire(now_second() - 60 * SECOND) is True


def test_claim__missed_row_runs_late_unless_catchup_none():
    calls: list[str] = []
    job = every_second("tests.catchup.taken", calls)
    slot = now_second() - 30 * SECOND
    ledger.insert_missed("tests.catchup.taken", slot, reason="missed: test", actor="test")
    assert job.run_for_slot(slot) == "ran"
    run = TaskRun.objects.get(task_name="tests.catchup.taken")
    steps = [(t.from_state, t.to_state) for t in run.transitions.order_by("id")]
    assert steps == [("pending", "missed"), ("missed", "running"), ("running", "succeeded")]

    strict = every_second("tests.catchup.strict", calls, catchup="none")
    ledger.insert_missed("tests.catchup.strict", slot, reason="missed: test", actor="test")
    assert strict.run_for_slot(slot) is None
    assert TaskRun.objects.get(task_name="tests.catchup.strict").state == RunState.MISSED
    assert calls == ["tests.catchup.taken"]


# -- the missed-slot sweep -------------------------------------------------------------


def test_sweep_missed__records_each_unclaimed_slot_once():
    calls: list[str] = []
    job = every_second("tests.sweep.few", calls, grace=2 * SECOND)
    registry.sync()
    seen_since("tests.sweep.few", 20)
    ran = now_second() - 10 * SECOND
    job.run_for_slot(ran)
    now = ledger.database_now()
    result = sweep_missed(now=now)
    missed = TaskRun.objects.filter(task_name="tests.sweep.few", state=RunState.MISSED)
    assert result.missed_slots == missed.count() >= 15
    assert not missed.filter(slot=ran).exists()
    assert all(r.error.startswith("missed: no instance claimed it") for r in missed)
    again = sweep_missed(now=now)
    assert again.missed_slots == 0 and not again.tasks, "it starts where the last one ended"


def test_sweep_missed__a_slot_only_refused_as_early_is_recorded_missed():
    # Before: an early call's `skipped` row stood for the slot: when no on-time call came,
    # nothing ran it and the sweep (so health) said nothing.
    job = every_second("tests.sweep.early", [], grace=2 * SECOND)
    registry.sync()
    slot = now_second() + timedelta(minutes=5)
    seen_since("tests.sweep.early", -(5 * 60 - 3))  # first seen 3 s before the slot
    with pytest.raises(InvalidSchedule, match="in the future"):
        job.run_for_slot(slot)
    result = sweep_missed(now=slot + 5 * SECOND, task="tests.sweep.early")
    run = TaskRun.objects.get(task_name="tests.sweep.early", slot=slot)
    assert run.state == RunState.MISSED and result.missed_slots >= 1
    steps = [(t.from_state, t.to_state) for t in run.transitions.order_by("at", "id")]
    assert steps == [("pending", "skipped"), ("skipped", "missed")]


def test_sweep_missed__paused_task_slots_skipped_paused_not_missed():
    every_second("tests.sweep.paused", [], grace=2 * SECOND)
    registry.sync()
    seen_since("tests.sweep.paused", 10)
    call_command("pause_task", "tests.sweep.paused", stdout=StringIO())
    # Paused since before it was deployed (slots due before a pause are missed: test_missed).
    TaskSchedule.objects.filter(task_name="tests.sweep.paused").update(
        paused_at=timezone.now() - 60 * SECOND
    )
    result = sweep_missed()
    rows = TaskRun.objects.filter(task_name="tests.sweep.paused")
    assert result.missed_slots == 0 and rows.exists()
    assert set(rows.values_list("state", flat=True)) == {RunState.SKIPPED}
    assert {r.error for r in rows} == {"paused (recorded by the missed-slot sweep)"}


def test_cleanup_locks__json_counts_missed_slots():
    every_second("tests.sweep.cleanup", [], grace=2 * SECOND)
    registry.sync()
    seen_since("tests.sweep.cleanup", 10)
    out = StringIO()
    call_command("cleanup_locks", "--json", "--dry-run", stdout=out)
    would = json.loads(out.getvalue())
    assert would["missed_slots"] >= 7 and not TaskRun.objects.exists()
    out = StringIO()
    call_command("cleanup_locks", "--json", stdout=out)
    done = json.loads(out.getvalue())
    assert {"stale_runs", "released_locks", "orphan_keys", "dry_run"} <= set(done)
    assert done["missed_slots"] == TaskRun.objects.filter(state=RunState.MISSED).count() >= 7


# -- pause and resume ----------------------------------------------------------------


def test_pause_task__slots_recorded_skipped_paused_then_resume_runs():
    calls: list[str] = []
    job = every_second("tests.pause.job", calls)
    out = StringIO()
    call_command("pause_task", "tests.pause.job", stdout=out)
    assert "Paused tests.pause.job" in out.getvalue()
    slot = now_second() - 5 * SECOND
    assert job.run_for_slot(slot) is None
    run = TaskRun.objects.get(task_name="tests.pause.job", slot=slot)
    # No reason given: none stored (who and from where are the pause event's), "paused" said.
    assert TaskSchedule.objects.get(task_name="tests.pause.job").paused_reason == ""
    assert run.state == RunState.SKIPPED and run.transitions.last().reason == "paused"
    call_command("resume_task", "tests.pause.job", stdout=StringIO())
    assert job.run_for_slot(slot + SECOND) == "ran"
    assert calls == ["tests.pause.job"]


def test_pause_task__unknown_name_names_close_matches():
    every_second("tests.pause.nightly", [])
    with pytest.raises(CommandError, match=r"did you mean tests\.pause\.nightly"):
        call_command("pause_task", "tests.pause.nigthly")
    with pytest.raises(CommandError, match="no schedule named"):
        call_command("resume_task", "zzz")


def test_pause_after_failures__pauses_after_n_failures_in_a_row():
    @once_per_schedule(every=SECOND, name="tests.pause.failing", pause_after_failures=2)
    def failing() -> None:
        raise RuntimeError("boom")

    registry.sync()
    base = now_second() - 10 * SECOND
    for n in range(2):
        with pytest.raises(RuntimeError):
            failing.run_for_slot(base + n * SECOND)
    row = TaskSchedule.objects.get(task_name="tests.pause.failing")
    assert row.paused and "2 failures in a row" in row.paused_reason


# -- backfill --------------------------------------------------------------------------


def test_backfill__runs_slots_without_row_once_twice_harmless():
    calls: list[str] = []
    job = every_second("tests.backfill.job", calls)
    end = now_second() - 10 * SECOND
    start = end - 9 * SECOND
    job.run_for_slot(start + 3 * SECOND)
    args = ["backfill", "tests.backfill.job", "--from", start.isoformat(), "--to", end.isoformat()]
    out = StringIO()
    call_command(*args, "--dry-run", stdout=out)
    assert "Would run 9 slots of tests.backfill.job (1 already have a row)" in out.getvalue()
    assert len(calls) == 1
    call_command(*args, stdout=StringIO())
    assert len(calls) == 10
    out = StringIO()
    call_command(*args, stdout=out)
    assert "Running 0 slots" in out.getvalue() and len(calls) == 10
    states = TaskRun.objects.filter(task_name="tests.backfill.job").values_list("state", flat=True)
    assert list(states) == [RunState.SUCCEEDED] * 10


def test_backfill__runs_a_slot_whose_row_only_refused_an_early_call():
    # Before: an early call's `skipped` row counted as the slot's row: backfill skipped it.
    calls: list[str] = []
    job = every_second("tests.backfill.early", calls)
    slot = now_second() + timedelta(minutes=10)
    with pytest.raises(InvalidSchedule, match="in the future"):
        job.run_for_slot(slot)
    args = ["--from", (slot - SECOND).isoformat(), "--to", (slot + SECOND).isoformat()]
    with freeze_now(slot + timedelta(minutes=1)):
        out = StringIO()
        call_command("backfill", "tests.backfill.early", *args, stdout=out)
    assert "Running 3 slots" in out.getvalue() and len(calls) == 3
    assert TaskRun.objects.get(slot=slot).state == RunState.SUCCEEDED


def test_backfill__range_bounded_and_old_slots_refused():
    every_second("tests.backfill.bounds", [])
    end = now_second()
    with pytest.raises(CommandError, match="more than 10,000 slots"):
        call_command(
            "backfill", "tests.backfill.bounds", "--from", (end - 86_400 * SECOND).isoformat(),
            "--to", end.isoformat(),
        )  # fmt: skip
    old = end - timedelta(days=31)
    out = StringIO()
    call_command(
        "backfill", "tests.backfill.bounds", "--from", old.isoformat(),
        "--to", (old + 4 * SECOND).isoformat(), "--dry-run", stdout=out,
    )  # fmt: skip
    assert "5 slots are older than PRUNE_AFTER_DAYS (30 days)" in out.getvalue()
    with pytest.raises(CommandError, match="has no UTC offset"):
        call_command("backfill", "tests.backfill.bounds", "--from", "2026-01-01T00:00", "--to", "x")


# -- run_schedules --once ------------------------------------------------------------------


def test_run_schedules__once_fires_due_slot_and_exits():
    calls: list[str] = []
    every_second("tests.once.job", calls, catchup="all", max_catchup=3)
    registry.sync()
    seen_since("tests.once.job", 60)
    out = StringIO()
    call_command("run_schedules", "--once", "--task", "tests.once.job", stdout=out)
    assert calls == ["tests.once.job"], "no row yet: the latest slot only"
    # Later slots: catchup="all" runs those after the newest row, at most max_catchup.
    latest = TaskRun.objects.get(task_name="tests.once.job").slot
    TaskRun.objects.filter(task_name="tests.once.job").update(slot=latest - 10 * SECOND)
    call_command("run_schedules", "--once", "--task", "tests.once.job", stdout=StringIO())
    assert len(calls) == 4


# -- batched claims and finishes (PostgreSQL; SQLite claims one by one) ---------------------


def test_claim_many__one_statement_wins_or_counts_duplicates():
    from django.db import connection

    from django_taskguard.claim import Taken, claim_many
    from django_taskguard.context import ActiveRun

    slot = now_second()
    wanted = [("tests.batch.a", 30.0), ("tests.batch.b", 30.0)]
    first = claim_many(slot, wanted)
    if connection.vendor != "postgresql":
        assert first is None
        return
    assert first is not None and all(isinstance(v, ActiveRun) for v in first.values())
    again = claim_many(slot, wanted)
    assert again is not None and all(isinstance(v, Taken) for v in again.values())
    runs = TaskRun.objects.filter(slot=slot)
    assert sorted(runs.values_list("duplicates", flat=True)) == [1, 1]
    assert all(
        [(t.from_state, t.to_state) for t in run.transitions.all()] == [("pending", "running")]
        for run in runs
    )
    # A missed row is left to the one-task path (None).
    ledger.insert_missed("tests.batch.c", slot, reason="missed: test", actor="test")
    assert claim_many(slot, [("tests.batch.c", 30.0)]) == {"tests.batch.c": None}


def test_succeed_many__records_each_fenced_row():
    from django.db import connection

    from django_taskguard.claim import claim_many

    if connection.vendor != "postgresql":
        assert ledger.succeed_many([]) is None
        return
    slot = now_second()
    claimed = claim_many(slot, [("tests.batch.x", 30.0), ("tests.batch.y", 30.0)])
    assert claimed is not None
    x, y = claimed["tests.batch.x"], claimed["tests.batch.y"]
    done = ledger.succeed_many(
        [(x.id, x.fence, x.owner, "returned"), (y.id, y.fence + 1000, y.owner, "returned")]
    )
    assert done == {x.id}, "a wrong fence is refused"
    assert TaskRun.objects.get(id=x.id).state == RunState.SUCCEEDED
    assert TaskRun.objects.get(id=y.id).state == RunState.RUNNING


def test_run_schedules__once_catchup_all_runs_slots_the_sweep_recorded_missed():
    calls: list[str] = []
    every_second("tests.once.swept", calls, catchup="all", grace=SECOND)
    registry.sync()
    seen_since("tests.once.swept", 60)
    job = registry.entries()["tests.once.swept"]
    newest = now_second() - 8 * SECOND
    job.run_for_slot(newest)  # the newest row before the scheduler went down
    sweep_missed()  # cleanup_locks from cron, while no scheduler runs
    swept = TaskRun.objects.filter(task_name="tests.once.swept", state=RunState.MISSED)
    assert swept.filter(slot__gt=newest).exists()
    call_command("run_schedules", "--once", "--task", "tests.once.swept", stdout=StringIO())
    runs = TaskRun.objects.filter(task_name="tests.once.swept", slot__gt=newest)
    assert set(runs.values_list("state", flat=True)) == {RunState.SUCCEEDED}
    assert len(calls) == 1 + runs.count() >= 8


def test_scheduler_due__a_late_wakeup_fires_slots_within_grace_in_order():
    from django_taskguard.scheduler import Scheduler

    every_second("tests.due.latest", [], grace=5 * SECOND)
    every_second("tests.due.strict", [], catchup="none", grace=5 * SECOND)
    entries = [registry.entries()[n] for n in ("tests.due.latest", "tests.due.strict")]
    scheduler = Scheduler(entries, max_workers=1)
    try:
        now = now_second()
        scheduler.first_due(now - 10 * SECOND)  # the cursors: 10 s ago
        due = dict((entry.task_name, slots) for entry, slots in scheduler.due(now))
    finally:
        scheduler.pool.close()
        scheduler.writer.close()
    # latest: the slots still within their grace (5 s), oldest first, then the newest;
    # none: every slot (the guard records the late ones missed).
    assert due["tests.due.latest"] == [now - n * SECOND for n in range(5, -1, -1)]
    assert due["tests.due.strict"] == [now - n * SECOND for n in range(9, -1, -1)]


def test_run_schedules__a_paused_slot_is_logged_as_paused(caplog):
    import logging

    calls: list[str] = []
    every_second("tests.once.paused", calls)
    registry.sync()
    seen_since("tests.once.paused", 60)
    call_command("pause_task", "tests.once.paused", stdout=StringIO())
    # run_schedules logs to its own handler, not propagated: listen on the logger itself.
    scheduler_logger = logging.getLogger("taskguard.scheduler")
    scheduler_logger.addHandler(caplog.handler)
    try:
        call_command("run_schedules", "--once", "--task", "tests.once.paused", stdout=StringIO())
    finally:
        scheduler_logger.removeHandler(caplog.handler)
    out = caplog.text
    assert calls == []
    assert "tests.once.paused slot" in out and "not run: the task is paused" in out, out
    assert "another call has it" not in out


def test_scheduler__a_slot_another_copy_ran_before_the_pause_is_not_logged_paused(caplog):
    import logging

    from django_taskguard.scheduler import NOT_RUN_HERE, Scheduler

    calls: list[str] = []
    every_second("tests.once.ran_first", calls, grace=timedelta(minutes=5))
    registry.sync()
    entry = registry.entries()["tests.once.ran_first"]
    slot = now_second() - 2 * SECOND
    entry.run_for_slot(slot)  # another copy ran the slot, then an operator paused the task
    call_command("pause_task", "tests.once.ran_first", stdout=StringIO())
    scheduler = Scheduler([entry], max_workers=1)
    scheduler_logger = logging.getLogger("taskguard.scheduler")
    scheduler_logger.addHandler(caplog.handler)
    try:
        scheduler._run(entry, [slot])  # this copy's call for the same slot loses
    finally:
        scheduler_logger.removeHandler(caplog.handler)
        scheduler.pool.close()
        scheduler.writer.close()
    assert calls == ["tests.once.ran_first"]
    assert TaskRun.objects.get(task_name="tests.once.ran_first").state == RunState.SUCCEEDED
    assert NOT_RUN_HERE in caplog.text, caplog.text
    assert "paused" not in caplog.text, caplog.text


# -- schedules the code no longer declares -------------------------------------------------


def test_sync__marks_removed_what_the_code_no_longer_declares_and_declared_again_not():
    every_second("tests.reg.kept", [])
    every_second("tests.reg.dropped", [])
    registry.sync(mark_removed=True)
    beat = TaskSchedule.objects.create(
        task_name="tests.reg.ping[ping]", source="celery", entry="ping", every=SECOND,
        grace=SECOND, max_catchup=1, declared_in="CELERY_BEAT_SCHEDULE",
    )  # fmt: skip
    decorated = TaskSchedule.objects.create(
        task_name="tests.reg.celery_task", source="celery", every=SECOND, grace=SECOND,
        max_catchup=1,
    )  # fmt: skip
    registry.unregister("tests.reg.dropped")
    before = timezone.now()
    registry.sync(mark_removed=True)
    removed = dict(TaskSchedule.objects.values_list("task_name", "removed_at"))
    assert removed["tests.reg.dropped"] is not None and removed["tests.reg.dropped"] >= before
    assert removed["tests.reg.celery_task"] is not None  # a decorated function's Celery task
    assert removed["tests.reg.kept"] is None
    assert removed[beat.task_name] is None  # a beat entry: the beat says, not the code
    assert TaskSchedule.objects.get(task_name="tests.reg.kept").declared_in == __name__
    every_second("tests.reg.dropped", [])
    registry.sync(mark_removed=True)
    assert TaskSchedule.objects.get(task_name="tests.reg.dropped").removed_at is None
    assert TaskSchedule.objects.get(pk=decorated.pk).removed_at is not None


def test_sync__an_operators_sync_marks_nothing_removed():
    # pause_task, acknowledge, cleanup_locks and the upkeep may run where less is imported
    # (another service on the same database): only the processes that fire schedules mark.
    every_second("tests.reg.dropped", [])
    registry.sync()
    registry.unregister("tests.reg.dropped")
    registry.sync()
    assert TaskSchedule.objects.get(task_name="tests.reg.dropped").removed_at is None


@modify_settings(INSTALLED_APPS={"append": "tests.support.apps.needs_extra"})
def test_sync__marks_nothing_removed_when_a_module_was_skipped():
    every_second("tests.reg.dropped", [])
    registry.sync(mark_removed=True)
    registry.unregister("tests.reg.dropped")
    registry.sync(mark_removed=True)
    assert registry.unimported(), "the app's tasks module was expected to be skipped"
    assert TaskSchedule.objects.get(task_name="tests.reg.dropped").removed_at is None
