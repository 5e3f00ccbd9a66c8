"""Argument types shared by taskguard's management commands."""

from __future__ import annotations

import difflib
from argparse import ArgumentTypeError
from collections.abc import Callable, Iterable
from datetime import datetime

from django.core.management.base import CommandError

from ..moments import moment_problem


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


def aware_datetime(value: str) -> datetime:
    """An argparse ``type=`` for an ISO-8601 time with its UTC offset (``...Z`` or ``+02:00``),
    within the bounds of :mod:`..moments`."""
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ArgumentTypeError(f"{value!r} is not an ISO-8601 time") from None
    if parsed.tzinfo is None:
        raise ArgumentTypeError(
            f"{value!r} has no UTC offset; write it as {value}Z or {value}+01:00"
        )
    if (problem := moment_problem(parsed, "a time")) is not None:
        raise ArgumentTypeError(problem)
    return parsed


def unknown_task(name: str, known: Iterable[str]) -> CommandError:
    """``CommandError`` for a task name no schedule has, naming the closest ones."""
    names = sorted(set(known))
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    if close:
        hint = f"did you mean {', '.join(close)}?"
    elif names:
        hint = f"known schedules: {', '.join(names[:10])}{', ...' if len(names) > 10 else ''}"
    else:
        hint = "no schedule is registered (see TASKGUARD['SCHEDULE_MODULES'])"
    return CommandError(f"no schedule named {name!r}; {hint}")
