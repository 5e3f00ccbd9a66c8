"""django.tasks glue: guarded functions as django.tasks tasks, with their slot carried along.

``@task()`` goes on top, the guard under it, so that the worker calls the guarded
function::

    @task()
    @once_per_schedule(every=timedelta(minutes=5))
    def sync(): ...

django.tasks (Django 6.0+) and its backport ``django_tasks`` (older Django) are both
recognised; neither is imported until a schedule is looked for. A slot travels with an
enqueued task as the keyword argument ``_taskguard_slot`` (``decorators.SLOT_KWARG``;
django.tasks has no message headers), which the guarded function takes off and claims:
a task enqueued for 12:00:01 that a worker runs at 12:00:05 claims 12:00:01.
``@once_per_key`` needs nothing: its key is built from the arguments, which travel.
"""

from __future__ import annotations

import functools
from datetime import datetime
from importlib import import_module
from typing import Any

from .. import data_schedules, registry
from ..decorating import guarded_policy
from ..decorators import SLOT_KWARG, carrying_slot
from ..exceptions import TaskGuardError
from ..models import TargetKind

__all__ = ["SLOT_KWARG", "enqueue_for_slot", "register", "task_classes"]

MODULES = ("django.tasks.base", "django_tasks.base")


@functools.lru_cache(maxsize=1)
def task_classes() -> tuple[type, ...]:
    """The django.tasks ``Task`` classes that can be imported here (Django's, the backport's)."""
    found = []
    for name in MODULES:
        try:
            found.append(import_module(name).Task)
        except ImportError:
            continue
    return tuple(found)


def scheduled_function(value: Any) -> Any:
    """The ``@once_per_schedule`` function a django.tasks task wraps, or None."""
    classes = task_classes()
    if not classes or not isinstance(value, classes):
        return None
    func = getattr(value, "func", None)
    if guarded_policy(func) is None or not callable(getattr(func, "run_for_slot", None)):
        return None
    return func


def enqueue_for_slot(task: Any, slot: datetime | str, /, *args: Any, **kwargs: Any) -> Any:
    """Enqueue ``task`` (``@task()`` over ``@once_per_schedule``) to run for ``slot``.

    ``slot`` is an aware datetime or an ISO-8601 string with an offset. It travels with
    the task; the worker's call claims it (not the slot current when it runs). Returns
    the backend's ``TaskResult``.
    """
    if scheduled_function(task) is None:
        raise TaskGuardError(
            f"enqueue_for_slot() takes a django.tasks task whose function is decorated with "
            f"@once_per_schedule (@task() on top); got {task!r}"
        )
    return task.enqueue(*args, **carrying_slot(kwargs, slot))


def _enqueue(task: Any, slot: datetime) -> str:
    result = enqueue_for_slot(task, slot)
    return f"django.tasks result {result.id} on backend {task.backend!r}"


def _find(value: Any) -> registry.Queued | None:
    func = scheduled_function(value)
    if func is None:
        return None
    return registry.Queued(func=func, enqueue=functools.partial(_enqueue, value))


def _target(target: str, found: Any) -> data_schedules.Target | None:
    """A data schedule's target that is a django.tasks task (its function guarded)."""
    classes = task_classes()
    if not classes or not isinstance(found, classes):
        return None
    func = getattr(found, "func", None)
    return data_schedules.guarded_target(
        target, TargetKind.DJANGO_TASKS, func, found, func, decorator="@task()"
    )


def register() -> None:
    """Let ``registry.discover`` find schedules wrapped by django.tasks tasks, and data
    schedules name them (idempotent)."""
    if _find not in registry.QUEUE_FINDERS:
        registry.QUEUE_FINDERS.append(_find)
    if _target not in data_schedules.BY_OBJECT:
        data_schedules.BY_OBJECT.append(_target)
