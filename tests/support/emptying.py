"""Between transactional tests: empty the tables that hold rows, in one transaction.

Django's ``TransactionTestCase`` flushes every database after each test with the ``flush``
command: a ``TRUNCATE`` of every table, then the ``post_migrate`` signal, which writes the
content types and permissions again. On PostgreSQL that was 0.1-0.3 s per test, about a
third of a pass. Here the tables are emptied with ``DELETE`` in one transaction (foreign keys
are deferred on PostgreSQL and SQLite, checks off on MariaDB for it), and the rows that
migrations wrote (content types, permissions, the migration log) stay, so nothing has to
write them again; the one other row ``post_migrate`` writes, the ledger's own (its identity
and fence), is written again by taskguard's receiver, as after ``flush``. Sequences are not
reset, as with Django's default ``reset_sequences=False``.
"""

from __future__ import annotations

from typing import Any

from django.db import connections, transaction
from django.test import TransactionTestCase

from django_taskguard.signal_handlers import keep_ledger_row

# Rows written by migrate (and post_migrate) that every test may count on.
KEPT = frozenset({"django_content_type", "auth_permission", "django_migrations"})

_tables: dict[str, list[str]] = {}


def empty(alias: str) -> None:
    """Delete the rows of every table of ``alias`` but :data:`KEPT`'s."""
    connection = connections[alias]
    if alias not in _tables:
        names = connection.introspection.django_table_names(only_existing=True)
        _tables[alias] = sorted(set(names) - KEPT)
    quote = connection.ops.quote_name
    mariadb = connection.vendor == "mysql"
    with transaction.atomic(using=alias), connection.cursor() as cursor:
        if mariadb:
            cursor.execute("SET FOREIGN_KEY_CHECKS = 0")
        try:
            for table in _tables[alias]:
                cursor.execute(f"DELETE FROM {quote(table)}")
        finally:
            if mariadb:
                cursor.execute("SET FOREIGN_KEY_CHECKS = 1")
    keep_ledger_row(using=alias)  # what post_migrate does after a flush


def _fixture_teardown(self: TransactionTestCase) -> None:
    for alias in self._databases_names(include_mirrors=False):  # type: ignore[attr-defined]
        empty(alias)


def install() -> Any:
    """Put :func:`_fixture_teardown` in place of Django's flush (the suite's conftest)."""
    TransactionTestCase._fixture_teardown = _fixture_teardown  # type: ignore[method-assign]
