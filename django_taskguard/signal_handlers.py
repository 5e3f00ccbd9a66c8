"""Receivers taskguard connects: startup cleanup when a Celery worker starts."""

from __future__ import annotations

import logging
from typing import Any

from . import ledger
from .conf import taskguard_settings

logger = logging.getLogger("taskguard.cleanup")


def run_startup_cleanup(**kwargs: Any) -> None:
    """Abandon this host's runs whose process is gone, if ``STARTUP_CLEANUP`` is on.

    Never raises: a worker must start even if the database is briefly away
    (``cleanup_locks`` catches the same runs once their lease has expired).
    """
    if not taskguard_settings.STARTUP_CLEANUP:
        return
    from .cleanup import startup_cleanup

    try:
        count = startup_cleanup()
    except Exception:
        logger.exception("taskguard startup cleanup failed")
        return
    finally:
        # The Celery main process forks pool children later: leave no
        # connection behind for them to inherit.
        ledger.settle_connection()
    if count:
        logger.warning("taskguard startup cleanup abandoned %d run(s) of dead processes", count)


def connect_celery() -> None:
    """Run the startup cleanup when a Celery worker is ready (if Celery is installed)."""
    try:
        from celery.signals import worker_ready
    except ImportError:  # pragma: no cover - celery is an extra
        return
    worker_ready.connect(run_startup_cleanup, dispatch_uid="taskguard.startup_cleanup")
