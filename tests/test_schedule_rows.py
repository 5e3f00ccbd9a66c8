"""The schedule rows' new parts: the upkeep lease, and the pause history."""

from datetime import timedelta

import pytest

from django_taskguard.ledger import upkeep as store

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]


def test_upkeep_lease__one_holder_then_none_until_the_interval_passes():
    hold, every = timedelta(seconds=30), timedelta(seconds=60)
    assert store.latest() is None
    assert store.take("a", hold, every)
    assert not store.take("b", hold, every)  # held
    assert store.finish("a", {"missed_slots": 2})
    assert not store.take("b", hold, every)  # free, but it ran less than a minute ago
    assert store.take("b", hold, timedelta(0))
    assert not store.finish("a", {})  # a's lease is gone: b holds it
    row = store.latest()
    assert row is not None and row.holder == "b" and row.result == {"missed_slots": 2}


def test_pause_and_resume__each_kept_with_who_from_where_and_why(scheduled_row):
    from django.core.management import call_command

    from django_taskguard import pauses
    from django_taskguard.ledger import schedules as schedule_store

    name = scheduled_row
    call_command("pause_task", name, "--reason", "disk full")
    assert pauses.resume(name, by="ana", origin="admin")
    assert not pauses.resume(name)  # not paused: nothing kept
    kept = [(e.kind, e.origin, e.reason) for e in schedule_store.events(name)]
    assert kept == [("resumed", "admin", ""), ("paused", "command", "disk full")]
    assert schedule_store.events(name)[1].by.count("@") == 1  # user@host


def test_pause_and_resume__the_change_and_its_event_are_kept_together_or_not_at_all(
    scheduled_row, monkeypatch
):
    """A pause whose event cannot be written is not made: no pause without its who and why
    (nor a resume)."""
    from django.db import DatabaseError

    from django_taskguard import pauses
    from django_taskguard.exceptions import BackendUnavailable
    from django_taskguard.ledger import schedules as schedule_store
    from django_taskguard.models import TaskSchedule

    name = scheduled_row

    def refused(*args, **kwargs):
        raise DatabaseError("the event's insert failed")

    real = schedule_store.record_event
    monkeypatch.setattr(schedule_store, "record_event", refused)
    with pytest.raises((BackendUnavailable, DatabaseError)):
        pauses.pause(name, "disk full", by="ana")
    assert not TaskSchedule.objects.get(task_name=name).paused
    assert schedule_store.paused() == {}
    monkeypatch.setattr(schedule_store, "record_event", real)
    assert pauses.pause(name, "disk full", by="ana")
    monkeypatch.setattr(schedule_store, "record_event", refused)
    with pytest.raises((BackendUnavailable, DatabaseError)):
        pauses.resume(name, by="ana")
    assert TaskSchedule.objects.get(task_name=name).paused
    assert [e.kind for e in schedule_store.events(name)] == ["paused"]


@pytest.fixture
def scheduled_row():
    from django_taskguard.ledger import schedules as schedule_store

    record = schedule_store.Record(
        task_name="tests.kept", source="function", function="tests.kept", cron="",
        cron_day_or=True, every=timedelta(minutes=1), time_zone="", default_zone="UTC",
        catchup="latest", grace=timedelta(seconds=30), max_catchup=10, pause_after_failures=None,
    )  # fmt: skip
    schedule_store.save([record])
    return record.task_name
