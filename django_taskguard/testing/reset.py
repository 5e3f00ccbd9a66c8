"""``reset_locks``: what taskguard keeps between two tests, forgotten."""

from __future__ import annotations

from .. import ledger, locks, pauses
from ..conf import taskguard_settings

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
      the paused-tasks cache.

    The database backend keeps nothing outside the database, whose rows the test
    framework removes (a transactional test flushes its tables).
    """
    taskguard_settings.reload()
    if ledger.alias() not in _own_identity:
        ledger.new_identity()
        _own_identity.add(ledger.alias())
    locks.forget_clients()
    pauses.forget()
    return locks.delete_ledger_keys()
