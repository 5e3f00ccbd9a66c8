"""An attempt whose function never started gives its slot or key back (issue 19 item 7):
back to the state its claim found the row in, with an end that someone records.

The attempts are given back through ``run_started`` receivers that raise (the plain path's
way to end an attempt before its function) or ``Attempt.give_back`` itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone

from django_taskguard import ledger, once_per_key, once_per_schedule, registry
from django_taskguard.conf import taskguard_settings
from django_taskguard.endings import Ending
from django_taskguard.guard import REFUSED, Attempt, Policy, begin, refused_late
from django_taskguard.missed import sweep_missed
from django_taskguard.models import RunState, TaskRun, TaskSchedule
from django_taskguard.pauses import forget, pause
from django_taskguard.signals import (
    duplicate_suppressed,
    run_given_back,
    run_skipped,
    run_started,
)

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]

NAME = "tests.give_back.task"


def refuse(sender: str, **kwargs: Any) -> None:
    raise RuntimeError("receiver says no")


@pytest.fixture
def given() -> Iterator[list[dict[str, Any]]]:
    """The ``run_given_back`` signals sent during the test."""
    sent: list[dict[str, Any]] = []

    def record(sender: str, **kwargs: Any) -> None:
        sent.append({"sender": sender, **kwargs})

    run_given_back.connect(record)
    try:
        yield sent
    finally:
        run_given_back.disconnect(record)


@contextmanager
def refused_start() -> Iterator[None]:
    """``run_started`` raises meanwhile: an attempt started then is given back, and the
    receiver's error reaches the caller."""
    run_started.connect(refuse)
    try:
        with pytest.raises(RuntimeError, match="receiver says no"):
            yield
    finally:
        run_started.disconnect(refuse)


def retry_by(message: str | None) -> Any:
    def classify(exc: BaseException) -> Ending:
        return Ending(RunState.RETRYING, "a retry will follow", 60.0, message)

    return classify


def boom() -> None:
    raise ValueError("boom")


def retrying_row(slot: Any, message: str | None = "m1") -> TaskRun:
    """The slot's first attempt raised and asked for a retry carried by ``message``."""
    first = begin(NAME, slot, Policy(), classify_raise=retry_by(message), message_id=message)
    assert isinstance(first, Attempt)
    with pytest.raises(ValueError):
        first.run(boom, (), {})
    row = TaskRun.objects.get(task_name=NAME)
    assert (row.state, row.attempt, row.retry_by) == (RunState.RETRYING, 1, message)
    return row


def test_give_back__a_retry_attempt_goes_back_to_retrying_and_only_its_retry_runs_it(
    given: list[dict[str, Any]],
) -> None:
    """A retry's attempt given back: the row awaits that retry again (``retrying``, attempt
    1, a deadline RETRY_GRACE_SECONDS ahead, ``retry_by`` kept), so a late retry is not
    refused, another copy is a duplicate, and the retry's message runs attempt 2.

    Regression: it became ``pending`` with no deadline: the next retry under
    ``catchup="none"`` was refused and recorded ``missed``, any copy could start it, and
    ``cleanup_locks``' "retry never came" no longer covered it."""
    slot = timezone.now().replace(microsecond=0) - timedelta(minutes=30)
    retrying_row(slot)
    second = begin(NAME, slot, Policy(), classify_raise=retry_by("m1"), message_id="m1")
    assert isinstance(second, Attempt)
    with refused_start():
        second.run(lambda: "ran", (), {})
    row = TaskRun.objects.get(task_name=NAME)
    assert (row.state, row.attempt, row.owner, row.retry_by) == (RunState.RETRYING, 1, "", "m1")
    grace = timedelta(seconds=taskguard_settings.RETRY_GRACE_SECONDS)
    assert row.lease_until is not None and row.lease_until > timezone.now() + grace / 2
    last = row.transitions.order_by("id").last()
    assert last is not None and (last.from_state, last.to_state) == ("running", "retrying")
    assert [g["reason"] for g in given] == [last.reason]
    assert given[0]["run"].id == row.id

    late = Policy(catchup="none", grace=timedelta(minutes=5))
    assert refused_late(NAME, slot, late, timezone.now()) is False  # the claim decides
    sweep_missed(task=NAME)  # not a pending slot: the sweep leaves it to its retry
    assert TaskRun.objects.get(task_name=NAME).state == RunState.RETRYING
    assert begin(NAME, slot, Policy(), message_id="other copy") is REFUSED
    third = begin(NAME, slot, Policy(), message_id="m1")
    assert isinstance(third, Attempt) and third.active.attempt == 2
    assert third.run(lambda: "ran", (), {}) == "ran"
    row = TaskRun.objects.get(task_name=NAME)
    assert (row.state, row.attempt, row.duplicates) == (RunState.SUCCEEDED, 2, 1)


