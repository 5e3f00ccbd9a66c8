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
from django_taskguard import once_per_schedule
from django_taskguard.exceptions import TaskGuardError
from django_taskguard.models import RunState, TaskRun, TaskRunTransition
from django_taskguard.retention import prune_runs

from .support.runs import make_run

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]


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


FINISHED = {
    RunState.SUCCEEDED,
    RunState.FAILED,
    RunState.SKIPPED,
    RunState.ABANDONED,
    RunState.MISSED,
}


def test_prune_runs__deletes_old_finished_runs_and_their_transitions(ledger):
    assert prune("--older-than", "30", "--batch-size", "2") == (
        "Deleted 5 finished runs and 10 transitions older than 30 days."
    )
    left = {(age, state) for (age, state), run in ledger.items()
            if TaskRun.objects.filter(pk=run.pk).exists()}  # fmt: skip
    assert left == set(ledger) - {("old", state) for state in FINISHED}
    gone = [ledger[("old", state)].pk for state in FINISHED]
    assert not TaskRunTransition.objects.filter(run_id__in=gone).exists()
    assert TaskRunTransition.objects.count() == 2 * (len(ledger) - 5)


def test_prune_runs__never_running_pending_or_retrying(ledger):
    prune("--older-than", "30")
    old = {ledger[("old", state)].pk for state in RunState.values}
    assert set(TaskRun.objects.filter(pk__in=old).values_list("state", flat=True)) == {
        RunState.RUNNING,
        RunState.PENDING,
        RunState.RETRYING,
    }


def test_prune_runs__dry_run_deletes_nothing(ledger):
    assert prune("--older-than", "30", "--dry-run") == (
        "Would delete 5 finished runs and 10 transitions older than 30 days."
    )
    assert TaskRun.objects.count() == len(ledger)


def test_prune_runs__default_age_from_the_setting(ledger):
    with override_settings(TASKGUARD={"BACKEND": "database", "PRUNE_AFTER_DAYS": 90}):
        assert prune().startswith("Deleted 0 finished runs")
    with override_settings(TASKGUARD={"BACKEND": "database", "PRUNE_AFTER_DAYS": 7}):
        assert prune().startswith("Deleted 5 finished runs")


def test_prune_runs__batches(ledger):
    result = prune_runs(timezone.now() - timedelta(days=31), batch_size=3)
    assert (result.runs, result.transitions, result.batches) == (5, 10, 2)


def test_prune_runs__the_delete_rechecks_the_state(ledger):
    # A batch read while the run was abandoned, deleted after it was taken over
    # under on_stale="retry": the DELETE's own state test keeps it.
    taken_over = ledger[("old", RunState.ABANDONED)]
    TaskRun.objects.filter(pk=taken_over.pk).update(state=RunState.RETRYING)
    done = ledger[("old", RunState.SUCCEEDED)]
    assert ledger_api.delete_finished([taken_over.pk, done.pk], timezone.now()) == (1, 2)
    assert TaskRun.objects.filter(pk=taken_over.pk).exists()
    assert taken_over.transitions.count() == 2


def test_prune_runs__bad_arguments_are_refused():
    refused = {
        ("--older-than", "-1"): "'-1' must be at least 1",
        ("--older-than", "0"): "'0' must be at least 1",
        ("--older-than", "29"): r"--older-than 29 is below TASKGUARD\['PRUNE_AFTER_DAYS'\] \(30\)",
        ("--older-than", "x"): "'x' is not a whole number of days",
        ("--batch-size", "0"): "'0' must be between 1 and 10000",
        ("--batch-size", "20000"): "'20000' must be between 1 and 10000",
    }
    for args, message in refused.items():
        with pytest.raises(CommandError, match=message):
            call_command("prune_runs", *args, stdout=StringIO())


def test_prune_runs__the_function_refuses_a_cut_inside_the_horizon():
    with pytest.raises(TaskGuardError, match="cannot prune runs younger than PRUNE_AFTER_DAYS"):
        prune_runs(timezone.now() - timedelta(days=29))


def test_prune_runs__a_pruned_slot_is_never_run_again():
    # Before: a straggler (or run_for_slot(old_slot)) ran a pruned slot a second time.
    calls: list[int] = []
    job = once_per_schedule(name="tests.retention.rerun")(lambda: calls.append(1))
    slot = timezone.now() - timedelta(days=3)
    with override_settings(TASKGUARD={"BACKEND": "database", "PRUNE_AFTER_DAYS": 5}):
        job.run_for_slot(slot)
    assert calls == [1]
    with override_settings(TASKGUARD={"BACKEND": "database", "PRUNE_AFTER_DAYS": 2}):
        assert prune().startswith("Deleted 1 finished run")
        assert not TaskRun.objects.exists()
        assert job.run_for_slot(slot) is None
    assert calls == [1], "the pruned slot ran again"
    refused = TaskRun.objects.get()
    assert (refused.state, refused.attempt) == (RunState.SKIPPED, 0)
    assert "older than the retention horizon (PRUNE_AFTER_DAYS = 2)" in refused.error


def test_fences__never_go_back_when_the_newest_rows_are_pruned():
    # The run with the highest fence is an old slot (a backfill, a late straggler):
    # pruning it must not hand its fence out again (SQLite used MAX(fence) + 1).
    recent = ledger_api.claim(
        "tests.fence.recent", timezone.now(), "h:1:a", 30, abandon_is_final=True
    )
    old_slot = timezone.now() - timedelta(days=40)
    old = ledger_api.claim("tests.fence.old", old_slot, "h:1:b", 30, abandon_is_final=True)
    assert old.fence is not None and recent.fence is not None and old.fence > recent.fence
    assert ledger_api.finish(old.id, 1, old.fence, "h:1:b", RunState.SUCCEEDED, "done")
    assert prune("--older-than", "30").startswith("Deleted 1 finished run")
    later = ledger_api.claim(
        "tests.fence.later", timezone.now(), "h:1:c", 30, abandon_is_final=True
    )
    assert later.fence is not None and later.fence > old.fence


def test_fences__move_past_fences_loaded_with_their_rows(tmp_path):
    # loaddata writes rows as they are (raw): the fence source moves past them.
    fixture = tmp_path / "runs.json"
    fixture.write_text(
        '[{"model": "taskguard.taskrun", "pk": 999000, "fields": {"task_name": "tests.loaded", '
        '"slot": "2026-01-01T00:00:00Z", "state": "succeeded", "attempt": 1, "fence": 5000000, '
        '"owner": "h:1:x", "created_at": "2026-01-01T00:00:00Z", "error": "", "duplicates": 0}}]'
    )
    call_command("loaddata", str(fixture), stdout=StringIO())
    row = ledger_api.claim("tests.fence.after", timezone.now(), "h:1:y", 30, abandon_is_final=True)
    assert row.fence is not None and row.fence > 5_000_000
