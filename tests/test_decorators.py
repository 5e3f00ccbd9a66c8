"""Bad input is a clear error at decoration or call time; odd task names work end to end."""

from __future__ import annotations

from datetime import date, datetime, timedelta
from datetime import timezone as dt_timezone

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from django_taskguard import current_run, ledger, once_per_schedule
from django_taskguard.decorators import SLOT_SOURCES
from django_taskguard.exceptions import InvalidSchedule, TaskGuardError
from django_taskguard.locks.base import run_key, task_digest
from django_taskguard.models import RunState, TaskRun
from django_taskguard.testing import freeze_now

from .support.runs import counted_duplicates
from .support.slots import BASE_SLOT

pytestmark = pytest.mark.dialect

SLOT = BASE_SLOT + timedelta(hours=21)


def body() -> str:
    return "ran"


LEASE_BOUNDS = r"lease_seconds= is .*; it must be a number of seconds from 1 to 86400"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cron": "61 * * * *"}, "invalid cron expression"),
        ({"cron": "every day at nine"}, "has 4 fields; it needs 5"),
        ({"cron": ""}, "has 0 fields; it needs 5"),
        ({"cron": "0 0 * * * *"}, "has 6 fields; it needs 5"),
        ({"cron": "0 0 30 2 *"}, "never fires"),
        ({"cron": 5}, "cron= must be a string, not int"),
        ({"cron": "0 21 * * *", "every": timedelta(minutes=5)}, "at most one of"),
        ({"cron": "0 21 * * *", "schedule": "0 22 * * *"}, "at most one of"),
        ({"every": timedelta(milliseconds=500)}, "at least one second"),
        ({"every": timedelta(0)}, "at least one second"),
        ({"every": timedelta(minutes=-5)}, "at least one second"),
        ({"every": 300}, "must be a timedelta"),
        ({"every": "5m"}, "must be a timedelta"),
        ({"schedule": 42}, "unsupported schedule"),
        ({"cron": "0 9 * * *", "time_zone": "Mars/Olympus"}, "unknown time zone 'Mars/Olympus'"),
        ({"cron": "0 9 * * *", "time_zone": ""}, "unknown time zone ''"),
        ({"every": timedelta(minutes=5), "time_zone": "Europe/Berlin"}, "cron schedule only"),
        ({"time_zone": "Europe/Berlin"}, "cron schedule only"),
        ({"schedule": timedelta(hours=1), "time_zone": "Europe/Berlin"}, "cron schedule only"),
        ({"on_duplicate": "ignore"}, "on_duplicate= must be one of skip, raise"),
        ({"overlap": "queue"}, "overlap= must be one of allow, skip"),
        ({"on_stale": "forget"}, "on_stale= must be one of abandon, retry"),
        ({"lease_seconds": 0}, LEASE_BOUNDS),
        ({"lease_seconds": -1}, LEASE_BOUNDS),
        ({"lease_seconds": "30"}, LEASE_BOUNDS),
        ({"lease_seconds": True}, LEASE_BOUNDS),
        ({"lease_seconds": 0.0005}, LEASE_BOUNDS),
        ({"lease_seconds": 0.5}, LEASE_BOUNDS),
        ({"lease_seconds": 86_401}, LEASE_BOUNDS),
        ({"lease_seconds": 1e11}, LEASE_BOUNDS),
        ({"lease_seconds": float("inf")}, LEASE_BOUNDS),
        ({"lease_seconds": float("nan")}, LEASE_BOUNDS),
        ({"name": ""}, "non-empty"),
        ({"name": "   "}, "non-empty"),
        ({"name": "x" * 256}, "at most 255"),
        ({"name": "nightly\x00report"}, "NUL"),
        ({"name": 12}, "non-empty string"),
        ({"slot_kwarg": "intended-date"}, "slot_kwarg= must name a keyword argument"),
        ({"slot_kwarg": "class"}, "slot_kwarg= must name a keyword argument"),
        ({"slot_kwarg": ""}, "slot_kwarg= must name a keyword argument"),
        ({"slot_kwarg": 5}, "slot_kwarg= must name a keyword argument"),
        ({"slot_kwarg": "s" * 101}, "slot_kwarg= must name a keyword argument"),
        ({"slot_kwarg": "_taskguard_schedule"}, "taskguard uses it"),
    ],
)
def test_once_per_schedule__bad_argument_raises_at_decoration(options, message):
    with pytest.raises(InvalidSchedule, match=message):
        once_per_schedule(**options)(body)


def test_once_per_schedule__decorating_a_non_callable_raises():
    with pytest.raises(TaskGuardError, match="callable"):  # InvalidSchedule is one
        once_per_schedule(every=timedelta(minutes=1))("not a function")  # type: ignore[arg-type]


