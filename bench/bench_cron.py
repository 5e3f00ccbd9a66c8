"""CPU of run_schedules' cron arithmetic alone: K cron schedules, simulated minutes. A script.

    python bench/bench_cron.py [--schedules 2000] [--minutes 10] [--distinct]
                               [--expression "* * * * *"] [--zone Europe/Berlin]
                               [--start 2026-10-25T00:30:30+00:00]

No database, no Redis, no bodies: the real ``Scheduler.due()`` (which slots fell due, the
next slot of each schedule) is asked once a simulated second, as ``run_schedules``' loop
does, over ``--minutes`` minutes from ``--start`` (a DST day takes the dearer path); the
script reports the process CPU seconds per simulated minute and per schedule-slot.
``--distinct``: every schedule a different (equivalent) expression, so that none shares
another's kept walk (at most 1,440 of them).
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timedelta, timezone

import django
from django.conf import settings


def expressions(args: argparse.Namespace) -> list[str]:
    if not args.distinct:
        return [args.expression] * args.schedules
    # Equivalent to the expression, written differently: "0-59" in minute-field spellings.
    minute, *rest = args.expression.split()
    assert minute == "*", "--distinct rewrites a '*' minute field"
    spelled = [f"{a}-59,0-{a}" for a in range(60)]
    hours = [f"{b}-23,0-{b}" for b in range(24)]
    found = [f"{m} {h} {' '.join(rest[1:])}" for h in hours for m in spelled]
    return found[: args.schedules]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=2000)
    parser.add_argument("--minutes", type=int, default=10)
    parser.add_argument("--expression", default="* * * * *")
    parser.add_argument("--zone", default="UTC")
    parser.add_argument("--distinct", action="store_true")
    parser.add_argument("--start", default="2026-11-26T12:00:30+00:00")
    args = parser.parse_args()
    settings.configure(USE_TZ=True, TIME_ZONE=args.zone, INSTALLED_APPS=["django_taskguard"])
    django.setup()
    from django_taskguard import once_per_schedule, registry
    from django_taskguard.scheduler import Scheduler

    for n, expression in enumerate(expressions(args)):
        once_per_schedule(cron=expression, name=f"bench.cron.{n}")(lambda: None)
    entries = list(registry.entries().values())
    scheduler = Scheduler(entries, max_workers=1)
    now = datetime.fromisoformat(args.start).astimezone(timezone.utc)
    scheduler.first_due(now)
    fired = 0
    started = time.process_time()
    for _ in range(args.minutes * 60):
        now += timedelta(seconds=1)
        fired += sum(len(slots) for _, slots in scheduler.due(now))
    used = time.process_time() - started
    print(
        f"K={len(entries)} {'distinct' if args.distinct else 'identical'} "
        f"{args.expression!r} in {args.zone}, {args.minutes} simulated minutes from "
        f"{args.start}: "
        f"{fired} slots due, {used:.2f} s CPU, {used / args.minutes:.3f} s CPU per minute, "
        f"{1e6 * used / max(fired, 1):.0f} us per schedule-slot"
    )


if __name__ == "__main__":
    main()
