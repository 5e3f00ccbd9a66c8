"""What the tests stand on, kept out of the folder of test files.

- Servers and wires: ``redis_server`` (a private ``redis-server``), ``redis_support``
  (settings pointing taskguard at it, Sentinel, TLS), ``mariadb_server`` (the session's
  private MariaDB), ``tcp_proxy`` (a wire that can stall or cut).
- Children: ``children`` (starting and reading ``python -m tests.support.proc`` processes),
  ``proc`` and ``proc_keyed`` (their scenarios), ``scheduler_child`` (run_schedules with a
  moved clock), ``inner_session`` (a pytest session of its own).
- Jobs a child imports by dotted path: ``celery_app``, ``celery_tasks``,
  ``celery_keyed_tasks``, ``djtasks_jobs``, ``schedule_jobs``, ``apps/``.
- Data and waiting: ``runs`` (ledger rows made by hand), ``slots``, ``monitoring``,
  ``waiting`` (``wait_for``).
- Django wiring named by ``tests/settings.py``: ``routers``, ``urls``.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository
