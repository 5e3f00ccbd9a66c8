"""``freeze_now``: the "now" taskguard computes slots from, frozen for a test."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import ContextDecorator
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any, TypeVar, cast
from unittest import mock

from asgiref.sync import iscoroutinefunction
from django.utils import timezone

from ..exceptions import TaskGuardError

F = TypeVar("F", bound=Callable[..., Any])

# A frozen "now" must leave room for slot arithmetic (a day's cron slots, a retention
# horizon) on both sides of it.
EARLIEST = datetime(1971, 1, 1, tzinfo=dt_timezone.utc)
LATEST = datetime(9000, 1, 1, tzinfo=dt_timezone.utc)


def _checked(when: Any) -> datetime:
    if not isinstance(when, datetime):
        raise TaskGuardError(f"freeze_now needs an aware datetime, not {type(when).__name__}")
    if timezone.is_naive(when):
        raise TaskGuardError(
            f"freeze_now needs an aware datetime (got naive {when.isoformat()}): give it a "
            f"tzinfo, e.g. datetime(2026, 3, 1, 21, 0, tzinfo=ZoneInfo('Europe/Paris'))"
        )
    utc = when.astimezone(dt_timezone.utc)
    if not EARLIEST <= utc < LATEST:
        raise TaskGuardError(
            f"freeze_now: {when.isoformat()} is outside {EARLIEST.year}-{LATEST.year - 1}"
        )
    return utc


class FrozenClock(ContextDecorator):
    """``django.utils.timezone.now()`` returns :attr:`now` while the block runs.

    Made by :func:`freeze_now`; usable as a context manager or a decorator, and
    nestable (the innermost wins). Move it with :meth:`move_to` and :meth:`advance`.
    """

    def __init__(self, when: datetime) -> None:
        self.now: datetime = _checked(when)  # aware, UTC
        self._patches: list[Any] = []

    def __call__(self, func: F) -> F:
        """Decorate ``func``; a coroutine function stays one, frozen while it is awaited
        (ContextDecorator's plain wrapper would return its coroutine unawaited, unfrozen)."""
        if not iscoroutinefunction(func):
            return super().__call__(func)

        @functools.wraps(func)
        async def frozen(*args: Any, **kwargs: Any) -> Any:
            with self:  # the clock is reentrant: nested uses stack their patches
                return await func(*args, **kwargs)

        return cast(F, frozen)

    def __enter__(self) -> FrozenClock:
        patch = mock.patch.object(timezone, "now", self._now)
        patch.start()
        self._patches.append(patch)
        return self

    def __exit__(self, *exc: object) -> None:
        self._patches.pop().stop()

    def _now(self) -> datetime:
        return self.now

    def move_to(self, when: datetime) -> None:
        """Make ``now`` ``when`` (an aware datetime)."""
        self.now = _checked(when)

    def advance(self, delta: timedelta) -> None:
        """Move ``now`` on by ``delta`` (a timedelta; negative goes back)."""
        if not isinstance(delta, timedelta):
            raise TaskGuardError(f"advance() needs a timedelta, not {type(delta).__name__}")
        self.now = _checked(self.now + delta)


def freeze_now(when: datetime) -> FrozenClock:
    """Freeze the "now" taskguard computes slots from at ``when`` (an aware datetime).

    A context manager or a decorator. It patches ``django.utils.timezone.now`` for the
    block, in every thread, and nothing else: a plain call of a ``cron=``/``every=``
    function runs the latest slot at or before ``when``; ``catchup="none"``'s lateness,
    the retention horizon and the future-slot check are judged from it too.

    Not frozen: ``datetime.now()``, ``time.time()``, ``time.monotonic()`` (leases are
    renewed on it), and the database's clock, which stamps ``started_at``/``finished_at``
    and judges every lease: a frozen test never makes a live run look expired.
    """
    return FrozenClock(when)
