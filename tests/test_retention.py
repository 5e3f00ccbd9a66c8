"""prune_runs: finished runs and their transitions go, in batches; live ones never."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings
from django.utils import timezone

from django_taskguard import ledger as ledger_api
from django_taskguard.models import RunState, TaskRun, TaskRunTransition
from django_taskguard.retention import prune_runs

from .runs import make_run

pytestmark = pytest.mark.django_db(transaction=True)


def prune(*args: str) -> str:
    out = StringIO()
    call_command("prune_runs", *args, stdout=out)
    return out.getvalue().strip()


@pytest.fixture
def ledger():  # type: ignore[no-untyped-def]
    old = timezone.now() - timedelta(days=60)
    recent = timezone.now() - timedelta(days=1)
    runs = {}
    for index, state in enumerate(RunState.values):
        runs[("old", state)] = make_run(
            f"tests.{state}", slot=old + timedelta(minutes=index), state=state, transitions=2
        )
        runs[("recent", state)] = make_run(
            f"tests.{state}", slot=recent + timedelta(minutes=index), state=state, transitions=2
        )
    return runs


FINISHED = {RunState.SUCCEEDED, RunState.FAILED, RunState.SKIPPED, RunState.ABANDONED}


def test_prune_runs__deletes_old_finished_runs_and_their_transitions(ledger):
    assert prune("--older-than", "30", "--batch-size", "2") == (
        "Deleted 4 finished runs and 8 transitions older than 30 days."
    )
    left = {(age, state) for (age, state), run in ledger.items()
            if TaskRun.objects.filter(pk=run.pk).exists()}  # fmt: skip
    assert left == set(ledger) - {("old", state) for state in FINISHED}
    gone = [ledger[("old", state)].pk for state in FINISHED]
    assert not TaskRunTransition.objects.filter(run_id__in=gone).exists()
    assert TaskRunTransition.objects.count() == 2 * (len(ledger) - 4)


def test_prune_runs__never_running_pending_or_retrying(ledger):
    prune("--older-than", "0")
    assert set(TaskRun.objects.values_list("state", flat=True)) == {
        RunState.RUNNING,
        RunState.PENDING,
        RunState.RETRYING,
    }


def test_prune_runs__dry_run_deletes_nothing(ledger):
    assert prune("--older-than", "30", "--dry-run") == (
        "Would delete 4 finished runs and 8 transitions older than 30 days."
    )
    assert TaskRun.objects.count() == len(ledger)


def test_prune_runs__default_age_from_the_setting(ledger):
    with override_settings(TASKGUARD={"BACKEND": "database", "PRUNE_AFTER_DAYS": 90}):
        assert prune().startswith("Deleted 0 finished runs")
    with override_settings(TASKGUARD={"BACKEND": "database", "PRUNE_AFTER_DAYS": 7}):
        assert prune().startswith("Deleted 4 finished runs")


def test_prune_runs__batches(ledger):
    result = prune_runs(timezone.now() - timedelta(days=30), batch_size=3)
    assert (result.runs, result.transitions, result.batches) == (4, 8, 2)


def test_prune_runs__the_delete_rechecks_the_state(ledger):
    # A batch read while the run was abandoned, deleted after it was taken over
    # under on_stale="retry": the DELETE's own state test keeps it.
    taken_over = ledger[("old", RunState.ABANDONED)]
    TaskRun.objects.filter(pk=taken_over.pk).update(state=RunState.RETRYING)
    done = ledger[("old", RunState.SUCCEEDED)]
    assert ledger_api.delete_finished([taken_over.pk, done.pk]) == (1, 2)
    assert TaskRun.objects.filter(pk=taken_over.pk).exists()
    assert taken_over.transitions.count() == 2


def test_prune_runs__bad_arguments_are_refused():
    refused = {
        ("--older-than", "-1"): "'-1' must not be negative",
        ("--older-than", "x"): "'x' is not a whole number of days",
        ("--batch-size", "0"): "'0' must be between 1 and 10000",
        ("--batch-size", "20000"): "'20000' must be between 1 and 10000",
    }
    for args, message in refused.items():
        with pytest.raises(CommandError, match=message):
            call_command("prune_runs", *args, stdout=StringIO())
