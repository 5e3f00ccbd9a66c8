"""The database side of a run: claim, renew, fences, judged by the database clock."""

from __future__ import annotations

from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

import pytest
from django.db import connection, transaction

from django_taskguard import current_run, ledger, once_per_schedule
from django_taskguard.exceptions import TaskGuardError
from django_taskguard.models import RunState, TaskRun, TaskRunTransition

from .support.slots import BASE_SLOT
from .support.waiting import wait_for

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]

BASE = BASE_SLOT


def slot(minutes: int) -> datetime:
    return BASE + timedelta(minutes=minutes)


def test_claim__new_row_is_ours_running_with_a_database_lease():
    row = ledger.claim("tests.ledger", slot(0), "h:1:a", 30, abandon_is_final=True)
    assert (row.owner, row.state, row.attempt) == ("h:1:a", RunState.RUNNING, 1)
    assert row.fence is not None and row.fence > 0
    assert row.expired is False
    run = TaskRun.objects.get(pk=row.id)
    assert run.slot == slot(0)
    assert run.started_at is not None and run.lease_until is not None
    assert timedelta(seconds=29) < run.lease_until - run.started_at <= timedelta(seconds=31)
    assert list(run.transitions.values_list("from_state", "to_state", "reason", "owner")) == [
        (RunState.PENDING, RunState.RUNNING, "claimed", "h:1:a")
    ]


def test_claim__taken_slot_returns_the_holder_and_counts_the_duplicate():
    first = ledger.claim("tests.ledger", slot(0), "h:1:a", 30, abandon_is_final=True)
    second = ledger.claim("tests.ledger", slot(0), "h:2:b", 30, abandon_is_final=True)
    assert second.owner == "h:1:a" and second.id == first.id and second.fence == first.fence
    run = TaskRun.objects.get(pk=first.id)
    assert run.duplicates == 1
    assert run.transitions.count() == 1, "a lost claim writes no transition"


def test_claim__expired_running_row_is_not_counted_as_a_duplicate():
    """A stale row is left to the takeover decision, which counts (or takes over) itself."""
    first = ledger.claim("tests.ledger", slot(0), "h:1:a", 0.2, abandon_is_final=True)
    wait_for(lambda: TaskRun.objects.stale().filter(pk=first.id).exists(), what="expiry")
    again = ledger.claim("tests.ledger", slot(0), "h:2:b", 30, abandon_is_final=True)
    assert again.owner == "h:1:a" and again.expired is True
    assert TaskRun.objects.get(pk=first.id).duplicates == 0


def test_claim__same_slot_in_another_task_or_instant_is_a_new_row():
    a = ledger.claim("tests.ledger", slot(0), "h:1:a", 30, abandon_is_final=True)
    b = ledger.claim("tests.ledger.other", slot(0), "h:1:b", 30, abandon_is_final=True)
    c = ledger.claim(
        "tests.ledger",
        slot(0) + timedelta(microseconds=1),
        "h:1:c",
        30,
        abandon_is_final=True,
    )
    assert len({a.id, b.id, c.id}) == 3
    assert (b.owner, c.owner) == ("h:1:b", "h:1:c")


def test_claim__inside_atomic_block_is_refused_and_writes_nothing():
    with pytest.raises(TaskGuardError, match="open transaction"), transaction.atomic():
        ledger.ensure_autocommit()
    assert not TaskRun.objects.exists()


def test_renew__extends_only_for_the_fence_holder():
    row = ledger.claim("tests.ledger", slot(0), "h:1:a", 5, abandon_is_final=True)
    assert row.fence is not None
    before = TaskRun.objects.get(pk=row.id).lease_until
    assert before is not None
    renewed = ledger.renew(row.id, row.fence, 60)
    assert renewed is not None and renewed - before > timedelta(seconds=50)
    assert TaskRun.objects.get(pk=row.id).lease_until == renewed
    assert ledger.renew(row.id, row.fence + 1000, 60) is None
    TaskRun.objects.filter(pk=row.id).update(state=RunState.SUCCEEDED)
    assert ledger.renew(row.id, row.fence, 60) is None, "a finished run is not renewed"


def test_fence__strictly_increases_per_task_across_slots_and_attempts():
    """Fences handed to the body grow with every slot and every takeover attempt."""
    seen: list[tuple[str, int, int]] = []

    def body(task: str) -> None:
        run = current_run()
        seen.append((task, run.attempt, run.fence))

    tasks = {
        name: once_per_schedule(name=name, on_stale="retry", lease_seconds=5)(
            lambda name=name: body(name)
        )
        for name in ("tests.fence.a", "tests.fence.b")
    }
    for minute in range(5):
        for guarded in tasks.values():
            guarded.run_for_slot(slot(minute))
    # A dead owner's row for slot 10, taken over by a new attempt once it expires.
    dead = ledger.claim("tests.fence.a", slot(10), "h:9:dead", 0.2, abandon_is_final=False)
    wait_for(lambda: TaskRun.objects.stale().filter(pk=dead.id).exists(), what="expiry")
    tasks["tests.fence.a"].run_for_slot(slot(10))

    for name in tasks:
        fences = [fence for task, _, fence in seen if task == name]
        assert fences == sorted(fences) and len(set(fences)) == len(fences), fences
    takeover = seen[-1]
    assert takeover[1] == 2, "the takeover is attempt 2"
    assert dead.fence is not None and takeover[2] > dead.fence
    assert takeover[2] > max(fence for _, _, fence in seen[:-1])
    run = TaskRun.objects.get(pk=dead.id)
    assert (run.state, run.attempt, run.fence) == (RunState.SUCCEEDED, 2, takeover[2])


