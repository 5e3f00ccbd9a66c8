"""The moments taskguard takes from its users: from 1970-01-01 to 9000-01-01 (UTC).

A data schedule's ``starts``/``ends``, a backfill's range and an acknowledgement's
``until`` are checked against these bounds where they are given (``define_schedule`` and
the admin's form, ``manage.py backfill`` and ``acknowledge``, the admin's backfill and
acknowledge pages): a moment near ``datetime``'s ends (year 1, year 9999) overflows once a
slot is computed from it or shown in another zone, and a row holding one would make every
page that shows it fail.
"""

from __future__ import annotations

from datetime import UTC, datetime

EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(9000, 1, 1, tzinfo=UTC)
BOUNDS = "from 1970-01-01 to 9000-01-01 (UTC)"


def moment_problem(moment: datetime, what: str) -> str | None:
    """Why the aware ``moment`` given as ``what`` is out of bounds, or None."""
    if EARLIEST <= moment <= LATEST:
        return None
    return f"{what} must be {BOUNDS}; got {moment.isoformat()}"
