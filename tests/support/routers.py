"""Database routers of the test project."""

from __future__ import annotations

from typing import Any

MIGRATED = ("default", "ledger")


class MigrateDefaultOnly:
    """Keep migrations (``makemigrations --check``) away from the test-only aliases."""

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return None if db in MIGRATED else False


class LedgerRouter:
    """Send taskguard's models to the "ledger" database, as a project with one would."""

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return "ledger" if model._meta.app_label == "taskguard" else None

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return "ledger" if model._meta.app_label == "taskguard" else None

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        if app_label == "taskguard":
            return db == "ledger"
        return None
