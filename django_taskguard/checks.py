"""System checks: misconfiguration is reported by ``manage.py check``, not at 21:00."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections, router
from django.utils.translation import ngettext

from .conf import DEFAULTS, number_problem, problem, taskguard_problem, taskguard_settings
from .locks import cache_problem, is_redis_cache
from .policy import Policy

# Each key's check id; the bounded numbers without one of their own share E009.
CHECK_IDS = {
    "BACKEND": "taskguard.E001",
    "LEASE_SECONDS": "taskguard.E004",
    "ON_REDIS_ERROR": "taskguard.E005",
    "DATABASE_ALIAS": "taskguard.E006",
    "FINISHED_MARKER_SECONDS": "taskguard.E012",
    "REDIS_ALIAS": "taskguard.E022",
    "SCHEDULE_MODULES": "taskguard.E020",
    "HEALTH_TOKEN": "taskguard.E021",
    "METRICS_TOKEN": "taskguard.E021",
    "KEY_PREFIX": "taskguard.E022",
    "INSTANCE_NAME": "taskguard.E022",
    "STARTUP_CLEANUP": "taskguard.E023",
    "BEAT_CLAIM": "taskguard.E023",
    "CHECKINS": "taskguard.E024",
    "OPENTELEMETRY": "taskguard.E025",
}
TOKEN_HINT = (
    "None (the default) lets staff users in only; a token lets a client in that sends "
    "'Authorization: Bearer <token>'."
)
HINTS = {
    "CHECKINS": "See docs/monitoring.md for the senders and their keys.",
    "HEALTH_TOKEN": TOKEN_HINT,
    "METRICS_TOKEN": TOKEN_HINT,
}


@register(Tags.compatibility)
def check_settings(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """Every key through its validator (the one its property calls where it is read)."""
    raw = getattr(settings, "TASKGUARD", {})
    trouble = taskguard_problem(raw)
    if trouble is not None:
        return [Error(f"{trouble}.", id="taskguard.E008")]
    errors: list[CheckMessage] = []
    for name in DEFAULTS:
        found = problem(name, raw.get(name, DEFAULTS[name]))
        if found is not None:
            hint = HINTS.get(name, f"The default is {DEFAULTS[name]!r}.")
            errors.append(Error(f"{found}.", hint=hint, id=CHECK_IDS.get(name, "taskguard.E009")))
    backend = raw.get("BACKEND", DEFAULTS["BACKEND"])
    alias = raw.get("REDIS_ALIAS", DEFAULTS["REDIS_ALIAS"])
    valid = problem("BACKEND", backend) is None and problem("REDIS_ALIAS", alias) is None
    cache = cache_problem(backend, alias) if valid else None
    if cache is not None:
        hint = (
            "Point REDIS_ALIAS at a cache whose BACKEND is 'django_redis.cache.RedisCache', "
            "or use BACKEND 'database'."
        )
        errors.append(Error(f"{cache[1]}.", hint=hint, id=cache[0]))
    if not settings.USE_TZ:
        errors.append(
            Error(
                "taskguard needs USE_TZ = True.",
                hint="Slots are aware UTC datetimes; naive times are ambiguous across DST.",
                id="taskguard.E003",
            )
        )
    if problem("DATABASE_ALIAS", raw.get("DATABASE_ALIAS", DEFAULTS["DATABASE_ALIAS"])) is None:
        errors += _check_database()
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        said = ngettext("Unknown TASKGUARD key", "Unknown TASKGUARD keys", len(unknown))
        errors.append(
            Warning(
                f"{said}: {', '.join(unknown)}.", hint=_likely_keys(unknown), id="taskguard.W001"
            )
        )
    return errors


def _likely_keys(unknown: list[str]) -> str:
    """The known key each of ``unknown`` is likely a typo of; every known key only when one
    of them is close to none (a list of 40 keys hides the one meant)."""
    hints, far = [], []
    for key in unknown:
        close = difflib.get_close_matches(str(key).upper(), list(DEFAULTS), n=1, cutoff=0.6)
        if close:
            hints.append(f"{key}: did you mean {close[0]}?")
        else:
            far.append(str(key))
    if far:
        hints.append(
            f"No known key is close to {', '.join(far)}; the known keys: "
            f"{', '.join(sorted(DEFAULTS))}."
        )
    return " ".join(hints)


def _valid(name: str) -> Any:
    """A setting's value, or None when it is invalid: ``check_settings`` reports that by its
    own id (E006, E008, ...), and no check may raise out of ``manage.py check``."""
    try:
        return getattr(taskguard_settings, name)
    except ImproperlyConfigured:
        return None


def _check_database() -> list[CheckMessage]:
    from .ledger.backends import of_vendor

    alias = taskguard_settings.DATABASE_ALIAS
    vendor = connections[alias].vendor
    if of_vendor(vendor) is None:
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
    from .ledger.backends import of_vendor

    alias = _valid("DATABASE_ALIAS")
    if (
        alias is None
        or not databases
        or alias not in databases
        or alias not in connections.settings
    ):
        return []
    connection = connections[alias]
    backend = of_vendor(connection.vendor)
    if backend is None:
        return []  # E007 from _check_database (check_settings)
    try:
        problem = backend.server_problem(connection)
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


@register(Tags.compatibility)
def check_schedule_modules(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """E026: a module named in ``SCHEDULE_MODULES`` that cannot be imported (a typo, a
    missing dependency, an error in it); E027: a module of schedules (there, or an app's
    ``tasks``/``jobs``) whose decorator refuses its arguments (a cron such as ``61 * * * *``).
    ``run_schedules`` and ``backfill`` refuse to start on either."""
    from . import registry
    from .exceptions import InvalidSchedule

    if _valid("SCHEDULE_MODULES") is None:
        return []  # E020
    errors: list[CheckMessage] = []
    for path, exc in registry.import_problems():
        if isinstance(exc, InvalidSchedule):
            errors.append(
                Error(
                    f"The module of schedules {path!r} refuses a schedule when imported: {exc}.",
                    hint="Fix the decorator's arguments (docs/schedules.md); run_schedules "
                    "and backfill do not start until the module imports.",
                    id="taskguard.E027",
                )
            )
        else:
            errors.append(
                Error(
                    f"{registry.schedule_module_problem(path, exc)}.",
                    hint="Name importable modules in TASKGUARD['SCHEDULE_MODULES'] (dotted "
                    "paths, as in an import statement); run_schedules, backfill, pause_task, "
                    "resume_task and cleanup_locks do not start until they import.",
                    id="taskguard.E026",
                )
            )
    return errors


@register(Tags.database)
def check_schedule_zones(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """W020: stored crons without their own zone that a copy with another TIME_ZONE saved
    (``check --database``, ``migrate``); only the schedules this copy registers (a row of
    a schedule removed from the code fires nowhere)."""
    from django.utils.timezone import get_default_timezone_name

    from . import registry
    from .exceptions import BackendUnavailable
    from .ledger import schedules as store

    alias = _valid("DATABASE_ALIAS")
    if alias is None or not databases or alias not in databases:
        return []
    if alias not in connections.settings:
        return []
    zone = get_default_timezone_name()
    try:
        registered = registry.discover().keys()
    except Exception:  # a schedules module that fails to import: sync says which, not check
        registered = registry.entries().keys()
    try:
        conflicts = store.zone_conflicts(zone, registered)
    except BackendUnavailable:
        return []  # unreachable or not migrated yet: the command that asked says so itself
    return [
        Warning(
            f"Schedule {task!r} was saved by a copy whose TIME_ZONE is {theirs!r}; this "
            f"copy's is {zone!r}: the two fire its cron at different instants.",
            hint="Give every copy of the project the same TIME_ZONE, or give the cron its "
            "own zone: @once_per_schedule(cron=..., time_zone='Europe/Berlin'), or "
            "define_schedule(..., time_zone=...).",
            id="taskguard.W020",
        )
        for task, theirs in conflicts
    ]


# Distinct data-schedule targets W021 looks up (checks run at every manage.py call).
TARGETS_CHECKED = 100
# The data schedules a W021 names (then "and N more").
NAMES_SHOWN = 5


def _some(names: list[str], count: int) -> str:
    """``a, b, c`` (and "and N more" past those named)."""
    more = count - len(names)
    return ", ".join(names) + (f" and {more} more" if more > 0 else "")


@register(Tags.database)
def check_data_targets(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """W021: data schedules whose target this process cannot find (``check --database``,
    ``migrate``): a copy like it fires none of their slots. W037: data schedules that follow
    a value of their target's policy (left empty) which their definition could not have
    been saved with (the target's decorator changed since). One grouped query, at most
    ``TARGETS_CHECKED`` distinct targets looked up."""
    from .data_schedules import resolve_target
    from .exceptions import BackendUnavailable
    from .ledger import schedules as store

    alias = _valid("DATABASE_ALIAS")
    if alias is None or not databases or alias not in databases:
        return []
    if alias not in connections.settings:
        return []
    try:
        targets = store.data_targets(TARGETS_CHECKED)
    except BackendUnavailable:
        return []  # unreachable or not migrated yet: the command that asked says so itself
    warnings: list[CheckMessage] = []
    for each in targets:
        target, kind, count = each.target, each.kind, each.schedules
        try:
            found = resolve_target(target)
        except Exception as exc:  # a check never raises out of manage.py check
            names = _some(store.data_schedule_names(target, kind, NAMES_SHOWN), count)
            warnings.append(
                Warning(
                    ngettext(
                        "%(n)d data schedule (%(names)s) runs %(target)r",
                        "%(n)d data schedules (%(names)s) run %(target)r",
                        count,
                    )
                    % {"n": count, "names": names, "target": target}
                    + f" ({kind or 'function'}), which this process cannot find: {exc}. A "
                    "copy like this one fires none of their slots, and the missed-slot sweep "
                    "records them missed.",
                    hint="Make the target importable where the schedules are fired (its "
                    "module in an installed app's tasks or jobs, or SCHEDULE_MODULES), or "
                    "point the schedules at its new name, disable or delete them.",
                    id="taskguard.W021",
                )
            )
            continue
        warnings += _following_what_they_cannot(each, found.policy)
    return warnings


def _following_what_they_cannot(each: Any, policy: Policy) -> list[CheckMessage]:
    """W037 for the data schedules of ``each`` (a ``ledger.schedules.DataTarget``), whose
    decorator's policy is ``policy``: a query only when some would be reported."""
    from .ledger import schedules as store
    from .models import TargetKind

    target, kind = each.target, each.kind
    celery_all = kind == TargetKind.CELERY and policy.catchup == "all"
    jitter = each.longest_jitter
    if not (celery_all and each.following_catchup) and (jitter is None or jitter < policy.grace):
        return []
    try:
        count, names = store.data_following(
            target, kind, NAMES_SHOWN, grace_below=policy.grace, catchup=celery_all
        )
    except Exception:  # a check never raises out of manage.py check
        return []
    if not count:
        return []
    grace = f"{policy.grace.total_seconds():g} s"
    return [
        Warning(
            ngettext(
                "%(n)d data schedule (%(names)s) of %(target)r follows",
                "%(n)d data schedules (%(names)s) of %(target)r follow",
                count,
            )
            % {"n": count, "names": _some(names, count), "target": target}
            + f" its decorator's policy (their catch-up or grace left empty), which now says "
            f"grace {grace}, catch-up {policy.catchup}: a jitter not shorter than that grace "
            "has starts judged late (their slots can be recorded missed), and a beat sends "
            "only the latest slot of a Celery task whatever its catch-up says (all is "
            "run_schedules').",
            hint="Give those schedules a grace longer than their jitter (or a shorter "
            "jitter), and a Celery task's schedules catch-up latest or none; or change the "
            "decorator back.",
            id="taskguard.W037",
        )
    ]


# A deployment check: ``migrate`` runs the database checks before it applies anything,
# and must not be told to run itself.
@register(Tags.database, deploy=True)
def check_migrations_applied(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """W014: taskguard's migrations not applied on ``DATABASE_ALIAS``
    (``check --deploy --database ALIAS``)."""
    from django.db.migrations.executor import MigrationExecutor

    alias = _valid("DATABASE_ALIAS")
    if alias is None or not databases or alias not in databases:
        return []
    try:
        executor = MigrationExecutor(connections[alias])
        leaves = [key for key in executor.loader.graph.leaf_nodes() if key[0] == "taskguard"]
        plan = executor.migration_plan(leaves)
    except DatabaseError:
        return []  # unreachable: the command that asked for the check says so itself
    missing = [
        migration.name for migration, _backwards in plan if migration.app_label == "taskguard"
    ]
    if not missing:
        return []
    return [
        Warning(
            f"{len(missing)} of taskguard's migrations are not applied on database "
            f"{alias!r} ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): "
            f"guarded calls, run_schedules and check_schedules will fail there.",
            hint=f"run: manage.py migrate taskguard --database {alias}",
            id="taskguard.W014",
        )
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

    alias = _valid("REDIS_ALIAS")
    if alias is None:
        return []
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
