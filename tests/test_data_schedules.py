"""define_schedule / delete_schedule: validation, identity, versions and history."""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from django_taskguard import define_schedule, delete_schedule
from django_taskguard.data_schedules import (
    ScheduleDefinitionError,
    jitter_offset,
    manual_slot,
    policy_of,
    resolve_target,
)
from django_taskguard.exceptions import InvalidSchedule
from django_taskguard.health import from_schedule
from django_taskguard.ledger import schedules as store
from django_taskguard.models import ScheduleEvent, ScheduleSource, TargetKind, TaskSchedule
from tests.support import data_targets

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]

TARGET = "tests.support.data_targets.send_report"
NOT_GUARDED = "is not a guarded task"


def test_define__creates_a_data_schedule_under_its_own_identity() -> None:
    row = define_schedule(
        "tenant-42", TARGET, cron="0 9 * * *", time_zone="Europe/Berlin", args=[42]
    )
    assert row.task_name == f"{TARGET}[tenant-42]"
    assert row.source == ScheduleSource.DATA
    assert row.target_kind == TargetKind.FUNCTION
    assert (row.entry, row.function, row.version) == ("tenant-42", TARGET, 1)
    assert row.args == [42] and row.kwargs == {}
    assert row.changed_at is not None
    (event,) = ScheduleEvent.objects.filter(task_name=row.task_name)
    assert (event.kind, event.version, event.origin) == ("created", 1, "code")
    assert event.changes["cron"] == [None, "0 9 * * *"]


def test_define__same_name_updates_and_keeps_what_changed() -> None:
    define_schedule("t1", TARGET, cron="0 9 * * *", args=[1])
    row = define_schedule("t1", TARGET, cron="0 10 * * *", args=[1], by="alice")
    assert row.version == 2 and row.cron == "0 10 * * *"
    assert TaskSchedule.objects.filter(task_name=row.task_name).count() == 1
    edited = ScheduleEvent.objects.filter(task_name=row.task_name, kind="edited").get()
    assert edited.changes == {"cron": ["0 9 * * *", "0 10 * * *"]}
    assert (edited.by, edited.version) == ("alice", 2)
    assert row.swept_until is not None  # the slots the old cron fired are not missed


def test_define__an_unchanged_definition_writes_nothing() -> None:
    first = define_schedule("t1", TARGET, every=timedelta(minutes=5), args=[1])
    again = define_schedule("t1", TARGET, every=timedelta(minutes=5), args=[1])
    assert again.version == first.version == 1
    assert ScheduleEvent.objects.filter(task_name=first.task_name).count() == 1


def test_define__disable_and_enable_are_their_own_events() -> None:
    define_schedule("t1", TARGET, every=timedelta(minutes=5), args=[1])
    define_schedule("t1", TARGET, every=timedelta(minutes=5), args=[1], enabled=False)
    row = define_schedule("t1", TARGET, every=timedelta(minutes=5), args=[1])
    kinds = list(
        ScheduleEvent.objects.filter(task_name=row.task_name)
        .order_by("id")
        .values_list("kind", flat=True)
    )
    assert kinds == ["created", "disabled", "enabled"]
    assert row.version == 3


def test_delete__leaves_a_tombstone_and_redefining_revives_it() -> None:
    define_schedule("t1", TARGET, every=timedelta(minutes=5), args=[1])
    assert delete_schedule("t1", TARGET, by="bob")
    row = store.get(f"{TARGET}[t1]")
    assert row is not None and row.removed_at is not None and not row.enabled
    assert row.version == 2
    assert not delete_schedule("t1", TARGET)  # already deleted
    revived = define_schedule("t1", TARGET, every=timedelta(minutes=5), args=[2])
    assert revived.removed_at is None and revived.enabled and revived.version == 3


