"""Check-ins on every path that runs or judges a slot: Celery retries, run_schedules' batch
and one-by-one paths, coroutines, the missed-slot sweep, cleanup of a SIGKILLed owner; and
what Sentry is told of each schedule."""

from __future__ import annotations

import asyncio
import json
import os
import warnings
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from io import StringIO
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import override_settings

from django_taskguard import ledger, once_per_schedule, registry
from django_taskguard.checkins import events, monitors, sending, sentry
from django_taskguard.contrib.celery import SCHEDULE_HEADER, SLOT_HEADER
from django_taskguard.models import RunState, TaskRun, TaskSchedule
from django_taskguard.registry import entries, unregister
from django_taskguard.scheduler import Scheduler
from django_taskguard.testing import freeze_now
from tests.support import celery_tasks
from tests.support.celery_app import app

from .support.checkin_setup import CheckIns, running_checkins
from .support.children import hold
from .support.monitoring import schedule
from .support.runs import make_run
from .support.slots import BASE_SLOT
from .support.waiting import wait_for
from .test_checkins import every_service, expected_id, seen

pytestmark = pytest.mark.dialect

SECOND = timedelta(seconds=1)
HOUR = timedelta(hours=1)


@pytest.fixture
def checkins(transactional_db: None) -> Iterator[CheckIns]:
    with running_checkins() as kit:
        yield kit


@pytest.fixture
def eager() -> Iterator[None]:
    app.conf.task_always_eager = True
    try:
        yield
    finally:
        app.conf.task_always_eager = False


def test_checkins__a_celery_retried_run_is_one_checkin(checkins: CheckIns, eager: None) -> None:
    """``flaky`` fails twice (autoretry), then succeeds: three attempts, one start, one end."""
    headers = {SLOT_HEADER: BASE_SLOT.isoformat(), SCHEDULE_HEADER: "retried"}
    result = celery_tasks.flaky.apply_async(kwargs={"log": "/dev/null"}, headers=headers)
    assert result.get() == "finally"
    hopeless_headers = {**headers, SCHEDULE_HEADER: "hopeless"}
    with pytest.raises(OSError, match="attempt 3"):
        celery_tasks.hopeless.apply_async(
            kwargs={"log": "/dev/null"}, headers=hopeless_headers
        ).get()
    checkins.settle()
    flaky = "tests.support.celery_tasks.flaky[retried]"
    hopeless = "tests.support.celery_tasks.hopeless[hopeless]"
    assert TaskRun.objects.get(task_name=flaky).attempt == 3
    assert TaskRun.objects.get(task_name=hopeless).attempt == 3
    assert seen(checkins.receiver) == sorted(
        every_service(["start", "ok"], expected_id(flaky, BASE_SLOT), monitors.default_slug(flaky))
        + every_service(
            ["start", "error"], expected_id(hopeless, BASE_SLOT), monitors.default_slug(hopeless)
        )
    )
    (end,) = [
        r["json"]
        for r in checkins.receiver.of("webhook")
        if r["json"]["event"] == "end" and r["json"]["task"] == flaky
    ]
    assert (end["state"], end["attempt"]) == (RunState.SUCCEEDED, 3)


@pytest.mark.parametrize("batch", [True, False], ids=["batch", "one-by-one"])
def test_checkins__run_schedules_paths_send_start_and_end(checkins: CheckIns, batch: bool) -> None:
    names = [f"tests.checkins.sched.{n}" for n in range(3)]
    for name in names:
        once_per_schedule(every=HOUR, name=name)(lambda: None)
    made = [entries()[name] for name in names]
    slot = made[0].schedule.latest_slot(datetime.now(UTC))
    scheduler = Scheduler(made, max_workers=2, batch=batch)
    try:
        scheduler.fire([(entry, [slot]) for entry in made])
        assert scheduler.dispatcher.settle(60), "the batch claims never settled"
        assert scheduler.pool.drain(60), "the jobs never finished"
    finally:
        scheduler.dispatcher.close()
        scheduler.pool.close()
        scheduler.writer.close()
        for name in names:
            unregister(name)
    checkins.settle()
    assert set(TaskRun.objects.values_list("state", flat=True)) == {RunState.SUCCEEDED}
    assert seen(checkins.receiver) == sorted(
        row
        for name in names
        for row in every_service(
            ["start", "ok"], expected_id(name, slot), monitors.default_slug(name)
        )
    )


def test_checkins__a_coroutine_sends_start_and_end(checkins: CheckIns) -> None:
    @once_per_schedule(every=HOUR, name="tests.checkins.coroutine")
    async def body() -> str:
        await asyncio.sleep(0)
        return "awaited"

    assert asyncio.run(body.run_for_slot(BASE_SLOT)) == "awaited"
    checkins.settle()
    ident = expected_id("tests.checkins.coroutine", BASE_SLOT)
    assert seen(checkins.receiver) == every_service(
        ["start", "ok"], ident, "tests-checkins-coroutine"
    )


