"""What a decorator's arguments decide about its calls: one :class:`Policy` per function."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

__all__ = [
    "DEFAULT_GRACE",
    "DEFAULT_MAX_CATCHUP",
    "Catchup",
    "OnDuplicate",
    "OnStale",
    "Overlap",
    "Policy",
]

OnDuplicate = Literal["skip", "raise"]
Overlap = Literal["allow", "skip"]
OnStale = Literal["abandon", "retry"]
Catchup = Literal["latest", "none", "all"]

DEFAULT_GRACE = timedelta(minutes=5)
DEFAULT_MAX_CATCHUP = 100


@dataclass(frozen=True)
class Policy:
    on_duplicate: str = "skip"  # "skip" | "raise"
    overlap: str = "allow"  # "allow" | "skip"
    on_stale: str = "abandon"  # "abandon" | "retry"
    lease_seconds: float | None = None
    # @once_per_key: how long a finished key blocks a new run (None: until pruned)
    keep_seconds: float | None = None
    # @once_per_key: store the JSON result; duplicates of the succeeded key get it
    return_result: bool = False
    catchup: str = "latest"  # "latest" | "none" | "all" (see docs/schedules.md)
    grace: timedelta = DEFAULT_GRACE  # how late a slot may be claimed before it is missed
    max_catchup: int = DEFAULT_MAX_CATCHUP  # catchup="all": at most this many slots
    pause_after_failures: int | None = None  # pause the task after this many failures in a row
    late_after: timedelta | None = None  # health: slots starting later than this are late
