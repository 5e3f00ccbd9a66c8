"""``@once_per_schedule``: run a function once per schedule slot across all instances."""

from __future__ import annotations

import dataclasses
import functools
import keyword
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, overload

from asgiref.sync import async_to_sync, iscoroutinefunction
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from . import coroutines, guard, ledger, registry, schedules
from .conf import late_after_delta, late_after_problem, lease_problem, taskguard_settings

# A slot source's hooks stay importable from here too (docs/architecture.md).
from .decorating import SLOT_SOURCES as SLOT_SOURCES
from .decorating import (
    USE_TZ_NEEDED,
    call_context,
    choose,
    dotted_name,
    note_guarded,
    note_on_stale,
    refuse_task_object,
    validate_task_name,
)
from .decorating import CallContext as CallContext
from .exceptions import InvalidSchedule, TaskGuardError
from .logfields import run_log_fields
from .policy import (
    DEFAULT_GRACE,
    DEFAULT_MAX_CATCHUP,
    Catchup,
    OnDuplicate,
    OnStale,
    Overlap,
    Policy,
)

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


# Bounds of the catch-up arguments, checked at decoration time.
GRACE_BOUNDS = (timedelta(seconds=1), timedelta(days=7))
MAX_CATCHUP_BOUNDS = (1, 10_000)
PAUSE_AFTER_FAILURES_BOUNDS = (1, 1_000)

# The keyword argument that carries a slot with an enqueued call (django.tasks has no
# message headers): ``contrib.tasks.enqueue_for_slot`` and ``run_schedules --enqueue`` add
# it, the guarded function takes it off before calling the user's and claims that slot.
logger = logging.getLogger("taskguard")
SLOT_KWARG = "_taskguard_slot"


# An operator's backfill (``manage.py backfill --enqueue``), carried with the slot: the call
# applies no lateness policy (``CallContext.backfill``, as a Celery message's
# ``taskguard_backfill`` header), as backfill's own runs do; popped like ``SLOT_KWARG``.
BACKFILL_KWARG = "_taskguard_backfill"
_backfilling: ContextVar[bool] = ContextVar("taskguard_backfilling", default=False)


@contextmanager
def backfilling() -> Iterator[None]:
    """The slots enqueued inside (through :func:`carrying_slot`) are an operator's backfill:
    they carry :data:`BACKFILL_KWARG`."""
    token = _backfilling.set(True)
    try:
        yield
    finally:
        _backfilling.reset(token)


def backfill_enqueued() -> bool:
    """Whether the slots enqueued now are an operator's backfill (inside :func:`backfilling`):
    an integration that carries a slot its own way (RQ's job meta, Dramatiq's message
    options) carries this with it too."""
    return _backfilling.get()


def carrying_slot(kwargs: dict[str, Any], slot: datetime | str) -> dict[str, Any]:
    """``kwargs`` with ``slot`` added as :data:`SLOT_KWARG` (normalized, ISO-8601 UTC): the
    keyword arguments of a call a task queue carries to the guarded function (each
    integration's ``enqueue_for_slot``), and :data:`BACKFILL_KWARG` inside
    :func:`backfilling`. The caller gives the slot as an argument, never as ``SLOT_KWARG``
    itself."""
    if SLOT_KWARG in kwargs or BACKFILL_KWARG in kwargs:
        raise TaskGuardError(f"give the slot as enqueue_for_slot()'s argument, not {SLOT_KWARG}=")
    carried = {**kwargs, SLOT_KWARG: schedules.normalize_slot(slot).isoformat()}
    if backfill_enqueued():
        carried[BACKFILL_KWARG] = True
    return carried


# A data schedule's enqueued call (django.tasks): ``{"task_name": ..., "version": n}``, the
# schedule's identity and version, popped like ``SLOT_KWARG``.
SCHEDULE_KWARG = "_taskguard_schedule"
# ``slot_kwarg=``: a keyword argument named by the user that carries the slot (django-q2's
# ``Schedule.intended_date_kwarg``); at most as long as django-q2's column for that name.
SLOT_KWARG_MAX_LENGTH = 100


