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
