"""The state machine: one transition table, every other transition refused.

``ledger.change()`` is the only writer of states: it checks the whole path
against the table before it touches the database, and it writes the state
change and one transition row per step in the same transaction.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
from django.db import DatabaseError, connection
from django.test.utils import CaptureQueriesContext

from django_taskguard import ledger
from django_taskguard.exceptions import IllegalTransition, TaskGuardError
from django_taskguard.ledger import Row, Step
from django_taskguard.models import RunState, TaskRun, TaskRunTransition
from django_taskguard.states import TRANSITIONS, check_transition

from .support.slots import BASE_SLOT

S = RunState
# The contract, spelled out independently of states.TRANSITIONS.
ALLOWED = {
    (S.PENDING, S.RUNNING),
    (S.PENDING, S.SKIPPED),
    (S.PENDING, S.ABANDONED),
    (S.RUNNING, S.SUCCEEDED),
    (S.RUNNING, S.FAILED),
    (S.RUNNING, S.RETRYING),
    (S.RUNNING, S.SKIPPED),
    (S.RUNNING, S.ABANDONED),
    (S.RUNNING, S.PENDING),
    (S.RUNNING, S.MISSED),  # a late claim of a missed slot given back
    (S.RETRYING, S.RUNNING),
    (S.RETRYING, S.FAILED),
    (S.RETRYING, S.ABANDONED),
    (S.ABANDONED, S.RETRYING),
    (S.PENDING, S.MISSED),
    (S.MISSED, S.RUNNING),
    # Only a row recording an early call's refusal (attempt 0, written before its slot):
    # the ledger's compare-and-set checks that (tests/test_decorators.py).
    (S.SKIPPED, S.RUNNING),
    (S.SKIPPED, S.PENDING),
    (S.SKIPPED, S.MISSED),
}
ALL_PAIRS = list(itertools.product(RunState.values, RunState.values))
ILLEGAL = [pair for pair in ALL_PAIRS if pair not in ALLOWED]
SLOT = BASE_SLOT + timedelta(hours=21)


def make_row(state: str, *, task: str = "tests.states", fence: int = 7) -> Row:
    run = TaskRun.objects.create(
        task_name=task, slot=SLOT, state=state, attempt=1, fence=fence, owner="h:1:tok"
    )
    return Row(run.id, state, 1, fence, "h:1:tok", None)


def test_transitions__table_is_the_contract():
    table = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert table == ALLOWED
    assert set(TRANSITIONS) == set(RunState.values)


@pytest.mark.parametrize(("from_state", "to_state"), sorted(ALLOWED))
def test_check_transition__allowed_pair_passes(from_state, to_state):
    check_transition(from_state, to_state)


@pytest.mark.parametrize(("from_state", "to_state"), ILLEGAL)
def test_check_transition__every_other_pair_raises(from_state, to_state):
    with pytest.raises(IllegalTransition, match=f"{from_state}.*{to_state}"):
        check_transition(from_state, to_state)


def test_check_transition__refusal_is_caught_as_taskguard_error():
    with pytest.raises(TaskGuardError, match=r"succeeded.*running"):
        check_transition("succeeded", "running")


def test_check_transition__unknown_state_raises():
    with pytest.raises(IllegalTransition):
        check_transition("bogus", S.RUNNING)
    with pytest.raises(IllegalTransition):
        check_transition(S.RUNNING, "bogus")


@pytest.mark.django_db
@pytest.mark.parametrize(("from_state", "to_state"), ILLEGAL)
def test_change__illegal_step_refused_before_any_query(from_state, to_state):
    row = Row(123456, from_state, 1, 1, "h:1:tok", None)
    with CaptureQueriesContext(connection) as queries, pytest.raises(IllegalTransition):
        ledger.change(row, [Step(to_state, "test")], actor="x", fenced=False)
    assert len(queries) == 0


@pytest.mark.django_db
def test_change__illegal_later_step_refuses_the_whole_path():
    """running -> succeeded is legal, succeeded -> running is not: nothing is written."""
    row = make_row(S.RUNNING)
    path = [Step(S.SUCCEEDED, "done"), Step(S.RUNNING, "again")]
    with CaptureQueriesContext(connection) as queries, pytest.raises(IllegalTransition):
        ledger.change(row, path, actor="x")
    assert len(queries) == 0
    assert TaskRun.objects.get(pk=row.id).state == S.RUNNING
    assert not TaskRunTransition.objects.exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("from_state", "to_state"), sorted(ALLOWED))
def test_change__allowed_step_writes_state_and_one_transition(from_state, to_state):
    row = make_row(from_state)
    changed = ledger.change(row, [Step(to_state, "because")], actor="me:1:t")
    assert changed is not None and changed.state == to_state
    assert TaskRun.objects.get(pk=row.id).state == to_state
    transitions = list(
        TaskRunTransition.objects.filter(run_id=row.id).values_list(
            "from_state", "to_state", "reason", "owner"
        )
    )
    assert transitions == [(from_state, to_state, "because", "me:1:t")]


@pytest.mark.django_db(transaction=True)
def test_change__multi_step_path_writes_one_row_per_step_in_order():
    row = make_row(S.RUNNING)
    path = [Step(S.RETRYING, "expired"), Step(S.RUNNING, "taken over")]
    changed = ledger.change(row, path, actor="me:1:t")
    assert changed is not None and changed.state == S.RUNNING
    got = list(
        TaskRunTransition.objects.filter(run_id=row.id)
        .order_by("id")
        .values_list("from_state", "to_state", "reason")
    )
    assert got == [(S.RUNNING, S.RETRYING, "expired"), (S.RETRYING, S.RUNNING, "taken over")]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "stale",
    [
        pytest.param({"state": S.PENDING}, id="state-changed"),
        pytest.param({"fence": 99}, id="fence-changed"),
    ],
)
def test_change__refused_by_compare_and_set_writes_nothing(stale):
    row = make_row(S.RUNNING)
    TaskRun.objects.filter(pk=row.id).update(**stale)
    changed = ledger.change(row, [Step(S.SUCCEEDED, "late")], actor="me:1:t")
    assert changed is None
    run = TaskRun.objects.get(pk=row.id)
    assert run.state == stale.get("state", S.RUNNING)
    assert run.finished_at is None
    assert not TaskRunTransition.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_change__lease_condition_judged_by_database_clock():
    """``lease="expired"`` refuses while the lease is live and passes once it is over."""
    row = make_row(S.RUNNING)
    TaskRun.objects.filter(pk=row.id).update(lease_until=SLOT + timedelta(days=3650))
    path = [Step(S.ABANDONED, "dead")]
    assert ledger.change(row, path, actor="x", lease="expired") is None
    assert ledger.change(row, path, actor="x", lease="live") is not None
    assert TaskRunTransition.objects.count() == 1

    other = make_row(S.RUNNING, task="tests.states.other")
    TaskRun.objects.filter(pk=other.id).update(lease_until=SLOT)
    assert ledger.change(other, path, actor="x", lease="live") is None
    assert ledger.change(other, path, actor="x", lease="expired") is not None
    assert TaskRunTransition.objects.count() == 2


TRIGGER_SQL = {
    "sqlite": [
        "CREATE TRIGGER taskguard_test_refuse BEFORE INSERT ON taskguard_taskruntransition "
        "BEGIN SELECT RAISE(ABORT, 'transition refused by test trigger'); END"
    ],
    "postgresql": [
        "CREATE FUNCTION taskguard_test_refuse() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RAISE EXCEPTION 'transition refused by test trigger'; END $$",
        "CREATE TRIGGER taskguard_test_refuse BEFORE INSERT ON taskguard_taskruntransition "
        "FOR EACH ROW EXECUTE FUNCTION taskguard_test_refuse()",
    ],
    "mysql": [
        "CREATE TRIGGER taskguard_test_refuse BEFORE INSERT ON taskguard_taskruntransition "
        "FOR EACH ROW SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'transition refused by test "
        "trigger'"
    ],
}
DROP_SQL = {
    "sqlite": ["DROP TRIGGER IF EXISTS taskguard_test_refuse"],
    "postgresql": [
        "DROP TRIGGER IF EXISTS taskguard_test_refuse ON taskguard_taskruntransition",
        "DROP FUNCTION IF EXISTS taskguard_test_refuse()",
    ],
    "mysql": ["DROP TRIGGER IF EXISTS taskguard_test_refuse"],
}


@pytest.mark.django_db(transaction=True)
def test_change__state_rolls_back_when_its_transition_row_cannot_be_written():
    """The state change and its transition row commit together or not at all.

    A real trigger makes the transition INSERT fail; the UPDATE of the state
    in the same change must not survive it.
    """
    row = make_row(S.RUNNING)
    with connection.cursor() as cursor:
        for sql in TRIGGER_SQL[connection.vendor]:
            cursor.execute(sql)
    try:
        with pytest.raises(DatabaseError, match="refused by test trigger"):
            ledger.change(row, [Step(S.SUCCEEDED, "done")], actor="x")
    finally:
        with connection.cursor() as cursor:
            for sql in DROP_SQL[connection.vendor]:
                cursor.execute(sql)
    run = TaskRun.objects.get(pk=row.id)
    assert run.state == S.RUNNING
    assert run.finished_at is None
    assert ledger.change(row, [Step(S.SUCCEEDED, "done")], actor="x") is not None


def test_check_transition__the_message_names_states_by_their_values():
    with pytest.raises(IllegalTransition) as info:
        check_transition(S.SUCCEEDED, S.RUNNING)
    assert str(info.value) == "a run cannot go from 'succeeded' to 'running'"