class Guarded(Protocol[P, R]):
    """A guarded function: call it like the original; it returns None when not run."""

    task_name: str | None
    schedule: schedules.Schedule | None
    policy: Policy
    slot_kwarg: str | None
    __wrapped__: Callable[P, R]

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R | None: ...

    def run_for_slot(
        self, slot: datetime | str, /, *args: P.args, **kwargs: P.kwargs
    ) -> R | None: ...


class AsyncGuarded(Protocol[P, T]):
    """A guarded coroutine function: await it like the original; it returns None when not run."""

    task_name: str | None
    schedule: schedules.Schedule | None
    policy: Policy
    slot_kwarg: str | None
    __wrapped__: Callable[P, Awaitable[T]]

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, T | None]: ...

    def run_for_slot(
        self, slot: datetime | str, /, *args: P.args, **kwargs: P.kwargs
    ) -> Coroutine[Any, Any, T | None]: ...


class ScheduleDecorator(Protocol):
    """What ``@once_per_schedule(...)`` returns: it guards a function or a coroutine function."""

    # A coroutine function matches both; the first wins (mypy asks to be told).
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: Callable[P, Coroutine[Any, Any, T]], /
    ) -> AsyncGuarded[P, T]: ...

    @overload
    def __call__(self, func: Callable[P, R], /) -> Guarded[P, R]: ...


@dataclass(frozen=True)
class _Spec(Generic[P, R]):
    func: Callable[P, R]
    name: str | None
    schedule: schedules.Schedule | None
    policy: Policy
    slot_kwarg: str | None = None

    def resolve(
        self, explicit: datetime | str | None, context: CallContext | None = None
    ) -> tuple[str, datetime]:
        if not django_settings.USE_TZ:
            raise ImproperlyConfigured(USE_TZ_NEEDED)
        now = timezone.now()  # Django's clock: what tests and time-travel libraries patch
        tolerance = _tolerance(taskguard_settings.SLOT_TOLERANCE_SECONDS)
        if context is not None and context.schedule_version is not None and context.task_name:
            name = context.task_name  # a data schedule's run: its identity is the schedule's
        else:
            name = self.name or (context.task_name if context else None) or dotted_name(self.func)
        given = explicit if explicit is not None else context.slot if context is not None else None
        if given is not None:
            slot = schedules.normalize_slot(given)
            if slot - now > tolerance:
                refuse_future_slot(name, slot, tolerance)
            return name, slot
        if self.schedule is not None:
            return name, self.schedule.latest_slot(now)
        raise TaskGuardError(
            f"{name!r} has no slot: give the decorator cron=, every= or schedule=, call "
            f".run_for_slot(slot), or send it through taskguard's Celery beat scheduler"
        )


@functools.lru_cache(maxsize=8)
def _tolerance(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def refuse_future_slot(task_name: str, slot: datetime, tolerance: timedelta) -> None:
    """A slot ahead of this clock by more than ``tolerance``: judged again on the
    database's clock (this one may be the one that is wrong); refused and recorded
    ``skipped`` when that one agrees (an on-time call still runs it)."""
    reason = guard.refused_early(task_name, slot, tolerance)
    if reason is not None:
        raise InvalidSchedule(reason)


def _grace(grace: timedelta | None) -> timedelta:
    if grace is None:
        return DEFAULT_GRACE
    low, high = GRACE_BOUNDS
    if not isinstance(grace, timedelta) or not low <= grace <= high:
        raise InvalidSchedule(
            f"grace= must be a timedelta from {low} to {high} (how late a slot may still be "
            f"claimed before it counts as missed); got {grace!r}"
        )
    return grace


def _bounded(argument: str, value: int | None, bounds: tuple[int, int]) -> int | None:
    if value is None:
        return None
    low, high = bounds
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidSchedule(
            f"{argument}= must be a whole number from {low} to {high}; got {value!r}"
        )
    return value


def _slot_kwarg(value: str | None) -> str | None:
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or not value.isidentifier()
        or keyword.iskeyword(value)
        or len(value) > SLOT_KWARG_MAX_LENGTH
    ):
        raise InvalidSchedule(
            f"slot_kwarg= must name a keyword argument (a Python identifier of at most "
            f"{SLOT_KWARG_MAX_LENGTH} characters, not a keyword); got {value!r}"
        )
    if value == SCHEDULE_KWARG:
        raise InvalidSchedule(f"slot_kwarg= cannot be {SCHEDULE_KWARG!r}: taskguard uses it")
    return value


