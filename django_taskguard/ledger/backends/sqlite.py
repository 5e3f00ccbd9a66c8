"""The ledger on SQLite: one writer at a time, so a write and its transitions are two
statements in one transaction, and fences come from the ledger row's counter, moved on
first in that transaction."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db import transaction

from .base import Backend, Values, one
from .fragments import LEDGER


class SQLiteBackend(Backend):
    vendor = "sqlite"
    fences_from_ledger_row = True

    now = "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now')"
    lease_after = "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', '+' || {seconds} || ' seconds')"
    seconds_ago = "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', '-' || %s || ' seconds')"
    lease_left = "(julianday(lease_until) - julianday('now')) * 86400.0"
    # The ledger row's counter, moved on by :meth:`fence_moved_on` first in the same
    # transaction (SQLite runs one writer at a time). Never MAX(fence) + 1: that goes back
    # when retention deletes the newest rows.
    next_fence = f"(SELECT fence FROM {LEDGER} WHERE id = 1)"
    duration = "(julianday(finished_at) - julianday(started_at)) * 86400.0"
    lateness = "(julianday(started_at) - julianday(slot)) * 86400.0"

    # :attr:`now`, run without parameters (its ``%`` not doubled).
    read_now = "SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')"
    bump_fence = f"UPDATE {LEDGER} SET fence = fence + 1 WHERE id = 1"
    fence_at_least_statement = f"UPDATE {LEDGER} SET fence = MAX(fence, %s) WHERE id = 1"

    def connection_lost(self, exc: Exception) -> bool:
        """Never: SQLite raises ``OperationalError`` for real errors too, which must not be
        retried."""
        return False

    def fence_moved_on(self, connection: Any) -> None:
        with connection.cursor() as cursor:
            cursor.execute(self.bump_fence)
            if cursor.rowcount == 0:  # no ledger row (a flushed table): made, then moved on
                self.ensure_ledger_row()
                cursor.execute(self.bump_fence)

    def ensure_ledger_row(self) -> None:
        from ..core import ensure_ledger_row  # the ORM's row, made as the ledger makes it

        ensure_ledger_row()

    def fence_at_least(self, connection: Any, value: int) -> None:
        with transaction.atomic(using=connection.alias):
            self.ensure_ledger_row()
            one(connection, self.fence_at_least_statement, [value])

    def renew(
        self, connection: Any, params: Mapping[str, Any], milliseconds: int | None
    ) -> Values | None:
        """Bounded by the connection's busy timeout, put back afterwards."""
        if milliseconds is None:
            return one(connection, self.renew_statement, params)
        previous = one(connection, "PRAGMA busy_timeout", [])
        try:
            return super().renew(connection, params, milliseconds)
        finally:
            if previous:
                self.bound_transaction(connection, int(previous[0]))

    def bound_transaction(self, connection: Any, milliseconds: int) -> None:
        ms = int(milliseconds)  # a number, never text: safe to write into the statement
        one(connection, f"PRAGMA busy_timeout = {ms}", [])
