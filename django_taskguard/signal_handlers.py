"""Receivers taskguard connects: the fence source moved past fences that arrive with
imported rows, the ledger's row after ``migrate``, the check-ins (``checkins.receivers``,
idle unless ``CHECKINS`` is set); and the startup cleanup, which ``contrib.celery``
connects to Celery's ``worker_ready``."""

from __future__ import annotations

import logging
from typing import Any

from . import ledger
from .conf import taskguard_settings
from .logfields import log_fields

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
        logger.exception(
            "taskguard startup cleanup failed", extra=log_fields("cleanup.startup_failed")
        )
        return
    finally:
        # The Celery main process forks pool children later: leave no
        # connection behind for them to inherit.
        ledger.settle_connection()
    if count:
        logger.warning(
            "taskguard startup cleanup abandoned %d run(s) of dead processes",
            count,
            extra=log_fields("cleanup.startup", state="abandoned"),
        )


def fence_imported(
    sender: Any, instance: Any, raw: bool = False, using: str = "", **kwargs: Any
) -> None:
    """A ``TaskRun`` loaded as it is (``loaddata``): never hand out its fence again."""
    if raw and instance.fence is not None and using == ledger.alias():
        ledger.fence_at_least(int(instance.fence))


def keep_ledger_row(using: str = "", **kwargs: Any) -> None:
    """After ``migrate`` or ``flush``: the ledger's own row is there, identity unchanged."""
    if using == ledger.alias():
        ledger.ensure_ledger_row(using)


def connect(app_config: Any) -> None:
    """Connect the receivers that need no optional package."""
    from django.db.models.signals import post_migrate, post_save

    from .checkins.receivers import connect as connect_checkins
    from .models import TaskRun

    connect_checkins()
    post_save.connect(fence_imported, sender=TaskRun, dispatch_uid="taskguard.fence_imported")
    post_migrate.connect(keep_ledger_row, sender=app_config, dispatch_uid="taskguard.ledger_row")
