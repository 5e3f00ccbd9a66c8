"""Run a guarded function, or a Celery task that wraps one, now, in this process."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..decorating import dotted_name, guarded_policy
from ..exceptions import TaskGuardError
from ..schedules import normalize_slot


@dataclass(frozen=True)
class Target:
    """What a test named: the guarded function, the Celery task around it (if any), and
    the task name its runs are recorded under."""

    guarded: Any  # made by @once_per_schedule or @once_per_key
    celery_task: Any  # the Celery task whose body it is, or None
    name: str

    @property
    def keyed(self) -> bool:
        return callable(getattr(self.guarded, "key_of", None))


def target_of(task: Any) -> Target:
    """The guarded function behind ``task`` (itself, or a Celery task's body), and its name.

    The name is the one a call records when no beat entry names the schedule:
    ``name=``, else the Celery task's name, else the function's dotted path.
    """
    if guarded_policy(task) is not None:
        return Target(task, None, getattr(task, "task_name", None) or dotted_name(task))
    # A Celery task: ``__wrapped__`` is the function given to @task (bound, with bind=True).
    body = getattr(task, "__wrapped__", None)
    if (
        body is not None
        and guarded_policy(body) is not None
        and callable(getattr(task, "apply", None))
    ):
        return Target(body, task, getattr(body, "task_name", None) or str(task.name))
    raise TaskGuardError(
        f"{task!r} is not a guarded function: give a function decorated with "
        f"@once_per_schedule or @once_per_key, or a Celery task whose body is one"
    )


def run_for_slot(task: Any, slot: datetime | str, /, *args: Any, **kwargs: Any) -> Any:
    """Run ``task`` for ``slot`` now, in this process, through the real guard.

    ``task`` is a ``@once_per_schedule`` function or a Celery task whose body is one;
    ``slot`` an aware datetime (or an ISO-8601 string), as a beat would stamp it. A
    function runs through its ``.run_for_slot``; a Celery task through ``task.apply()``
    with the slot in its message headers, as a worker would run the beat's message
    (``self.request``, retries and the Celery task name included).

    Returns what the function returned, or ``None`` when the slot was taken already (a
    duplicate, counted). The function's exception propagates.
    """
    target = target_of(task)
    if target.keyed:
        raise TaskGuardError(
            f"{target.name!r} is an @once_per_key function: run it with run_for_key(), "
            f"its key comes from its arguments"
        )
    if target.celery_task is None:
        return target.guarded.run_for_slot(slot, *args, **kwargs)
    # Imported here: the Celery glue is an integration, needed only for a Celery task.
    from ..contrib.celery.headers import SLOT_HEADER

    headers = {SLOT_HEADER: normalize_slot(slot).isoformat()}
    return target.celery_task.apply(args, kwargs, headers=headers, throw=True).get()


def run_for_key(task: Any, /, *args: Any, **kwargs: Any) -> Any:
    """Run ``task`` with these arguments now, in this process, through the real guard.

    ``task`` is an ``@once_per_key`` function or a Celery task whose body is one; its
    key is built from the arguments (``task.key_of(*args, **kwargs)`` for a function).
    A Celery task runs through ``task.apply()``, as a worker would run its message.

    Returns what the function returned, or ``None`` when the key was taken already (or
    its stored result, with ``return_result=True``). The function's exception propagates.
    """
    target = target_of(task)
    if not target.keyed:
        raise TaskGuardError(
            f"{target.name!r} is an @once_per_schedule function: run it with "
            f"run_for_slot(task, slot)"
        )
    if target.celery_task is None:
        return target.guarded(*args, **kwargs)
    return target.celery_task.apply(args, kwargs, throw=True).get()
