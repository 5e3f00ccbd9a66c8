"""Guarded Celery tasks of the tests: each execution appends a line to ``log``.

Line format: ``EVENT TASKNAME SLOT ATTEMPT PID FENCE TIME``.
"""

from __future__ import annotations

import os
import time

from celery import shared_task

from django_taskguard import current_run, once_per_schedule
from tests.support.proc import record


def note(log: str, event: str) -> None:
    run = current_run()
    record(
        log,
        f"{event} {run.task_name} {run.slot.isoformat()} {run.attempt} {os.getpid()} {run.fence} "
        f"{time.time():.3f}",
    )


@shared_task(bind=True)
@once_per_schedule()
def tick(self, log: str, seconds: float = 0.2) -> str:
    note(log, "run")
    time.sleep(seconds)
    return "ticked"


@shared_task(bind=True, autoretry_for=(OSError,), retry_backoff=1, retry_jitter=True, max_retries=5)
@once_per_schedule()
def flaky(self, log: str, failures: int = 2) -> str:
    note(log, "run")
    if current_run().attempt <= failures:
        raise OSError(f"flaky failure on attempt {current_run().attempt}")
    return "finally"


@shared_task(bind=True, autoretry_for=(OSError,), retry_backoff=1, max_retries=2)
@once_per_schedule()
def hopeless(self, log: str) -> str:
    note(log, "run")
    raise OSError(f"hopeless failure on attempt {current_run().attempt}")


@shared_task(bind=True)
@once_per_schedule()
def explicit_retry(self, log: str) -> str:
    note(log, "run")
    if current_run().attempt < 2:
        raise self.retry(countdown=0)
    return "retried"


def _slow(log: str, seconds: float) -> str:
    note(log, "start")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    current_run().check()
    note(log, "end")
    return "slow"


@shared_task(bind=True)
@once_per_schedule(on_stale="retry", lease_seconds=3)
def slow_retry(self, log: str, seconds: float = 6.0) -> str:
    return _slow(log, seconds)


@shared_task(bind=True)
@once_per_schedule(on_stale="abandon", lease_seconds=3)
def slow_abandon(self, log: str, seconds: float = 6.0) -> str:
    return _slow(log, seconds)


def _gated(log: str, gate: str) -> str:
    """Attempt 1 holds its slot (a live, renewed lease) until the file ``gate`` exists."""
    note(log, "start")
    while current_run().attempt == 1 and not os.path.exists(gate):
        time.sleep(0.05)
    current_run().check()
    note(log, "end")
    return "opened"


@shared_task(bind=True)
@once_per_schedule(on_stale="retry", lease_seconds=3)
def gated(self, log: str, gate: str) -> str:
    return _gated(log, gate)


# A prefork worker can take up to ~5 s (its maintain_pool timer) to notice that a
# pool child was killed and requeue the message: a lease that outlives that by far,
# on a loaded machine too (the redelivery must find it live, to be put back).
@shared_task(bind=True)
@once_per_schedule(on_stale="retry", lease_seconds=20)
def gated_long_lease(self, log: str, gate: str) -> str:
    return _gated(log, gate)


@shared_task(bind=True)
@once_per_schedule()
def unscheduled(self, log: str) -> str:
    note(log, "run")
    return "ran"


@once_per_schedule(name="tests.inner", cron="* * * * *")
def inner(log: str) -> str:
    note(log, "inner")
    return "inner"


@shared_task(bind=True)
@once_per_schedule()
def outer(self, log: str) -> str:
    note(log, "outer")
    return inner(log) or "inner skipped"


# The documented HA setup with retries (docs/celery.md): max_retries=2, so at most 3
# attempts per slot, whatever copies the other beats send.
@shared_task(
    bind=True, autoretry_for=(OSError,), retry_backoff=1, retry_jitter=False, max_retries=2
)
@once_per_schedule()
def ha_flaky(self, log: str) -> str:
    note(log, "run")
    if current_run().attempt <= 2:
        raise OSError(f"ha_flaky failure on attempt {current_run().attempt}")
    return "finally"


@shared_task(
    bind=True, autoretry_for=(OSError,), retry_backoff=1, retry_jitter=False, max_retries=2
)
@once_per_schedule()
def ha_hopeless(self, log: str) -> str:
    note(log, "run")
    raise OSError(f"ha_hopeless failure on attempt {current_run().attempt}")


# Always raises; each retry 3 s later: a second copy of the slot's message sent 0.5 s after
# the first meets the row while it is retrying.
@shared_task(bind=True, autoretry_for=(OSError,), retry_kwargs={"countdown": 3}, max_retries=2)
@once_per_schedule()
def always_fails(self, log: str) -> str:
    note(log, "run")
    raise OSError(f"always_fails on attempt {current_run().attempt}")


@shared_task(bind=True)
@once_per_schedule(catchup="none")
def strict(self, log: str, label: str = "-") -> str:
    """A late message is recorded missed and not run (tests/test_backfill_beat.py)."""
    note(log, f"run:{label}")
    return "strict"


@shared_task(bind=True)
@once_per_schedule(name="tests.celery.report")
def report(self, log: str, tenant: int, fmt: str = "pdf") -> str:
    """A data schedule's target (arguments, and a name= its schedules' identities override):
    the event is ``report:TENANT:FMT``."""
    note(log, f"report:{tenant}:{fmt}")
    return f"report {tenant} {fmt}"
