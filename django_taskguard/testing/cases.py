"""The pytest fixture's helper object, and a Django test case for unittest-style tests."""

from __future__ import annotations

from django.test import TransactionTestCase

from .calls import run_for_key, run_for_slot
from .clock import freeze_now
from .records import assert_no_run, assert_ran_once, assert_state, runs_for
from .reset import reset_locks


class TaskguardKit:
    """What the ``taskguard`` pytest fixture gives: the helpers of
    :mod:`django_taskguard.testing`, as attributes."""

    run_for_slot = staticmethod(run_for_slot)
    run_for_key = staticmethod(run_for_key)
    freeze_now = staticmethod(freeze_now)
    runs_for = staticmethod(runs_for)
    assert_ran_once = staticmethod(assert_ran_once)
    assert_state = staticmethod(assert_state)
    assert_no_run = staticmethod(assert_no_run)
    reset_locks = staticmethod(reset_locks)


class TaskguardTestCase(TransactionTestCase):
    """A ``TransactionTestCase`` that calls :func:`reset_locks` before and after each test.

    Guarded calls need a transactional test: the guard's claim commits on its own, and a
    ``TestCase`` runs every test inside a transaction (the guard refuses to claim there).
    Call ``super().setUp()`` when you override ``setUp``. Add the ledger's database to
    ``databases`` when ``TASKGUARD["DATABASE_ALIAS"]`` is not ``"default"``.
    """

    def setUp(self) -> None:
        super().setUp()
        reset_locks()
        self.addCleanup(reset_locks)