def test_give_back__a_given_back_retry_that_never_comes_is_abandoned_by_cleanup() -> None:
    """The given-back retry's deadline passes: ``cleanup_locks`` records it abandoned,
    "retry never came", as it does for any retry that never came."""
    slot = timezone.now().replace(microsecond=0) - timedelta(minutes=30)
    retrying_row(slot)
    second = begin(NAME, slot, Policy(), message_id="m1")
    assert isinstance(second, Attempt)
    with refused_start():
        second.run(lambda: "ran", (), {})
    runs = TaskRun.objects.filter(task_name=NAME)
    runs.update(lease_until=timezone.now() - timedelta(minutes=1))
    call_command("cleanup_locks", stdout=StringIO())
    row = runs.get()
    assert row.state == RunState.ABANDONED
    assert "retry never came" in row.transitions.order_by("id").last().reason  # type: ignore[union-attr]


def test_give_back__a_takeover_goes_back_to_retrying_and_the_next_call_takes_it() -> None:
    """``on_stale="retry"`` took over an abandoned attempt, then gave it back: the row
    awaits its next attempt (``retrying``, any caller may start it), not ``pending``."""
    slot = timezone.now().replace(microsecond=0) - timedelta(minutes=30)
    first = begin(NAME, slot, Policy())
    assert isinstance(first, Attempt)
    row = ledger.read_by_id(first.active.id)
    assert row is not None
    assert ledger.abandon(row, actor="test", reason="its owner died", lease="") is not None
    first.lock.release(first.key, first.active.token)
    policy = Policy(on_stale="retry")
    second = begin(NAME, slot, policy)
    assert isinstance(second, Attempt) and second.active.attempt == 2
    with refused_start():
        second.run(lambda: "ran", (), {})
    row_after = TaskRun.objects.get(task_name=NAME)
    assert (row_after.state, row_after.attempt, row_after.retry_by) == (
        RunState.RETRYING,
        1,
        None,
    )
    third = begin(NAME, slot, policy)
    assert isinstance(third, Attempt) and third.run(lambda: "ran", (), {}) == "ran"
    assert TaskRun.objects.get(task_name=NAME).state == RunState.SUCCEEDED


def test_give_back__a_late_claim_of_a_missed_slot_goes_back_to_missed() -> None:
    """A late call took a slot the sweep had recorded ``missed`` and gave it back: the slot
    stays ``missed`` (the alarm stands; a later late call may still take it), not
    ``pending`` (which the sweep would record missed a second time)."""
    slot = timezone.now().replace(microsecond=0) - timedelta(minutes=30)
    assert ledger.insert_missed(NAME, slot, reason="missed: nobody came", actor="test")
    attempt = begin(NAME, slot, Policy())
    assert isinstance(attempt, Attempt)
    with refused_start():
        attempt.run(lambda: "ran", (), {})
    row = TaskRun.objects.get(task_name=NAME)
    assert (row.state, row.attempt, row.owner, row.lease_until) == (
        RunState.MISSED,
        0,
        "",
        None,
    )
    assert row.error == "missed: nobody came"
    again = begin(NAME, slot, Policy())
    assert isinstance(again, Attempt) and again.run(lambda: "ran", (), {}) == "ran"


def test_give_back__the_sweep_judges_a_given_back_slot_by_when_it_was_given_back() -> None:
    """A slot handed out long ago, claimed and given back just now, gets its grace from
    the give-back; after that, the sweep records it ``missed`` with a reason that fits.

    Regression: judged by ``created_at``, it was recorded missed at once, "enqueued, but no
    worker started it"."""

    @once_per_schedule(every=timedelta(hours=1), name=NAME, grace=timedelta(minutes=5))
    def job() -> None:
        pass

    try:
        registry.sync()
        TaskSchedule.objects.filter(task_name=NAME).update(
            first_seen=timezone.now() - timedelta(days=1), swept_until=None
        )
        slot = timezone.now().replace(minute=0, second=0, microsecond=0)
        with refused_start():
            job.run_for_slot(slot)
        runs = TaskRun.objects.filter(task_name=NAME, slot=slot)
        runs.update(created_at=timezone.now() - timedelta(minutes=20))  # handed out long ago
        sweep_missed(task=NAME)
        row = runs.get()
        assert row.state == RunState.PENDING and row.finished_at is not None
        runs.update(finished_at=timezone.now() - timedelta(minutes=10))  # given back long ago
        sweep_missed(task=NAME)
        row = runs.get()
        assert row.state == RunState.MISSED
        assert row.error.startswith("missed: pending (handed out or given back) and not started")
    finally:
        registry.unregister(NAME)


