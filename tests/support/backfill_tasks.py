"""A django.tasks task over a guarded function, the target of data schedules in
tests/test_data_backfill.py (the Immediate backend: an enqueued slot runs at once, in the
test's process). ``name=`` keeps the dotted path for the task: it names the django.tasks
task, not the guarded function."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django_taskguard import current_run, once_per_schedule

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task

executed: list[tuple[str, datetime, Any, str]] = []  # (task name, slot, tenant, fmt)


@task()
@once_per_schedule(name="tests.backfill.report")
def report(tenant_id: int, *, fmt: str = "pdf") -> str:
    run = current_run()
    executed.append((run.task_name, run.slot, tenant_id, fmt))
    return f"report {tenant_id} {fmt}"
