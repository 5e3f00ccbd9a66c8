"""The upkeep's row: a fleet-wide lease (compare-and-set), and what the latest run did.

:mod:`django_taskguard.upkeep` takes the lease before it runs, renews it while it runs,
and records the end; the health verdict reads :func:`latest`. Every query uses
``DATABASE_ALIAS``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db.models import Q

from ..models import DatabaseNow, Upkeep
from .core import alias, clip, translated

ERROR_MAX_LENGTH = 2_000
# A holder is ``who#token``: the token tells apart two processes that name themselves alike
# (containers with the same host name and pid); ``ran_by`` keeps the ``who``.
HOLDER_TAIL = "#"


def take(holder: str, hold: timedelta, every: timedelta) -> bool:
    """Take the lease for ``hold`` when it is free (lapsed or released) and the latest run
    started at least ``every`` ago (by the database's clock); False: another process holds
    it, or upkeep ran recently."""
    with translated:
        Upkeep.objects.using(alias()).bulk_create([Upkeep(id=1)], ignore_conflicts=True)
        free = Q(held_until__isnull=True) | Q(held_until__lte=DatabaseNow())
        due = Q(started_at__isnull=True) | Q(started_at__lte=DatabaseNow() - every)
        taken = (
            Upkeep.objects.using(alias())
            .filter(free, due, id=1)
            .update(holder=holder, held_until=DatabaseNow() + hold, started_at=DatabaseNow())
        )
    return bool(taken)


def renew(holder: str, hold: timedelta) -> bool:
    """Hold the lease ``hold`` longer from now (compare-and-set on the holder); False: the
    lease was lost (another process took it after it lapsed) or given back."""
    with translated:
        return bool(
            Upkeep.objects.using(alias())
            .filter(id=1, holder=holder, held_until__isnull=False)
            .update(held_until=DatabaseNow() + hold)
        )


def finish(holder: str, result: dict[str, Any], error: str = "") -> bool:
    """Record the end of this holder's run and give the lease back; False when the lease
    was lost (another process took it after it lapsed)."""
    with translated:
        return bool(
            Upkeep.objects.using(alias())
            .filter(id=1, holder=holder)
            .update(
                held_until=None,
                finished_at=DatabaseNow(),
                ran_by=holder.split(HOLDER_TAIL, 1)[0],
                error=clip(error, ERROR_MAX_LENGTH),
                result=result,
            )
        )


def release(holder: str) -> bool:
    """Give the lease back without recording a run (a run that did not finish)."""
    with translated:
        return bool(
            Upkeep.objects.using(alias()).filter(id=1, holder=holder).update(held_until=None)
        )


def latest() -> Upkeep | None:
    """The upkeep row (None: upkeep never ran against this database)."""
    with translated:
        return Upkeep.objects.using(alias()).filter(id=1).first()
