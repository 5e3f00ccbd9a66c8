"""APScheduler 4 (a pre-release; run in a separate environment, see docs/development.md):
a guarded job claims the running job's ``scheduled_fire_time``; two schedulers (each with
its own in-memory data store, as two processes have) firing the same one-second interval
run each slot once. Skipped where APScheduler 3 is installed (the suite's own venv)."""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from datetime import timezone as dt_timezone

import pytest

from django_taskguard.models import RunState, TaskRun

from .support.children import executions
from .support.waiting import wait_for

pytestmark = [pytest.mark.processes, pytest.mark.pure]

apscheduler = pytest.importorskip("apscheduler")
if not hasattr(apscheduler, "current_job"):
    pytest.skip("APScheduler 4 only (this is 3.x)", allow_module_level=True)


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(60)
def test_apscheduler4__two_schedulers_each_slot_once_at_its_fire_time(tmp_path, monkeypatch):
    from apscheduler import Scheduler
    from apscheduler.triggers.interval import IntervalTrigger

    from tests.support import aps_jobs

    # One start for both: every scheduler fires the same instants. (Not one far in the
    # past: APScheduler 4 walks an interval trigger from its start, one fire time at a time.)
    start = datetime.now(dt_timezone.utc).replace(microsecond=0)
    log = tmp_path / "executions.log"
    monkeypatch.setattr(aps_jobs, "LOG", str(log))
    schedulers = [Scheduler() for _ in range(2)]
    for scheduler in schedulers:
        scheduler.__enter__()
        scheduler.add_schedule(
            aps_jobs.tick, IntervalTrigger(seconds=1, start_time=start), id="tick"
        )
        scheduler.start_in_background()
    try:
        wait_for(
            lambda: TaskRun.objects.filter(state=RunState.SUCCEEDED).count() >= 5,
            timeout=60,
            what="five slots to run",
        )
    finally:
        for scheduler in schedulers:
            scheduler.__exit__(None, None, None)
    done = Counter(words[1] for words in executions(log))
    assert set(done.values()) == {1}, done
    rows = list(TaskRun.objects.filter(task_name="tests.aps.tick"))
    assert sorted(run.slot.isoformat() for run in rows) == sorted(done)
    assert all(run.slot.microsecond == 0 for run in rows), "the slots are the fire times"
    assert sum(run.duplicates for run in rows) >= len(rows) - 2, "both schedulers fired"