def test_once_per_schedule__bare_and_called_forms_keep_the_function():
    bare = once_per_schedule(body)
    called = once_per_schedule(cron="0 21 * * *")(body)
    for guarded in (bare, called):
        assert guarded.__wrapped__ is body and guarded.__name__ == "body"
    assert bare.schedule is None and called.schedule is not None


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("slot", "message"),
    [
        (datetime(2026, 2, 1, 21, 0), "timezone-aware"),
        ("2026-02-01T21:00:00", "timezone-aware"),
        (date(2026, 2, 1), "aware datetime, not date"),
        (1767301200, "aware datetime, not int"),
        (None, "needs a slot"),
        ("tomorrow at nine", "not an ISO-8601"),
    ],
)
def test_run_for_slot__bad_slot_raises_and_does_not_run(slot, message):
    calls: list[int] = []
    # A schedule too: a bad explicit slot must not fall back to the schedule's slot.
    guarded = once_per_schedule(name="tests.badslot", every=timedelta(minutes=1))(
        lambda: calls.append(1)
    )
    with pytest.raises(InvalidSchedule, match=message):
        guarded.run_for_slot(slot)
    assert calls == [] and not TaskRun.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_run_for_slot__future_slot_beyond_tolerance_is_refused_within_it_accepted(lock_backend):
    calls: list[datetime] = []

    @once_per_schedule(name="tests.future")
    def guarded() -> None:
        calls.append(current_run().slot)

    far = timezone.now() + timedelta(minutes=10)
    with pytest.raises(InvalidSchedule, match="in the future"):
        guarded.run_for_slot(far)
    refused = TaskRun.objects.get(slot=far)  # recorded, never silent
    assert (refused.state, refused.attempt) == (RunState.SKIPPED, 0)
    (step,) = refused.transitions.all()
    assert "the database's clock says" in step.reason and "SLOT_TOLERANCE_SECONDS" in step.reason
    near = timezone.now() + timedelta(seconds=2)  # SLOT_TOLERANCE_SECONDS is 5
    guarded.run_for_slot(near)
    assert calls == [near]
    assert TaskRun.objects.get(slot=near).state == RunState.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_run_for_slot__an_early_call_does_not_take_the_slot_from_on_time_calls(lock_backend):
    # Before: the early call's `skipped` row answered every later call: the slot never
    # ran anywhere. Now the first on-time call takes the row over, and says so.
    calls: list[datetime] = []

    @once_per_schedule(name="tests.future.early")
    def guarded() -> str:
        calls.append(current_run().slot)
        return "ran"

    slot = (timezone.now() + timedelta(minutes=10)).replace(microsecond=0)
    for _ in range(2):  # a fast clock's calls: refused, recorded once
        with pytest.raises(InvalidSchedule, match="in the future"):
            guarded.run_for_slot(slot)
    assert TaskRun.objects.get(slot=slot).state == RunState.SKIPPED
    with freeze_now(slot):  # a caller whose clock says the slot is due
        assert guarded.run_for_slot(slot) == "ran"
        assert guarded.run_for_slot(slot) is None  # and only one of them
    assert calls == [slot]
    run = TaskRun.objects.get(slot=slot)
    assert (run.state, run.attempt) == (RunState.SUCCEEDED, 1)
    steps = [(t.from_state, t.to_state) for t in run.transitions.order_by("at", "id")]
    assert steps == [
        ("pending", "skipped"),
        ("skipped", "running"),
        ("running", "succeeded"),
    ]
    assert "ahead of the clock" in run.transitions.get(from_state="skipped").reason
    assert counted_duplicates(slot=slot) == 1


@pytest.mark.django_db(transaction=True)
def test_run_for_slot__a_skipped_row_that_is_no_early_refusal_is_never_taken(lock_backend):
    # The takeover is the ledger's compare-and-set: a slot skipped for another reason
    # (written after its slot: paused, older than retention) stays skipped.
    calls: list[int] = []
    guarded = once_per_schedule(name="tests.future.skipped")(lambda: calls.append(1))
    ledger.insert_skipped("tests.future.skipped", SLOT, reason="paused: test", actor="test")
    assert guarded.run_for_slot(SLOT) is None
    run = TaskRun.objects.get(slot=SLOT)
    assert (run.state, run.attempt, calls) == (RunState.SKIPPED, 0, [])
    assert counted_duplicates(slot=SLOT) == 1


@pytest.mark.django_db(transaction=True)
def test_run_for_slot__a_slow_local_clock_is_judged_by_the_database_clock(
    monkeypatch, lock_backend
):
    # This process's clock is 10 minutes slow; a beat with a good clock stamped a
    # slot 2 s ahead of real time. The database's clock says it is fine: it runs.
    calls: list[datetime] = []
    guarded = once_per_schedule(name="tests.future.skewed")(lambda: calls.append(1))
    stamped = timezone.now() + timedelta(seconds=2)
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() - timedelta(minutes=10))
    guarded.run_for_slot(stamped)
    assert calls == [1]
    assert TaskRun.objects.get().state == RunState.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_run_for_slot__iso_string_and_other_offsets_are_normalised_to_utc(lock_backend):
    seen: list[datetime] = []

    @once_per_schedule(name="tests.iso")
    def guarded() -> None:
        seen.append(current_run().slot)

    guarded.run_for_slot(SLOT.isoformat().replace("+00:00", "Z"))
    paris = SLOT.astimezone(dt_timezone(timedelta(hours=1)))
    assert guarded.run_for_slot(paris) is None, "the same instant is the same slot"
    assert seen == [SLOT] and seen[0].tzinfo is dt_timezone.utc
    assert counted_duplicates() == 1


