"""Stale-lock cleanup, shared by ``manage.py cleanup_locks``, the admin and startup.

Every change is a compare-and-set in the ledger (:func:`ledger.abandon`) on
the run's state, fence and, but at startup, its lease by the database's
clock. A run whose owner renewed its lease, finished, or was taken over
meanwhile is not touched, so running this from every instance at once is
safe, and running it twice changes nothing the second time. Lock keys are
only ever deleted by compare-and-delete on the token of an attempt that is
known to be over; the lock backend's own sweep (Redis: claim records of
unrecorded slots, orphan keys) is :meth:`LockBackend.sweep`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from django.db.models import QuerySet

from . import ledger
from .exceptions import BackendUnavailable
from .ledger import RunRef
from .locks import LockBackend, get_backend
from .logfields import row_log_fields
from .models import TaskRun
from .owner import Owner, actor, clean_name, pid_space
from .signals import run_abandoned
from .states import RunState

logger = logging.getLogger("taskguard.cleanup")

BATCH_SIZE = 500
# Runs named one by one in a result (the counts are always whole).
LISTED = 100
T = TypeVar("T")


@dataclass(frozen=True)
class Touched:
    """One run cleanup abandoned (or would), and why."""

    task: str
    slot: datetime
    owner: str
    reason: str
    lock_released: bool  # its Redis key still held its token and was deleted
    run_id: int = 0
    key: str | None = None  # an @once_per_key run's key

    def as_dict(self) -> dict[str, Any]:
        found: dict[str, Any] = {
            "id": self.run_id,
            "task": self.task,
            "slot": self.slot.isoformat(),
            "owner": self.owner,
            "reason": self.reason,
            "lock_released": self.lock_released,
        }
        if self.key is not None:
            found["key"] = self.key
        return found


@dataclass(frozen=True)
class InFlight:
    """A running attempt whose lease is still valid: cleanup leaves it, and says until when."""

    task: str
    slot: datetime
    owner: str
    lease_until: datetime
    seconds_left: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "slot": self.slot.isoformat(),
            "owner": self.owner,
            "lease_until": self.lease_until.isoformat(),
            "seconds_left": round(self.seconds_left, 1),
        }


@dataclass
class CleanupResult:
    stale_runs: int = 0
    released_locks: int = 0
    orphan_keys: int = 0
    unrecorded_slots: int = 0  # slots whose Redis winner died before its row, now recorded
    missed_slots: int = 0  # due slots nobody claimed within their grace, recorded missed
    dry_run: bool = False
    runs: list[Touched] = field(default_factory=list)
    in_flight: list[InFlight] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "stale_runs": self.stale_runs,
            "released_locks": self.released_locks,
            "orphan_keys": self.orphan_keys,
            "unrecorded_slots": self.unrecorded_slots,
            "missed_slots": self.missed_slots,
            "dry_run": self.dry_run,
            "runs": [touched.as_dict() for touched in self.runs],
            "in_flight": [flight.as_dict() for flight in self.in_flight],
        }


def cleanup_locks(
    *,
    task: str | None = None,
    runs: QuerySet[TaskRun] | None = None,
    dry_run: bool = False,
    batch_size: int = BATCH_SIZE,
    scan_orphans: bool = True,
    user: str | None = None,
) -> CleanupResult:
    """Abandon stale runs, release their locks; then the lock backend's own sweep.

    ``runs`` limits the work to those runs (the admin action; read as a
    subquery, so "select all" costs no memory) and skips the backend's sweep,
    as does ``scan_orphans=False``. ``user``: the person who asked (the admin),
    named in each reason and as the transitions' actor. Raises
    ``BackendUnavailable`` when the database or the lock backend cannot be reached; a
    lock backend that does not answer stops no stale run from being abandoned (the
    ledger decides; their keys lapse with their TTL), it is raised after them.
    """
    result = CleanupResult(dry_run=dry_run)
    lock = get_backend()
    by, who = _acting(user, "cleanup_locks", "cleanup")
    unreleased: BackendUnavailable | None = None
    for run in ledger.stale_runs(task=task, among=runs, batch_size=batch_size):
        reason = _why(run, by)
        if dry_run:
            released = _holds(lock, run)
        elif abandon(run, reason, lease="expired", who=who):
            try:
                released = release_if_held(lock, run)
            except BackendUnavailable as exc:
                released, unreleased = False, exc
        else:
            continue
        result.stale_runs += 1
        result.released_locks += released
        if len(result.runs) < LISTED:
            result.runs.append(
                Touched(run.task_name, run.slot, run.owner, reason, released, run.id, run.key)
            )
    for flight in ledger.in_flight(task=task, among=runs, limit=LISTED):
        result.in_flight.append(InFlight(*flight))
    if unreleased is not None:
        raise BackendUnavailable(
            f"{result.stale_runs} stale runs abandoned, but their lock keys could not be "
            f"released ({unreleased}); they lapse with their TTL"
        ) from unreleased
    if scan_orphans and runs is None:
        result.unrecorded_slots, result.orphan_keys = call_backend(lock.sweep, task, dry_run)
    return result


def _acting(user: str | None, by: str, role: str) -> tuple[str, str]:
    """What a reason says did it, and the transitions' actor: a person when ``user`` is given."""
    if user is None:
        return by, actor(role)
    return f"admin action by {user}", actor(f"admin/{clean_name(user)}")


