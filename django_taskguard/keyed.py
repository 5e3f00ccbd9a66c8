"""``@once_per_key``: run a function at most once per key (an idempotency key) across all
instances, with the same guarantees as a schedule slot."""

from __future__ import annotations

import functools
import inspect
import string
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, cast, overload

from asgiref.sync import iscoroutinefunction
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from . import coroutines, guard
from .conf import lease_problem
from .decorating import (
    USE_TZ_NEEDED,
    CallContext,
    call_context,
    choose,
    dotted_name,
    note_on_stale,
    refuse_task_object,
    validate_task_name,
)
from .exceptions import InvalidKey, InvalidSchedule
from .models import KEY_MAX_LENGTH
from .policy import OnDuplicate, OnStale, Policy

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

# ``keep`` is stored nowhere: it is judged when a call meets a finished key, in
# seconds on the database's clock. Ten years is "forever" for any real use.
KEEP_MAX = timedelta(days=3650)


class AsyncKeyGuarded(Protocol[P, T]):
    """A keyed coroutine function: await it like the original; it returns None when not run."""

    task_name: str | None
    policy: Policy
    __wrapped__: Callable[P, Awaitable[T]]

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, T | None]: ...

    def key_of(self, *args: P.args, **kwargs: P.kwargs) -> str:
        """The key a call with these arguments runs under (checked, as stored)."""
        ...


class KeyDecorator(Protocol):
    """What ``@once_per_key(...)`` returns: it guards a function or a coroutine function."""

    # A coroutine function matches both; the first wins (mypy asks to be told).
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: Callable[P, Coroutine[Any, Any, T]], /
    ) -> AsyncKeyGuarded[P, T]: ...

    @overload
    def __call__(self, func: Callable[P, R], /) -> KeyGuarded[P, R]: ...


class KeyGuarded(Protocol[P, R]):
    """A keyed function: call it like the original; it returns None when not run."""

    task_name: str | None
    policy: Policy
    __wrapped__: Callable[P, R]

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R | None: ...

    def key_of(self, *args: P.args, **kwargs: P.kwargs) -> str:
        """The key a call with these arguments runs under (checked, as stored)."""
        ...


def check_key(value: object, where: str) -> str:
    """``value`` if it can be stored and told apart as a key; ``InvalidKey`` if not.

    Keys are stored exactly as given: a NUL or a lone surrogate (which no database
    stores) is refused rather than escaped, since an escaped key could equal
    another key that was given that way.
    """
    if not isinstance(value, str):
        raise InvalidKey(f"{where}: a key must be a str, got {type(value).__name__} {value!r}")
    if not value:
        raise InvalidKey(f"{where}: the key is empty")
    if len(value) > KEY_MAX_LENGTH:
        raise InvalidKey(
            f"{where}: the key is {len(value)} characters long; at most {KEY_MAX_LENGTH} are "
            f"stored ({value[:40]!r}...). Hash long keys yourself (e.g. hashlib.sha256)"
        )
    if "\x00" in value:
        raise InvalidKey(f"{where}: the key contains a NUL character: {value!r}")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidKey(f"{where}: the key contains a lone surrogate: {value!r}") from None
    return value


def keep_seconds(keep: timedelta | None) -> float | None:
    """``keep=`` as seconds (None: until pruned), or ``InvalidSchedule``."""
    if keep is None:
        return None
    if not isinstance(keep, timedelta):
        raise InvalidSchedule(f"keep= must be a timedelta or None, got {keep!r}")
    if keep < timedelta(0) or keep > KEEP_MAX:
        raise InvalidSchedule(f"keep= must be between 0 and {KEEP_MAX.days} days, got {keep}")
    return keep.total_seconds()


def _flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidSchedule(f"{name}= must be True or False, got {value!r}")
    return value


@functools.lru_cache(maxsize=256)
def _fields(template: str) -> tuple[str, ...]:
    """The top-level names a ``str.format`` template refers to (``order`` of ``{order.id}``)."""
    names = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        root = field.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise InvalidSchedule(
                f"key={template!r}: name the parameters ({{order_id}}), not positions ({{}}/{{0}})"
            )
        names.append(root)
    return tuple(names)


class _KeyMaker(Generic[P]):
    """Builds a call's key from ``key=``: a format string over the parameters, or a callable."""

    def __init__(self, key: str | Callable[..., str], func: Callable[P, Any], where: str) -> None:
        self.key = key
        self.where = where
        self.signature = inspect.signature(func)
        params = self.signature.parameters
        plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        # Parameter names in order when every one is plain (else None: bind each call).
        self.simple: tuple[str, ...] | None = (
            tuple(params) if all(p.kind in plain for p in params.values()) else None
        )
        self.positional = tuple(n for n, p in params.items() if p.kind is plain[0])
        self.defaults = {n: p.default for n, p in params.items() if p.default is not p.empty}
        if isinstance(key, str):
            var_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
            unknown = [name for name in _fields(key) if name not in params]
            if unknown and not var_keyword:
                raise InvalidSchedule(
                    f"@once_per_key on {where}: key={key!r} names {', '.join(unknown)}, which "
                    f"{'is' if len(unknown) == 1 else 'are'} not a parameter of the function "
                    f"({', '.join(params) or 'none'})"
                )
        elif not callable(key):
            raise InvalidSchedule(
                f"@once_per_key on {where}: key= must be a format string or a callable"
            )

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        if not isinstance(self.key, str):
            return check_key(self.key(*args, **kwargs), f"{self.where}: key=")
        if self.simple is not None and len(args) <= len(self.positional):
            # The hot path: plain parameters, no *args/**kwargs. Anything this cannot
            # build (a missing argument, an unknown or repeated keyword) goes the long
            # way below, which says what is wrong.
            values = dict(self.defaults)
            values.update(zip(self.positional, args, strict=False))
            if kwargs:
                if not kwargs.keys().isdisjoint(self.positional[: len(args)]):
                    values = {}  # given twice: bind() below raises
                values.update(kwargs)
            try:
                if len(values) == len(self.simple):
                    return check_key(self.key.format_map(values), self.where)
            except (KeyError, AttributeError, IndexError):
                pass
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise InvalidKey(
                f"{self.where}: cannot bind the call to build its key ({exc})"
            ) from exc
        bound.apply_defaults()
        values = dict(bound.arguments)
        for name, param in self.signature.parameters.items():
            if param.kind is param.VAR_KEYWORD:
                values.update(values.pop(name, {}))
        try:
            built = self.key.format(**values)
        except (KeyError, AttributeError, IndexError) as exc:
            raise InvalidKey(f"{self.where}: key={self.key!r} cannot be built ({exc!r})") from exc
        return check_key(built, f"{self.where}: key={self.key!r}")