def test_checkins__the_sweep_pushes_each_missed_slot_newest_twenty(checkins: CheckIns) -> None:
    """cleanup_locks' sweep records 30-odd slots nobody fired: each of the newest 20 is one
    ``missed`` check-in (error) with its own id; the reason counts the rest."""
    task = "tests.checkins.nobody"
    first = ledger.database_now().replace(microsecond=0) - 40 * SECOND
    schedule(task, every=SECOND, grace=2 * SECOND, first_seen=first)
    call_command("cleanup_locks", "--json", stdout=StringIO())
    checkins.settle()
    missed = sorted(TaskRun.objects.filter(task_name=task).values_list("slot", flat=True))
    assert len(missed) > 30
    assert seen(checkins.receiver) == sorted(
        row
        for slot in missed[-20:]
        for row in every_service(
            ["error"], expected_id(task, slot, missed=True), "tests-checkins-nobody"
        )
    )
    (reason,) = {r["json"]["reason"] for r in checkins.receiver.of("webhook")}
    assert reason.startswith("missed: no instance claimed it within its grace (2s)")
    assert reason.endswith(f" ({len(missed) - 20} older missed slots not checked in)")
    assert {r["json"]["state"] for r in checkins.receiver.of("webhook")} == {RunState.MISSED}


@pytest.mark.file_and_server
@pytest.mark.processes
def test_checkins__a_sigkilled_owner_is_pushed_abandoned_by_cleanup(
    checkins: CheckIns, child_env: dict[str, str], scratch: Path
) -> None:
    victim = hold(
        child_env, scratch / "exec.log", "tests.checkins.killed", slot=0, seconds=120, lease=2
    )
    run_id = victim.started()["started"]
    victim.killed()
    wait_for(lambda: TaskRun.objects.stale().filter(pk=run_id).exists(), 30, "lease expiry")
    assert json.loads(_cleanup())["stale_runs"] == 1
    checkins.settle()
    run = TaskRun.objects.get(pk=run_id)
    assert run.state == RunState.ABANDONED
    ident = expected_id(run.task_name, run.slot)
    assert seen(checkins.receiver) == every_service(["error"], ident, "tests-checkins-killed")
    (pushed,) = [r["json"] for r in checkins.receiver.of("webhook")]
    assert (pushed["event"], pushed["run_id"]) == ("abandoned", run_id)
    assert "expired" in pushed["reason"]


def test_checkins__a_retry_of_an_abandoned_run_is_a_checkin_of_its_own(checkins: CheckIns) -> None:
    """The ``abandoned`` check-in closed the slot's id at the services: the attempt that takes
    the run over (``on_stale="retry"``) starts and ends another one, under one id."""

    @once_per_schedule(every=HOUR, name="tests.checkins.retaken", on_stale="retry")
    def retaken() -> str:
        return "done"

    make_run(retaken.task_name, slot=BASE_SLOT, state=RunState.ABANDONED)
    assert retaken.run_for_slot(BASE_SLOT) == "done"
    checkins.settle()
    found = seen(checkins.receiver)
    ids = {ident for _, _, ident, _ in found}
    assert len(ids) == 1 and ids != {expected_id(retaken.task_name, BASE_SLOT)}
    assert found == every_service(["ok", "start"], ids.pop(), "tests-checkins-retaken")


def _cleanup() -> str:
    out = StringIO()
    call_command("cleanup_locks", "--json", stdout=out)
    return out.getvalue()


def test_monitor_config__crontab_in_a_zone_and_intervals(transactional_db: None) -> None:
    nightly = schedule("tests.mc.nightly", cron="30 2 * * *", grace=timedelta(minutes=5))
    TaskSchedule.objects.filter(pk=nightly.pk).update(time_zone="America/New_York")
    schedule("tests.mc.two_hours", every=2 * HOUR, grace=timedelta(seconds=30))
    schedule("tests.mc.quick", every=30 * SECOND)
    monitors.forget_schedules()
    assert sentry.config({}, "tests.mc.nightly") == {
        "schedule": {"type": "crontab", "value": "30 2 * * *"},
        "timezone": "America/New_York",
        "checkin_margin": 5,
        "max_runtime": 1440,
    }
    assert sentry.config(
        {"max_runtime_minutes": 90, "recovery_threshold": 2}, "tests.mc.two_hours"
    ) == {
        "schedule": {"type": "interval", "value": 2, "unit": "hour"},
        "timezone": "UTC",
        "checkin_margin": 1,
        "max_runtime": 90,
        "recovery_threshold": 2,
    }
    assert sentry.config({}, "tests.mc.quick") is None  # Sentry has no sub-minute interval
    assert sentry.config({}, "tests.mc.unknown") is None


