"""A process forked while another of its parent's threads holds one of taskguard's module
locks (an upkeep's sweep in a prefork worker's parent, beside the pool forking a new child)
is not stuck on that lock: each is made afresh in the child (``os.register_at_fork``)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest

from django_taskguard import cron, pauses, registry
from django_taskguard.cron import CronSchedule

from .support.slots import BASE_SLOT

pytestmark = [pytest.mark.pure, pytest.mark.processes]


def _walk() -> None:
    cron._walk(CronSchedule("0 9 * * *", "UTC"), BASE_SLOT)


def _entries() -> None:
    registry.entries()


def _paused() -> None:
    with pauses._lock:  # what paused_reason takes to read afresh
        pass


LOCKS: dict[str, tuple[Callable[[], AbstractContextManager[object]], Callable[[], None]]] = {
    "cron walks": (lambda: cron._walks_lock, _walk),
    "registry": (lambda: registry._lock, _entries),
    "pauses": (lambda: pauses._lock, _paused),
}


@pytest.mark.parametrize("name", sorted(LOCKS))
def test_fork__a_child_forked_while_a_module_lock_is_held_takes_it(name: str) -> None:
    held, use = LOCKS[name]
    with held():  # as another thread of the parent holds it at the fork
        pid = os.fork()
        if pid == 0:  # the child: exit 0 once it has taken the lock
            try:
                use()
            finally:
                os._exit(0)
    deadline = time.monotonic() + 20  # the child takes the lock at once, or never
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the child forked while the {name} lock was held is stuck on it")
