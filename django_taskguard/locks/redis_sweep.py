"""The Redis lock's sweep (``RedisLock.sweep``, run by ``cleanup_locks``).

- A *claim record* (``{prefix}:dup:{<digest>:<slot>}``) whose lock key is gone
  (or holds the finished marker) names a slot that some call won in Redis,
  with the count of the calls that lost to it. If the winner never wrote its
  row (it died, or lost the database, between its Redis claim and its
  insert), the losers returned ``None`` and nothing else records the slot:
  the sweep records it ``abandoned`` (G3). If the row exists (the winner lost
  to the row, its final release never reached Redis, or late calls met the
  finished marker), the count is added to it.
- An *orphan key* is a lock key whose token no live attempt holds; it is
  removed by compare-and-delete on that token. Finished markers are never
  touched: they lapse.

Every ledger read and write goes through :mod:`django_taskguard.ledger`
(which raises ``BackendUnavailable`` when the database is unreachable); Redis
errors come out as ``BackendUnavailable`` too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, TypeVar

import redis
from django.utils import timezone
from redis.exceptions import LockError, RedisError
from redis.lock import Lock

from .. import ledger
from ..exceptions import BackendUnavailable
from ..logfields import log_fields
from ..owner import actor
from ..signals import run_abandoned
from .keys import SlotKey, task_digest

logger = logging.getLogger("taskguard.cleanup")

T = TypeVar("T")

# Claim records are recorded by one cleaner at a time (two would both add a
# record's count to its row): the others skip them. The guard lives this long
# and is renewed while the sweep goes on.
SWEEP_SECONDS = 60


@dataclass(frozen=True)
class ClaimRecord:
    """A slot someone claimed in Redis whose lock is gone: the row may be missing."""

    key: str  # the claim record's key
    task_name: str
    slot: datetime | None  # None: a keyed run's record (``run_key`` says which)
    duplicates: int  # calls counted in Redis, not yet in TaskRun.duplicates
    token: str  # the Redis winner's token ("" when the winner already finished)
    run_key: str | None = None  # the key of an @once_per_key run

    @property
    def when(self) -> datetime:
        """The slot, or for a keyed run the time it is recorded (its row's slot)."""
        return self.slot if self.slot is not None else timezone.now()


class RedisLock(Protocol):
    """What the sweep uses of ``locks.redis.RedisLock``."""

    client: redis.Redis

    def unrecorded_claims(self) -> Iterator[ClaimRecord]: ...
    def forget_claim(self, record: ClaimRecord) -> bool: ...
    def scan_run_keys(self) -> Iterator[tuple[str, str | None]]: ...
    def release(self, key: str, token: str) -> bool: ...
    def key_prefix(self) -> str: ...


def sweep(lock: RedisLock, task: str | None, dry_run: bool) -> tuple[int, int]:
    """Record unrecorded claims, then remove orphan keys; return both counts."""
    # A claim record is only looked at once its lock key is gone: the winner
    # released it, or its lease lapsed (then, as with any lapsed lease, the
    # slot is no longer that owner's to record), or it holds the finished marker.
    recorded = record_claims(lock, task, dry_run)
    return recorded, orphan_keys(lock, task, dry_run)


def _redis(call: Callable[..., T], *args: object) -> T:
    """``call(*args)``, a Redis error raised as ``BackendUnavailable``."""
    try:
        return call(*args)
    except (RedisError, OSError) as exc:
        raise BackendUnavailable(f"the taskguard lock Redis is unreachable ({exc})") from exc


# -- claim records ----------------------------------------------------------------


def record_claims(lock: RedisLock, task: str | None, dry_run: bool) -> int:
    """Record every claimed slot that has no row; return how many (or would be)."""
    if dry_run:
        claims = _claims(lock, task)
        return sum(
            not ledger.row_exists(claim.task_name, claim.when, claim.run_key) for claim in claims
        )
    guard = Lock(
        lock.client,
        f"{lock.key_prefix()}:cleanup:claims",
        timeout=SWEEP_SECONDS,
        blocking=False,
        thread_local=False,
    )
    if not _redis(guard.acquire):
        logger.info(
            "taskguard claim records are being recorded by another cleanup_locks",
            extra=log_fields("cleanup.busy"),
        )
        return 0
    try:
        # Scanned under the guard, and each record read just before it is
        # written: a record is never counted from a stale read of another sweep.
        return sum(_record(lock, claim) for claim in _while_held(guard, _claims(lock, task)))
    finally:
        try:
            guard.release()
        except RedisError as exc:  # lapsed or unreachable: it expires on its own
            logger.warning(
                "taskguard cleanup could not release its claim guard (%s)",
                exc,
                extra=log_fields("cleanup.guard_release_failed", reason=exc),
            )


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
            except LockError:  # (a RedisError too: caught first)
                logger.warning(
                    "taskguard cleanup lost its claim guard; the rest is left",
                    extra=log_fields("cleanup.guard_lost"),
                )
                return
            except RedisError as exc:
                raise BackendUnavailable(
                    f"the taskguard lock Redis is unreachable ({exc})"
                ) from exc
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
    if not lock.forget_claim(claim):
        # The slot's lock was taken again since we read the record. The new
        # holder folds the record's whole count into the row when it releases
        # (or the next sweep does, if it dies too): take our count back so it is
        # not counted twice. The abandoned row, if we made it, stays recorded.
        ledger.add_duplicates(claim.task_name, claim.when, -claim.duplicates, claim.run_key)
        logger.info(
            "taskguard claim %s is held again; its count is left to it",
            claim.key,
            extra=log_fields("claim.held_again", task=claim.task_name),
        )
    return created


def _write(claim: ClaimRecord) -> bool:
    """Add the count to the slot's row, or insert the row ``abandoned``; True if inserted."""
    slot, key = claim.when, claim.run_key
    if ledger.add_duplicates(claim.task_name, slot, claim.duplicates, key):
        return False
    reason = _reason(claim)
    run_id = ledger.insert_abandoned(
        claim.task_name,
        slot,
        reason=reason,
        duplicates=claim.duplicates,
        actor=actor("cleanup"),
        key=key,
    )
    if run_id is None:
        # A caller inserted the row between our UPDATE and INSERT: count on its row.
        ledger.add_duplicates(claim.task_name, slot, claim.duplicates, key)
        return False
    what = f"key {key!r}" if key is not None else f"slot {slot}"
    logger.warning(
        "taskguard %s %s recorded abandoned: %s",
        claim.task_name,
        what,
        reason,
        extra=log_fields(
            "run.abandoned",
            task=claim.task_name,
            slot=slot,
            key=key,
            run_id=run_id,
            state="abandoned",
            reason=reason,
            duplicates=claim.duplicates,
        ),
    )
    run_abandoned.send(sender=claim.task_name, run_id=run_id, slot=slot, reason=reason)
    return True


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
    taskguard's acquire) is removed. Finished markers are not lock keys here.
    """
    digest = task_digest(task) if task is not None else None
    removed = 0
    for found in list(_scan(lock, digest)):
        verdict = _verdict(found)
        if verdict == "unrecorded" and _redis(lock.client.pttl, found.key) != -1:
            continue  # a lease still runs: maybe a live winner's; it lapses by itself
        if verdict in ("dead", "unrecorded"):
            removed += 1 if dry_run else int(lock.release(found.key, found.token))
    return removed


@dataclass(frozen=True)
class RunKey:
    key: str
    token: str
    digest: str
    slot: datetime | None  # None: a keyed run's lock key


def _scan(lock: RedisLock, digest: str | None) -> Iterator[RunKey]:
    for key, token in lock.scan_run_keys():
        parsed = SlotKey.parse(key)
        if parsed is None or not token or (digest is not None and parsed.digest != digest):
            continue
        yield RunKey(key, token, parsed.digest, parsed.slot)


def _verdict(found: RunKey) -> str:
    """``live``, ``dead`` (its attempt is over) or ``unrecorded`` (no row names the token)."""
    if found.slot is None:
        rows = ledger.keyed_token_holders(found.token)
    else:
        rows = ledger.token_holders(found.slot, found.token)
    mine = [alive for name, alive in rows if task_digest(name) == found.digest]
    if not mine:
        return "unrecorded"
    return "live" if any(mine) else "dead"