@pytest.mark.parametrize(
    "today",
    # A week before the US spring-forward and fall-back, a leap day, a New Year's Eve.
    [
        "2027-03-07T12:00:00+00:00",
        "2027-10-31T12:00:00+00:00",
        "2028-02-29T23:59:30+00:00",
        "2026-12-31T23:59:59+00:00",
    ],
)
def test_monitor_config__max_runtime_whatever_the_date(today: str) -> None:
    """Sentry's ``max_runtime`` for a schedule is the same on every day of the year: a
    nightly job in a zone with daylight saving is not told 1380 minutes in the weeks before
    its spring-forward (it was, from early December to mid March)."""
    with freeze_now(datetime.fromisoformat(today)):
        nightly = monitors.monitor_config(
            "30 2 * * *", True, "America/New_York", None, timedelta(minutes=5)
        )
        weekdays = monitors.monitor_config("0 9 * * 1-5", True, "Europe/Berlin", None, HOUR)
    assert nightly is not None and nightly["max_runtime"] == 1440
    assert weekdays is not None and weekdays["max_runtime"] == 1440  # Monday to Tuesday


def test_monitor_config__day_and_mode_and_uneven_slots(transactional_db: None) -> None:
    """Celery's ``day_or=False`` ("the first Monday") reads both day fields with AND, Sentry
    with OR: no ``monitor_config`` then. Uneven slots: the shortest gap, whatever the hour."""
    first_monday = schedule("tests.mc.first_monday", cron="0 9 1-7 * 1")
    weekly = schedule("tests.mc.mondays", cron="0 9 * * 1")
    TaskSchedule.objects.filter(pk__in=[first_monday.pk, weekly.pk]).update(cron_day_or=False)
    schedule("tests.mc.twice", cron="0 9,10 * * *")
    monitors.forget_schedules()
    assert sentry.config({}, "tests.mc.first_monday") is None
    assert sentry.config({}, "tests.mc.mondays")["schedule"]["value"] == "0 9 * * 1"
    assert sentry.config({}, "tests.mc.twice")["max_runtime"] == 60


def test_monitor_config__sent_with_every_sentry_checkin(checkins: CheckIns) -> None:
    @once_per_schedule(every=HOUR, name="tests.checkins.configured")
    def configured() -> None:
        pass

    registry.sync()
    configured.run_for_slot(BASE_SLOT)
    checkins.settle()
    configs = [r["item"].get("monitor_config") for r in checkins.receiver.of("sentry")]
    assert len(configs) == 2 and configs[0] == configs[1]
    assert configs[0]["schedule"] == {"type": "interval", "value": 1, "unit": "hour"}


def test_default_slug__sentry_safe_stable_and_unique_when_cut() -> None:
    assert monitors.default_slug("reports.Nightly Report") == "reports-nightly-report"
    long_a = "app.tasks." + "x" * 60 + ".a"
    long_b = "app.tasks." + "x" * 60 + ".b"
    slug_a, slug_b = monitors.default_slug(long_a), monitors.default_slug(long_b)
    assert len(slug_a) <= 50 and len(slug_b) <= 50 and slug_a != slug_b
    assert slug_a == monitors.default_slug(long_a)
    assert all(c.isdigit() or c in "abcdefghijklmnopqrstuvwxyz-_" for c in slug_a)


def test_sending__a_forked_child_starts_its_own_thread(checkins: CheckIns) -> None:
    """The parent's sending thread does not exist in a forked child: the child's first
    check-in starts one there (``os.getpid()`` changed), and it is delivered."""
    only_webhook = {"webhook": {"url": f"{checkins.receiver.url}/webhook"}}
    with override_settings(TASKGUARD={**settings.TASKGUARD, "CHECKINS": only_webhook}):
        ledger.identity()  # read here: the child inherits it and needs no connection
        sending.submit(_checkin("tests.checkins.parent"))
        checkins.settle()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads, 3.12+
            pid = os.fork()
        if pid == 0:  # the child: never back into pytest
            sending.submit(_checkin("tests.checkins.child"))
            os._exit(0 if sending.flush(20) else 1)  # a thread of the parent's would not drain
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    tasks = [r["json"]["task"] for r in checkins.receiver.wait_for(2, "webhook")]
    assert tasks == ["tests.checkins.parent", "tests.checkins.child"]


def _checkin(task: str) -> events.CheckIn:
    return events.CheckIn(
        event=events.START, task=task, slot=BASE_SLOT, state=RunState.RUNNING, ok=True, run_id=1
    )


def test_checkins__cleanup_of_a_keyed_run_sends_none(checkins: CheckIns) -> None:
    """``run_abandoned`` carries no key: the sending thread reads the row, and a keyed run
    (``@once_per_key``) is not checked in, while the stale slot's run beside it is."""
    keyed = make_run("tests.checkins.keyed", 0)
    TaskRun.objects.filter(pk=keyed.pk).update(key="order:42")
    slotted = make_run("tests.checkins.slotted", 0)
    assert json.loads(_cleanup())["stale_runs"] == 2
    checkins.settle()
    assert {r["json"]["task"] for r in checkins.receiver.of("webhook")} == {slotted.task_name}
    assert seen(checkins.receiver) == every_service(
        ["error"], expected_id(slotted.task_name, slotted.slot), "tests-checkins-slotted"
    )
