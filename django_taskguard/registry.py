"""The schedule registry: every ``@once_per_schedule(cron=|every=|schedule=)`` function.

The decorator records itself here at decoration time (memory only: nothing is
written at import or app-ready). :func:`discover` imports the modules that declare
schedules (``TASKGUARD["SCHEDULE_MODULES"]`` and every installed app's ``tasks`` and
``jobs`` modules, as Celery autodiscovers); :func:`sync` then saves what it found in
``TaskSchedule`` (``run_schedules``, ``cleanup_locks``, ``pause_task`` call it), where
the missed-slot sweep and the admin read it.

An app's ``tasks``/``jobs`` module that cannot be imported (a third-party app whose
Celery tasks need an extra nobody installed) does not stop discovery when its error is
one the caller tolerates: it is skipped and named in :func:`unimported`. Nothing is
lost by that: :func:`sync` marks the schedules the code no longer declares removed only
after a complete discovery, so a schedule the skipped module declared keeps its row, its
pause, and its missed-slot sweep. A module named in
``SCHEDULE_MODULES`` is never skipped: the user asked for it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from importlib import import_module
from types import ModuleType
from typing import Any

from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone
from django.utils.module_loading import module_has_submodule
from django.utils.timezone import get_default_timezone_name

from .conf import taskguard_settings
from .ledger import schedules as store
from .logfields import log_fields
from .models import ScheduleSource
from .policy import Policy
from .schedules import Schedule, describe

AUTODISCOVER = ("tasks", "jobs")

logger = logging.getLogger("taskguard.registry")


@dataclass(frozen=True)
class Entry:
    """One registered schedule.

    ``fire(slot)`` runs one slot through the guard as a scheduler's call: the
    catch-up policy applies (``catchup="none"`` records a late slot ``missed``); it
    returns True when the body ran in this call.
    ``run_for_slot(slot)`` is the decorated function's own (an operator's call:
    no lateness policy), for backfill.
    ``enqueue(slot)``: set when a task queue's task wraps the function (a django.tasks
    ``@task()`` above it, see :data:`QUEUE_FINDERS`): hands the slot to that task's
    backend and says what it made there (``run_schedules --enqueue``).
    """

    task_name: str
    schedule: Schedule
    policy: Policy
    function: str
    fire: Callable[[datetime], bool]
    run_for_slot: Callable[[datetime], Any]
    func: Callable[[], Any]  # the undecorated function (a batch claim runs it)
    source: str = ScheduleSource.FUNCTION
    named: bool = False  # the decorator was given name=
    enqueue: Callable[[datetime], str] | None = None

    def record(self) -> store.Record:
        policy = self.policy
        return store.Record(
            task_name=self.task_name,
            source=self.source,
            function=self.function,
            catchup=policy.catchup,
            grace=policy.grace,
            max_catchup=policy.max_catchup,
            pause_after_failures=policy.pause_after_failures,
            late_after=policy.late_after,
            default_zone=get_default_timezone_name(),
            declared_in=getattr(self.func, "__module__", None) or "",
            **describe(self.schedule),
        )


@dataclass(frozen=True)
class Queued:
    """A task queue's task object that wraps a decorated function."""

    func: Any  # the decorated function the task calls
    enqueue: Callable[[datetime], str]  # hand one slot to the queue; say what it made


# Recognisers of a task queue's task objects, asked about every attribute of the modules
# that :func:`discover` imports (``contrib.tasks`` registers django.tasks'): a Queued when
# the attribute is a task that wraps a decorated function, else None.
QUEUE_FINDERS: list[Callable[[Any], Queued | None]] = []

_lock = threading.Lock()
_entries: dict[str, Entry] = {}
_by_wrapper: dict[int, str] = {}  # id(decorated function) -> task name


def _after_fork() -> None:
    """A forked child's lock is free: held at the fork by another thread of its parent (an
    upkeep looking up a data schedule's target), it would be held in the child for good."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def register(entry: Entry, wrapper: Any) -> None:
    """Record a decorated function's schedule (at decoration time; memory only)."""
    with _lock:
        known = _entries.get(entry.task_name)
        if known is not None and known.function != entry.function:
            # Not an error at import time (a test that redefines a job, a module imported
            # under two names): the newest wins, and it is said.
            logger.warning(
                "taskguard: two schedules are named %r (%s, then %s); the latest is kept. "
                "Give one of them another name=",
                entry.task_name,
                known.function,
                entry.function,
                extra=log_fields("schedule.duplicate_name", task=entry.task_name),
            )
        _entries[entry.task_name] = entry
        _by_wrapper[id(wrapper)] = entry.task_name