def abandon(run: RunRef, reason: str, *, lease: str, who: str | None = None) -> bool:
    """Mark one running row ``abandoned`` if it is still as read; send ``run_abandoned``.

    ``who``: the transition's actor (``cleanup@host:pid`` when not given).
    """
    with ledger.translated:
        changed = ledger.abandon(run.row, actor=who or actor("cleanup"), reason=reason, lease=lease)
    if changed is None:
        logger.info(
            "taskguard run %s changed meanwhile; left alone",
            run.id,
            extra=row_log_fields("run.abandon_skipped", run),
        )
        return False
    logger.warning(
        "taskguard run %s (%s) abandoned: %s",
        run.id,
        run.task_name,
        reason,
        extra=row_log_fields("run.abandoned", run, state="abandoned", reason=reason),
    )
    run_abandoned.send(sender=run.task_name, run_id=run.id, slot=run.slot, reason=reason)
    return True


def _why(run: RunRef, by: str) -> str:
    if run.state == RunState.RETRYING:
        return (
            f"retry never came: attempt {run.attempt} asked for a retry, due by "
            f"{_iso(run.lease_until)} (its wait plus RETRY_GRACE_SECONDS); {by}"
        )
    return f"lease of {run.owner} expired at {_iso(run.lease_until)}; {by}"


def _holds(lock: LockBackend, run: RunRef) -> bool:
    return bool(run.token) and call_backend(
        lock.holder, lock.key_for(run.task_name, run.slot, run.key)
    ) == (run.token)


def release_if_held(lock: LockBackend, run: RunRef) -> bool:
    """Delete the run's lock key only while it still holds the run's token."""
    if not _holds(lock, run):
        return False
    return bool(
        call_backend(lock.release, lock.key_for(run.task_name, run.slot, run.key), run.token)
    )


def call_backend(method: Callable[..., T], *args: Any) -> T:
    """``method(*args)``, the lock client's own errors raised as ``BackendUnavailable``."""
    try:
        return method(*args)
    except BackendUnavailable:
        raise
    except (OSError, ConnectionError) as exc:
        raise BackendUnavailable(f"the taskguard lock backend is unreachable ({exc})") from exc


def release_lock(run_id: int, *, user: str | None = None) -> str:
    """Free one run whose owner is confirmed dead; return what was done.

    ``"abandoned"``: it was running with an expired lease (by the database
    clock) and is now abandoned, its key released if it held the run's
    token. ``"released"``: the run was already over and its key still held
    its token. ``"live"``: the owner's lease is valid, nothing was touched.
    ``"nothing"``: there was nothing to free. ``user``: the person who asked,
    named in the reason and as the transition's actor.
    """
    lock = get_backend()
    by, who = _acting(user, "released by admin", "cleanup")
    found = ledger.run_ref(run_id)
    if found is None:
        return "nothing"
    ref, alive = found
    if ref.state == RunState.RUNNING:
        if alive:
            return "live"
        if not abandon(ref, _why(ref, by), lease="expired", who=who):
            return "live"
        release_if_held(lock, ref)
        return "abandoned"
    return "released" if release_if_held(lock, ref) else "nothing"


def startup_cleanup() -> int:
    """Abandon runs of dead processes that this process can see; return how many.

    Call it once when a worker process starts (the Celery receivers do, with
    ``STARTUP_CLEANUP`` on). Only runs whose owner is in this process's pid
    space (the same kernel boot and pid namespace, see :mod:`.owner`) and
    whose pid is not alive (and is not this process) are touched: a pid from
    another container, even one with the same host name, is never judged here.
    """
    space = pid_space()
    if space == "-":
        return 0  # no way to tell whose pids these are
    lock = get_backend()
    count = 0
    for run in ledger.running_in_pid_space(space, BATCH_SIZE):
        owner = Owner.parse(run.owner)
        if owner is None or not owner.same_pid_space():
            continue
        if owner.pid == os.getpid() or pid_alive(owner.pid):
            continue
        reason = f"owner process {owner.process} is gone (startup cleanup in its pid namespace)"
        if abandon(run, reason, lease=""):
            count += 1
            release_if_held(lock, run)
    return count


def pid_alive(pid: int) -> bool:
    """True unless ``pid`` certainly does not exist in this pid namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _iso(value: datetime | None) -> str:
    return value.isoformat() if value else "?"