def _carried_slot(
    spec: _Spec[Any, Any], kwargs: dict[str, Any], context: CallContext | None
) -> Any:
    """The slot a plain call carries, popped from ``kwargs``: taskguard's own ``SLOT_KWARG``
    (``run_schedules --enqueue``, ``backfill``), else the decorator's ``slot_kwarg=``. A call
    of a function with ``slot_kwarg=`` that carries no slot at all is refused: its slot is
    never recomputed from the clock."""
    carried = kwargs.pop(SLOT_KWARG, None)
    if spec.slot_kwarg is None or spec.slot_kwarg == SLOT_KWARG:
        return carried
    named = kwargs.pop(spec.slot_kwarg, None)
    if carried is not None:
        return carried
    if named is None and (context is None or context.slot is None):
        raise TaskGuardError(
            f"{spec.name or dotted_name(spec.func)!r} takes its slot from the keyword argument "
            f"{spec.slot_kwarg}= (slot_kwarg=), and this call has none: it did not run (give "
            f"{spec.slot_kwarg}=<aware datetime or ISO-8601 string>, or call .run_for_slot())"
        )
    return named


def _begin_call(spec: _Spec[Any, Any], carried: Any, context: CallContext | None) -> guard.Started:
    """Claim the slot of a plain call: the one an enqueued task carried (``SLOT_KWARG``),
    else the slot source's, else the schedule's latest."""
    task_name, slot = spec.resolve(carried, context)
    hooks = context or CallContext()
    policy = late = spec.policy
    if hooks.backfill:  # no lateness policy; a missed row is taken over (see backfill)
        if policy.catchup == "none":
            policy = late = dataclasses.replace(policy, catchup="latest")
    elif hooks.grace is not None:
        late = dataclasses.replace(late, catchup="none", grace=hooks.grace)
    if late.catchup == "none" and guard.refused_late(task_name, slot, late, timezone.now()):
        return guard.REFUSED
    started = guard.begin(
        task_name,
        slot,
        policy,
        classify_raise=hooks.classify_raise,
        instance=hooks.instance,
        on_busy=hooks.on_busy,
        message_id=hooks.message_id,
    )
    if hooks.schedule_version is not None:
        note_version(started, hooks.schedule_version)
    return started


def note_version(started: guard.Started, version: int) -> None:
    """Record on a won claim's row the data schedule version that fired it; never raises
    (the run goes on without it: the version is for people, the claim is what counts)."""
    if not isinstance(started, guard.Attempt):
        return
    try:
        ledger.note_schedule_version(started.active.id, version)
    except Exception as exc:
        logger.warning(
            "taskguard %s slot %s: the schedule version %d could not be recorded (%s)",
            started.active.task_name,
            started.active.slot.isoformat(),
            version,
            exc,
            extra=run_log_fields("version.record_failed", started.active, reason=exc),
        )


def _carried_schedule(kwargs: dict[str, Any], context: CallContext | None) -> CallContext | None:
    """The call's context, with the data schedule an enqueued call carried
    (``SCHEDULE_KWARG``, popped from ``kwargs``) when there is one, and whether it is an
    operator's backfill (``BACKFILL_KWARG``, popped too)."""
    if kwargs.pop(BACKFILL_KWARG, None):
        context = dataclasses.replace(context or CallContext(), backfill=True)
    carried = kwargs.pop(SCHEDULE_KWARG, None)
    if carried is None:
        return context
    try:
        task_name, version = str(carried["task_name"]), int(carried["version"])
    except (TypeError, KeyError, ValueError):
        raise TaskGuardError(
            f"{SCHEDULE_KWARG}= must be {{'task_name': ..., 'version': n}}, not {carried!r}"
        ) from None
    return dataclasses.replace(
        context or CallContext(), task_name=task_name, schedule_version=version
    )


def _begin_for_slot(spec: _Spec[Any, Any], slot: datetime | str) -> guard.Started:
    """Claim the slot given to ``run_for_slot``."""
    if slot is None:
        # resolve(None) means "no explicit slot": it would quietly fall
        # back to the schedule's current slot.
        raise InvalidSchedule("run_for_slot() needs a slot: an aware datetime, not None")
    task_name, resolved = spec.resolve(slot)
    return guard.begin(task_name, resolved, spec.policy)


