"""The ledger's backends: one per database, chosen once per alias by Django's vendor name.

:mod:`.base` holds what every database implements (the statements, the strategies that
run them, the documented capability flags); :mod:`.postgresql`, :mod:`.mysql` (MariaDB)
and :mod:`.sqlite` each hold their database's SQL whole; :mod:`.fragments` the text they
share (tables, column lists, the duplicate-count rule, the ``SET`` clauses of the changes).
"""

from __future__ import annotations

from typing import Any

from django.db import connections

from ...exceptions import TaskGuardError
from .base import Backend
from .mysql import MARIADB_MINIMUM, MariaDBBackend, mysql_problem
from .postgresql import PostgreSQLBackend
from .sqlite import SQLiteBackend

# One backend object per database, shared by every alias on one: its statements are
# built once.
BACKENDS: dict[str, Backend] = {
    backend.vendor: backend for backend in (PostgreSQLBackend(), MariaDBBackend(), SQLiteBackend())
}
_chosen: dict[str, Backend] = {}


def backend_for(alias: str) -> Backend:
    """The backend of database ``alias``, chosen on first use (``TaskGuardError``: the
    ledger cannot live there) and kept for the process's life."""
    try:
        return _chosen[alias]
    except KeyError:
        pass
    connection = connections[alias]
    problem = vendor_problem(connection)
    if problem is not None:
        raise TaskGuardError(problem)
    chosen = _chosen[alias] = BACKENDS[connection.vendor]
    return chosen


def of_vendor(vendor: str) -> Backend | None:
    """The backend for ``vendor``, without asking the server (None: no such backend)."""
    return BACKENDS.get(vendor)


def vendor_problem(connection: Any) -> str | None:
    """Why the ledger cannot live on ``connection``'s database (None: it can).

    MySQL-compatible databases connect to tell MariaDB from MySQL (once per connection
    object: Django caches what the server said).
    """
    vendor = connection.vendor
    if vendor not in BACKENDS:
        return f"database vendor {vendor!r} is not supported (PostgreSQL, MariaDB or SQLite)"
    return BACKENDS[vendor].server_problem(connection)


__all__ = [
    "BACKENDS",
    "MARIADB_MINIMUM",
    "Backend",
    "backend_for",
    "mysql_problem",
    "of_vendor",
    "vendor_problem",
]
