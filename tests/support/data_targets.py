"""Targets of data schedules for the tests: guarded functions with arguments (a report per
tenant), imported by the tests and, through ``TASKGUARD["SCHEDULE_MODULES"]``, by the
children. Every execution appends ``TASK SLOT PID TIME`` (the task name is the data
schedule's, ``target[name]``) to ``TASKGUARD_TEST_SCHEDULE_LOG`` with O_APPEND: executions
counted outside the ledger; ``executed`` keeps this process's, with their arguments.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

import pytest

from django_taskguard import current_run, once_per_schedule
from tests.support.proc import record

LOG = os.environ.get("TASKGUARD_TEST_SCHEDULE_LOG", "")
executed: list[tuple[str, Any, dict[str, Any]]] = []  # (task name, args, kwargs)


def _note(*args: Any, **kwargs: Any) -> None:
    run = current_run()
    executed.append((run.task_name, args, kwargs))
    if LOG:
        record(LOG, f"{run.task_name} {run.slot.isoformat()} {os.getpid()} {time.time():.6f}")


@once_per_schedule()
def send_report(tenant_id: int, *, fmt: str = "pdf") -> str:
    """A tenant's report: the target of many data schedules."""
    _note(tenant_id, fmt=fmt)
    return f"report {tenant_id} {fmt}"


@once_per_schedule(name="tests.data.named")
def named_job() -> None:
    """A target with name=: data schedules still record their own identity."""
    _note()


@once_per_schedule()
def failing(message: str = "boom") -> None:
    _note(message)
    raise RuntimeError(message)


def not_guarded(tenant_id: int) -> None:
    """Not a valid target (no guard)."""


@once_per_schedule()
def echo(value: str) -> None:
    """Logs ``TASK|VALUE SLOT PID TIME``: the arguments each slot ran with, outside the ledger."""
    run = current_run()
    executed.append((run.task_name, (value,), {}))
    if LOG:
        record(
            LOG, f"{run.task_name}|{value} {run.slot.isoformat()} {os.getpid()} {time.time():.6f}"
        )


@once_per_schedule()
def anything(*args: Any, **kwargs: Any) -> None:
    """Takes any arguments (the check cannot refuse a reserved one by the signature)."""
    _note(*args, **kwargs)


def redeploy(monkeypatch: pytest.MonkeyPatch, **policy: Any) -> None:
    """``send_report``'s decorator as a deploy changes it (``@once_per_schedule(grace=...)``),
    for the test (undone after it)."""
    monkeypatch.setattr(send_report, "policy", replace(send_report.policy, **policy))