def test_define__a_name_taken_by_a_code_schedule_is_refused() -> None:
    TaskSchedule.objects.create(
        task_name=f"{TARGET}[beat]",
        source=ScheduleSource.CELERY,
        every=timedelta(minutes=1),
        grace=timedelta(minutes=5),
        max_catchup=100,
        declared_in="CELERY_BEAT_SCHEDULE",
    )
    with pytest.raises(ScheduleDefinitionError, match="already a celery schedule"):
        define_schedule("beat", TARGET, every=timedelta(minutes=5), args=[1])


@pytest.mark.parametrize(
    ("kwargs", "field", "says"),
    [
        ({"target": "tests.support.data_targets.not_guarded"}, "target", NOT_GUARDED),
        ({"target": "no.such.thing"}, "target", NOT_GUARDED),
        ({"cron": "61 * * * *"}, "cron", "61"),
        ({"cron": "0 9 * * *", "time_zone": "Mars/Olympus"}, "time_zone", "unknown time zone"),
        ({"args": []}, "kwargs", "does not take these arguments"),
        ({"args": [1, 2, 3]}, "kwargs", "does not take these arguments"),
        ({"kwargs": {"nope": 1}}, "kwargs", "does not take these arguments"),
        ({"kwargs": {"when": object()}}, "kwargs", "not JSON"),
        ({"every": timedelta(milliseconds=10)}, "every", "every must be"),
        ({"every": timedelta(minutes=1), "time_zone": "UTC"}, "time_zone", "interval"),
        ({"cron": None, "every": None}, "cron", "cron expression or an interval"),
        ({"grace": timedelta(days=30)}, "grace", "grace must be"),
        ({"max_catchup": 0}, "max_catchup", "max_catchup"),
        ({"jitter": timedelta(minutes=10)}, "jitter", "half the shortest gap"),
        ({"catchup": "sometimes"}, "catchup", "catchup must be"),
        ({"name": ""}, "name", "name must be"),
        ({"name": " padded"}, "name", "spaces"),
    ],
)
def test_define__bad_input_is_refused_with_its_field(
    kwargs: dict[str, object], field: str, says: str
) -> None:
    given: dict[str, object] = {
        "name": "t1",
        "target": TARGET,
        "cron": "*/5 * * * *",
        "args": [1],
    }
    if "every" in kwargs:
        given["cron"] = None
    given.update(kwargs)
    name, target = given.pop("name"), given.pop("target")
    with pytest.raises(ScheduleDefinitionError, match=says) as raised:
        define_schedule(name, target, **given)  # type: ignore[arg-type]
    assert raised.value.field == field
    assert isinstance(raised.value, InvalidSchedule)
    assert not TaskSchedule.objects.filter(source=ScheduleSource.DATA).exists()


@pytest.mark.pure
def test_resolve_target__a_module_it_names_is_not_imported_when_no_guarded_task_has_the_name() -> (
    None
):
    assert "tests.support.import_canary" not in sys.modules
    with pytest.raises(ScheduleDefinitionError, match=NOT_GUARDED):
        resolve_target("tests.support.import_canary.job")
    assert "tests.support.import_canary" not in sys.modules  # its top-level code never ran


@pytest.mark.pure
def test_resolve_target__a_module_that_raises_when_imported_is_the_same_refusal() -> None:
    with pytest.raises(ScheduleDefinitionError, match=NOT_GUARDED) as refused:
        resolve_target("tests.support.import_refused.job")
    assert refused.value.field == "target"
    assert "tests.support.import_refused" not in sys.modules


@pytest.mark.pure
def test_resolve_target__says_nothing_of_which_modules_exist() -> None:
    said = []
    for module in ("tests.support.import_canary", "tests.support.no_such_module", "os"):
        with pytest.raises(ScheduleDefinitionError) as refused:
            resolve_target(f"{module}.job")
        said.append(str(refused.value).replace(module, "MODULE"))
    assert len(set(said)) == 1, said


def test_define__a_target_with_name_is_recorded_under_the_schedules_identity() -> None:
    row = define_schedule("nightly", "tests.data.named", cron="0 3 * * *")
    assert row.task_name == "tests.data.named[nightly]"
    assert row.target_kind == TargetKind.FUNCTION


