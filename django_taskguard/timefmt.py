"""How the admin shows a moment: local time with its zone and seconds, and UTC beside.

One convention on every page: ``2026-11-22 22:00:00 CET (21:00:00 UTC)``, or
``2026-11-22 21:00:00 UTC`` alone when the zone is UTC.
"""

from __future__ import annotations

from datetime import datetime, tzinfo
from datetime import timezone as dt_timezone

from django.utils import timezone


def local(moment: datetime, zone: tzinfo | None = None) -> str:
    """``2026-11-22 22:00:00 CET``: the current time zone's (Django's ``TIME_ZONE``); in
    UTC when that zone's time is past ``datetime``'s ends (a row stored out of bounds)."""
    try:
        return f"{moment.astimezone(zone or timezone.get_current_timezone()):%Y-%m-%d %H:%M:%S %Z}"
    except OverflowError:
        return utc(moment)


def utc(moment: datetime) -> str:
    """``2026-11-22 21:00:00 UTC``."""
    return f"{moment.astimezone(dt_timezone.utc):%Y-%m-%d %H:%M:%S} UTC"


def both(moment: datetime, zone: tzinfo | None = None) -> str:
    """``2026-11-22 22:00:00 CET (21:00:00 UTC)`` (the UTC date too when it differs); UTC
    alone when the zone is UTC, or its time is past ``datetime``'s ends (a row stored out
    of bounds)."""
    try:
        here = moment.astimezone(zone or timezone.get_current_timezone())
    except OverflowError:
        return utc(moment)
    if here.tzname() == "UTC":  # the zone is UTC: once
        return utc(moment)
    there = moment.astimezone(dt_timezone.utc)
    when = f"{there:%H:%M:%S}" if here.date() == there.date() else f"{there:%Y-%m-%d %H:%M:%S}"
    return f"{here:%Y-%m-%d %H:%M:%S %Z} ({when} UTC)"