def test_timestamps__stored_in_utc_from_the_database_clock():
    row = ledger.claim("tests.ledger", slot(0), "h:1:a", 30, abandon_is_final=True)
    run = TaskRun.objects.get(pk=row.id)
    assert run.started_at is not None
    skew = abs((run.started_at - datetime.now(dt_timezone.utc)).total_seconds())
    assert skew < 60, f"started_at {run.started_at} is not the current UTC time"
    assert TaskRunTransition.objects.get(run=run).at is not None


def test_read__finds_the_row_by_task_and_slot():
    assert ledger.read("tests.ledger", slot(0)) is None
    row = ledger.claim("tests.ledger", slot(0), "h:1:a", 30, abandon_is_final=True)
    found = ledger.read("tests.ledger", slot(0))
    assert found is not None and (found.id, found.owner, found.fence) == (
        row.id,
        row.owner,
        row.fence,
    )
    assert connection.vendor in ("sqlite", "postgresql", "mysql")


def test_claim__with_autocommit_turned_off_is_refused_and_writes_nothing():
    """Not in atomic(), but an implicit transaction the caller owns: the claim would not commit."""
    calls: list[int] = []
    guarded = once_per_schedule(name="tests.ledger.noautocommit")(lambda: calls.append(1))
    transaction.set_autocommit(False)
    try:
        with pytest.raises(TaskGuardError, match="autocommit turned off"):
            guarded.run_for_slot(slot(0))
    finally:
        transaction.rollback()
        transaction.set_autocommit(True)
    assert calls == []
    assert not TaskRun.objects.exists()


def test_unreachable__sqlites_lock_timeout_is_called_busy_not_unreachable():
    from django.db import OperationalError

    busy = ledger.unreachable(OperationalError("database is locked"))
    assert str(busy).startswith("the taskguard database is busy: another connection held")
    down = ledger.unreachable(OperationalError("connection refused"))
    assert str(down) == "the taskguard database is unreachable (connection refused)"


def test_claim__the_lease_left_is_read_on_the_database_clock():
    row = ledger.claim("tests.ledger.left", slot(0), "h:1:a", 30, abandon_is_final=True)
    taken = ledger.claim("tests.ledger.left", slot(0), "h:2:b", 30, abandon_is_final=True)
    assert row.lease_left is not None and 29 <= row.lease_left <= 30.5
    assert taken.lease_left is not None and 25 <= taken.lease_left <= 30.5


def _expired_claim(task: str) -> ledger.Row:
    """A running attempt of ``task`` at slot 0 whose 1 s lease has expired (database clock)."""
    row = ledger.claim(task, slot(0), "h:1:a", 1, abandon_is_final=False)
    assert row is not None
    wait_for(lambda: ledger.read(task, slot(0)).expired, 10, "the lease to expire")
    return row


def test_take_over__refused_when_the_owner_renewed_after_the_read():
    """The claim read the row expired, then its owner renewed (it was only slow): the
    compare-and-set checks the lease again, so a live owner is never displaced."""
    row = _expired_claim("tests.toctou")
    stale = ledger.read("tests.toctou", slot(0))
    assert stale is not None and stale.expired
    assert ledger.renew(row.id, row.fence, 30) is not None
    assert ledger.take_over(stale, "h:2:b", 30, "expired; on_stale=retry") is None
    assert ledger.abandon(stale, actor="h:2:b", reason="expired") is None
    now = ledger.read("tests.toctou", slot(0))
    assert (now.owner, now.attempt, now.state, now.fence) == ("h:1:a", 1, "running", row.fence)


def test_renew__an_older_fence_is_refused_after_a_takeover():
    row = _expired_claim("tests.old_fence")
    stale = ledger.read("tests.old_fence", slot(0))
    taken = ledger.take_over(stale, "h:2:b", 30, "expired; on_stale=retry")
    assert taken is not None and taken.fence > row.fence
    lease = TaskRun.objects.get(pk=row.id).lease_until
    assert ledger.renew(row.id, row.fence, 300) is None, "the old attempt renewed the new one's"
    assert TaskRun.objects.get(pk=row.id).lease_until == lease
    assert ledger.renew(taken.id, taken.fence, 30) is not None


def test_insert_unheld_many__returns_only_the_pairs_this_call_wrote():
    """Two sweeps that both found a slot without a row: the second writes nothing and says
    so, even though the row is now in the state it meant to write (each slot's ``missed``
    is counted and signalled once: one missed check-in)."""
    slot = BASE_SLOT + timedelta(minutes=7)
    second = timedelta(seconds=1)
    first = [("t.unheld", slot, "missed: nobody fired"), ("t.unheld", slot + second, "missed")]
    written = ledger.insert_unheld_many(RunState.MISSED, first, actor="sweep@a:1")
    assert written == {("t.unheld", slot), ("t.unheld", slot + second)}
    again = [*first, ("t.unheld", slot + 2 * second, "missed")]
    written = ledger.insert_unheld_many(RunState.MISSED, again, actor="sweep@b:2")
    assert written == {("t.unheld", slot + 2 * second)}
    assert TaskRun.objects.filter(task_name="t.unheld", state=RunState.MISSED).count() == 3
