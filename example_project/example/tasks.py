"""Periodic Celery tasks. Run two beats and two workers: each slot still runs once."""

import os
import time

from celery import shared_task
from celery.utils.log import get_task_logger

from django_taskguard import current_run, once_per_schedule

logger = get_task_logger(__name__)
SLOW_SECONDS = 40


@shared_task(bind=True)
@once_per_schedule()  # the slot comes from the message taskguard's beat stamped
def heartbeat(self) -> str:  # type: ignore[no-untyped-def]
    return current_run().slot.isoformat()


@shared_task(bind=True, autoretry_for=(OSError,), retry_backoff=True, max_retries=3)
@once_per_schedule(on_stale="retry")  # a killed worker's slot is taken over after its lease
def report(self, region: str) -> str:  # type: ignore[no-untyped-def]
    run = current_run()
    return f"report {region} for {run.slot.isoformat()} (attempt {run.attempt})"


# Acked when received (Celery's default; the settings turn acks_late on for the others), so
# a killed worker takes the message with it: nothing comes back for the slot, and only
# cleanup_locks can record what became of it (README, "Watch a crash and its cleanup").
@shared_task(bind=True, acks_late=False)
@once_per_schedule()  # on_stale="abandon": a run whose worker died is recorded, not re-run
def slow(self) -> str:  # type: ignore[no-untyped-def]
    run = current_run()
    logger.info(
        "slow: slot %s, fence %s, pid %s: sleeping %ss",
        run.slot.isoformat(),
        run.fence,
        os.getpid(),
        SLOW_SECONDS,
    )
    time.sleep(SLOW_SECONDS)
    return f"slow {run.slot.isoformat()} done"