# -- what a definition leaves empty follows its target's decorator (issue 33) --------------

POLICY_FIELDS = ("catchup", "grace", "max_catchup", "pause_after_failures", "late_after")


def _in_effect(row: TaskSchedule) -> tuple[Any, ...]:
    found = policy_of(TaskSchedule.objects.get(pk=row.pk), resolve_target(TARGET).policy)
    return tuple(getattr(found, name) for name in POLICY_FIELDS)


def test_define__empty_policy_fields_stay_empty_and_follow_the_targets_decorator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    row = define_schedule("t1", TARGET, cron="0 9 * * *", args=[1])
    stored = TaskSchedule.objects.get(pk=row.pk)
    assert tuple(getattr(stored, name) for name in POLICY_FIELDS) == ("", None, None, None, None)
    assert _in_effect(row) == ("latest", timedelta(minutes=5), 100, None, None)
    data_targets.redeploy(
        monkeypatch,
        catchup="none",
        grace=timedelta(minutes=20),
        max_catchup=7,
        pause_after_failures=3,
        late_after=timedelta(minutes=2),
    )
    # Followed without saving the schedule again: by its runs and by health alike.
    assert _in_effect(row) == ("none", timedelta(minutes=20), 7, 3, timedelta(minutes=2))
    judged = from_schedule(TaskSchedule.objects.get(pk=row.pk))
    assert (judged.grace, judged.late_after) == (timedelta(minutes=20), timedelta(minutes=2))
    assert TaskSchedule.objects.get(pk=row.pk).version == 1


def test_define__what_a_definition_sets_wins_over_its_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    row = define_schedule(
        "t1", TARGET, cron="0 9 * * *", args=[1], catchup="all", grace=45, max_catchup=3
    )
    data_targets.redeploy(monkeypatch, catchup="none", grace=timedelta(minutes=20), max_catchup=7)
    assert _in_effect(row)[:3] == ("all", timedelta(seconds=45), 3)
    # Emptied again: it follows from this version on (the history says so).
    again = define_schedule("t1", TARGET, cron="0 9 * * *", args=[1])
    assert _in_effect(again)[:3] == ("none", timedelta(minutes=20), 7)
    edited = ScheduleEvent.objects.get(task_name=row.task_name, kind="edited")
    assert edited.changes["grace"] == [45.0, None]
    assert edited.changes["catchup"] == ["all", ""]


def test_define__a_jitter_is_checked_against_the_grace_it_follows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    define_schedule("t1", TARGET, every=timedelta(hours=1), args=[1], jitter=60)
    data_targets.redeploy(monkeypatch, grace=timedelta(seconds=30))
    with pytest.raises(ScheduleDefinitionError, match=r"shorter than its target's grace") as raised:
        define_schedule("t1", TARGET, every=timedelta(hours=1), args=[2], jitter=60)
    assert raised.value.field == "jitter"
    row = define_schedule("t1", TARGET, every=timedelta(hours=1), args=[2], jitter=60, grace=90)
    assert row.grace == timedelta(seconds=90)  # a grace of its own lets it keep the jitter


def test_jitter_offset__is_stable_and_within_the_jitter() -> None:
    jitter = timedelta(seconds=30)
    offsets = {jitter_offset(f"t[{n}]", jitter) for n in range(200)}
    assert all(timedelta(0) <= offset < jitter for offset in offsets)
    assert len(offsets) > 150  # spread, not one instant
    assert jitter_offset("t[1]", jitter) == jitter_offset("t[1]", jitter)
    assert jitter_offset("t[1]", None) == timedelta(0)


def test_manual_slot__never_a_whole_second() -> None:
    now = timezone.now().replace(microsecond=0)
    assert manual_slot(now).microsecond == 1
    assert manual_slot(now.replace(microsecond=5)).microsecond == 5


