"""Memory the kept cron walks hold at their limit: KEEP_WALKS walks of 2 x KEEP_TIMES fire
times each (the most a walk holds between trims). A script.

    python bench/bench_cron_memory.py [--walks 4096] [--zone Europe/Berlin]
                                      [--expression "* * * * *"]

Every walk a different (equivalent) spelling of the expression (its minute, hour and
month fields) or day rule, so that none shares
another's walk, kept in cron.py's own table; traced with ``tracemalloc`` from before the
first walk to after the last (the walks' datetimes, their croniter streams, the table).
"""

from __future__ import annotations

import argparse
import gc
import tracemalloc
from datetime import datetime, timedelta, timezone

import django
from django.conf import settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=None)
    parser.add_argument("--zone", default="Europe/Berlin")
    parser.add_argument("--expression", default="* * * * *")
    args = parser.parse_args()
    settings.configure(USE_TZ=True, TIME_ZONE="UTC")
    django.setup()
    from django_taskguard import cron

    walks = args.walks or cron.KEEP_WALKS
    held = 2 * cron.KEEP_TIMES
    minute, hour, day, month, weekday = args.expression.split()
    assert (minute, hour, month) == ("*", "*", "*"), "the walks rewrite '*' in these fields"
    spelled = [
        f"{a}-59,0-{a} {b}-23,0-{b} {day} {m} {weekday}"
        for m in ("*", "1-12")
        for b in range(24)
        for a in range(60)
    ]
    start = datetime(2026, 6, 1, 12, tzinfo=timezone.utc)
    crons = [cron.CronSchedule(e, tz_name=args.zone, day_or=d) for d in (True, False)
             for e in spelled][:walks]  # fmt: skip
    assert len(crons) == walks, f"at most {len(spelled) * 2} distinct walks"
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for schedule in crons:
        walk = cron._walk(schedule, start)
        walk.between(start, start + timedelta(days=1), held - 1)
        assert len(walk.times) == held, len(walk.times)
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    assert len(cron._walks) == walks
    total = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    print(f"{walks} walks x {held} fire times ({args.expression!r}, {args.zone}): "
          f"{total / 1e6:.1f} MB held ({total / walks / 1e3:.1f} kB a walk)")  # fmt: skip


if __name__ == "__main__":
    main()