def unregister(task_name: str) -> None:
    """Forget a schedule (tests, and code that builds schedules at run time)."""
    with _lock:
        _entries.pop(task_name, None)
        for key in [key for key, name in _by_wrapper.items() if name == task_name]:
            del _by_wrapper[key]


def entries() -> dict[str, Entry]:
    """The schedules registered in this process so far, by task name."""
    with _lock:
        return dict(_entries)


@dataclass(frozen=True)
class Unimported:
    """An app's ``tasks``/``jobs`` module that :func:`discover` could not import."""

    module: str
    error: BaseException

    def __str__(self) -> str:
        error = f"{type(self.error).__name__}: {self.error}"
        if isinstance(self.error, ImportError):
            said = f"{self.module} could not be imported ({error})"
        else:
            said = f"{self.module} raised {error} when imported"
        return f"{said}; the schedules it declares are unknown to this process"


_unimported: list[Unimported] = []


def discover(
    tolerate: tuple[type[Exception], ...] = (ImportError,), stop_if_declared: bool = False
) -> dict[str, Entry]:
    """Import the modules that declare schedules; return every registered schedule.

    An app module whose import raises one of ``tolerate`` (default: a missing
    dependency) is skipped, see :func:`unimported`, and the schedules it registered
    before the failing line are forgotten; any other error is ``ImproperlyConfigured``
    naming the module. So is a tolerated one when ``stop_if_declared`` and the module is
    known to declare schedules (:func:`_stop_if_declared`).
    """
    modules = [_import(path) for path in taskguard_settings.SCHEDULE_MODULES]
    skipped: list[Unimported] = []
    for config in apps.get_app_configs():
        for name in AUTODISCOVER:
            if module_has_submodule(config.module, name):
                path = f"{config.name}.{name}"
                try:
                    modules.append(import_module(path))
                except Exception as exc:
                    left = _forget_module(path)
                    if not isinstance(exc, tolerate):
                        raise ImproperlyConfigured(str(Unimported(path, exc))) from exc
                    if stop_if_declared:
                        _stop_if_declared(path, exc, left)
                    skipped.append(Unimported(path, exc))
    with _lock:
        _unimported[:] = skipped
    _find_celery_tasks(modules)
    _find_queued(modules)
    return entries()


def _forget_module(path: str) -> list[str]:
    """Unregister what a module that failed half-way registered; return their names."""
    with _lock:
        left = [name for name, entry in _entries.items() if _under(entry.function, path)]
    for name in left:
        unregister(name)
    return left


def _under(function: str, module: str) -> bool:
    return function.startswith(f"{module}.")


def _stop_if_declared(path: str, error: Exception, left: list[str]) -> None:
    """A module known to declare schedules (it registered one before failing, or a saved
    schedule's function is in it) is the project's own: a broken deploy, not a missing
    extra. Going on would fire part of it and record the rest ``missed``."""
    declared = left + [name for name in store.functions_under(path) if name not in left]
    if declared:
        raise ImproperlyConfigured(
            f"{path} could not be imported ({type(error).__name__}: {error}); it declares "
            f"the schedules {', '.join(sorted(declared))}, so this command does not start "
            "without it. Fix the import (once it imports, a schedule it no longer declares is "
            "marked removed, and can be retired in the admin)"
        ) from error


def unimported() -> list[Unimported]:
    """The app modules the latest :func:`discover` skipped, with their errors."""
    with _lock:
        return list(_unimported)


def sync(
    tolerate: tuple[type[Exception], ...] = (ImportError,),
    stop_if_declared: bool = False,
    *,
    mark_removed: bool = False,
    say_conflicts: bool = True,
) -> dict[str, Entry]:
    """:func:`discover`, then save every schedule found in ``TaskSchedule``.

    ``mark_removed``: also mark removed the function schedules this process does not
    declare. Only the processes that fire them ask for it (``run_schedules``, ``backfill``):
    an operator's command or the upkeep, in a process that may import less (another
    service sharing the database, an old copy during a deploy), would flap them.
    ``say_conflicts``: log the zone conflicts (the upkeep, every interval, does not)."""
    found = discover(tolerate, stop_if_declared)
    if say_conflicts:
        _say_zone_conflicts(found.keys())
    now = timezone.now()
    store.save([entry.record() for entry in found.values()], now)
    if mark_removed:
        _mark_removed(found.keys(), now)
    return found


