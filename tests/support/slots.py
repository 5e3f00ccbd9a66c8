"""The slots tests use: recent ones (inside any retention horizon), the same in every process.

Guarded calls refuse slots older than ``PRUNE_AFTER_DAYS`` (their rows may have been
pruned), so tests cannot use fixed dates. The base is three days ago at midnight UTC,
chosen once per test session and handed to child processes in the environment, so
that a test running across midnight still agrees with its children.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

ENV = "TASKGUARD_TEST_BASE_SLOT"


def _base() -> datetime:
    given = os.environ.get(ENV)
    if given:
        return datetime.fromisoformat(given)
    now = datetime.now(timezone.utc) - timedelta(days=3)
    base = now.replace(hour=0, minute=0, second=0, microsecond=0)
    os.environ[ENV] = base.isoformat()
    return base


BASE_SLOT = _base()
