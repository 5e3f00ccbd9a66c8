"""Stale-lock cleanup, shared by ``manage.py cleanup_locks``, the admin and startup.

Every change goes through :func:`ledger.change` with ``lease="expired"`` (or,
at startup, against this host's dead pids): a compare-and-set on the run's
state, fence and lease by the database's clock. A run whose owner renewed its
lease, finished, or was taken over meanwhile is not touched, so running this
from every instance at once is safe, and running it twice changes nothing
the second time. Redis keys are only ever deleted by compare-and-delete on
the token of an attempt that is known to be over. The Redis sweep (claim
records of unrecorded slots, orphan keys) is in ``cleanup_redis``.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import DatabaseError, connections
from django.db.models import QuerySet

from . import ledger
from .conf import taskguard_settings
from .exceptions import BackendUnavailable
from .ledger import Row, Step
from .locks import LockBackend, backend_name, get_backend
from .locks.base import run_key
from .models import TaskRun
from .signals import run_abandoned
from .states import RunState

logger = logging.getLogger("taskguard.cleanup")

BATCH_SIZE = 500

ROW_FIELDS = ("id", "task_name", "slot", "state", "attempt", "fence", "owner", "lease_until")


@dataclass
class CleanupResult:
    stale_runs: int = 0
    released_locks: int = 0
    orphan_keys: int = 0
    unrecorded_slots: int = 0  # slots whose Redis winner died before its row, now recorded
    dry_run: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "stale_runs": self.stale_runs,
            "released_locks": self.released_locks,
            "orphan_keys": self.orphan_keys,
            "unrecorded_slots": self.unrecorded_slots,
            "dry_run": self.dry_run,
        }


def actor() -> str:
    """Who the transition log names as the cleaner."""
    return f"cleanup@{socket.gethostname()}:{os.getpid()}"


def token_of(owner: str) -> str:
    """The per-attempt token: the last ``:`` part of ``host:pid:token``."""
    return owner.rsplit(":", 1)[-1] if owner.count(":") >= 2 else ""


def cleanup_locks(
    *,
    task: str | None = None,
    runs: QuerySet[TaskRun] | None = None,
    dry_run: bool = False,
    batch_size: int = BATCH_SIZE,
    scan_orphans: bool = True,
) -> CleanupResult:
    """Abandon stale runs, release their locks; with Redis, sweep its keys too.

    The Redis sweep (``cleanup_redis``) records the slots whose Redis winner
    died before writing its row, and removes orphan lock keys. ``runs``
    limits the work to those runs (the admin action; read as a subquery, so
    "select all" costs no memory) and skips the Redis sweep, as does
    ``scan_orphans=False``.
    Raises ``BackendUnavailable`` when the database or the lock backend
    cannot be reached.
    """
    result = CleanupResult(dry_run=dry_run)
    lock = get_backend()
    queryset = TaskRun.objects.stale()
    if task is not None:
        queryset = queryset.filter(task_name=task)
    if runs is not None:
        queryset = queryset.filter(pk__in=runs.order_by().values("pk"))
        scan_orphans = False
    for run in _batches(queryset, batch_size):
        if dry_run:
            result.stale_runs += 1
            result.released_locks += _holds(lock, run)
            continue
        reason = f"lease of {run['owner']} expired at {_iso(run['lease_until'])}; cleanup_locks"
        if abandon(run, reason, lease="expired"):
            result.stale_runs += 1
            result.released_locks += release_if_held(lock, run)
    if scan_orphans and backend_name() == "redis":
        from .cleanup_redis import sweep  # needs the redis extra, installed with this backend

        result.unrecorded_slots, result.orphan_keys = sweep(lock, task, dry_run)
    return result


def _batches(queryset: Any, batch_size: int) -> Iterator[dict[str, Any]]:
    """Rows of ``queryset`` by ascending primary key, ``batch_size`` at a time."""
    last = 0
    while True:
        try:
            fields = [*ROW_FIELDS, *queryset.query.annotations]
            batch = list(queryset.filter(pk__gt=last).order_by("pk").values(*fields)[:batch_size])
        except DatabaseError as exc:
            raise database_unreachable(exc) from exc
        yield from batch
        if len(batch) < batch_size:
            return
        last = batch[-1]["id"]


def abandon(run: dict[str, Any], reason: str, *, lease: str) -> bool:
    """Mark one running row ``abandoned`` if it is still as read; send ``run_abandoned``."""
    alias = taskguard_settings.DATABASE_ALIAS
    row = Row(run["id"], run["state"], run["attempt"], run["fence"], run["owner"], None)
    try:
        changed = ledger.change(
            alias,
            row,
            [Step(RunState.ABANDONED, reason)],
            actor=actor(),
            lease=lease,
            sets=[("error = %s", (reason,))],
        )
    except DatabaseError as exc:
        raise database_unreachable(exc) from exc
    if changed is None:
        logger.info("taskguard run %s changed meanwhile; left alone", run["id"])
        return False
    logger.warning("taskguard run %s (%s) abandoned: %s", run["id"], run["task_name"], reason)
    run_abandoned.send(sender=run["task_name"], run_id=run["id"], slot=run["slot"], reason=reason)
    return True


def _key(run: dict[str, Any]) -> str:
    return run_key(taskguard_settings.KEY_PREFIX, run["task_name"], run["slot"])


def _holds(lock: LockBackend, run: dict[str, Any]) -> bool:
    token = token_of(run["owner"])
    return bool(token) and call_backend(lock.holder, _key(run)) == token


def release_if_held(lock: LockBackend, run: dict[str, Any]) -> bool:
    """Delete the run's lock key only while it still holds the run's token."""
    token = token_of(run["owner"])
    if not token or call_backend(lock.holder, _key(run)) != token:
        return False
    return bool(call_backend(lock.release, _key(run), token))


def call_backend(method: Any, *args: Any) -> Any:
    """``method(*args)``, the lock client's own errors raised as ``BackendUnavailable``."""
    try:
        return method(*args)
    except BackendUnavailable:
        raise
    except Exception as exc:  # the client's own errors (redis.ConnectionError, ...)
        if not _is_backend_error(exc):
            raise
        raise backend_unreachable(exc) from exc


