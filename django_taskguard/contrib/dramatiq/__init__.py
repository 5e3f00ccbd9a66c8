"""Dramatiq glue: guarded actors claim the slot their message was sent for.

- :mod:`.options`: the message options (``taskguard_slot``, ``taskguard_schedule``) and a
  message's identity (id and retry count);
- :mod:`.middleware`: ``TaskguardMiddleware`` and the worker-side slot source, with
  ``Retries``' retries as attempts of one row;
- :mod:`.sending`: ``send_for_slot`` and the recogniser through which
  ``run_schedules --enqueue`` sends due slots to actors.

Nothing here is imported unless Dramatiq is installed (``pip install
"django-taskguard[dramatiq]"``); the app registers it when it is (``apps.py``).
"""

from __future__ import annotations

from ...decorating import SLOT_SOURCES
from .middleware import TaskguardMiddleware, classify_raise, dramatiq_call_context
from .options import SCHEDULE_OPTION, SLOT_OPTION, message_key, message_options
from .sending import register as register_sending
from .sending import scheduled_function, send_for_slot

__all__ = [
    "SCHEDULE_OPTION",
    "SLOT_OPTION",
    "TaskguardMiddleware",
    "classify_raise",
    "dramatiq_call_context",
    "message_key",
    "message_options",
    "register",
    "scheduled_function",
    "send_for_slot",
]


def register() -> None:
    """Wire Dramatiq in (idempotent): guarded actors find their slot in the message being
    processed, and ``run_schedules --enqueue`` finds the schedules actors wrap."""
    if dramatiq_call_context not in SLOT_SOURCES:
        SLOT_SOURCES.append(dramatiq_call_context)
    register_sending()
