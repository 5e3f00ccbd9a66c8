"""The site's Celery tasks, run in this process as a worker runs a beat's message."""

from datetime import datetime, timezone

import pytest
from example.tasks import heartbeat, report

from django_taskguard.testing import assert_ran_once, run_for_slot, runs_for

SLOT = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)


def test_heartbeat__one_run_per_stamped_slot(taskguard):
    assert run_for_slot(heartbeat, SLOT) == SLOT.isoformat()
    assert run_for_slot(heartbeat, SLOT) is None  # a second beat's copy of the message
    assert assert_ran_once(heartbeat, SLOT).task_name == "example.tasks.heartbeat"


def test_report__each_region_is_its_own_call_of_one_slot(taskguard):
    # The beat schedule has report-eu and report-us: each message carries its own entry
    # name, so each is its own task ("example.tasks.report[report-eu]"). Run here without
    # an entry name, both calls are the one task "example.tasks.report".
    assert (
        run_for_slot(report, SLOT, region="eu") == f"report eu for {SLOT.isoformat()} (attempt 1)"
    )
    assert run_for_slot(report, SLOT, region="us") is None
    assert [run.duplicates for run in runs_for(report)] == [1]


def test_report__a_naive_slot_is_refused(taskguard):
    with pytest.raises(ValueError, match="timezone-aware"):
        run_for_slot(report, SLOT.replace(tzinfo=None), region="eu")