def backend_unreachable(exc: Exception) -> BackendUnavailable:
    return BackendUnavailable(f"the taskguard lock backend is unreachable ({exc})")


def database_unreachable(exc: Exception) -> BackendUnavailable:
    return BackendUnavailable(f"the taskguard database is unreachable ({exc})")


def _is_backend_error(exc: Exception) -> bool:
    try:
        from redis.exceptions import RedisError
    except ImportError:  # pragma: no cover - redis is an extra
        return False
    return isinstance(exc, (RedisError, OSError))


def release_lock(run: TaskRun) -> str:
    """Free one run whose owner is confirmed dead; return what was done.

    ``"abandoned"``: it was running with an expired lease (by the database
    clock) and is now abandoned, its key released if it held the run's
    token. ``"released"``: the run was already over and its key still held
    its token. ``"live"``: the owner's lease is valid, nothing was touched.
    ``"nothing"``: there was nothing to free.
    """
    lock = get_backend()
    current = _batches(TaskRun.objects.filter(pk=run.pk).with_lease(), 1)
    row = next(current, None)
    if row is None:
        return "nothing"
    if row["state"] == RunState.RUNNING:
        if row["lease_alive"]:
            return "live"
        reason = f"lease of {row['owner']} expired at {_iso(row['lease_until'])}; released by admin"
        if not abandon(row, reason, lease="expired"):
            return "live"
        release_if_held(lock, row)
        return "abandoned"
    return "released" if release_if_held(lock, row) else "nothing"


def startup_cleanup() -> int:
    """Abandon this host's runs whose process is gone; return how many.

    Call it once when a worker process starts (the Celery receivers do, with
    ``STARTUP_CLEANUP`` on). Only rows whose owner is *this* hostname and whose
    pid is not alive here (and is not this process) are touched: other hosts'
    runs, and runs of live processes, are never freed. Hostnames must be unique
    per process namespace (the default in Docker and Kubernetes).
    """
    host = socket.gethostname()
    lock = get_backend()
    queryset = TaskRun.objects.running().filter(owner__startswith=f"{host}:")
    count = 0
    for run in _batches(queryset, BATCH_SIZE):
        pid = _pid(run["owner"], host)
        if pid is None or pid == os.getpid() or pid_alive(pid):
            continue
        reason = f"owner process {host}:{pid} is gone (startup cleanup on the same host)"
        if abandon(run, reason, lease=""):
            count += 1
            release_if_held(lock, run)
    return count


def _pid(owner: str, host: str) -> int | None:
    rest = owner[len(host) + 1 :].split(":")
    return int(rest[0]) if len(rest) == 2 and rest[0].isdigit() else None


def pid_alive(pid: int) -> bool:
    """True unless ``pid`` certainly does not exist on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _iso(value: datetime | None) -> str:
    return value.isoformat() if value else "?"


def database_now() -> datetime:
    """The database's clock (every instance judges deadlines against the same time)."""
    alias = taskguard_settings.DATABASE_ALIAS
    with connections[alias].cursor() as cursor:
        cursor.execute(f"SELECT {ledger.dialect(alias).now.replace('%%', '%')}")
        value = ledger._aware(cursor.fetchone()[0])
    assert value is not None
    return value


def ensure_database(alias: str | None = None) -> None:
    """Raise ``BackendUnavailable`` unless the taskguard database answers."""
    alias = alias or taskguard_settings.DATABASE_ALIAS
    try:
        connections[alias].ensure_connection()
    except DatabaseError as exc:
        raise database_unreachable(exc) from exc