def test_define__a_cron_without_a_zone_is_saved_with_the_definers_time_zone(
    settings: object,
) -> None:
    settings.TIME_ZONE = "Asia/Kolkata"  # type: ignore[attr-defined]
    row = define_schedule("t1", TARGET, cron="30 9 * * *", args=[1])
    assert row.time_zone == "Asia/Kolkata"
    interval = define_schedule("t2", TARGET, every=timedelta(minutes=5), args=[1])
    assert interval.time_zone == ""


def test_define__taskguards_own_keyword_arguments_are_refused() -> None:
    with pytest.raises(ScheduleDefinitionError, match="_taskguard_slot") as raised:
        define_schedule(
            "t1",
            "tests.support.data_targets.anything",
            every=timedelta(minutes=5),
            kwargs={"_taskguard_slot": "2026-01-01T00:00:00+00:00"},
        )
    assert raised.value.field == "kwargs"
    assert not TaskSchedule.objects.exists()


def test_define__a_retired_schedule_defined_again_goes_on_with_its_versions() -> None:
    define_schedule("t1", TARGET, every=timedelta(minutes=5), args=[1])
    define_schedule("t1", TARGET, every=timedelta(minutes=6), args=[1])
    delete_schedule("t1", TARGET)
    assert store.retire(f"{TARGET}[t1]")
    again = define_schedule("t1", TARGET, every=timedelta(minutes=5), args=[1])
    assert again.version == 4  # after 1, 2 and the deletion's 3: no copy takes it as known


def test_define__moving_the_slots_counts_them_from_the_edit() -> None:
    first = define_schedule("t1", TARGET, every=timedelta(minutes=5), args=[1])
    TaskSchedule.objects.filter(pk=first.pk).update(first_seen=timezone.now() - timedelta(days=1))
    moved = define_schedule("t1", TARGET, every=timedelta(minutes=7), args=[1])
    assert moved.first_seen > timezone.now() - timedelta(minutes=1)
    kept = define_schedule("t1", TARGET, every=timedelta(minutes=7), args=[2])
    assert kept.first_seen == moved.first_seen  # new arguments move no slot


# -- identities of code schedules and beat entries (issue 33) ----------------------------


def test_define__a_name_equal_to_its_target_is_refused() -> None:
    """Its identity would be the bare target: the target's own (its code schedule's)."""
    with pytest.raises(ScheduleDefinitionError, match="differ from its target") as caught:
        define_schedule(TARGET, TARGET, cron="0 9 * * *", args=[1])
    assert caught.value.field == "name"
    assert not TaskSchedule.objects.exists()


def test_define__the_identity_of_a_registered_code_schedule_is_refused_before_its_row() -> None:
    from django_taskguard import once_per_schedule, registry

    @once_per_schedule(cron="0 3 * * *", name=f"{TARGET}[weekly]")
    def weekly() -> None: ...

    try:
        assert not TaskSchedule.objects.exists()  # a deploy whose code schedule has no row yet
        with pytest.raises(ScheduleDefinitionError, match="declared by the code") as caught:
            define_schedule("weekly", TARGET, cron="* * * * *", args=[666])
        assert caught.value.field == "name"
        assert not TaskSchedule.objects.exists()
        registry.sync()
        row = TaskSchedule.objects.get(task_name=f"{TARGET}[weekly]")
        assert (row.source, row.cron) == (ScheduleSource.FUNCTION, "0 3 * * *")
    finally:
        registry.unregister(f"{TARGET}[weekly]")


def test_define__the_identity_of_a_beat_entry_is_refused() -> None:
    from .support.celery_app import app

    app.conf.beat_schedule = {"nightly": {"task": TARGET, "schedule": 60.0, "args": [1]}}
    try:
        with pytest.raises(ScheduleDefinitionError, match="beat entry 'nightly'"):
            define_schedule("nightly", TARGET, cron="0 9 * * *", args=[1])
    finally:
        app.conf.beat_schedule = {}
    assert not TaskSchedule.objects.exists()


