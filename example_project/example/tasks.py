"""Periodic Celery tasks. Run two beats and two workers: each slot still runs once."""

from celery import shared_task

from django_taskguard import current_run, once_per_schedule


@shared_task(bind=True)
@once_per_schedule()  # the slot comes from the message taskguard's beat stamped
def heartbeat(self) -> str:  # type: ignore[no-untyped-def]
    return current_run().slot.isoformat()


@shared_task(bind=True, autoretry_for=(OSError,), retry_backoff=True, max_retries=3)
@once_per_schedule(on_stale="retry")  # a killed worker's slot is taken over after its lease
def report(self, region: str) -> str:  # type: ignore[no-untyped-def]
    run = current_run()
    return f"report {region} for {run.slot.isoformat()} (attempt {run.attempt})"
