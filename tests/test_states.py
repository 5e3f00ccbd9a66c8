"""The state machine: one transition table, every other transition refused; the named
sets of states, and every state walked through every place that must handle it.

``ledger.change()`` is the only writer of states: it checks the whole path
against the table before it touches the database, and it writes the state
change and one transition row per step in the same transaction.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import timedelta

import pytest
from django.db import DatabaseError, connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from django_taskguard import health, ledger, once_per_schedule, overview, panel, states
from django_taskguard.admin import STATE_COLOURS
from django_taskguard.admin_overview import CELL_COLOURS
from django_taskguard.claim import claim_many
from django_taskguard.exceptions import IllegalTransition, TaskGuardError
from django_taskguard.ledger import Row, Step
from django_taskguard.locks.redis_scripts import FINISHED_MARKER
from django_taskguard.models import RunState, TaskRun, TaskRunTransition
from django_taskguard.signals import duplicate_suppressed
from django_taskguard.states import GIVEN_BACK_TO, TRANSITIONS, check_transition

from .support.monitoring import due_slot, finished, schedule
from .support.redis_support import command, redis_backend
from .support.runs import make_run
from .support.slots import BASE_SLOT

pytestmark = pytest.mark.dialect

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


# -- the named sets, and every state through every place that must handle it ------------
#
# What each state means, spelled out here independently of states.py: which of its named
# sets hold it, how the admin panel's summary starts, what health finds wrong with a task
# whose latest due slot is in it (HEALTH_FAILURES=1), and what a second call meeting it
# does (database lock: run, or be counted a duplicate). A new RunState member fails
# test_every_state__has_its_meaning_spelled_out until it is placed here, and then each
# test below that walks the members fails until its place handles it.


@dataclass(frozen=True)
class Meaning:
    sets: frozenset[str]
    summary: str
    problems: tuple[str, ...]
    runs: bool  # a call for the row's slot runs the function
    counted: bool  # ... or, not run, is counted a duplicate


def meaning(sets: str, summary: str, problems: str, *, runs: bool, counted: bool) -> Meaning:
    return Meaning(frozenset(sets.split()), summary, tuple(problems.split()), runs, counted)


FOR_GOOD = "TERMINAL DUPLICATE PRUNABLE"
MEANINGS: dict[str, Meaning] = {
    S.PENDING: meaning("LIVE", "Due but not started", "late", runs=True, counted=False),
    # (a running row here holds a live lease)
    S.RUNNING: meaning("LIVE ATTEMPT", "Running now", "", runs=False, counted=True),
    S.RETRYING: meaning("LIVE ATTEMPT", "Attempt 1 ended", "", runs=True, counted=False),
    S.SUCCEEDED: meaning(
        f"{FOR_GOOD} ENDED TIMED OUTCOME", "Finished:", "", runs=False, counted=True
    ),
    S.FAILED: meaning(
        f"{FOR_GOOD} ENDED TIMED OUTCOME PROBLEM", "Failed:", "failing", runs=False, counted=True
    ),
    S.SKIPPED: meaning(FOR_GOOD, "Skipped on purpose", "failing", runs=False, counted=True),
    # (counted under on_stale="abandon", the default; "retry" takes it over)
    S.ABANDONED: meaning(
        "ENDED PRUNABLE OUTCOME PROBLEM", "Abandoned:", "failing", runs=False, counted=True
    ),
    # (a late call under catchup="latest", the default, still takes a missed slot)
    S.MISSED: meaning("PRUNABLE OUTCOME PROBLEM", "Missed:", "missed", runs=True, counted=False),
}
NAMED_SETS = {
    "TERMINAL": states.TERMINAL_STATES,
    "DUPLICATE": states.DUPLICATE_STATES,
    "LIVE": states.LIVE_STATES,
    "ATTEMPT": states.ATTEMPT_STATES,
    "ENDED": states.ENDED_STATES,
    "TIMED": states.TIMED_STATES,
    "PRUNABLE": states.PRUNABLE_STATES,
    "OUTCOME": states.OUTCOME_STATES,
    "PROBLEM": states.PROBLEM_STATES,
}
EVERY_STATE = pytest.mark.parametrize("state", RunState.values)


def test_every_state__has_its_meaning_spelled_out():
    assert set(MEANINGS) == set(RunState.values)
    assert set(TRANSITIONS) == set(RunState.values)
    assert set(GIVEN_BACK_TO.values()) <= set(RunState.values)


@pytest.mark.parametrize("name", sorted(NAMED_SETS))
def test_state_sets__each_holds_the_states_that_mean_it(name):
    named = NAMED_SETS[name]
    assert len(named) == len(set(named)), named
    assert set(named) == {state for state, said in MEANINGS.items() if name in said.sets}


def test_state_sets__a_terminal_row_allows_no_transition_but_an_early_refusal_taken_over():
    for state in states.TERMINAL_STATES:
        if state != S.SKIPPED:
            assert TRANSITIONS[state] == frozenset(), state
    for state in set(RunState.values) - set(states.TERMINAL_STATES):
        assert TRANSITIONS[state], f"{state} is not terminal: something must follow it"


def test_state_sets__sql_gets_each_as_parameters_in_one_order():
    for named in NAMED_SETS.values():
        assert isinstance(named, tuple)
        assert all(isinstance(state, str) for state in named)


@pytest.mark.django_db(transaction=True)
@EVERY_STATE
def test_every_state__the_panel_summarises_it(state):
    assert set(panel.SUMMARIES) == set(RunState.values)
    run = make_run(f"tests.states.{state}", 0, state=state, lease=3600)
    said = panel.why_not_running(run).summary
    assert said.startswith(MEANINGS[state].summary), said
    if state != S.SUCCEEDED:
        assert "ran and will not run again" not in said, said


def test_every_state__has_its_own_colour_in_the_admin_and_the_overview():
    assert set(STATE_COLOURS) == set(RunState.values)
    assert len(set(STATE_COLOURS.values())) == len(RunState.values), "two states, one colour"
    cells = set(CELL_COLOURS)
    assert cells == {overview.GAP, overview.DUE, overview.PAUSED}
    assert not cells & set(RunState.values), "a run's cell takes its state's own colour"


@pytest.mark.django_db(transaction=True)
def test_every_state__the_admin_draws_it_in_the_changelist_and_the_overview(admin_client):
    minute = timedelta(minutes=1)
    slot = due_slot(minute)
    schedule("tests.states.strip", every=minute)
    for n, state in enumerate(RunState.values):
        finished("tests.states.strip", slot - n * minute, state)
    listing = admin_client.get(reverse("admin:taskguard_taskrun_changelist"))
    page = admin_client.get(reverse("admin:taskguard_taskrun_overview"))
    assert listing.status_code == page.status_code == 200
    html, strip = listing.content.decode(), page.content.decode()
    for state in RunState.values:
        colour = STATE_COLOURS[state]
        assert f"background:{colour};color:#fff" in html, state  # its badge
        assert f'class="taskguard-cell {state}"' in strip, state
        assert f'style="background:{colour}"' in strip, state


@pytest.mark.django_db(transaction=True)
@EVERY_STATE
def test_every_state__the_health_verdict_judges_it(state):
    task = f"tests.states.{state}"
    schedule(task)
    run = finished(task, due_slot(), state)
    if state == S.RUNNING:  # alive, started a minute ago
        alive = {"lease_until": timezone.now() + timedelta(hours=1), "finished_at": None}
        TaskRun.objects.filter(pk=run.pk).update(
            started_at=timezone.now() - timedelta(minutes=1), **alive
        )
    elif state == S.PENDING:
        TaskRun.objects.filter(pk=run.pk).update(started_at=None, finished_at=None)
    with override_settings(TASKGUARD={"BACKEND": "database", "HEALTH_FAILURES": 1}):
        (judged,) = [t for t in health.check().tasks if t.task == task]
    assert tuple(problem.code for problem in judged.problems) == MEANINGS[state].problems


@pytest.mark.django_db(transaction=True)
def test_every_state__the_metrics_count_it_and_time_only_the_timed(admin_client):
    minute = timedelta(minutes=1)
    slot = due_slot(minute)
    for n, state in enumerate(RunState.values):
        finished("tests.states.metrics", slot - n * minute, state, seconds=2.0)
    response = admin_client.get(reverse("taskguard:metrics"))
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            if sample.labels.get("task") == "tests.states.metrics":
                samples[(sample.name, sample.labels.get("state"), sample.labels.get("le"))] = (
                    sample.value
                )
    for state in RunState.values:
        assert samples[("taskguard_runs", state, None)] == 1, state
    timed = sum(1 for said in MEANINGS.values() if "TIMED" in said.sets)
    assert samples[("taskguard_run_duration_seconds_gcount", None, None)] == timed
    assert samples[("taskguard_run_duration_seconds_gsum", None, None)] == pytest.approx(
        2.0 * timed, abs=0.01
    )


def row_in(state: str, task: str) -> TaskRun:
    """A row at SLOT in ``state``, at attempt 1 (a running one holds a live lease)."""
    running = state == S.RUNNING
    return TaskRun.objects.create(
        task_name=task,
        slot=SLOT,
        state=state,
        attempt=1,
        fence=3,
        owner="otherhost:1:0:" + "e" * 32,
        started_at=timezone.now() - timedelta(minutes=1),
        lease_until=timezone.now() + timedelta(hours=1) if running or state == S.RETRYING else None,
        finished_at=None if running else timezone.now(),
    )


def second_call(task: str) -> tuple[bool, list[str]]:
    """Call ``task`` for SLOT: (did it run, the states its duplicate signals reported)."""
    ran, seen = [], []
    job = once_per_schedule(name=task)(lambda: ran.append(True))
    uid = f"tests.states.{task}"
    duplicate_suppressed.connect(
        lambda state, **_: seen.append(state), weak=False, dispatch_uid=uid
    )
    try:
        job.run_for_slot(SLOT)
    finally:
        duplicate_suppressed.disconnect(dispatch_uid=uid)
    return bool(ran), seen


@pytest.mark.django_db(transaction=True)
@EVERY_STATE
def test_every_state__a_call_meeting_it_runs_or_counts_a_duplicate(state):
    # The database's rule (the claim's SQL and the claim's reading of its row).
    task = f"tests.states.claim.{state}"
    row_in(state, task)
    ran, seen = second_call(task)
    said = MEANINGS[state]
    assert (ran, bool(seen)) == (said.runs, said.counted), (ran, seen)
    if said.counted:
        assert TaskRun.objects.get(task_name=task).duplicates == 1


@pytest.mark.django_db(transaction=True)
@EVERY_STATE
def test_every_state__redis_answers_later_calls_alone_exactly_on_terminal_states(
    state, redis_server
):
    # The Lua ACQUIRE counts every call that meets the finished marker a duplicate, with no
    # query: the marker must be left on exactly the terminal rows, each of which the
    # database counts a duplicate whatever the call asked (DUPLICATE_STATES), never on one
    # a later call may still take or run.
    task = f"tests.states.redis.{state}"
    row_in(state, task)
    with redis_backend(redis_server) as lock:
        ran, _seen = second_call(task)  # Redis is empty: the call reads the row
        marked = command(redis_server, "get", lock.key(task, SLOT)) == FINISHED_MARKER.encode()
        if ran:
            return  # it ran (and left the marker of its own success): not this rule's case
        assert marked is (state in states.TERMINAL_STATES), state
        assert not marked or state in states.DUPLICATE_STATES, state
        if marked:
            with CaptureQueriesContext(connection) as queries:
                assert second_call(task) == (False, ["finished"])
            assert len(queries) == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("early", [False, True], ids=["skipped-behind", "refused-early"])
def test_every_state__the_batch_claim_and_its_one_task_fallback_count_a_call_once(early):
    # A skipped row at attempt 0 (a slot skipped behind a live run, or an early call's
    # refusal): the batch claim leaves it to the one-task path (None), which decides it as
    # a single call would. One call: one duplicate if it does not run, none if it runs.
    if connection.vendor != "postgresql":
        pytest.skip("the batch claim is PostgreSQL's")
    task = "tests.states.batch"
    created = SLOT - timedelta(minutes=1) if early else timezone.now()
    row = TaskRun.objects.create(
        task_name=task, slot=SLOT, state=S.SKIPPED, attempt=0, owner="", error="skipped"
    )
    TaskRun.objects.filter(pk=row.pk).update(created_at=created, finished_at=timezone.now())
    assert claim_many(SLOT, [(task, 30.0)]) == {task: None}
    ran, seen = second_call(task)
    assert ran is early and bool(seen) is not early
    assert TaskRun.objects.get(pk=row.pk).duplicates == (0 if early else 1)
