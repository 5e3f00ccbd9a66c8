"""``python -m tests.support.aps_child SECONDS``: a process with its own APScheduler 3
``BackgroundScheduler`` (as every web worker of a site has one) firing ``aps_jobs.tick``
every second (an epoch-aligned interval) on ``TaskguardExecutor`` for ``SECONDS``.
Prints ``ready`` once its scheduler runs, and ``done`` at the end."""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import django


def main() -> None:
    django.setup()
    from apscheduler.schedulers.background import BackgroundScheduler

    from django_taskguard.contrib.apscheduler import TaskguardExecutor, epoch_interval
    from tests.support.aps_jobs import tick

    scheduler = BackgroundScheduler(
        executors={"default": TaskguardExecutor(max_workers=4)},
        job_defaults={"misfire_grace_time": 30},
    )
    scheduler.add_job(tick, epoch_interval(timedelta(seconds=1)))
    scheduler.start()
    print("ready", flush=True)
    time.sleep(float(sys.argv[1]))
    scheduler.shutdown(wait=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
