"""Helpers for your own tests of guarded functions (docs/testing.md).

- :func:`run_for_slot`, :func:`run_for_key`: run a guarded function (or a Celery task
  whose body is one) now, in this process, through the real guard;
- :func:`freeze_now`: freeze the "now" that slots are computed from;
- :func:`runs_for`, :func:`assert_ran_once`, :func:`assert_state`,
  :func:`assert_no_run`: read what the ledger recorded, and assert on it;
- :func:`reset_locks`: forget what taskguard keeps between two tests (Redis keys of
  this ledger, in-process caches);
- :class:`TaskguardTestCase` for unittest-style tests; the ``taskguard`` pytest
  fixture (``django_taskguard.testing.pytest_plugin``, loaded automatically).

Guarded calls need a transactional test (``@pytest.mark.django_db(transaction=True)``,
the ``taskguard`` fixture, or ``TransactionTestCase``): the guard's claim commits on
its own and is refused inside the transaction that ``TestCase`` wraps each test in.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__all__ = [
    "FrozenClock",
    "TaskguardKit",
    "TaskguardTestCase",
    "assert_no_run",
    "assert_ran_once",
    "assert_state",
    "freeze_now",
    "reset_locks",
    "run_for_key",
    "run_for_slot",
    "runs_for",
]

if TYPE_CHECKING:
    from .calls import run_for_key, run_for_slot
    from .cases import TaskguardKit, TaskguardTestCase
    from .clock import FrozenClock, freeze_now
    from .records import assert_no_run, assert_ran_once, assert_state, runs_for
    from .reset import reset_locks

# Loaded on first use: they need Django's app registry, and the pytest plugin in this
# package is loaded (and so is this module) before Django is set up, or without Django.
_HOMES = {
    "run_for_slot": "calls",
    "run_for_key": "calls",
    "TaskguardKit": "cases",
    "TaskguardTestCase": "cases",
    "FrozenClock": "clock",
    "freeze_now": "clock",
    "runs_for": "records",
    "assert_ran_once": "records",
    "assert_state": "records",
    "assert_no_run": "records",
    "reset_locks": "reset",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{home}"), name)
