"""Keep migration commands (``makemigrations --check``) away from the test-only aliases."""

from __future__ import annotations

from typing import Any


class MigrateDefaultOnly:
    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return None if db == "default" else False