def _plain_forms(
    spec: _Spec[Any, Any], func: Callable[..., Any]
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The guarded function and its ``run_for_slot``, running ``func`` in the caller's thread."""

    # A plain function (not a callable object) so that Celery's
    # ``shared_task(bind=True)`` can bind ``self`` to it like any task body.
    @functools.wraps(spec.func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        context = _carried_schedule(kwargs, call_context())
        carried = _carried_slot(spec, kwargs, context)
        return guard.run(_begin_call(spec, carried, context), func, args, kwargs)

    def run_for_slot(slot: datetime | str, /, *args: Any, **kwargs: Any) -> Any:
        return guard.run(_begin_for_slot(spec, slot), func, args, kwargs)

    return wrapper, run_for_slot


def _async_forms(spec: _Spec[Any, Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The guarded coroutine function and its ``run_for_slot`` (see ``coroutines``)."""
    target = spec.func

    @functools.wraps(target)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        context = _carried_schedule(kwargs, call_context())  # the caller's task's
        carried = _carried_slot(spec, kwargs, context)
        begin = functools.partial(_begin_call, spec, carried, context)
        return await coroutines.execute(begin, target, args, kwargs)

    async def run_for_slot(slot: datetime | str, /, *args: Any, **kwargs: Any) -> Any:
        begin = functools.partial(_begin_for_slot, spec, slot)
        return await coroutines.execute(begin, target, args, kwargs)

    return wrapper, run_for_slot


@overload
def once_per_schedule(  # type: ignore[overload-overlap]
    func: Callable[P, Coroutine[Any, Any, T]], /
) -> AsyncGuarded[P, T]: ...


@overload
def once_per_schedule(func: Callable[P, R], /) -> Guarded[P, R]: ...


@overload
def once_per_schedule(
    *,
    cron: str | None = None,
    every: timedelta | None = None,
    schedule: Any = None,
    time_zone: str | None = None,
    name: str | None = None,
    on_duplicate: OnDuplicate = "skip",
    overlap: Overlap = "allow",
    on_stale: OnStale = "abandon",
    lease_seconds: float | None = None,
    catchup: Catchup = "latest",
    grace: timedelta | None = None,
    max_catchup: int | None = None,
    pause_after_failures: int | None = None,
    late_after: float | timedelta | None = None,
    slot_kwarg: str | None = None,
) -> ScheduleDecorator: ...


def once_per_schedule(
    func: Callable[..., Any] | None = None,
    /,
    *,
    cron: str | None = None,
    every: timedelta | None = None,
    schedule: Any = None,
    time_zone: str | None = None,
    name: str | None = None,
    on_duplicate: OnDuplicate = "skip",
    overlap: Overlap = "allow",
    on_stale: OnStale = "abandon",
    lease_seconds: float | None = None,
    catchup: Catchup = "latest",
    grace: timedelta | None = None,
    max_catchup: int | None = None,
    pause_after_failures: int | None = None,
    late_after: float | timedelta | None = None,
    slot_kwarg: str | None = None,
) -> Any:
    """Run the decorated function at most once per schedule slot, across every instance.

    The slot is, in order: the one given to ``.run_for_slot(slot)``; the one
    taskguard's beat scheduler stamped on the Celery message; the latest fire
    time at or before now of ``cron=`` (read in ``time_zone=``, an IANA name such as
    ``"Europe/Berlin"``; Django's ``TIME_ZONE`` when not given), ``every=``
    (epoch-aligned) or ``schedule=`` (a celery ``crontab``/``schedule``).
    The winning call returns the function's result; a call that finds its
    slot taken returns ``None`` (or raises ``DuplicateRun`` with
    ``on_duplicate="raise"``). A coroutine function stays one (the claim and the
    finish run in worker threads, see docs/decorators.md).

    ``catchup``/``grace``/``max_catchup``: what happens to slots that fell due while
    nothing fired them (see docs/schedules.md); ``pause_after_failures=N`` pauses the
    task after N failures in a row; ``late_after`` (seconds or a timedelta): the task is
    unhealthy when its last ``LATE_START_RUNS`` slots all started later than this after
    their time (default ``LATE_START_SECONDS``). ``slot_kwarg="name"``: a plain call takes
    its slot from that keyword argument (an aware datetime or an ISO-8601 string with an
    offset; django-q2's ``intended_date_kwarg``), pops it, and never recomputes it: a call
    without it raises ``TaskGuardError``. A function with a schedule is registered (in
    memory) for ``run_schedules`` and the missed-slot sweep.
    """
    # Raised when the function is known, so the message can name it.
    bad_schedule: InvalidSchedule | None = None
    try:
        built = schedules.build(cron, every, schedule, time_zone)
    except InvalidSchedule as exc:
        built, bad_schedule = None, exc
    if name is not None:
        validate_task_name(name)
    slot_kwarg = _slot_kwarg(slot_kwarg)
    if lease_seconds is not None:
        problem = lease_problem(lease_seconds, "lease_seconds=")
        if problem is not None:
            raise InvalidSchedule(problem)
    if (problem := late_after_problem(late_after)) is not None:
        raise InvalidSchedule(problem)
    policy = Policy(
        on_duplicate=choose("on_duplicate", on_duplicate, ("skip", "raise")),
        overlap=choose("overlap", overlap, ("allow", "skip")),
        on_stale=choose("on_stale", on_stale, ("abandon", "retry")),
        lease_seconds=lease_seconds,
        catchup=choose("catchup", catchup, ("latest", "none", "all")),
        grace=_grace(grace),
        max_catchup=_bounded("max_catchup", max_catchup, MAX_CATCHUP_BOUNDS) or DEFAULT_MAX_CATCHUP,
        pause_after_failures=_bounded(
            "pause_after_failures", pause_after_failures, PAUSE_AFTER_FAILURES_BOUNDS
        ),
        late_after=late_after_delta(late_after),
    )
    if built is None and (catchup == "all" or max_catchup is not None):
        raise InvalidSchedule(
            "catchup='all' and max_catchup= need a schedule that run_schedules fires (cron=, "
            "every= or schedule=); a beat sends one message per slot. catchup='none' and "
            "grace= work without one (a stamped message later than grace is recorded missed)"
        )

    def decorate(target: Callable[..., Any]) -> Any:
        refuse_task_object(target, "@once_per_schedule(...)")
        if bad_schedule is not None:
            where = name or dotted_name(target)
            raise InvalidSchedule(
                f"@once_per_schedule on {where}: {bad_schedule}"
            ) from bad_schedule
        spec = _Spec(target, name, built, policy, slot_kwarg)
        if name is None:
            validate_task_name(dotted_name(target))
        note_on_stale(name or dotted_name(target), policy.on_stale)

        if iscoroutinefunction(target):
            wrapper, run_for_slot = _async_forms(spec)
            plain: Callable[..., Any] = async_to_sync(target)  # run_schedules' threads
            _, plain_run_for_slot = _plain_forms(spec, plain)
        else:
            wrapper, run_for_slot = _plain_forms(spec, target)
            plain, plain_run_for_slot = target, run_for_slot

        def fire(slot: datetime) -> bool:
            """A scheduler's call for ``slot`` (the catch-up policy applies); True if it ran."""
            task_name, resolved = spec.resolve(slot)
            if guard.refused_late(task_name, resolved, policy, timezone.now()):
                return False
            ran = False

            def body() -> Any:
                nonlocal ran
                ran = True
                return plain()

            guard.execute(task_name, resolved, policy, body, (), {})
            return ran

        guarded: Any = wrapper  # typed by the overloads
        guarded.task_name = name
        guarded.schedule = built
        guarded.policy = policy
        guarded.slot_kwarg = slot_kwarg
        guarded.run_for_slot = run_for_slot
        guarded.body = plain  # the undecorated function, callable in a thread (data schedules)
        note_guarded(name or dotted_name(target), guarded)
        if built is not None:
            entry = registry.Entry(
                task_name=name or dotted_name(target),
                schedule=built,
                policy=policy,
                function=dotted_name(target),
                fire=fire,
                run_for_slot=plain_run_for_slot,
                func=plain,
                named=name is not None,
            )
            registry.register(entry, wrapper)
        return guarded

    if func is not None:
        return decorate(func)
    return decorate
