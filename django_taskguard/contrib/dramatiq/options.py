"""The message options taskguard puts on a Dramatiq message, and how they are read back.

A slot travels in the message's options (``taskguard_slot``, ISO-8601 UTC), never in its
arguments: the actor's function is called with the arguments it was sent. A data
schedule's message also carries ``taskguard_schedule`` (``{"task_name": ..., "version":
n}``: the schedule's identity and the version that fired it, as ``decorators.SCHEDULE_KWARG``
does for django.tasks). Dramatiq keeps a message's options through its retries and
redeliveries, so every attempt of a message claims the slot it was sent for. A message the
worker glue put back (it met a live attempt of its slot) carries ``taskguard_deferred``; one
that ``backfill --enqueue`` sent carries ``taskguard_backfill`` (no lateness policy applies).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from ... import schedules
from ...decorating import validate_task_name
from ...decorators import backfill_enqueued
from ...exceptions import TaskGuardError

SLOT_OPTION = "taskguard_slot"
SCHEDULE_OPTION = "taskguard_schedule"
# Sent by ``backfill --enqueue``: an operator's backfill, to which no lateness policy applies.
BACKFILL_OPTION = "taskguard_backfill"
# How often the worker glue put the message back (a copy that met a live attempt).
DEFERRED_OPTION = "taskguard_deferred"


def message_options(
    slot: datetime | str, *, schedule: str | None = None, version: int | None = None
) -> dict[str, Any]:
    """The options that send a guarded actor's message for ``slot`` (an aware datetime or
    an ISO-8601 string with an offset); ``schedule`` and ``version``: a data schedule's
    identity (``target[name]``) and version, given together.

    ``actor.send_with_options(args=..., **message_options(slot))``.
    """
    options: dict[str, Any] = {SLOT_OPTION: schedules.normalize_slot(slot).isoformat()}
    if backfill_enqueued():
        options[BACKFILL_OPTION] = True
    if (schedule is None) != (version is None):
        raise TaskGuardError("give a data schedule's schedule= and version= together, or neither")
    if schedule is not None and version is not None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise TaskGuardError(f"version= must be a whole number from 1, not {version!r}")
        options[SCHEDULE_OPTION] = {"task_name": validate_task_name(schedule), "version": version}
    return options


def schedule_of(options: Mapping[str, Any]) -> tuple[str, int] | None:
    """A message's data schedule (identity, version), or None when it carries none."""
    carried = options.get(SCHEDULE_OPTION)
    if carried is None:
        return None
    try:
        return str(carried["task_name"]), int(carried["version"])
    except (TypeError, KeyError, ValueError):
        raise TaskGuardError(
            f"the {SCHEDULE_OPTION} option must be {{'task_name': ..., 'version': n}}, "
            f"not {carried!r}"
        ) from None


def deferrals_of(options: Mapping[str, Any]) -> int:
    """How many times the message was put back (``DEFERRED_OPTION``)."""
    value = options.get(DEFERRED_OPTION) or 0
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def retries_of(options: Mapping[str, Any]) -> int:
    """How many times Dramatiq's ``Retries`` middleware has retried the message so far."""
    value = options.get("retries") or 0
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def message_key(message_id: str, retries: int) -> str:
    """The message's identity for ``guard.begin``: its id and retry count.

    ``Retries`` re-enqueues the same message id with one more retry; a redelivery (its
    worker died, or it was delivered twice) keeps both. So a stale copy of an earlier
    delivery is never taken for the retry that an attempt asked for.
    """
    return f"{message_id}/{retries}"
