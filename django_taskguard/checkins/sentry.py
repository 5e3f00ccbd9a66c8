"""Sentry Crons, through the site's own initialised ``sentry_sdk`` client.

``sentry_sdk.crons.capture_checkin`` with the check-in id, ``in_progress`` at the start,
``ok`` or ``error`` at the end. ``sentry_sdk.crons.consts.MonitorStatus`` has these three
only (no ``missed`` or ``timeout`` a client may send): a missed or abandoned slot is sent as
``error``, with its own id for a missed slot. ``monitor_config`` comes from the registered
schedule (:func:`.monitors.schedule_of`), so Sentry creates or updates the monitor; a
schedule Sentry cannot express (an interval under a minute) sends none.

Delivery is Sentry's transport's (its own queue and retries): what this module sees failing
is a missing client (``sentry_sdk.init`` not called in this process) or an event the client
dropped (``capture_event`` returned no id).
"""

from __future__ import annotations

import logging
from typing import Any

from ..logfields import log_fields
from . import monitors
from .events import START, CheckIn
from .http import SendError

logger = logging.getLogger("taskguard.checkins")

_said_no_client = False


def send(
    options: dict[str, Any], checkin: CheckIn, checkin_id: str, slug: str, timeout: float
) -> None:
    global _said_no_client
    import sentry_sdk
    from sentry_sdk.crons import capture_checkin

    if not sentry_sdk.get_client().is_active():
        if not _said_no_client:
            _said_no_client = True
            logger.warning(
                "taskguard check-ins: TASKGUARD['CHECKINS']['sentry'] is set but sentry_sdk "
                "has no client in this process (call sentry_sdk.init); check-ins not sent",
                extra=log_fields("checkin.no_client"),
            )
        raise SendError("no sentry_sdk client (sentry_sdk.init was not called)")
    status = "in_progress" if checkin.event == START else "ok" if checkin.ok else "error"
    sent = capture_checkin(
        monitor_slug=slug,
        check_in_id=checkin_id.replace("-", ""),
        status=status,
        duration=None if checkin.event == START else checkin.duration,
        monitor_config=config(options, checkin.task),  # type: ignore[arg-type]
    )
    if sent is None:
        raise SendError("sentry_sdk dropped the check-in (capture_event returned no id)")


def config(options: dict[str, Any], task_name: str) -> dict[str, Any] | None:
    """The ``monitor_config`` sent with every check-in of ``task_name`` (None: none)."""
    try:
        schedule = monitors.schedule_of(task_name)
    except Exception as exc:  # the ledger away: the check-in goes, without a schedule
        logger.warning(
            "taskguard check-ins: the schedule of %s not read (%s)",
            task_name,
            exc,
            extra=log_fields("checkin.schedule_unread", task=task_name, reason=exc),
        )
        return None
    if schedule is None:
        return None
    config = dict(schedule)
    for key in ("max_runtime_minutes", "failure_issue_threshold", "recovery_threshold"):
        if key in options:
            config[key.removesuffix("_minutes")] = options[key]
    return config
