"""System checks: misconfiguration is reported by ``manage.py check``, not at 21:00."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import DatabaseError, connections, router

from .conf import (
    BACKENDS,
    BOUNDS,
    DEFAULTS,
    ON_REDIS_ERROR_CHOICES,
    modules_problem,
    number_problem,
    taskguard_settings,
    token_problem,
)
from .locks import is_redis_cache

# Bounded numbers with a check id of their own; the others share E009.
NUMBER_CHECK_IDS = {"LEASE_SECONDS": "taskguard.E004", "FINISHED_MARKER_SECONDS": "taskguard.E012"}


@register(Tags.compatibility)
def check_settings(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    raw = getattr(settings, "TASKGUARD", {})
    if not isinstance(raw, dict):
        return [Error("TASKGUARD must be a dict.", id="taskguard.E008")]
    backend = raw.get("BACKEND", DEFAULTS["BACKEND"])
    alias = str(raw.get("REDIS_ALIAS", DEFAULTS["REDIS_ALIAS"]))
    if backend not in BACKENDS:
        errors.append(
            Error(
                f"TASKGUARD['BACKEND'] is {backend!r}.",
                hint="Use 'auto', 'redis' or 'database'.",
                id="taskguard.E001",
            )
        )
    if backend == "redis" and not is_redis_cache(alias):
        errors.append(
            Error(
                f"TASKGUARD['BACKEND'] is 'redis' but CACHES[{alias!r}] "
                "is not a django-redis cache.",
                hint="Point REDIS_ALIAS at a cache whose BACKEND is "
                "'django_redis.cache.RedisCache', or use BACKEND 'database'.",
                id="taskguard.E002",
            )
        )
    if not settings.USE_TZ:
        errors.append(
            Error(
                "taskguard needs USE_TZ = True.",
                hint="Slots are aware UTC datetimes; naive times are ambiguous across DST.",
                id="taskguard.E003",
            )
        )
    for name in BOUNDS:
        problem = number_problem(name, raw.get(name, DEFAULTS[name]))
        if problem is not None:
            errors.append(
                Error(
                    f"{problem}.",
                    hint=f"The default is {DEFAULTS[name]!r}.",
                    id=NUMBER_CHECK_IDS.get(name, "taskguard.E009"),
                )
            )
    for name in ("HEALTH_TOKEN", "METRICS_TOKEN"):
        problem = token_problem(name, raw.get(name))
        if problem is not None:
            errors.append(
                Error(
                    f"{problem}.",
                    hint="None (the default) lets staff users in only; a token lets a "
                    "client in that sends 'Authorization: Bearer <token>'.",
                    id="taskguard.E021",
                )
            )
    on_error = raw.get("ON_REDIS_ERROR", DEFAULTS["ON_REDIS_ERROR"])
    if on_error not in ON_REDIS_ERROR_CHOICES:
        errors.append(
            Error(
                f"TASKGUARD['ON_REDIS_ERROR'] is {on_error!r}.",
                hint="Use 'database' or 'fail'.",
                id="taskguard.E005",
            )
        )
    problem = modules_problem(raw.get("SCHEDULE_MODULES", DEFAULTS["SCHEDULE_MODULES"]))
    if problem is not None:
        errors.append(Error(f"{problem}.", id="taskguard.E020"))
    errors += _check_database()
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        errors.append(
            Warning(
                f"Unknown TASKGUARD keys: {', '.join(unknown)}.",
                hint=f"Known keys: {', '.join(sorted(DEFAULTS))}.",
                id="taskguard.W001",
            )
        )
    return errors


def _check_database() -> list[CheckMessage]:
    alias = taskguard_settings.DATABASE_ALIAS
    if alias not in connections.settings:
        return [
            Error(
                f"TASKGUARD['DATABASE_ALIAS'] is {alias!r}, which is not in DATABASES.",
                id="taskguard.E006",
            )
        ]
    vendor = connections[alias].vendor
    if vendor not in ("postgresql", "sqlite", "mysql"):
        return [
            Error(
                f"taskguard supports PostgreSQL, MariaDB and SQLite; DATABASES[{alias!r}] "
                f"is {vendor}.",
                id="taskguard.E007",
            )
        ]
    return _check_routing(alias)


@register(Tags.database)
def check_ledger_server(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """MariaDB 10.11+, not MySQL (E007): Django's "mysql" is both, and only the server
    tells which (``check --database``, ``migrate``)."""
    from .ledger.sql import vendor_problem

    alias = taskguard_settings.DATABASE_ALIAS
    if not databases or alias not in databases or alias not in connections.settings:
        return []
    connection = connections[alias]
    if connection.vendor != "mysql":
        return []
    try:
        problem = vendor_problem(connection)
    except DatabaseError:
        return []  # unreachable: the command that asked for the check says so itself
    if problem is None:
        return []
    return [
        Error(
            f"DATABASES[{alias!r}]: {problem}.",
            hint="Put the ledger on MariaDB 10.11 or later, PostgreSQL or SQLite "
            "(TASKGUARD['DATABASE_ALIAS']).",
            id="taskguard.E007",
        )
    ]


@register(Tags.database)
def check_schedule_zones(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """W020: stored crons without their own zone that a copy with another TIME_ZONE saved
    (``check --database``, ``migrate``)."""
    from django.utils.timezone import get_default_timezone_name

    from .exceptions import BackendUnavailable
    from .ledger import schedules as store

    alias = taskguard_settings.DATABASE_ALIAS
    if not databases or alias not in databases or alias not in connections.settings:
        return []
    zone = get_default_timezone_name()
    try:
        conflicts = store.zone_conflicts(zone)
    except BackendUnavailable:
        return []  # unreachable or not migrated yet: the command that asked says so itself
    return [
        Warning(
            f"Schedule {task!r} was saved by a copy whose TIME_ZONE is {theirs!r}; this "
            f"copy's is {zone!r}: the two fire its cron at different instants.",
            hint="Give every copy of the project the same TIME_ZONE, or give the cron its "
            "own zone (a time zone for the schedule).",
            id="taskguard.W020",
        )
        for task, theirs in conflicts
    ]


def _check_routing(alias: str) -> list[CheckMessage]:
    """The ledger lives on ``alias``: the routers must let it be migrated there, and
    should send the project's own TaskRun queries there too."""
    from .models import TaskRun

    errors: list[CheckMessage] = []
    if not router.allow_migrate_model(alias, TaskRun):
        errors.append(
            Error(
                f"TASKGUARD['DATABASE_ALIAS'] is {alias!r}, but the database routers do not "
                f"allow taskguard's migrations there, so its tables will not exist.",
                hint=f"Let allow_migrate() return True for app 'taskguard' on {alias!r}, then "
                f"run: manage.py migrate taskguard --database {alias}",
                id="taskguard.E011",
            )
        )
    routed = {router.db_for_read(TaskRun), router.db_for_write(TaskRun)}
    if routed != {alias}:
        errors.append(
            Warning(
                f"TASKGUARD['DATABASE_ALIAS'] is {alias!r}, but the database routers send "
                f"TaskRun queries to {', '.join(sorted(map(repr, routed)))}.",
                hint="taskguard itself always uses DATABASE_ALIAS; your own TaskRun queries "
                "(TaskRun.objects...) would read another database. Route app 'taskguard' to "
                f"{alias!r}, or use TaskRun.objects.using({alias!r}).",
                id="taskguard.W013",
            )
        )
    return errors


