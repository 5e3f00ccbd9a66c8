"""``reset_locks``: what taskguard keeps between two tests, forgotten."""

from __future__ import annotations

from .. import locks, pauses
from ..conf import taskguard_settings


def reset_locks() -> int:
    """Forget what taskguard keeps between two tests; return how many Redis keys went.

    - Redis: when ``TASKGUARD["REDIS_ALIAS"]`` is a django-redis cache, every key of
      this ledger there (locks, finished-slot markers, claim records, enqueue and beat
      records) is deleted, found by ``SCAN`` under the ledger's key prefix. Other
      ledgers' keys (another project, your development site) are never touched, and the
      Redis database is never flushed. A finished marker left by one test would
      otherwise answer the next test's call for the same slot ("finished": not run),
      since the test database's rows are gone but its ledger identity is not.
    - In this process: the cached settings, lock backend and Redis clients (so
      ``override_settings(TASKGUARD=...)``, ``CACHES`` included, applies afresh), and
      the paused-tasks cache.

    The database backend keeps nothing outside the database, whose rows the test
    framework removes (a transactional test flushes its tables).
    """
    taskguard_settings.reload()
    locks.forget_clients()
    pauses.forget()
    return locks.delete_ledger_keys()
