"""The site's scheduled jobs. Every instance schedules them; taskguard runs each slot once."""

import os
from datetime import timedelta

from django_taskguard import current_run, once_per_schedule

DEMO_EVERY = timedelta(seconds=2)


@once_per_schedule(cron="0 21 * * *")
def nightly_report() -> str:
    """The 21:00 (Asia/Shanghai) report from the seed note, once however many instances fire it."""
    return "report sent"


@once_per_schedule(every=DEMO_EVERY, name="example.demo_tick")
def demo_tick(instance: str, log_path: str) -> str:
    """What the demo's instances all fire: records who ran each slot (O_APPEND, unfenced)."""
    run = current_run()
    line = f"{run.slot.isoformat()} {instance} {os.getpid()} {run.fence}\n"
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    return instance