MIN_REDIS = (7, 0)


def redis_version_problem(version: str) -> str | None:
    """Why a Redis of ``version`` cannot hold the locks (no ``SET ... NX GET``), or None."""
    try:
        found = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return None  # a fork with its own numbering: the acquire says so if it fails
    if found < MIN_REDIS:
        return f"is Redis {version}; taskguard's lock needs 7.0 or newer (SET ... NX GET)"
    return None


@register(Tags.caches)
def check_lock_redis(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """Report a lock Redis that cannot be built (E010), may evict keys or cannot be asked (W01x)."""
    from .locks import backend_name

    alias = taskguard_settings.REDIS_ALIAS
    try:
        if backend_name() != "redis" or not is_redis_cache(alias):
            return []
        marker = taskguard_settings.raw().get("FINISHED_MARKER_SECONDS", 0)
        if number_problem("FINISHED_MARKER_SECONDS", marker) is not None:
            return []  # E012; the lock refuses to be built with it
        from redis.exceptions import RedisError, ResponseError

        from .locks.redis import RedisLock
    except Exception:  # a broken setting is reported by check_settings
        return []
    try:
        lock = RedisLock.for_alias(alias)  # builds the client; connects to nothing yet
    except Exception as exc:
        return [
            Error(
                f"taskguard cannot build its Redis client from CACHES[{alias!r}] "
                f"({type(exc).__name__}: {exc}).",
                hint="Fix the cache's LOCATION and OPTIONS. For Sentinel, the cache needs "
                "OPTIONS CONNECTION_FACTORY 'django_redis.pool.SentinelConnectionFactory' "
                "(or DJANGO_REDIS_CONNECTION_FACTORY) and SENTINELS; see docs/redis.md.",
                id="taskguard.E010",
            )
        ]
    try:
        too_old = redis_version_problem(lock.server_version())
        policy = lock.eviction_policy()
    except ResponseError as exc:
        return [
            Warning(
                f"taskguard could not read maxmemory-policy of CACHES[{alias!r}] ({exc}).",
                hint="Make sure the lock Redis uses maxmemory-policy noeviction.",
                id="taskguard.W012",
            )
        ]
    except RedisError as exc:
        return [
            Warning(
                f"taskguard could not reach the lock Redis CACHES[{alias!r}] ({exc}).",
                hint="Its maxmemory-policy was not checked. Tasks still run once via the "
                "database while it is down if ON_REDIS_ERROR is 'database'.",
                id="taskguard.W011",
            )
        ]
    if too_old is not None:
        return [
            Error(
                f"The lock Redis CACHES[{alias!r}] {too_old}.",
                hint="Upgrade the Redis that holds taskguard's locks to 7.0 or newer, or use "
                "TASKGUARD['BACKEND'] = 'database'.",
                id="taskguard.E013",
            )
        ]
    if policy != "noeviction":
        return [
            Warning(
                f"The lock Redis CACHES[{alias!r}] has maxmemory-policy {policy!r}: under "
                "memory pressure it may evict lock keys.",
                hint="Use maxmemory-policy noeviction for the Redis that holds taskguard's "
                "locks (or a separate Redis for them). An evicted lock costs the fast path, "
                "not correctness: the database row still decides.",
                id="taskguard.W010",
            )
        ]
    return []
