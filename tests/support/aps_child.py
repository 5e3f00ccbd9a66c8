"""``python -m tests.support.aps_child STOPFILE``: a process with its own APScheduler 3
``BackgroundScheduler`` (as every web worker of a site has one) firing ``aps_jobs.tick``
every second (an epoch-aligned interval) on ``TaskguardExecutor`` until ``STOPFILE``
exists. Prints ``ready`` once its scheduler runs, and ``done`` once it has stopped."""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path

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
    stop = Path(sys.argv[1])
    while not stop.exists():
        time.sleep(0.1)
    scheduler.shutdown(wait=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
