"""``python -m tests.support.scheduler_child [run_schedules options]``: run_schedules in a child.

``TASKGUARD_TEST_CLOCK_OFFSET`` (seconds, may be negative) moves this process's clock:
``django.utils.timezone.now`` is replaced before the command starts, so the scheduler,
the decorator and the guard all read the shifted time (the database's clock is not
moved). The product has no such switch; only this test entry point reads it.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime, timedelta

import django


def main() -> None:
    django.setup()
    offset = float(os.environ.get("TASKGUARD_TEST_CLOCK_OFFSET", "0"))
    if offset:
        from django.utils import timezone

        real = timezone.now
        shift = timedelta(seconds=offset)

        def shifted() -> datetime:
            return real() + shift

        timezone.now = shifted
    from django.core.management import call_command

    call_command("run_schedules", *sys.argv[1:])


if __name__ == "__main__":
    main()