def once_per_key(
    func: Any = None,
    /,
    *,
    key: str | Callable[..., str] | None = None,
    keep: timedelta | None = None,
    name: str | None = None,
    on_duplicate: OnDuplicate = "skip",
    on_stale: OnStale = "abandon",
    lease_seconds: float | None = None,
    return_result: bool = False,
) -> KeyDecorator:
    """Run the decorated function at most once per key, across every instance.

    ``key`` is a format string over the function's parameters
    (``"order:{order_id}"``, defaults included) or a callable given the call's
    arguments that returns the key. The winning call returns the function's
    result; a call whose key is running or finished returns ``None`` (or raises
    ``DuplicateRun`` with ``on_duplicate="raise"``). ``keep``: how long a
    finished key blocks a new run (``None``: until ``prune_runs`` deletes its row;
    ``timedelta(0)``: only while it runs). ``return_result=True``: the result is stored
    as JSON (at most 64 KiB) and a duplicate of the succeeded key returns it (one query).
    A coroutine function stays one (the claim and the finish run in worker threads).
    """
    if func is not None or key is None:
        raise InvalidSchedule(
            "@once_per_key needs key=, a format string over the function's parameters or a "
            "callable: @once_per_key(key='order:{order_id}')"
        )
    if name is not None:
        validate_task_name(name)
    if lease_seconds is not None:
        problem = lease_problem(lease_seconds, "lease_seconds=")
        if problem is not None:
            raise InvalidSchedule(problem)
    if isinstance(key, str):
        _fields(key)
    policy = Policy(
        on_duplicate=choose("on_duplicate", on_duplicate, ("skip", "raise")),
        on_stale=choose("on_stale", on_stale, ("abandon", "retry")),
        lease_seconds=lease_seconds,
        keep_seconds=keep_seconds(keep),
        return_result=_flag(return_result, "return_result"),
    )

    given = key

    def decorate(target: Callable[..., Any]) -> Any:
        refuse_task_object(target, "@once_per_key(...)")
        where = name or dotted_name(target)
        if name is None:
            validate_task_name(where)
        make_key = _KeyMaker(given, target, where)
        note_on_stale(where, policy.on_stale)

        keyed = _Keyed(name, where, policy, make_key)
        if iscoroutinefunction(target):
            wrapper = _async_form(keyed, target)
        else:
            wrapper = _plain_form(keyed, target)

        guarded: Any = wrapper  # typed by KeyDecorator
        guarded.task_name = name
        guarded.policy = policy
        guarded.key_of = make_key
        return guarded

    return cast("KeyDecorator", decorate)


@dataclass(frozen=True)
class _Keyed:
    """What a keyed call needs besides the function: the names, the policy, the key."""

    name: str | None
    where: str
    policy: Policy
    make_key: _KeyMaker[Any]

    def begin(self, run_key: str, hooks: CallContext) -> guard.Started:
        """Claim ``run_key`` for this call (blocking: Redis and the database)."""
        return guard.begin(
            self.name or hooks.task_name or self.where,
            timezone.now(),
            self.policy,
            classify_raise=hooks.classify_raise,
            instance=hooks.instance,
            on_busy=hooks.on_busy,
            message_id=hooks.message_id,
            key=run_key,
        )


def _plain_form(keyed: _Keyed, target: Callable[..., Any]) -> Callable[..., Any]:
    # A plain function, so that Celery's ``shared_task(bind=True)`` can bind it.
    @functools.wraps(target)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not django_settings.USE_TZ:
            raise ImproperlyConfigured(USE_TZ_NEEDED)
        run_key = keyed.make_key(*args, **kwargs)
        started = keyed.begin(run_key, call_context() or CallContext())
        return guard.run(started, target, args, kwargs)

    return wrapper


def _async_form(keyed: _Keyed, target: Callable[..., Any]) -> Callable[..., Any]:
    """The guarded coroutine function (see ``coroutines``)."""

    @functools.wraps(target)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not django_settings.USE_TZ:
            raise ImproperlyConfigured(USE_TZ_NEEDED)
        run_key = keyed.make_key(*args, **kwargs)
        begin = functools.partial(keyed.begin, run_key, call_context() or CallContext())
        return await coroutines.execute(begin, target, args, kwargs)

    return wrapper
