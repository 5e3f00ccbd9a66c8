"""The Redis half of ``cleanup_locks``: claim records of unrecorded slots, orphan lock keys.

Imported by :func:`cleanup.cleanup_locks` only when the backend is redis (so
the redis extra is installed).

- A *claim record* (``{prefix}:dup:{digest}:{slot}``, see ``locks/redis.py``)
  whose lock key is gone names a slot that some call won in Redis, with the
  count of the calls that lost to it. If the winner never wrote its row (it
  died, or lost the database, between its Redis claim and its insert), the
  losers returned ``None`` and nothing else records the slot: this module
  records it ``abandoned`` (G3). If the row exists, the count is added to it.
- An *orphan key* is a lock key whose token no live attempt holds; it is
  removed by compare-and-delete on that token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import F, QuerySet
from django.db.models.functions import Now
from redis.exceptions import LockError, RedisError
from redis.lock import Lock

from .conf import taskguard_settings
from .exceptions import BackendUnavailable
from .locks import LockBackend
from .locks.base import parse_run_key, task_digest
from .locks.redis import ClaimRecord, RedisLock
from .models import TaskRun, TaskRunTransition
from .owner import actor as _actor
from .signals import run_abandoned
from .states import RunState, check_transition

logger = logging.getLogger("taskguard.cleanup")


def actor() -> str:
    return _actor("cleanup")


def backend_unreachable(exc: Exception) -> BackendUnavailable:
    return BackendUnavailable(f"the taskguard lock backend is unreachable ({exc})")


def database_unreachable(exc: Exception) -> BackendUnavailable:
    return BackendUnavailable(f"the taskguard database is unreachable ({exc})")


def call_backend(method: Any, *args: Any) -> Any:
    try:
        return method(*args)
    except BackendUnavailable:
        raise
    except (RedisError, OSError) as exc:
        raise backend_unreachable(exc) from exc


# Claim records are recorded by one cleaner at a time (two would both add a
# record's count to its row): the others skip them. The guard lives this long
# and is renewed while the sweep goes on.
SWEEP_SECONDS = 60


def sweep(lock: LockBackend, task: str | None, dry_run: bool) -> tuple[int, int]:
    """Record unrecorded claims, then remove orphan keys; return both counts."""
    assert isinstance(lock, RedisLock)
    # A claim record is only looked at once its lock key is gone: the winner
    # released it, or its lease lapsed (then, as with any lapsed lease, the
    # slot is no longer that owner's to record).
    recorded = record_claims(lock, task, dry_run)
    return recorded, orphan_keys(lock, task, dry_run)


# -- claim records ----------------------------------------------------------------


def record_claims(lock: RedisLock, task: str | None, dry_run: bool) -> int:
    """Record every claimed slot that has no row; return how many (or would be)."""
    if dry_run:
        return sum(not _row_exists(claim) for claim in _claims(lock, task))
    guard = Lock(
        lock.client,
        f"{taskguard_settings.KEY_PREFIX}:cleanup:claims",
        timeout=SWEEP_SECONDS,
        blocking=False,
        thread_local=False,
    )
    if not call_backend(guard.acquire):
        logger.info("taskguard claim records are being recorded by another cleanup_locks")
        return 0
    try:
        # Scanned under the guard, and each record read just before it is
        # written: a record is never counted from a stale read of another sweep.
        return sum(_record(lock, claim) for claim in _while_held(guard, _claims(lock, task)))
    finally:
        try:
            guard.release()
        except RedisError as exc:  # lapsed or unreachable: it expires on its own
            logger.warning("taskguard cleanup could not release its claim guard (%s)", exc)


def _claims(lock: RedisLock, task: str | None) -> Iterator[ClaimRecord]:
    """Claim records whose lock is gone (of ``task`` only, if given), read as scanned."""
    for claim in lock.unrecorded_claims():
        if task is None or claim.task_name == task:
            yield claim


def _while_held(guard: Lock, claims: Iterator[ClaimRecord]) -> Iterator[ClaimRecord]:
    """``claims``, one by one, renewing the guard; stop if it lapsed (another cleaner goes on)."""
    renewed = time.monotonic()
    for claim in claims:
        if time.monotonic() - renewed > SWEEP_SECONDS / 3:
            try:
                guard.reacquire()
            except LockError:
                logger.warning("taskguard cleanup lost its claim guard; the rest is left")
                return
            except RedisError as exc:
                raise backend_unreachable(exc) from exc
            renewed = time.monotonic()
        yield claim


def _record(lock: RedisLock, claim: ClaimRecord) -> bool:
    """Write ``claim`` into the ledger, then forget it; True when a row was created.

    The database goes first, so a crash in between can never lose a slot: its
    cost is that the next sweep finds the record again and adds its count to
    the row a second time (an overcount of duplicates, never a lost slot). A
    new call that wins the slot in Redis and releases it, folding the record,
    in the milliseconds between our read and our write costs the same.
    """
    created = _write(claim)
    if not call_backend(lock.forget_claim, claim):
        # The slot's lock was taken again since we read the record. The new
        # holder folds the record's whole count into the row when it releases
        # (or the next sweep does, if it dies too): take our count back so it is
        # not counted twice. The abandoned row, if we made it, stays recorded.
        _add_duplicates(claim, -claim.duplicates)
        logger.info("taskguard claim %s is held again; its count is left to it", claim.key)
    return created


def _write(claim: ClaimRecord) -> bool:
    """Add the count to the slot's row, or insert the row ``abandoned``; True if inserted."""
    if _add_duplicates(claim, claim.duplicates):
        return False
    try:
        run_id, reason = _insert_abandoned(claim)
    except IntegrityError:
        # A caller inserted the row between our UPDATE and INSERT: count on its row.
        _add_duplicates(claim, claim.duplicates)
        return False
    except DatabaseError as exc:
        raise database_unreachable(exc) from exc
    logger.warning(
        "taskguard %s slot %s recorded abandoned: %s", claim.task_name, claim.slot, reason
    )
    run_abandoned.send(sender=claim.task_name, run_id=run_id, slot=claim.slot, reason=reason)
    return True


