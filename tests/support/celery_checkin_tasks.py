"""The Celery task of the check-in end-to-end test (tests/test_checkins_e2e.py).

``checkin_tick`` appends ``EVENT TASKNAME SLOT ATTEMPT PID FENCE TIME`` to ``log`` for each
attempt (tests/support/celery_tasks.py's ``note``); on every fifth slot (its epoch second a
multiple of 5) its first attempt asks Celery for a retry, so that slot's run ends on
attempt 2: one check-in, one start and one end (ok), whatever the retry.
"""

from __future__ import annotations

from celery import shared_task

from django_taskguard import current_run, once_per_schedule
from tests.support.celery_tasks import note

RETRY_EVERY = 5


@shared_task(bind=True)
@once_per_schedule()
def checkin_tick(self, log: str) -> str:
    run = current_run()
    note(log, "run")
    if run.attempt == 1 and int(run.slot.timestamp()) % RETRY_EVERY == 0:
        raise self.retry(countdown=0)
    return "ticked"
