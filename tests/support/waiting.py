"""Waiting on a condition (never on time alone)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 30.0,
    what: str = "condition",
    every: float = 0.05,
    describe: Callable[[], str] | None = None,
) -> T:
    """Poll ``predicate`` until it returns a truthy value (returned); fail after ``timeout``.

    ``describe``, if given, adds what it returns to the failure (a cluster's state).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    details = f"\n{describe()}" if describe is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{details}")
