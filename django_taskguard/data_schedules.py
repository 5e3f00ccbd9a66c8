"""Data schedules: schedules defined as rows (in the admin, or by :func:`define_schedule`).

A data schedule names what it runs (its *target*): a guarded function (``@once_per_schedule``,
by its task name), a Celery task (by its name; its body guarded) or a django.tasks task (by
its dotted path; its function guarded). Its runs are recorded as ``target[name]``
(:func:`decorating.task_identity`), so 5,000 tenants' schedules of one task are 5,000
schedules, each once per slot. The target's kind decides what fires it (``TargetKind``):
``run_schedules`` runs function and django.tasks targets (``--enqueue`` hands the latter to
their backend), taskguard's Celery beat schedulers send Celery ones.

Everything a definition says is checked here, the same for the admin's form and the API
(:func:`validate`): the target exists here and is guarded, it takes the arguments, the cron
parses, the zone exists, every bound holds. Every change is kept (``ScheduleEvent``, with
what changed and the version it made); see :mod:`.ledger.schedules` for the write.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import itertools
import json
import logging
import sys
import zoneinfo
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any

from django.utils import timezone
from django.utils.timezone import get_default_timezone_name

from . import registry, schedules
from .conf import late_after_delta, late_after_problem
from .cron import CronSchedule
from .decorating import guarded_named, guarded_policy, has_control_characters, task_identity
from .exceptions import InvalidSchedule, TaskGuardError
from .ledger import schedules as store
from .logfields import log_fields
from .models import (
    TASK_NAME_MAX_LENGTH,
    Catchup,
    ScheduleEventKind,
    ScheduleEventOrigin,
    ScheduleSource,
    TargetKind,
    TaskSchedule,
)
from .moments import moment_problem
from .policy import DEFAULT_GRACE, DEFAULT_MAX_CATCHUP, Policy

logger = logging.getLogger("taskguard.data_schedules")

__all__ = [
    "Target",
    "define_schedule",
    "delete_schedule",
    "jitter_offset",
    "resolve_target",
    "validate",
]

NAME_MAX_LENGTH = 200
# Bounds, checked where a definition is given (the admin's form, define_schedule).
EVERY_BOUNDS = (timedelta(seconds=1), timedelta(days=366))
GRACE_BOUNDS = (timedelta(seconds=1), timedelta(days=7))
MAX_CATCHUP_BOUNDS = (1, 10_000)
PAUSE_AFTER_FAILURES_BOUNDS = (1, 1_000)
JITTER_MAX = timedelta(hours=1)
ARGUMENTS_MAX_BYTES = 64 * 1024
# Lists and objects within one another in the arguments (deeper is refused, not recursed into).
# MariaDB's JSON columns refuse a depth above 32, the innermost values counted, and the
# history keeps the arguments two levels down ({"args": [old, new]}): 24 leaves room.
JSON_MAX_DEPTH = 24
TOO_DEEP = (
    f"the arguments are nested deeper than {JSON_MAX_DEPTH} levels (lists and objects "
    "within one another)"
)
DESCRIPTION_MAX_LENGTH = 2_000
# Keyword arguments a call carries for the guard (decorators.SLOT_KWARG, SCHEDULE_KWARG): a
# schedule's own arguments never name them (a target taking **kwargs would pass them on).
RESERVED_PREFIX = "_taskguard_"


class ScheduleDefinitionError(InvalidSchedule):
    """A definition that cannot be saved; ``field`` names the part that is wrong (the
    admin's form shows the message beside it), empty for the whole."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Target:
    """What a data schedule runs, as found in this process.

    ``guarded``: the ``@once_per_schedule`` function (its ``policy``, its ``body``);
    ``task``: the Celery or django.tasks task object that wraps it (None for a function);
    ``signature``: what the arguments are checked against.
    """

    name: str
    kind: str  # TargetKind
    guarded: Any
    task: Any
    signature: inspect.Signature | None

    @property
    def policy(self) -> Policy:
        policy = guarded_policy(self.guarded)
        assert policy is not None
        return policy


def _signature(func: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):  # a builtin, a C callable: nothing to check against
        return None


def _guarded(value: Any) -> bool:
    return guarded_policy(value) is not None and callable(getattr(value, "run_for_slot", None))


# Where a target is looked for besides the guarded functions, registered by the integrations
# (the core imports neither Celery nor django.tasks): ``BY_NAME`` finders are asked first with
# the target's name (``contrib.celery``: a Celery task of that name); ``BY_OBJECT`` finders
# with the name and the object its dotted path names (``contrib.tasks``: a django.tasks
# task). Each returns a Target, None when the target is not theirs, or raises
# ScheduleDefinitionError when it is theirs but cannot be a target (not guarded).
BY_NAME: list[Callable[[str], Target | None]] = []
BY_OBJECT: list[Callable[[str, Any], Target | None]] = []
# Who else may hold a data schedule's identity before it has a row, registered by the
# integrations (``contrib.celery``: the entries of the Celery app's beat_schedule): each is
# asked with the identity and says what holds it, or None.
HELD_BY: list[Callable[[str], str | None]] = []


def held_by(task_name: str) -> str | None:
    """What holds the identity ``task_name`` besides a data schedule (a schedule the code
    declares, a beat entry), or None. The code's schedules are discovered first: on a
    deploy whose code schedule has no row yet, a data schedule of its identity would fire
    the function with the editor's arguments, and the code schedule would never get a row.
    A stored row of another kind is refused when saved (``NotDataSchedule``)."""
    try:
        declared = registry.discover()
    except Exception:  # a broken module of schedules (check E026): what is registered here
        declared = registry.entries()
    entry = declared.get(task_name)
    if entry is not None:
        return f"a schedule declared by the code ({entry.function})"
    for finder in HELD_BY:
        holder = finder(task_name)
        if holder is not None:
            return holder
    return None


def guarded_target(
    target: str, kind: str, guarded: Any, task: Any, runs: Any, *, decorator: str
) -> Target:
    """The Target of an integration's task wrapping ``guarded``, or the error saying to guard
    it (under ``decorator``); ``runs``: what its arguments are checked against."""
    if not _guarded(guarded):
        raise ScheduleDefinitionError(
            f"the task {target} is not guarded: put @once_per_schedule() under {decorator} "
            "(each slot then runs once, whatever the number of schedulers)",
            "target",
        )
    return Target(target, kind, guarded, task, _signature(runs))


def not_a_guarded_task(target: str) -> ScheduleDefinitionError:
    """The one refusal of a target that is no guarded task here, whatever it names: it says
    nothing of which modules exist (nothing it names was imported to find out)."""
    return ScheduleDefinitionError(
        f"{target} is not a guarded task: give the task name of an @once_per_schedule "
        "function (its module in an installed app's tasks or jobs, or SCHEDULE_MODULES), a "
        "Celery task's name, or a django.tasks task's dotted path (@task() over "
        "@once_per_schedule)",
        "target",
    )


def _guarded_task(target: str) -> Any:
    """The guarded function registered as ``target``, the modules that declare schedules
    imported first (only those: what a target names is never imported for it)."""
    found = guarded_named(target)
    if found is None:
        # SCHEDULE_MODULES and the apps' tasks/jobs; a broken one (check E026): what is
        # registered.
        with contextlib.suppress(Exception):
            registry.discover()
        found = guarded_named(target)
    return found


def _at_path(target: str) -> Any:
    """What the dotted path ``target`` names in a module already imported, or None. Never
    imports: a django.tasks task's guarded function is registered from the task's module,
    so that module is loaded when the task is a target."""
    module, _, attribute = target.rpartition(".")
    loaded = sys.modules.get(module) if module else None
    return getattr(loaded, attribute, None) if loaded is not None else None


def resolve_target(target: str) -> Target:
    """Find ``target`` among the guarded tasks here: a Celery task of that name (the Celery
    app's registry), a guarded function of that task name, or the django.tasks task at that
    dotted path whose function it is (in the modules ``run_schedules`` imports). Nothing the
    target names is imported to find it (a web process checking an editor's input runs no
    module's top-level code). Raises :class:`ScheduleDefinitionError`, the same for
    whatever is not a guarded task."""
    if not isinstance(target, str) or not target.strip() or len(target) > 500:
        raise ScheduleDefinitionError(
            "the target must be a task name or dotted path of at most 500 characters", "target"
        )
    for by_name in BY_NAME:
        named = by_name(target)
        if named is not None:
            return named
    found = _guarded_task(target)
    # A django.tasks task over a guarded function is named by its path (its function may have
    # a name= of its own); so may a guarded function. Only a module already imported is
    # looked in.
    at_path = _at_path(target)
    if at_path is not None and at_path is not found:
        for by_object in BY_OBJECT:
            try:
                task = by_object(target, at_path)
            except ScheduleDefinitionError:  # a task, not guarded: the same refusal
                raise not_a_guarded_task(target) from None
            if task is not None:
                return task
        if found is None and _guarded(at_path):
            found = at_path
    if found is None or not _guarded(found):
        raise not_a_guarded_task(target)
    return Target(target, TargetKind.FUNCTION, found, None, _signature(found))


def json_depth(value: Any, stop: int = JSON_MAX_DEPTH + 2) -> int:
    """How many lists and objects ``value`` holds within one another (a scalar: 0), counted
    level by level (no recursion) and no further than ``stop``."""
    depth, level = 0, [value]
    while depth < stop:
        containers = [item for item in level if isinstance(item, (Mapping, list, tuple))]
        if not containers:
            break
        depth += 1
        level = [
            inner
            for item in containers
            for inner in (item.values() if isinstance(item, Mapping) else item)
        ]
    return depth


def _check_arguments(target: Target, args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    if not isinstance(args, (list, tuple)):
        raise ScheduleDefinitionError(
            f"args must be a JSON list, not {type(args).__name__}", "args"
        )
    if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
        raise ScheduleDefinitionError("kwargs must be a JSON object (string keys)", "kwargs")
    args, kwargs = list(args), dict(kwargs)
    for field, value in (("args", args), ("kwargs", kwargs)):
        if json_depth(value) > JSON_MAX_DEPTH:
            raise ScheduleDefinitionError(TOO_DEEP, field)
    reserved = sorted(key for key in kwargs if key.startswith(RESERVED_PREFIX))
    if reserved:
        raise ScheduleDefinitionError(
            f"{', '.join(reserved)}: keyword arguments starting with {RESERVED_PREFIX} are "
            "taskguard's own (the slot and schedule a call carries)",
            "kwargs",
        )
    try:
        text = json.dumps([args, kwargs], allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ScheduleDefinitionError(f"the arguments are not JSON: {exc}", "kwargs") from None
    if len(text.encode()) > ARGUMENTS_MAX_BYTES:
        raise ScheduleDefinitionError(
            f"the arguments take {len(text.encode())} bytes as JSON; at most "
            f"{ARGUMENTS_MAX_BYTES} are kept",
            "kwargs",
        )
    if "\x00" in text or "\\u0000" in text:
        raise ScheduleDefinitionError("the arguments must not contain NUL characters", "kwargs")
    if target.signature is not None:
        try:
            target.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ScheduleDefinitionError(
                f"{target.name} does not take these arguments: {exc}", "kwargs"
            ) from None
    return args, kwargs


# The areas of the IANA database's canonical Region/City names (and Etc/...); a name outside
# them is a legacy alias (EST, MST, HST, CET, US/Eastern, GMT), kept for compatibility and
# not what the zone is called: EST is a fixed UTC-5 with no daylight saving time, which
# few who type it mean.
ZONE_AREAS = frozenset(
    {"Africa", "America", "Antarctica", "Arctic", "Asia", "Atlantic", "Australia", "Europe",
     "Indian", "Pacific", "Etc"}
)  # fmt: skip


def is_canonical_zone(name: str) -> bool:
    """Whether ``name`` is an IANA Region/City name (or ``UTC``, ``Etc/...``), not an alias."""
    return name == "UTC" or name.partition("/")[0] in ZONE_AREAS


@lru_cache(maxsize=1)
def _zones_by_lowercase() -> dict[str, str]:
    return {name.lower(): name for name in zoneinfo.available_timezones()}


def _zone(name: str | None) -> str:
    if not name:
        return ""
    if not isinstance(name, str):
        raise ScheduleDefinitionError(f"the time zone must be text, not {name!r}", "time_zone")
    known = _zones_by_lowercase().get(name.lower())
    if known is not None and known != name:  # ZoneInfo finds it on a case-blind filesystem
        raise ScheduleDefinitionError(
            f"unknown time zone {name!r}: did you mean {known!r}?", "time_zone"
        )
    try:
        zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ScheduleDefinitionError(
            f"unknown time zone {name!r}: give an IANA name such as Europe/Berlin", "time_zone"
        ) from None
    if not is_canonical_zone(name):
        raise ScheduleDefinitionError(
            f"time zone {name!r} is a legacy alias: give its IANA Region/City name (such as "
            "America/New_York, Europe/Berlin) or UTC",
            "time_zone",
        )
    return name


def _duration(
    value: Any, field: str, bounds: tuple[timedelta, timedelta], *, zero: bool = False
) -> timedelta:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta):
        raise ScheduleDefinitionError(f"{field} must be a timedelta, not {value!r}", field)
    low, high = bounds
    if (zero and value == timedelta(0)) or low <= value <= high:
        return value
    raise ScheduleDefinitionError(f"{field} must be from {low} to {high}; got {value}", field)


def _late_after(given: float | timedelta | None, jitter: timedelta | None) -> timedelta | None:
    """The schedule's late-start bound: ``given``, else None (its target's, else the
    setting's: :func:`followed`). A bound given here must be longer than the jitter, which
    delays starts by design."""
    if given is None:
        return None
    if (problem := late_after_problem(given)) is not None:
        raise ScheduleDefinitionError(problem, "late_after")
    bound = late_after_delta(given)
    if jitter and bound is not None and bound <= jitter:
        raise ScheduleDefinitionError(
            f"late_after ({bound}) must be longer than the jitter ({jitter}): a start that "
            "late is by design",
            "late_after",
        )
    return bound


def _whole(value: Any, field: str, bounds: tuple[int, int]) -> int:
    low, high = bounds
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ScheduleDefinitionError(
            f"{field} must be a whole number from {low} to {high}; got {value!r}", field
        )
    return value


def _moment(value: Any, field: str) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime) or timezone.is_naive(value):
        raise ScheduleDefinitionError(f"{field} must be an aware datetime, not {value!r}", field)
    if (problem := moment_problem(value, field)) is not None:
        raise ScheduleDefinitionError(problem, field)
    return value


def _schedule(
    cron: str | None, every: timedelta | None, time_zone: str, day_or: bool = True
) -> schedules.StoredSchedule:
    if (cron is None or cron == "") == (every is None):
        raise ScheduleDefinitionError(
            "give a cron expression or an interval (every), not both", "cron"
        )
    if every is not None:
        if time_zone:
            raise ScheduleDefinitionError(
                "an interval's slots are aligned to the epoch (UTC): give a time zone with a "
                "cron expression only",
                "time_zone",
            )
        return schedules.IntervalSchedule(_duration(every, "every", EVERY_BOUNDS))
    try:
        return CronSchedule(str(cron), time_zone or None, day_or)
    except InvalidSchedule as exc:
        raise ScheduleDefinitionError(str(exc), "cron") from None


def _shortest_gap(schedule: schedules.StoredSchedule) -> timedelta:
    if isinstance(schedule, schedules.IntervalSchedule):
        return schedule.every
    now = timezone.now()
    slots = schedule.slots_between(now, now + timedelta(days=400), 64)
    gaps = [later - earlier for earlier, later in itertools.pairwise(slots)]
    return min(gaps) if gaps else timedelta(days=1)


def validate(
    name: str,
    target: str,
    *,
    cron: str | None = None,
    cron_day_or: bool = True,
    every: timedelta | None = None,
    time_zone: str | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    enabled: bool = True,
    starts: datetime | None = None,
    ends: datetime | None = None,
    catchup: str | None = None,
    grace: timedelta | None = None,
    max_catchup: int | None = None,
    pause_after_failures: int | None = None,
    jitter: timedelta | None = None,
    late_after: float | timedelta | None = None,
    description: str = "",
) -> tuple[str, dict[str, Any]]:
    """Check a definition; return its task name (``target[name]``) and the values
    :func:`ledger.schedules.define` saves. Raises :class:`ScheduleDefinitionError`.

    Unset ``catchup``/``grace``/``max_catchup``/``pause_after_failures``/``late_after``
    are stored empty: the schedule follows its target's decorator (:func:`followed`).
    ``cron_day_or=False``: a slot's day must match both the day of month and the day of
    week when both are restricted (celery's crontab), not either (cron's)."""
    if not isinstance(name, str) or not name.strip() or len(name) > NAME_MAX_LENGTH:
        raise ScheduleDefinitionError(
            f"the name must be a non-empty string of at most {NAME_MAX_LENGTH} characters",
            "name",
        )
    if has_control_characters(name) or name != name.strip():
        raise ScheduleDefinitionError(
            "the name must not contain control characters (NUL, a newline, a tab, an escape...) "
            "nor start or end with spaces",
            "name",
        )
    if "[" in name or "]" in name:
        raise ScheduleDefinitionError(
            "the name must not contain [ or ]: the identity target[name] would be ambiguous",
            "name",
        )
    found = resolve_target(target)
    policy = found.policy
    zone = _zone(time_zone)
    if cron and not zone:
        # Stored, not implied: every copy then reads the cron in the same zone, whatever
        # its own TIME_ZONE (a code schedule's cron follows each copy's; W020 says so).
        zone = get_default_timezone_name()
    if not isinstance(cron_day_or, bool):
        raise ScheduleDefinitionError(
            f"cron_day_or must be True or False, not {cron_day_or!r}", "cron"
        )
    schedule = _schedule(cron, every, zone, cron_day_or)
    args, kwargs = _check_arguments(found, args, {} if kwargs is None else kwargs)
    # Left empty, catch-up, grace, max catch-up, pause after failures and late after are
    # stored empty and follow the target's decorator (:func:`followed`): a later change of
    # its policy is followed after a deploy. The checks below hold for the value in
    # effect now; check W037 says when a change of the target's breaks them.
    catchup = catchup or ""
    if catchup and catchup not in Catchup.values:
        raise ScheduleDefinitionError(
            f"catchup must be one of {', '.join(Catchup.values)}; got {catchup!r}", "catchup"
        )
    if found.kind == TargetKind.CELERY and (catchup or policy.catchup) == "all":
        whose = "catchup='all'" if catchup else f"catch-up all (the target's, {found.name})"
        raise ScheduleDefinitionError(
            f"{whose} is run_schedules' (a beat sends the latest slot; backfill runs the "
            "others): give latest or none to a Celery task",
            "catchup",
        )
    if grace is not None:
        grace = _duration(grace, "grace", GRACE_BOUNDS)
    if max_catchup is not None:
        max_catchup = _whole(max_catchup, "max_catchup", MAX_CATCHUP_BOUNDS)
    if pause_after_failures is not None:
        _whole(pause_after_failures, "pause_after_failures", PAUSE_AFTER_FAILURES_BOUNDS)
    starts, ends = _moment(starts, "starts"), _moment(ends, "ends")
    if starts is not None and ends is not None and ends <= starts:
        raise ScheduleDefinitionError("ends must be after starts", "ends")
    if jitter is not None:
        jitter = _duration(jitter, "jitter", (timedelta(seconds=1), JITTER_MAX), zero=True)
        gap = _shortest_gap(schedule)
        if jitter * 2 > gap:
            raise ScheduleDefinitionError(
                f"jitter ({jitter}) must be at most half the shortest gap between two slots "
                f"({gap}): a start must come before the next slot",
                "jitter",
            )
        in_effect = policy.grace if grace is None else grace
        if jitter >= in_effect:
            whose = "the grace" if grace is not None else f"its target's grace ({found.name})"
            raise ScheduleDefinitionError(
                f"jitter ({jitter}) must be shorter than {whose} ({in_effect}): a start that "
                "late would be judged late",
                "jitter",
            )
        jitter = jitter or None
    late_after = _late_after(late_after, jitter)
    if not isinstance(enabled, bool):
        raise ScheduleDefinitionError(f"enabled must be True or False, not {enabled!r}", "enabled")
    if not isinstance(description, str) or len(description) > DESCRIPTION_MAX_LENGTH:
        raise ScheduleDefinitionError(
            f"the description must be text of at most {DESCRIPTION_MAX_LENGTH} characters",
            "description",
        )
    task_name = task_identity(found.name, name)
    if len(task_name) > TASK_NAME_MAX_LENGTH:  # task_identity cuts; never longer
        raise ScheduleDefinitionError("the target and name are too long", "name")
    if task_name == found.name:
        raise ScheduleDefinitionError(
            f"the name must differ from its target ({found.name}): the target alone is the "
            "identity of its own calls and of a schedule the code declares for it",
            "name",
        )
    holder = held_by(task_name)
    if holder is not None:
        raise ScheduleDefinitionError(
            f"{task_name} is the identity of {holder}: a data schedule cannot take it; "
            "choose another name",
            "name",
        )
    described = schedules.describe(schedule)
    values: dict[str, Any] = {
        "entry": name,
        "function": found.name,
        "target_kind": found.kind,
        "cron": described["cron"],
        "cron_day_or": described["cron_day_or"],
        "every": described["every"],
        "time_zone": described["time_zone"],
        "args": args,
        "kwargs": kwargs,
        "enabled": enabled,
        "starts": starts,
        "ends": ends,
        "catchup": catchup,
        "grace": grace,
        "max_catchup": max_catchup,
        "pause_after_failures": pause_after_failures,
        "jitter": jitter,
        "late_after": late_after,
        "description": description.replace("\x00", ""),
    }
    return task_name, values


def define_schedule(
    name: str,
    target: str,
    *,
    cron: str | None = None,
    cron_day_or: bool = True,
    every: timedelta | None = None,
    time_zone: str | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    enabled: bool = True,
    starts: datetime | None = None,
    ends: datetime | None = None,
    catchup: str | None = None,
    grace: timedelta | None = None,
    max_catchup: int | None = None,
    pause_after_failures: int | None = None,
    jitter: timedelta | None = None,
    late_after: float | timedelta | None = None,
    description: str = "",
    by: str = "",
    reason: str = "",
    origin: ScheduleEventOrigin = ScheduleEventOrigin.CODE,
) -> TaskSchedule:
    """Create the data schedule ``name`` of ``target``, or update it (same name and target);
    return its row. Its runs are recorded as ``target[name]``.

    Checked first (:func:`validate`): a bad definition raises ``InvalidSchedule`` naming
    what is wrong, and nothing is saved. The change is kept in the schedule's history
    (``by``: who, default this process; ``origin``: from where; ``reason``). An edit never
    fires a slot early nor loses the one that is due (docs/schedules.md, "Editing")."""
    from .owner import actor

    task_name, values = validate(
        name,
        target,
        cron=cron,
        cron_day_or=cron_day_or,
        every=every,
        time_zone=time_zone,
        args=args,
        kwargs=kwargs,
        enabled=enabled,
        starts=starts,
        ends=ends,
        catchup=catchup,
        grace=grace,
        max_catchup=max_catchup,
        pause_after_failures=pause_after_failures,
        jitter=jitter,
        late_after=late_after,
        description=description,
    )
    try:
        defined = store.define(
            task_name,
            values,
            origin=origin,
            grace_of=grace_of,
            by=by or actor("api"),
            reason=reason,
        )
    except store.NotDataSchedule as exc:
        raise ScheduleDefinitionError(
            f"{exc}: a data schedule cannot take its name; choose another name", "name"
        ) from None
    return defined.row


def delete_schedule(
    name: str,
    target: str,
    *,
    by: str = "",
    reason: str = "",
    origin: ScheduleEventOrigin = ScheduleEventOrigin.CODE,
) -> bool:
    """Delete the data schedule ``name`` of ``target``: nothing fires it any more; its runs
    and its history stay. False when there is no such schedule."""
    from .owner import actor

    task_name = task_identity(target, name)
    deleted = store.delete_data(
        task_name, origin=origin, grace_of=grace_of, by=by or actor("api"), reason=reason
    )
    return deleted is not None


def jitter_offset(task_name: str, jitter: timedelta | None) -> timedelta:
    """How long after each slot the schedule ``task_name`` starts: a stable hash of its
    name spread over ``[0, jitter)``, the same in every copy (the slot is unchanged)."""
    if not jitter:
        return timedelta(0)
    digest = hashlib.sha256(task_name.encode("utf-8")).digest()
    fraction = int.from_bytes(digest[:8], "big") / 2**64
    return timedelta(microseconds=int(jitter / timedelta(microseconds=1) * fraction))


def policy_of(row: TaskSchedule, target_policy: Policy) -> Policy:
    """The policy a data schedule's runs follow: its target's (``target_policy``, as found
    here), with what the row sets (an empty field follows the target)."""
    return replace(
        target_policy,
        catchup=row.catchup or target_policy.catchup,
        grace=target_policy.grace if row.grace is None else row.grace,
        max_catchup=target_policy.max_catchup if row.max_catchup is None else row.max_catchup,
        pause_after_failures=(
            target_policy.pause_after_failures
            if row.pause_after_failures is None
            else row.pause_after_failures
        ),
        late_after=target_policy.late_after if row.late_after is None else row.late_after,
    )


def target_policy(target: str) -> Policy:
    """The policy of the target named ``target`` as found in this process (its decorator's
    ``catchup=``, ``grace=``...); the package's defaults when it is not found here (a copy
    like this one fires none of its slots: check W021), said once per target and process."""
    try:
        return resolve_target(target).policy
    except Exception as exc:  # never raises: a sweep or a health page judges with what it has
        if target not in _unfound:
            _unfound.add(target)
            logger.warning(
                "taskguard: %s is not a guarded task in this process (%s): the data schedules "
                "that follow its policy are judged here by the defaults (grace %s, catch-up "
                "latest) until it is; give this process the module that defines it "
                "(check W021)",
                target,
                exc,
                DEFAULT_GRACE,
                extra=log_fields("schedule.target_unfound", task=target),
            )
        return Policy()


# The targets target_policy did not find, said once each (a warning per health request or
# sweep would bury the log).
_unfound: set[str] = set()


def grace_of(row: TaskSchedule) -> timedelta:
    """The grace ``row``'s slots are judged by (:func:`followed`)."""
    return followed(row).grace


def followed(row: TaskSchedule, policies: dict[str, Policy] | None = None) -> Policy:
    """What ``row``'s slots are judged by (catch-up, grace, max catch-up, pause after
    failures, late after): a code schedule's as stored; a data schedule's own, its
    target's (:func:`target_policy`) where it leaves one empty. ``policies``: the targets'
    already looked up, by name (a sweep of 100,000 schedules looks each target up once)."""
    if row.source == ScheduleSource.DATA and (
        not row.catchup
        or row.grace is None
        or row.max_catchup is None
        or row.pause_after_failures is None
        or row.late_after is None
    ):
        if policies is None:
            return policy_of(row, target_policy(row.function))
        if row.function not in policies:
            policies[row.function] = target_policy(row.function)
        return policy_of(row, policies[row.function])
    return Policy(
        catchup=row.catchup,
        grace=DEFAULT_GRACE if row.grace is None else row.grace,
        max_catchup=DEFAULT_MAX_CATCHUP if row.max_catchup is None else row.max_catchup,
        pause_after_failures=row.pause_after_failures,
        late_after=row.late_after,
    )


def manual_slot(now: datetime | None = None) -> datetime:
    """A slot for a run asked for now ("run now"): the current time to the microsecond, never
    a whole second, so that it never takes a slot of the schedule itself (cron slots are
    whole minutes, interval slots whole seconds)."""
    now = (now or timezone.now()).astimezone(schedules.UTC)
    return now if now.microsecond else now.replace(microsecond=1)


# What runs a data schedule's slot now, by target kind: given the row, the slot and who
# asked, hands the slot to the schedule's executor and says what it did (never runs the
# body in the caller's process). Registered by what fires each kind: run_schedules'
# (function, django_tasks) in :mod:`.data_firing`, the Celery glue's in contrib.celery.
RUNNERS: dict[str, Callable[[TaskSchedule, datetime, str], str]] = {}


def run_now(
    row: TaskSchedule, *, by: str = "", origin: ScheduleEventOrigin = ScheduleEventOrigin.CODE
) -> str:
    """Hand a manual slot of the data schedule ``row`` to its executor, through the guard;
    keep who asked. Returns what was done."""
    from .owner import actor

    runner = RUNNERS.get(row.target_kind)
    if row.removed_at is not None:
        raise TaskGuardError(f"{row.task_name} was deleted: nothing runs it")
    if runner is None:
        raise TaskGuardError(
            f"{row.task_name}: nothing here can hand out a {row.target_kind or 'code'} slot"
        )
    slot = manual_slot()
    who = by or actor("api")
    said = runner(row, slot, who)
    store.record_event(
        row.task_name,
        ScheduleEventKind.RAN_NOW,
        origin=origin,
        by=who,
        reason=f"slot {slot.isoformat()}: {said}",
    )
    return said
