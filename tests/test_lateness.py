"""Start lateness: the taskguard_start_lateness_seconds histogram, the late-start health
rule (LATE_START_SECONDS / LATE_START_RUNS, late_after=), and where the bound is kept."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

from django_taskguard import health, ledger, once_per_schedule, registry
from django_taskguard.exceptions import TaskGuardError
from django_taskguard.ledger import schedules as schedule_store
from django_taskguard.metrics import LATENESS_BUCKETS
from django_taskguard.models import RunState, ScheduleEventKind, TaskRun, TaskSchedule
from tests.support import data_targets  # noqa: F401  (registers the schedules' targets)

from .support.monitoring import DAY, due_slot, schedule, upkeep_ran

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]
MINUTE = timedelta(minutes=1)
TASK = "tests.lateness.sync"


def late_settings(**values: object) -> override_settings:
    return override_settings(TASKGUARD={"BACKEND": "database", **values})


@pytest.fixture(autouse=True)
def _upkeep_ran(transactional_db: None) -> None:
    upkeep_ran()


def started(
    slot: datetime,
    seconds: float,
    *,
    task: str = TASK,
    state: str = RunState.SUCCEEDED,
    attempt: int = 1,
    key: str | None = None,
) -> TaskRun:
    """A run of ``task`` at ``slot`` whose (latest) attempt started ``seconds`` after it."""
    start = slot + timedelta(seconds=seconds)
    return TaskRun.objects.create(
        task_name=task,
        slot=slot,
        key=key,
        state=state,
        attempt=attempt,
        owner="worker-1:17:0:aa01",
        started_at=start,
        finished_at=start + timedelta(seconds=1),
    )


def slots(count: int, every: timedelta = DAY) -> list[datetime]:
    """The latest ``count`` due slots of an ``every`` schedule, newest first (the health
    tests' schedules are daily: a new slot falling due mid-test would be late, no run)."""
    due = due_slot(every)
    return [due - n * every for n in range(count)]


def judged(task: str = TASK) -> health.TaskHealth:
    [found] = [t for t in health.check().tasks if t.task == task]
    return found


def late_problems(found: health.TaskHealth) -> list[str]:
    return [
        p.detail for p in found.problems if "after their time" in p.detail or "its time" in p.detail
    ]


# -- the histogram ------------------------------------------------------------------------


def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    client = Client()
    user = User.objects.create_user("ops", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_taskrun"))
    client.force_login(user)
    response = client.get(reverse("taskguard:metrics"))
    assert response.status_code == 200, response.content
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_lateness_histogram__first_starts_of_slots_by_bucket():
    schedule(TASK, every=MINUTE)
    newest, *older = slots(7, MINUTE)
    started(newest, 0.3)
    started(older[0], 7, state=RunState.FAILED)
    started(older[1], 45, state=RunState.RUNNING)
    started(older[2], 2000, state=RunState.ABANDONED)
    started(older[3], 900, attempt=2)  # a retry's start: not the slot's start, left out
    missed = started(older[4], 0, state=RunState.MISSED, attempt=0)
    TaskRun.objects.filter(pk=missed.pk).update(started_at=None)  # never started
    started(timezone.now() - MINUTE, 500, key="order:1")  # keyed: its slot is no schedule's
    started(newest - timedelta(days=3), 500)  # outside the window
    samples = scrape()
    task = (("task", TASK),)

    def bucket(le: str) -> float:
        return samples[("taskguard_start_lateness_seconds_bucket", (("le", le), *task))]

    assert [bucket(f"{b:g}") for b in LATENESS_BUCKETS] == [0, 1, 1, 1, 2, 2, 3, 3, 3, 4]
    assert bucket("+Inf") == 4
    assert samples[("taskguard_start_lateness_seconds_gcount", task)] == 4
    assert samples[("taskguard_start_lateness_seconds_gsum", task)] == pytest.approx(
        2052.3, abs=0.01
    )
    # The duration histogram is unchanged beside it (succeeded and failed attempts).
    assert samples[("taskguard_run_duration_seconds_bucket", (("le", "+Inf"), *task))] == 4


def test_lateness_histogram__read_in_the_window_summary_scan(django_assert_num_queries):
    for slot in slots(3, MINUTE):
        started(slot, 12)
    with django_assert_num_queries(1):
        summary = ledger.window_summary(
            timezone.now() - timedelta(hours=1), (0.5, 10.0), (10.0, 60.0)
        )
    found = summary[(TASK, RunState.SUCCEEDED)]
    assert found.runs == 3 and found.buckets == (0, 3)  # each took 1 s
    assert found.lateness_count == 3 and found.lateness_buckets == (0, 3)
    assert found.lateness_sum == pytest.approx(36, abs=0.01)


# -- the health rule ----------------------------------------------------------------------


def test_late_starts__the_last_n_all_late_is_unhealthy():
    schedule(TASK, every=DAY)
    for slot, seconds in zip(slots(4), (42, 97, 60, 1), strict=True):
        started(slot, seconds)
    with late_settings(LATE_START_SECONDS=30):
        found = judged()
        assert late_problems(found) == [
            "the last 3 slots started 42-97 s after their time (bound 30 s)"
        ]
        assert [p.code for p in found.problems] == [health.LATE_START]
        metrics = scrape()
        assert metrics[("taskguard_task_healthy", (("task", TASK),))] == 0
    with late_settings(LATE_START_SECONDS=30, LATE_START_RUNS=1):
        assert late_problems(judged()) == ["its last slot started 42 s after its time (bound 30 s)"]
    with late_settings(LATE_START_SECONDS=30, LATE_START_RUNS=4):
        assert judged().healthy  # the 4th latest started on time


def test_late_starts__check_schedules_the_health_url_and_the_overview_say_it():
    from .support.monitoring import run_check

    schedule(TASK, every=DAY)
    for slot in slots(3):
        started(slot, 50)
    with late_settings(LATE_START_SECONDS=30, HEALTH_TOKEN="probe-token-0123456789"):
        status, out = run_check()
        assert status == 1
        assert (
            "LATE_START" in out
            and "the last 3 slots started 50 s after their time (bound 30 s)" in out
        )
        response = Client().get(
            reverse("taskguard:health"),
            headers={"authorization": "Bearer probe-token-0123456789"},
        )
        assert response.status_code == 503
        [task] = response.json()["tasks"]
        assert task["problems"] == [
            {
                "code": "late_start",
                "detail": "the last 3 slots started 50 s after their time (bound 30 s)",
            }
        ]
        staff = Client()
        user = User.objects.create_user("viewer", password="pw", is_staff=True)
        user.user_permissions.add(Permission.objects.get(codename="view_taskrun"))
        staff.force_login(user)
        page = staff.get(reverse("admin:taskguard_taskrun_overview")).content.decode()
        assert "the last 3 slots started 50 s after their time (bound 30 s)" in page


def test_late_starts__on_time_or_mixed_is_healthy():
    schedule(TASK, every=DAY)
    on_time = slots(3)
    for slot in on_time:
        started(slot, 5)
    with late_settings(LATE_START_SECONDS=30):
        assert judged().healthy
        # Mixed: two late, the newest on time; then the newest late, an older on time.
        TaskRun.objects.filter(slot__in=on_time[1:]).update(started_at=on_time[0] + MINUTE)
        assert judged().healthy
        TaskRun.objects.filter(slot=on_time[0]).update(started_at=on_time[0] + MINUTE)
        TaskRun.objects.filter(slot=on_time[2]).update(started_at=on_time[2])
        assert judged().healthy


def test_late_starts__fewer_started_than_the_count_is_not_judged():
    schedule(TASK, every=DAY)
    newest, second, third = slots(3)
    started(newest, 100)
    started(second, 100)
    missed = started(third, 0, state=RunState.MISSED, attempt=0)
    TaskRun.objects.filter(pk=missed.pk).update(started_at=None)
    with late_settings(LATE_START_SECONDS=30):
        assert late_problems(judged()) == []
        # A missed slot is passed over: an older started one completes the three.
        started(third - MINUTE, 100)
        assert late_problems(judged()) != []


def test_late_starts__retried_slots_are_passed_over():
    schedule(TASK, every=DAY)
    newest, *older = slots(4)
    started(newest, 500, attempt=2)  # its row keeps the retry's start
    for slot in older:
        started(slot, 5)
    with late_settings(LATE_START_SECONDS=30):
        assert judged().healthy
    with late_settings(LATE_START_SECONDS=30, LATE_START_RUNS=1):
        assert judged().healthy  # the latest first start is the 5 s one
        TaskRun.objects.filter(slot=newest).update(attempt=1)
        assert late_problems(judged()) == [
            "its last slot started 500 s after its time (bound 30 s)"
        ]


def test_late_starts__a_paused_task_is_not_judged():
    schedule(TASK, every=DAY, paused=True)
    for slot in slots(3):
        started(slot, 500)
    with late_settings(LATE_START_SECONDS=30):
        found = judged()
        assert found.healthy and found.status == health.PAUSED


def test_late_starts__no_bound_no_rule_and_nothing_read():
    schedule(TASK, every=DAY)
    for slot in slots(3):
        started(slot, 500)
    assert judged().healthy  # LATE_START_SECONDS is None by default
    facts = ledger.task_facts([(TASK, None)], timezone.now() - timedelta(hours=1), 3)
    assert facts[TASK].late_starts is None
    facts = ledger.task_facts([(TASK, None)], timezone.now() - timedelta(hours=1), 3, 3)
    assert facts[TASK].late_starts == pytest.approx((500, 500), abs=0.01)


def test_late_starts__a_task_without_a_schedule_is_not_judged():
    for slot in slots(3):
        started(slot, 500, task="tests.lateness.unscheduled")
    with late_settings(LATE_START_SECONDS=30):
        assert late_problems(judged("tests.lateness.unscheduled")) == []


def test_late_starts__the_schedule_s_own_bound_wins():
    row = schedule(TASK, every=DAY)
    for slot in slots(3):
        started(slot, 50)
    row.late_after = timedelta(seconds=120)
    row.save()
    with late_settings(LATE_START_SECONDS=30):
        assert judged().healthy
    row.late_after = timedelta(seconds=10)
    row.save()
    assert late_problems(judged()) == [  # no setting: its own bound alone
        "the last 3 slots started 50 s after their time (bound 10 s)"
    ]


def test_late_starts__an_acknowledgement_of_the_due_slot_covers_them():
    from django_taskguard import acknowledgements

    schedule(TASK, every=DAY)
    for slot in slots(3):
        started(slot, 50)
    with late_settings(LATE_START_SECONDS=30):
        assert not judged().healthy
        acknowledgements.acknowledge(TASK, "slow host replaced", by="ops")
        assert schedule_store.latest_events(ScheduleEventKind.ACKNOWLEDGED, [TASK])
        assert judged().healthy


def test_late_starts__every_task_past_the_200th_in_a_bounded_number_of_statements(
    django_assert_max_num_queries,
):
    due = due_slot(DAY)
    for n in range(3):
        schedule(f"tests.lateness.t{n}", every=DAY)
        started(due, 50, task=f"tests.lateness.t{n}")
    with late_settings(LATE_START_SECONDS=30, LATE_START_RUNS=1):
        health.check()
        with django_assert_max_num_queries(20) as few:
            health.check()
        for n in range(3, 250):
            schedule(f"tests.lateness.t{n}", every=DAY)
            started(due, 50, task=f"tests.lateness.t{n}")
        # Two more statements per 200 tasks where names are not one array (as before).
        with django_assert_max_num_queries(len(few.captured_queries) + 2):
            verdict = health.check()
    assert len(verdict.unhealthy) == 250


# -- the bound: decorator, registration, validation ---------------------------------------


@pytest.fixture
def forget() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        registry.unregister(name)


@pytest.mark.parametrize(
    ("given", "kept"),
    [(30, timedelta(seconds=30)), (0.5 + 1, timedelta(seconds=1.5)), (MINUTE, MINUTE)],
)
def test_late_after__seconds_or_timedelta_kept_with_the_registration(forget, given, kept):
    name = "tests.lateness.decorated"
    forget.append(name)

    @once_per_schedule(every=MINUTE, name=name, late_after=given)
    def job() -> None: ...

    assert job.policy.late_after == kept
    record = registry.entries()[name].record()
    assert record.late_after == kept
    schedule_store.save([record])
    assert TaskSchedule.objects.get(task_name=name).late_after == kept
    schedule_store.save([registry.entries()[name].record()])  # saved again: unchanged
    assert TaskSchedule.objects.get(task_name=name).late_after == kept


def test_late_after__none_by_default():
    @once_per_schedule(every=MINUTE, name="tests.lateness.plain")
    def job() -> None: ...

    registry.unregister("tests.lateness.plain")
    assert job.policy.late_after is None


@pytest.mark.parametrize(
    "bad", [0, -1, 86_401, timedelta(0), timedelta(days=2), "30", True, float("nan")]
)
def test_late_after__out_of_bounds_refused_at_decoration(bad):
    with pytest.raises(TaskGuardError, match=r"late_after= is .*from 1 to 86400 seconds"):
        once_per_schedule(every=MINUTE, name="tests.lateness.bad", late_after=bad)
    assert "tests.lateness.bad" not in registry.entries()


# -- data schedules: late_after is part of the definition ---------------------------------

TARGET = "tests.support.data_targets.send_report"


def test_define_schedule__late_after_is_kept_in_the_definition_and_its_history():
    from django_taskguard import define_schedule
    from django_taskguard.models import ScheduleEvent

    row = define_schedule("t1", TARGET, every=DAY, args=[1], late_after=45)
    assert row.late_after == timedelta(seconds=45)
    created = ScheduleEvent.objects.get(task_name=row.task_name, kind="created")
    assert created.changes["late_after"] == [None, 45.0]
    row = define_schedule("t1", TARGET, every=DAY, args=[1], late_after=timedelta(minutes=2))
    edited = ScheduleEvent.objects.get(task_name=row.task_name, kind="edited")
    assert edited.changes == {"late_after": [45.0, 120.0]}
    assert row.late_after == timedelta(minutes=2)
    # Judged by its own bound (no setting).
    for slot in slots(3):
        started(slot, 150, task=row.task_name)
    assert late_problems(judged(row.task_name)) == [
        "the last 3 slots started 150 s after their time (bound 120 s)"
    ]


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"late_after": 0}, "late_after= is 0"),
        ({"late_after": "soon"}, "a number of seconds or a timedelta"),
        ({"late_after": 10, "jitter": timedelta(seconds=20)}, "longer than the jitter"),
    ],
)
def test_define_schedule__a_bad_late_after_is_refused_with_its_field(given, says):
    from django_taskguard import define_schedule
    from django_taskguard.data_schedules import ScheduleDefinitionError

    with pytest.raises(ScheduleDefinitionError, match=says) as raised:
        define_schedule("t1", TARGET, every=MINUTE, args=[1], **given)
    assert raised.value.field == "late_after"
    assert not TaskSchedule.objects.filter(task_name=f"{TARGET}[t1]").exists()


def test_data_schedule_admin__late_after_field_saved_and_checked():
    from .test_data_schedule_admin import ADD, EDITOR_PERMS, errors, form_data, login

    editor = login("eve", *EDITOR_PERMS)
    refused = editor.post(ADD, form_data(late_after="0"))
    assert refused.status_code == 200
    assert "late_after= is" in str(errors(refused).get("late_after"))
    response = editor.post(ADD, form_data(late_after="00:01:30"))
    assert response.status_code == 302, errors(response)
    row = TaskSchedule.objects.get(task_name=f"{TARGET}[tenant-42]")
    assert row.late_after == timedelta(seconds=90)