def _runs(claim: ClaimRecord) -> QuerySet[TaskRun]:
    alias = taskguard_settings.DATABASE_ALIAS
    return TaskRun.objects.using(alias).filter(task_name=claim.task_name, slot=claim.slot)


def _row_exists(claim: ClaimRecord) -> bool:
    try:
        return bool(_runs(claim).exists())
    except DatabaseError as exc:
        raise database_unreachable(exc) from exc


def _add_duplicates(claim: ClaimRecord, count: int) -> bool:
    """Add ``count`` to the slot's row; False when there is no row."""
    try:
        return bool(_runs(claim).update(duplicates=F("duplicates") + count))
    except DatabaseError as exc:
        raise database_unreachable(exc) from exc


def _insert_abandoned(claim: ClaimRecord) -> tuple[int, str]:
    """The slot's row, ``abandoned``, and its transition, in one transaction.

    No attempt ever held the row, so it has no owner, no fence and attempt 0;
    an ``on_stale="retry"`` takeover starts attempt 1 with a new fence.
    """
    check_transition(RunState.PENDING, RunState.ABANDONED)
    reason = _reason(claim)
    alias = taskguard_settings.DATABASE_ALIAS
    with transaction.atomic(using=alias):
        run = TaskRun.objects.using(alias).create(
            task_name=claim.task_name,
            slot=claim.slot,
            state=RunState.ABANDONED,
            attempt=0,
            fence=None,
            owner="",
            created_at=Now(),
            finished_at=Now(),
            error=reason,
            duplicates=claim.duplicates,
        )
        TaskRunTransition.objects.using(alias).create(
            run=run,
            from_state=RunState.PENDING,
            to_state=RunState.ABANDONED,
            at=Now(),
            reason=reason,
            owner=actor(),
        )
    return run.pk, reason


def _reason(claim: ClaimRecord) -> str:
    calls = "1 call" if claim.duplicates == 1 else f"{claim.duplicates} calls"
    return (
        f"the Redis winner (token {claim.token or 'unknown'}) died before recording its claim "
        f"(or could not reach the database), so the function did not run; {calls} found the "
        f"slot taken; cleanup_locks"
    )


# -- orphan lock keys -------------------------------------------------------------


def orphan_keys(lock: RedisLock, task: str | None, dry_run: bool) -> int:
    """Remove keys whose attempt is over, or that can never lapse (compare-and-delete).

    A key whose token no row names yet may be a live winner's, between its
    ``SET NX`` and its row insert (or stuck there: a pause, a slow database).
    Its lease is the only word on whether that owner is alive, so such a key
    is left to lapse with it; only one with no expiry at all (not written by
    taskguard's acquire) is removed.
    """
    digest = task_digest(task) if task is not None else None
    removed = 0
    for found in call_backend(lambda: list(_scan(lock, digest))):
        verdict = _verdict(found)
        if verdict == "unrecorded" and call_backend(lock.client.pttl, found.key) != -1:
            continue  # a lease still runs: maybe a live winner's; it lapses by itself
        if verdict in ("dead", "unrecorded"):
            removed += 1 if dry_run else bool(call_backend(lock.release, found.key, found.token))
    return removed


@dataclass(frozen=True)
class RunKey:
    key: str
    token: str
    digest: str
    slot: datetime


def _scan(lock: LockBackend, digest: str | None) -> Iterator[RunKey]:
    for key, token in lock.scan_run_keys():
        parsed = parse_run_key(key)
        if parsed is None or not token or (digest is not None and parsed[0] != digest):
            continue
        yield RunKey(key, token, parsed[0], parsed[1])


def _verdict(found: RunKey) -> str:
    """``live``, ``dead`` (its attempt is over) or ``unrecorded`` (no row names the token)."""
    try:
        rows = list(
            TaskRun.objects.using(taskguard_settings.DATABASE_ALIAS)
            .filter(slot=found.slot, owner__endswith=f":{found.token}")
            .with_lease()
            .values_list("task_name", "lease_alive")  # type: ignore[misc]  # annotation
        )
    except DatabaseError as exc:
        raise database_unreachable(exc) from exc
    mine = [alive for name, alive in rows if task_digest(name) == found.digest]
    if not mine:
        return "unrecorded"
    return "live" if any(mine) else "dead"
