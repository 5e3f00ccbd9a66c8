"""Argument types shared by taskguard's management commands."""

from __future__ import annotations

from argparse import ArgumentTypeError
from collections.abc import Callable


def whole_number(low: int, high: int | None = None, unit: str = "") -> Callable[[str], int]:
    """An argparse ``type=`` for a whole number in ``[low, high]`` (``high`` None: no bound)."""
    noun = f"a whole number of {unit}" if unit else "a whole number"

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise ArgumentTypeError(f"{value!r} is not {noun}") from None
        if high is not None and not low <= number <= high:
            raise ArgumentTypeError(f"{value!r} must be between {low} and {high}")
        if number < low:
            bound = "must not be negative" if low == 0 else f"must be at least {low}"
            raise ArgumentTypeError(f"{value!r} {bound}")
        return number

    return parse
