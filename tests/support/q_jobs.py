"""Guarded functions that django-q2 qclusters run (tests/test_django_q2.py).

``every_second`` has a schedule of its own, whose slots ``run_schedules --enqueue`` copies
hand to django-q2 (``on_django_q``). The others take their slot from the ``intended``
keyword argument (``slot_kwarg=``: what a django-q2 ``Schedule`` with
``intended_date_kwarg="intended"`` passes). Each appends
``TASK SLOT PID ATTEMPT`` to ``TASKGUARD_TEST_SCHEDULE_LOG`` with O_APPEND for every
execution: executions counted outside the ledger.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

from django_taskguard import current_run, once_per_schedule
from django_taskguard.contrib.django_q import on_django_q
from tests.support.proc import record

LOG = os.environ.get("TASKGUARD_TEST_SCHEDULE_LOG", "")


def _note(task: str) -> None:
    run = current_run()
    if LOG:
        record(LOG, f"{task} {run.slot.isoformat()} {os.getpid()} {run.attempt}")


@once_per_schedule(slot_kwarg="intended", name="tests.q.tick")
def tick() -> str:
    _note("tests.q.tick")
    return "ticked"


@once_per_schedule(slot_kwarg="intended", name="tests.q.slow")
def slow(seconds: float) -> str:
    """Runs past django-q2's ``retry``: the broker presents it again meanwhile."""
    _note("tests.q.slow")
    time.sleep(seconds)
    return "slow done"


@once_per_schedule(slot_kwarg="intended", name="tests.q.flaky")
def flaky() -> str:
    """Fails its first attempt: django-q2 presents the task again after ``retry``."""
    _note("tests.q.flaky")
    if current_run().attempt == 1:
        raise OSError("the first attempt fails")
    return "second attempt"


@once_per_schedule(slot_kwarg="intended", name="tests.q.hang", lease_seconds=3)
def hang() -> None:
    """Hangs until its worker is SIGKILLed."""
    _note("tests.q.hang")
    time.sleep(120)


@once_per_schedule(every=timedelta(seconds=1), name="tests.q.every")
def every_second() -> str:
    _note("tests.q.every")
    return "every second"


every_second_on_q = on_django_q(every_second)
