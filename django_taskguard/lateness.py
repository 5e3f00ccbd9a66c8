"""Start lateness: how long after its slot a slot's run started, and health's rule for a
schedule whose slots keep starting late.

A slot's start is its first attempt's (``TaskRun.started_at`` of a run at ``attempt`` 1: a
retry moves ``started_at`` on). The ledger reads the lateness (:func:`ledger.task_facts`,
:func:`ledger.window_summary`); this module says what the bound is and what the verdict says.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from django.utils.translation import ngettext

from .conf import taskguard_settings


def bound(late_after: timedelta | None) -> timedelta | None:
    """A schedule's late-start bound: its own ``late_after``, else ``LATE_START_SECONDS``
    (None: no bound, no rule)."""
    if late_after is not None:
        return late_after
    seconds = taskguard_settings.LATE_START_SECONDS
    return None if seconds is None else timedelta(seconds=seconds)


def runs_to_read(bounds: Iterable[timedelta | None]) -> int | None:
    """How many latest starts per task the verdict reads: ``LATE_START_RUNS``, or None when
    no task has a bound (then it reads none)."""
    if any(found is not None for found in bounds):
        return taskguard_settings.LATE_START_RUNS
    return None


def late_detail(starts: tuple[float, float] | None, limit: timedelta | None) -> str | None:
    """Why the task is late, when its last ``LATE_START_RUNS`` first starts (the least and
    greatest lateness, in seconds; None: fewer started) all came later than ``limit``."""
    if starts is None or limit is None:
        return None
    least, greatest = starts
    if least <= limit.total_seconds():
        return None
    count = taskguard_settings.LATE_START_RUNS
    spread = f"{least:.0f}" if round(least) == round(greatest) else f"{least:.0f}-{greatest:.0f}"
    return ngettext(
        "its last slot started %(spread)s s after its time (bound %(bound)s s)",
        "the last %(n)d slots started %(spread)s s after their time (bound %(bound)s s)",
        count,
    ) % {"n": count, "spread": spread, "bound": f"{limit.total_seconds():g}"}
