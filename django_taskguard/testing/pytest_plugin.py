"""The ``taskguard`` pytest fixture (loaded by the ``pytest11`` entry point ``taskguard``).

This module is loaded in every pytest session of a project that has django-taskguard
installed, Django project or not: it imports nothing but pytest when loaded. Disable
it with ``-p no:taskguard``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .cases import TaskguardKit


@pytest.fixture
def taskguard(transactional_db: None) -> Iterator[TaskguardKit]:
    """The helpers of ``django_taskguard.testing``, in a transactional test (guarded calls
    commit their claim), with :func:`~django_taskguard.testing.reset_locks` called before
    and after the test.

    Needs pytest-django (``transactional_db``). Mark the test
    ``@pytest.mark.django_db(transaction=True, databases=[...])`` when the ledger's
    database (``TASKGUARD["DATABASE_ALIAS"]``) is not ``"default"``.
    """
    from .cases import TaskguardKit
    from .reset import reset_locks

    reset_locks()
    yield TaskguardKit()
    reset_locks()


@pytest.fixture(autouse=True)
def _taskguard_after_transactional_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A transactional test that does not use the ``taskguard`` fixture
    (``@pytest.mark.django_db(transaction=True)``, ``transactional_db``, ``live_server``)
    leaves nothing of taskguard's to the next one: its ledger's Redis keys, the
    paused-tasks cache (``reset.forget_after_test``)."""
    yield
    if "taskguard" in request.fixturenames or not _transactional(request):
        return
    from .reset import forget_after_test

    forget_after_test()


def _transactional(request: pytest.FixtureRequest) -> bool:
    names = request.fixturenames
    if "transactional_db" in names or "live_server" in names:
        return True
    marker = request.node.get_closest_marker("django_db")
    if marker is None:
        return False
    transaction = marker.kwargs.get("transaction", marker.args[0] if marker.args else False)
    return bool(transaction or marker.kwargs.get("reset_sequences"))