def _mark_removed(declared: Collection[str], now: datetime) -> None:
    """Function schedules (a Celery task's too: no beat entry) the code no longer declares
    are marked removed; declared again, they are not. Only after a complete discovery: a
    skipped module's schedules are unknown to this process, not removed."""
    if unimported():
        return
    sources = (ScheduleSource.FUNCTION, ScheduleSource.CELERY)
    for name in store.mark_removed(declared, sources, now, entry=""):
        logger.warning(
            "taskguard: schedule %s is no longer declared by the code: marked removed (not "
            "swept nor judged); retire it in the admin to delete its row, its runs stay",
            name,
            extra=log_fields("schedule.removed", task=name),
        )


def _say_zone_conflicts(registered: Collection[str]) -> None:
    """A cron without its own zone runs in Django's TIME_ZONE: copies that disagree on it
    fire different instants. Said before this copy's save records its own zone (check
    ``taskguard.W020`` says it too)."""
    zone = get_default_timezone_name()
    for task_name, theirs in store.zone_conflicts(zone, registered):
        logger.error(
            "taskguard: schedule %s was saved by a copy whose TIME_ZONE is %r; this copy's is "
            "%r, so the two fire its cron at different instants. Give every copy the same "
            "TIME_ZONE, or the cron its own time zone: @once_per_schedule(cron=..., "
            "time_zone='Europe/Berlin'), or define_schedule(..., time_zone=...)",
            task_name,
            theirs,
            zone,
            extra=log_fields("schedule.zone_conflict", task=task_name),
        )


def _import(path: str) -> ModuleType:
    try:
        return import_module(path)
    except Exception as exc:
        _forget_module(path)
        raise ImproperlyConfigured(schedule_module_problem(path, exc)) from exc


def schedule_module_problem(path: str, error: BaseException) -> str:
    """What is wrong with a module named in ``SCHEDULE_MODULES`` whose import raised."""
    if isinstance(error, ImportError):
        return f"TASKGUARD['SCHEDULE_MODULES'] names {path!r}, which cannot be imported: {error}"
    return (
        f"TASKGUARD['SCHEDULE_MODULES'] names {path!r}, which raised "
        f"{type(error).__name__} when imported: {error}"
    )


def import_problems() -> list[tuple[str, BaseException]]:
    """The modules of schedules whose import fails, with their errors (checks E026, E027):
    every module named in ``SCHEDULE_MODULES`` that raises anything, and every installed
    app's ``tasks``/``jobs`` module whose decorators refuse their arguments
    (``InvalidSchedule``; its other errors, a missing extra most often, are the commands'
    to judge, see :func:`discover`). What a failing module registered is forgotten."""
    from .exceptions import InvalidSchedule

    found: list[tuple[str, BaseException]] = []
    for path in taskguard_settings.SCHEDULE_MODULES:
        try:
            import_module(path)
        except Exception as exc:
            _forget_module(path)
            found.append((path, exc))
    for config in apps.get_app_configs():
        for name in AUTODISCOVER:
            path = f"{config.name}.{name}"
            if path in taskguard_settings.SCHEDULE_MODULES:
                continue
            try:
                if module_has_submodule(config.module, name):
                    import_module(path)
            except InvalidSchedule as exc:
                _forget_module(path)
                found.append((path, exc))
            except Exception:
                _forget_module(path)
    return found


def _find_celery_tasks(modules: Iterable[ModuleType]) -> None:
    """A decorated function that a Celery task wraps is fired by a beat, not by
    ``run_schedules``; it runs under the Celery task's name unless it was given name=."""
    for module in modules:
        for value in list(vars(module).values()):
            run = getattr(value, "run", None)
            task_name = getattr(value, "name", None)
            found = _by_wrapper.get(id(getattr(run, "__func__", run)))
            if found is None or not isinstance(task_name, str) or not callable(value):
                continue
            with _lock:
                entry = _entries.pop(found)
                celery = replace(
                    entry,
                    source=ScheduleSource.CELERY,
                    task_name=entry.task_name if entry.named else task_name,
                )
                _entries[celery.task_name] = celery
                for key, name in list(_by_wrapper.items()):
                    if name == found:
                        _by_wrapper[key] = celery.task_name


def _find_queued(modules: Iterable[ModuleType]) -> None:
    """A decorated function that a task queue's task wraps can be handed to its queue."""
    if not QUEUE_FINDERS:
        return
    for module in modules:
        for value in list(vars(module).values()):
            for finder in QUEUE_FINDERS:
                queued = finder(value)
                found = _by_wrapper.get(id(queued.func)) if queued is not None else None
                if queued is None or found is None:
                    continue
                with _lock:
                    entry = _entries.get(found)
                    if entry is not None and entry.source == ScheduleSource.FUNCTION:
                        _entries[found] = replace(entry, enqueue=queued.enqueue)