@pytest.mark.django_db(transaction=True)
def test_call__no_slot_source_at_all_raises_and_does_not_run(lock_backend):
    # Registered sources (the Celery glue's) have nothing to say outside a task.
    assert all(source() is None for source in SLOT_SOURCES)
    calls: list[int] = []
    guarded = once_per_schedule(name="tests.noslot")(lambda: calls.append(1))
    with pytest.raises(TaskGuardError, match="has no slot"):
        guarded()
    assert calls == [] and not TaskRun.objects.exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("r" * 255, id="255-chars"),
        pytest.param("报表.每日", id="cjk"),
        pytest.param("🚀 launch · nightly", id="emoji"),
        pytest.param("é" * 255, id="255-non-ascii"),
        pytest.param("a:run:b {x} *?[] ' \" ; DROP TABLE", id="punctuation"),
    ],
)
def test_task_name__long_and_unicode_names_work_end_to_end(name, lock_backend):
    guarded = once_per_schedule(name=name)(body)
    assert guarded.run_for_slot(SLOT) == "ran"
    assert guarded.run_for_slot(SLOT) is None
    run = TaskRun.objects.get()
    assert (run.task_name, run.state, counted_duplicates()) == (name, RunState.SUCCEEDED, 1)
    key = run_key("taskguard", name, SLOT)
    assert key == f"taskguard:run:{{{task_digest(name)}:{SLOT:%Y%m%dT%H%M%S}.000000Z}}"
    assert len(task_digest(name)) == 32 and key.isascii()


@pytest.mark.django_db(transaction=True)
def test_task_name__defaults_to_the_dotted_path(lock_backend):
    guarded = once_per_schedule(body)
    guarded.run_for_slot(SLOT)
    assert TaskRun.objects.get().task_name == "tests.test_decorators.body"


@pytest.mark.parametrize(
    ("cron", "message"),
    [
        ("0 25 * * *", "the hour field '25' is not valid (allowed: 0-23)"),
        ("61 * * * *", "the minute field '61' is not valid (allowed: 0-59)"),
        ("0 0 32 * *", "the day-of-month field '32' is not valid (allowed: 1-31)"),
        ("0 0 * 13 *", "the month field '13' is not valid"),
        ("0 0 * * 9", "the day-of-week field '9' is not valid"),
        ("0 0 * *", "has 4 fields; it needs 5"),
    ],
)
def test_once_per_schedule__bad_cron_names_the_field_and_the_function(cron, message):
    def nightly_report() -> None: ...

    with pytest.raises(InvalidSchedule) as info:
        once_per_schedule(cron=cron)(nightly_report)
    text = str(info.value)
    assert text.startswith("@once_per_schedule on tests.test_decorators.")
    assert "nightly_report" in text and message in text


@pytest.mark.django_db(transaction=True)
def test_call__use_tz_false_says_e003_at_run_time(settings):
    settings.USE_TZ = False
    calls: list[int] = []
    job = once_per_schedule(every=timedelta(minutes=1))(lambda: calls.append(1))
    for call in (job, lambda: job.run_for_slot(SLOT)):
        with pytest.raises(
            ImproperlyConfigured, match=r"USE_TZ = True \(system check taskguard.E003\)"
        ):
            call()
    assert calls == []


@pytest.mark.django_db(transaction=True)
def test_slot_kwarg__the_slot_is_taken_from_the_argument_popped_and_never_recomputed(
    lock_backend,
):
    seen: list[tuple[datetime, dict[str, object]]] = []

    @once_per_schedule(every=timedelta(minutes=1), slot_kwarg="intended", name="tests.slotkw")
    def guarded(**kwargs: object) -> str:
        seen.append((current_run().slot, kwargs))
        return "ran"

    # django-q2 passes the schedule's next_run as an ISO string; the schedule's own latest
    # slot (now) is another one: the argument's wins.
    assert guarded(intended=SLOT.isoformat(), region="eu") == "ran"
    assert guarded(intended=SLOT.astimezone(dt_timezone(timedelta(hours=2)))) is None
    assert seen == [(SLOT, {"region": "eu"})]
    assert list(TaskRun.objects.values_list("slot", "state")) == [(SLOT, RunState.SUCCEEDED)]
    assert counted_duplicates() == 1
    with pytest.raises(TaskGuardError, match=r"intended= .*this call has none: it did not run"):
        guarded(region="eu")
    with pytest.raises(InvalidSchedule, match="aware"):
        guarded(intended=SLOT.replace(tzinfo=None))
    assert len(seen) == 1 and TaskRun.objects.count() == 1