def test_give_back__retention_deletes_a_keys_given_back_row() -> None:
    """A key's given-back row (``pending``: nothing ran) older than PRUNE_AFTER_DAYS is
    deleted by ``prune_runs``, which reopens the key; a younger one is kept.

    Regression: no sweep, retention or cleanup ever ended it: it stayed forever."""

    @once_per_key(key="k:{n}", name=NAME)
    def charge(n: int) -> int:
        return n

    for n in (1, 2):
        with refused_start():
            charge(n)
    old = timezone.now() - timedelta(days=taskguard_settings.PRUNE_AFTER_DAYS + 2)
    TaskRun.objects.filter(key="k:1").update(created_at=old, slot=old, finished_at=old)
    assert set(TaskRun.objects.values_list("key", "state")) == {
        ("k:1", RunState.PENDING),
        ("k:2", RunState.PENDING),
    }
    call_command("prune_runs", stdout=StringIO())
    assert list(TaskRun.objects.values_list("key", flat=True)) == ["k:2"]
    assert charge(1) == 1


def test_give_back__retention_deletes_an_unscheduled_slots_given_back_row() -> None:
    """A slot of a task with no schedule (no sweep covers it) given back long ago is
    deleted by ``prune_runs``; a later call for that slot is refused as pruned (recorded
    ``skipped``), never run."""
    ran: list[int] = []

    @once_per_schedule(name=NAME)
    def body() -> None:
        ran.append(1)

    old = timezone.now().replace(microsecond=0) - timedelta(
        days=taskguard_settings.PRUNE_AFTER_DAYS + 2
    )
    with (
        override_settings(TASKGUARD={"PRUNE_AFTER_DAYS": 10_000}),
        refused_start(),
    ):
        body.run_for_slot(old)
    TaskRun.objects.update(created_at=old, finished_at=old)
    call_command("prune_runs", stdout=StringIO())
    assert not TaskRun.objects.exists()
    assert body.run_for_slot(old) is None and ran == []
    assert TaskRun.objects.get().state == RunState.SKIPPED


def test_give_back__a_skip_receiver_that_raises_leaves_the_skip_and_the_finished_marker(
    caplog: pytest.LogCaptureFixture, lock_backend: str
) -> None:
    """A ``run_skipped`` receiver raises after the attempt was recorded ``skipped`` (the
    task is paused): the skip stands, its lock says finished, and the receiver's error
    reaches the caller; nothing tries to give the row back.

    Regression: give_back ran on the skipped row, logged "was taken over; not given back",
    and released the lock instead of leaving the finished marker."""
    calls: list[int] = []
    seen: list[str] = []

    @once_per_schedule(every=timedelta(hours=1), name=NAME)
    def body() -> None:
        calls.append(1)

    def duplicate(sender: str, **kwargs: Any) -> None:
        seen.append(kwargs["state"])

    slot = timezone.now().replace(minute=0, second=0, microsecond=0)
    registry.sync()
    assert pause(NAME, "maintenance")
    run_skipped.connect(refuse)
    duplicate_suppressed.connect(duplicate)
    try:
        with (
            caplog.at_level(logging.INFO, logger="taskguard"),
            pytest.raises(RuntimeError, match="receiver says no"),
        ):
            body.run_for_slot(slot)
        row = TaskRun.objects.get(task_name=NAME)
        last = row.transitions.order_by("id").last()
        assert row.state == RunState.SKIPPED and last is not None
        assert (last.from_state, last.to_state) == ("running", "skipped")
        assert last.reason.startswith("paused:")
        assert "not given back" not in caplog.text
        assert body.run_for_slot(slot) is None
    finally:
        run_skipped.disconnect(refuse)
        duplicate_suppressed.disconnect(duplicate)
        registry.unregister(NAME)
        forget()
    assert calls == []
    # Redis: the finished marker answers; the database backend reads the row.
    assert seen == ["finished" if lock_backend == "redis" else RunState.SKIPPED]


def test_give_back__the_reason_quotes_a_huge_exception_only_in_part() -> None:
    """The reason (stored and logged) quotes at most a bounded part of the exception."""
    from django_taskguard.guard import REASON_EXCEPTION_CHARS, not_started_reason

    reason = not_started_reason(RuntimeError("é" * 1_000_000))
    assert len(reason) < REASON_EXCEPTION_CHARS + 100 and "RuntimeError" in reason
