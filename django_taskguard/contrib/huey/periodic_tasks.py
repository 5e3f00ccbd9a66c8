"""``periodic()``: Huey periodic tasks that every consumer may run, once per slot.

``@huey.periodic_task(crontab(...))`` is enqueued by every consumer that has periodic
tasks on, so Huey's advice is to run exactly one such consumer (``-n`` on the others).
:func:`periodic` replaces it: every consumer's scheduler enqueues the task stamped with
the slot it is due for (from the ``@once_per_schedule`` under it), and the ledger lets
one copy run each slot; the others are counted duplicates.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from huey.api import PeriodicTask
from huey.consumer import Scheduler

from ...data_firing import slots_after
from ...decorating import guarded_policy
from ...decorators import SLOT_KWARG
from ...exceptions import InvalidSchedule
from ...logfields import log_fields
from .worker import install

logger = logging.getLogger("taskguard.huey")

RESERVED = ("task_base", "validate_datetime")

_lock = threading.Lock()
_stamped: dict[str, datetime] = {}  # task name -> the last slot this process stamped


def periodic(huey: Any, **options: Any) -> Callable[[Any], Any]:
    """Make a Huey periodic task of a ``@once_per_schedule(cron=|every=)`` function.

    Goes on top, in place of ``@huey.periodic_task(...)``; ``options`` are
    ``huey.task``'s (``retries=``, ``retry_delay=``, ``priority=``, ``name=``, ...)::

        @periodic(huey, retries=2)
        @once_per_schedule(cron="*/5 * * * *")
        def report(): ...

    Each time a consumer's scheduler looks at its periodic tasks (once a minute), it
    enqueues this one when a slot of the schedule came due since it last did, with that
    slot in the task's keyword arguments (and, after a scheduler that fell behind, the
    slots between, as ``run_schedules`` fires them). Any number of consumers may do so. A schedule
    with slots closer together than that minute is refused: ``run_schedules --enqueue``
    sends those.
    """
    reserved = sorted(set(options) & set(RESERVED))
    if reserved:
        raise InvalidSchedule(f"periodic() sets {', '.join(reserved)} itself")
    install(huey)

    def decorate(func: Any) -> Any:
        schedule = getattr(func, "schedule", None)
        if guarded_policy(func) is None or schedule is None:
            raise InvalidSchedule(
                f"periodic() goes above @once_per_schedule(cron=...) or (every=...), whose "
                f"schedule gives the slots; got {func!r}"
            )
        _refuse_frequent(func.task_name, schedule)
        stamp = _stamper(huey, func, schedule)
        return huey.task(task_base=PeriodicTask, validate_datetime=stamp, **options)(func)

    return decorate


def check_period() -> timedelta:
    """How often a Huey consumer's scheduler looks at periodic tasks."""
    return timedelta(seconds=Scheduler.periodic_task_seconds)


def _refuse_frequent(task_name: str, schedule: Any) -> None:
    now = datetime.now(timezone.utc)
    period = check_period()
    if schedule.count_between(now, now + period - timedelta(microseconds=1), 2) > 1:
        raise InvalidSchedule(
            f"{task_name!r} has slots closer together than a Huey consumer looks at periodic "
            f"tasks ({period.total_seconds():g} s): fire it with run_schedules --enqueue "
            f"and @huey.task() instead of periodic()"
        )


def _stamper(huey: Any, func: Any, schedule: Any) -> Callable[[Any, datetime], bool]:
    task_name, policy = func.task_name, func.policy

    def validate_datetime(task: Any, timestamp: datetime) -> bool:
        """Huey's question "enqueue it now?": yes when a slot came due since this process
        last said yes (or, the first time, within one check period), the slot stamped on
        the task. Slots that came due between two looks (a scheduler that fell behind)
        are sent too, as ``run_schedules`` would: those still within the grace under
        ``catchup="latest"``, the newest ``max_catchup`` otherwise."""
        now = timestamp.replace(tzinfo=timezone.utc) if huey.utc else timestamp.astimezone()
        latest = schedule.latest_slot(now)
        with _lock:
            last = _stamped.get(task_name)
            if last is None:
                due = [latest] if now - latest < check_period() else []
            else:
                due = slots_after(schedule, policy, last, latest) if latest > last else []
            if not due:
                return False
            _stamped[task_name] = latest
        if policy.catchup == "latest":
            due = [slot for slot in due[:-1] if now - slot <= policy.grace] + [latest]
        for slot in due[:-1]:
            _send(huey, type(task)(kwargs={SLOT_KWARG: slot.isoformat()}), task_name, slot)
        task.kwargs[SLOT_KWARG] = due[-1].isoformat()
        return True

    return validate_datetime


def _send(huey: Any, task: Any, task_name: str, slot: datetime) -> None:
    """Enqueue a passed slot; never raises (an exception here would end the consumer's
    scheduler): a slot not sent is recorded ``missed`` by the sweep unless it runs."""
    try:
        huey.enqueue(task)
    except Exception:
        logger.exception(
            "taskguard %s slot %s could not be sent to Huey; the sweep records it missed "
            "unless another consumer sends it",
            task_name,
            slot.isoformat(),
            extra=log_fields("huey.send_failed", task=task_name, slot=slot),
        )


def forget() -> None:
    """Forget the slots this process stamped (tests: a fresh consumer)."""
    with _lock:
        _stamped.clear()
