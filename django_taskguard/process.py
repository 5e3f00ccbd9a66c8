"""Values that belong to one process: made again in a forked child.

A thread, a socket, a lock or a random stream made before a fork is the parent's: the
child must make its own. Python's at-fork hooks are not enough (uWSGI without
``py-call-osafterfork`` forks without running them), so the value is keyed by the pid
and rebuilt the first time it is asked for under a new one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["PerProcess", "per_process"]

T = TypeVar("T")


class PerProcess(Generic[T]):
    """``factory()``'s value for this process: ``get()`` makes it on first use, and again
    when the pid has changed since. Two threads that race on a first use may each make
    one (the last is kept): make a value for which that is harmless, or lock around it."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._made: tuple[int, T] | None = None

    def get(self) -> T:
        made, pid = self._made, os.getpid()
        if made is None or made[0] != pid:
            made = self._made = (pid, self._factory())
        return made[1]

    def mine(self) -> T | None:
        """The value made in this process, or None (never made here: nothing to close)."""
        made = self._made
        return made[1] if made is not None and made[0] == os.getpid() else None

    def forget(self) -> None:
        """Drop the value: the next ``get()`` makes a new one."""
        self._made = None


def per_process(factory: Callable[[], T]) -> PerProcess[T]:
    """A value made by ``factory`` once per process (again after a fork)."""
    return PerProcess(factory)
