"""``python -m tests.support.q_enqueuer SECONDS FILE``: a django-q2 "scheduler" in a child.

At every whole second (UTC, epoch-aligned) for ``SECONDS``, it enqueues
``tests.support.q_jobs.tick`` with ``intended=<that second, ISO-8601>`` through django-q2's
``async_task``: what django-q2's scheduler does for a ``Schedule`` whose
``intended_date_kwarg`` is ``"intended"`` (its granularity is a minute, too coarse for a
test). Two of these are two schedulers firing the same slots. Appends each slot it
enqueued to ``FILE``, one a line.
"""

from __future__ import annotations

import sys
import time
from datetime import datetime, timezone

import django


def main() -> None:
    django.setup()
    from django_q.tasks import async_task

    deadline = time.time() + float(sys.argv[1])
    while True:
        now = time.time()
        second = int(now) + 1
        if second > deadline:
            return
        time.sleep(second - now)
        slot = datetime.fromtimestamp(second, timezone.utc)
        async_task("tests.support.q_jobs.tick", intended=slot.isoformat())
        with open(sys.argv[2], "a") as out:
            out.write(slot.isoformat() + "\n")


if __name__ == "__main__":
    main()