def test_sync__a_deleted_data_schedule_does_not_keep_blocking_the_code_schedule() -> None:
    from django_taskguard import once_per_schedule, registry

    define_schedule("weekly", TARGET, cron="0 9 * * *", args=[1])
    assert delete_schedule("weekly", TARGET)

    @once_per_schedule(cron="0 3 * * *", name=f"{TARGET}[weekly]")
    def weekly() -> None: ...

    try:
        registry.sync()
        row = TaskSchedule.objects.get(task_name=f"{TARGET}[weekly]")
        assert (row.source, row.cron, row.removed_at) == (
            ScheduleSource.FUNCTION,
            "0 3 * * *",
            None,
        )
        assert row.enabled and row.args == [] and row.entry == ""
        # Its history stays: the data schedule's events are kept under the name.
        assert ScheduleEvent.objects.filter(task_name=row.task_name, kind="deleted").exists()
    finally:
        registry.unregister(f"{TARGET}[weekly]")


# -- odd names and zones (issue 33) ------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["a]b[c", "a[b", "tenant]", "a\nb", "a\rb", "a\tb", "a\x1b[31mb", "a\u2028b", "a\u202eb"],
    ids=["brackets", "open", "close", "newline", "cr", "tab", "escape", "line-sep", "bidi"],
)
def test_define__a_name_with_brackets_or_control_characters_is_refused(name: str) -> None:
    with pytest.raises(ScheduleDefinitionError) as caught:
        define_schedule(name, TARGET, cron="0 9 * * *", args=[1])
    assert caught.value.field == "name"
    assert "\n" not in str(caught.value) and "\r" not in str(caught.value)
    assert not TaskSchedule.objects.exists()


@pytest.mark.parametrize("zone", ["EST", "MST", "HST", "EST5EDT", "CET", "US/Eastern", "GMT"])
def test_define__a_legacy_zone_alias_is_refused(zone: str) -> None:
    with pytest.raises(ScheduleDefinitionError, match="Region/City") as caught:
        define_schedule("t1", TARGET, cron="0 9 * * *", time_zone=zone, args=[1])
    assert caught.value.field == "time_zone"


def test_define__a_zone_in_the_wrong_case_suggests_its_name() -> None:
    with pytest.raises(ScheduleDefinitionError, match="did you mean 'Europe/Berlin'"):
        define_schedule("t1", TARGET, cron="0 9 * * *", time_zone="europe/berlin", args=[1])


@pytest.mark.parametrize("zone", ["America/New_York", "Europe/Berlin", "UTC", "Etc/UTC"])
def test_define__canonical_zone_names_are_accepted(zone: str) -> None:
    assert (
        define_schedule("t1", TARGET, cron="0 9 * * *", time_zone=zone, args=[1]).time_zone == zone
    )


@pytest.mark.parametrize("name", ["tests.odd\nname", "tests.odd\x1bname", "tests.odd\u2029name"])
def test_decorator__a_name_with_control_characters_is_refused(name: str) -> None:
    from django_taskguard import once_per_schedule

    with pytest.raises(InvalidSchedule, match="control characters"):

        @once_per_schedule(every=timedelta(minutes=5), name=name)
        def odd() -> None: ...


@pytest.mark.pure
def test_target_policy__a_target_not_found_here_is_judged_by_the_defaults_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from django_taskguard import data_schedules
    from django_taskguard.policy import Policy

    with caplog.at_level("WARNING", logger="taskguard.data_schedules"):
        for _ in range(3):
            assert data_schedules.target_policy("tests.nowhere.send_report") == Policy()
    said = [r for r in caplog.records if getattr(r, "event", "") == "schedule.target_unfound"]
    assert len(said) == 1, said
    assert "tests.nowhere.send_report is not a guarded task in this process" in said[0].message
    data_schedules._unfound.discard("tests.nowhere.send_report")
