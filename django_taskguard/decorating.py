"""What ``@once_per_schedule`` and ``@once_per_key`` share: checking their arguments,
naming their task, and the hooks through which a slot source (the Celery glue) tells them
about the current call (``SLOT_SOURCES``, ``CallContext``)."""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from .endings import ClassifyRaise, OnBusy
from .exceptions import InvalidSchedule
from .models import TASK_NAME_MAX_LENGTH
from .policy import Policy

# The words of system check taskguard.E003, said at run time too: manage.py shell,
# scripts, gunicorn and Celery workers run no system checks.
USE_TZ_NEEDED = (
    "taskguard needs USE_TZ = True (system check taskguard.E003): slots are aware UTC "
    "datetimes, and naive times are ambiguous across DST"
)


@dataclass(frozen=True)
class CallContext:
    """What a slot source (the Celery glue) knows about the current call."""

    slot: datetime | str | None = None
    task_name: str | None = None
    # See endings.ClassifyRaise / endings.OnBusy: how the caller's framework retries and
    # redelivers, so retries and redeliveries are attempts, never lost slots.
    classify_raise: ClassifyRaise | None = None
    # Where the call runs, for people (a Celery worker's ``w1@host``).
    instance: str | None = None
    on_busy: OnBusy | None = None
    # The message carrying the call (Celery's task id and retry count): after a retry that
    # names its message (``Ending.retry_by``), only that message starts the next attempt.
    message_id: str | None = None
    # A misfire grace for this call (a beat entry's ``taskguard_grace`` header): a call
    # later than it after its slot is recorded ``missed``, whatever the decorator says.
    grace: timedelta | None = None
    # An operator's backfill (a Celery message with ``taskguard_backfill``): no lateness
    # policy, like ``backfill``'s own calls; a slot the sweep recorded ``missed`` is run.
    backfill: bool = False
    # A data schedule's call (its version, sent with the slot): ``task_name`` is then the
    # schedule's identity (``target[name]``), whatever ``name=`` the decorator has, and the
    # run records the version that fired it.
    schedule_version: int | None = None


# Functions consulted at call time, in order, for the slot and task name of a
# call that has no explicit slot (``contrib.celery`` registers one that reads
# the beat-stamped message header).
SLOT_SOURCES: list[Callable[[], CallContext | None]] = []


def call_context() -> CallContext | None:
    for source in SLOT_SOURCES:
        context = source()
        if context is not None:
            return context
    return None


def guarded_policy(func: Any) -> Policy | None:
    """The policy of a function made by ``@once_per_schedule`` or ``@once_per_key``,
    or None for any other."""
    policy = getattr(func, "policy", None)
    if not isinstance(policy, Policy):
        return None
    if callable(getattr(func, "run_for_slot", None)) or callable(getattr(func, "key_of", None)):
        return policy
    return None


def refuse_task_object(target: Any, decorator: str) -> None:
    """Refuse what is not a function, saying so plainly for a django.tasks task (the
    decorator goes under ``@task()``, whose worker must call the guarded function)."""
    if callable(target):
        return
    if callable(getattr(target, "enqueue", None)) and callable(getattr(target, "func", None)):
        raise InvalidSchedule(
            f"{decorator} is above a task object ({target!r}); put it under the task "
            f"decorator: @task() on top, then {decorator}, then def"
        )
    raise InvalidSchedule(f"{decorator.partition('(')[0]} decorates a callable, not {target!r}")


# Every ``@once_per_schedule`` function by its task name (its ``name=`` or dotted path), noted
# at decoration time whatever its slot source: what a data schedule's target names
# (:mod:`.data_schedules`). Memory only: a module not imported yet is not in it.
_guarded: dict[str, Any] = {}


def note_guarded(task_name: str, guarded: Any) -> None:
    _guarded[task_name] = guarded


def guarded_named(task_name: str) -> Any:
    """The ``@once_per_schedule`` function named ``task_name`` in this process, or None."""
    return _guarded.get(task_name)


# Every decorated function's ``on_stale`` by task name, noted at decoration time whatever its
# slot source (a schedule, a beat's stamp, a key): the admin's panel says what becomes of an
# abandoned run of it. Memory only; a Celery task's own name is the function's dotted path
# unless ``name=`` was given, as it is here.
_on_stale: dict[str, str] = {}


def note_on_stale(task_name: str, on_stale: str) -> None:
    _on_stale[task_name] = on_stale


def on_stale_of(task_name: str) -> str | None:
    """The ``on_stale`` of the decorated function named ``task_name`` in this process."""
    return _on_stale.get(task_name)


def dotted_name(func: Callable[..., Any]) -> str:
    return f"{func.__module__}.{func.__qualname__}"


def task_identity(target: str, name: str | None) -> str:
    """The ``TaskRun.task_name`` of a schedule named ``name`` that runs ``target``.

    ``"app.tasks.report[nightly-eu]"``: the target (a Celery task's name, a function's) and
    the schedule's name (a beat entry's, a data schedule's) in brackets, so that one task
    backing several schedules runs once per slot *per schedule*. No name, or one equal to
    the target: the target alone. Longer than 255 characters: cut, with ``~`` and 16 hex
    digits of the full name's SHA-256 at the end (stable, and distinct in practice).
    """
    if not name or name == target:
        return target
    full = f"{target}[{name}]"
    if len(full) <= TASK_NAME_MAX_LENGTH:
        return full
    digest = hashlib.sha256(full.encode("utf-8")).hexdigest()[:16]
    return f"{full[: TASK_NAME_MAX_LENGTH - 17]}~{digest}"


def validate_task_name(name: str) -> str:
    """Reject task names that cannot be stored or told apart."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidSchedule(f"task name must be a non-empty string, got {name!r}")
    if len(name) > TASK_NAME_MAX_LENGTH:
        raise InvalidSchedule(
            f"task name is {len(name)} characters long; at most {TASK_NAME_MAX_LENGTH} fit "
            f"({name[:40]!r}...)"
        )
    if has_control_characters(name):
        raise InvalidSchedule(
            f"task name must not contain control characters (NUL, a newline, a tab, an escape, "
            f"a line separator...): {name!r}"
        )
    return name


def has_control_characters(text: str) -> bool:
    """Whether ``text`` holds a character that breaks or disguises a line of a log or of a
    command's output: a control (``\n``, ``\t``, ``\x1b``, NUL), a format character (a
    bidirectional override, a zero-width one), a line or paragraph separator, or a
    surrogate, private-use or unassigned code point."""
    return any(unicodedata.category(char)[0] == "C" or char in "\u2028\u2029" for char in text)


def choose(argument: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise InvalidSchedule(f"{argument}= must be one of {', '.join(allowed)}; got {value!r}")
    return value
