"""``reset_locks``: what taskguard keeps between two tests, forgotten."""

from __future__ import annotations

import contextlib

from .. import ledger, locks, pauses, upkeep
from ..conf import taskguard_settings
from ..exceptions import BackendUnavailable

# The databases whose ledger this process gave an identity of its own.
_own_identity: set[str] = set()


def reset_locks() -> int:
    """Forget what taskguard keeps between two tests; return how many Redis keys went.

    - Redis: when ``TASKGUARD["REDIS_ALIAS"]`` is a django-redis cache, every key of
      this ledger there (locks, finished-slot markers, claim records, enqueue and beat
      records) is deleted, found by ``SCAN`` under the ledger's key prefix. Other
      ledgers' keys (another project, your development site) are never touched, and the
      Redis database is never flushed. A finished marker left by one test would
      otherwise answer the next test's call for the same slot ("finished": not run),
      since the test database's rows are gone but its ledger identity is not.
    - The first time in a process (per database): the ledger gets an identity of its
      own, so that test processes that share a cloned database (``manage.py test
      --parallel``) do not share their Redis keys.
    - In this process: the cached settings, lock backend and Redis clients (so
      ``override_settings(TASKGUARD=...)``, ``CACHES`` included, applies afresh), and
      the paused-tasks cache; the automatic upkeep is turned off (a thread writing to the
      test database beside the tests), until ``upkeep.forget()``.

    The database backend keeps nothing outside the database, whose rows the test
    framework removes (a transactional test flushes its tables).
    """
    taskguard_settings.reload()
    upkeep.forget(off=True)
    if ledger.alias() not in _own_identity:
        ledger.new_identity()
        _own_identity.add(ledger.alias())
    locks.forget_clients()
    pauses.forget()
    return locks.delete_ledger_keys()


def forget_after_test() -> None:
    """After a transactional test that did not ask for ``reset_locks`` (the pytest plugin
    calls it): what taskguard kept must not answer the next test, whose database is empty.

    On the Redis backend, once this process has used the ledger (its identity is known),
    the ledger's keys there are deleted (a Redis that does not answer is left to its keys'
    TTLs); the paused-tasks cache and cached settings and clients are forgotten. No
    database query: the test's database may be flushed and closed to it already.
    """
    if ledger.identity_known() and locks.backend_name() == "redis":
        with contextlib.suppress(BackendUnavailable):
            locks.delete_ledger_keys()
    taskguard_settings.reload()
    locks.forget_clients()
    pauses.forget()
