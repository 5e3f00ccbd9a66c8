"""The site's scheduled jobs, tested with django_taskguard.testing (docs/testing.md)."""

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from example.jobs import DEMO_EVERY, demo_tick, nightly_report

from django_taskguard.models import RunState
from django_taskguard.testing import (
    TaskguardTestCase,
    assert_no_run,
    assert_ran_once,
    freeze_now,
    run_for_slot,
    runs_for,
)

SHANGHAI = ZoneInfo("Asia/Shanghai")  # the site's TIME_ZONE: cron="0 21 * * *" is 21:00 there


def test_nightly_report__runs_once_for_the_evening_however_many_instances_call(taskguard):
    with freeze_now(datetime(2026, 3, 1, 21, 0, 30, tzinfo=SHANGHAI)):
        results = [nightly_report() for _ in range(3)]  # three instances' schedulers fire
    assert results == ["report sent", None, None]
    run = assert_ran_once(nightly_report, datetime(2026, 3, 1, 21, 0, tzinfo=SHANGHAI))
    assert run.duplicates == 2


def test_nightly_report__before_21_00_the_slot_is_yesterdays(taskguard):
    with freeze_now(datetime(2026, 3, 2, 20, 59, tzinfo=SHANGHAI)):
        nightly_report()
    assert_ran_once(nightly_report, datetime(2026, 3, 1, 21, 0, tzinfo=SHANGHAI))
    assert_no_run(nightly_report, datetime(2026, 3, 2, 21, 0, tzinfo=SHANGHAI))


def test_demo_tick__each_slot_once_and_the_body_sees_its_slot(taskguard, tmp_path):
    log = tmp_path / "executions.log"
    first = datetime(2026, 3, 1, 12, 0, tzinfo=SHANGHAI)
    with freeze_now(first) as clock:
        for instance in ("web-1", "web-2"):
            demo_tick(instance, str(log))
        clock.advance(DEMO_EVERY)
        demo_tick("web-2", str(log))
    slots = [datetime.fromisoformat(line.split()[0]) for line in log.read_text().splitlines()]
    assert slots == [first, first + DEMO_EVERY]  # (aware datetimes: zones do not matter)
    assert [run.state for run in runs_for(demo_tick)] == [RunState.SUCCEEDED] * 2


class NightlyReportTests(TaskguardTestCase):
    """The same, for unittest-style tests: a TransactionTestCase that resets the locks."""

    def test_a_slot_given_explicitly(self) -> None:
        slot = datetime.now(SHANGHAI).replace(hour=21, minute=0, second=0, microsecond=0)
        slot -= timedelta(days=1)
        self.assertEqual(run_for_slot(nightly_report, slot), "report sent")
        self.assertIsNone(run_for_slot(nightly_report, slot))
        self.assertEqual(assert_ran_once(nightly_report, slot).duplicates, 1)
