"""One guarded call: claim the slot, run the function under a lease, record how it ended."""

from __future__ import annotations

import itertools
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NoReturn, TypeVar

from django.db import DatabaseError

from . import ledger
from .claim import Taken, claim_slot
from .conf import taskguard_settings
from .context import ActiveRun, _current
from .exceptions import BackendUnavailable, DuplicateRun, LeaseLost, TaskGuardError
from .heartbeat import heartbeats
from .ledger import Row, Step
from .locks import Acquired, LockBackend, get_backend, run_key
from .signals import (
    duplicate_suppressed,
    run_abandoned,
    run_failed,
    run_skipped,
    run_started,
    run_succeeded,
)
from .states import RunState

logger = logging.getLogger("taskguard.guard")

R = TypeVar("R")
HOST = socket.gethostname()


@dataclass(frozen=True)
class Policy:
    on_duplicate: str = "skip"  # "skip" | "raise"
    overlap: str = "allow"  # "allow" | "skip"
    on_stale: str = "abandon"  # "abandon" | "retry"
    lease_seconds: float | None = None


# Optional hooks a slot source (the Celery glue) passes for one call:
#   will_retry(exc) -> True when the caller's framework will run this slot again
#     after ``exc`` (Celery's autoretry_for): the attempt ends ``retrying``, not ``failed``.
#   on_busy(seconds) is called when another attempt holds a live lease on the slot
#     (``seconds``: a hint of how long that lease has left) and must raise, to have the
#     call come back later (a broker redelivery) instead of being dropped as a duplicate.
#     Such a call is not counted in ``duplicates`` then; it is when it comes back to a
#     finished slot.
WillRetry = Callable[[BaseException], bool]
OnBusy = Callable[[float], None]


# Attempt tokens: 64 random bits per process, then a counter (no system call but
# getpid per call). The random part is drawn again whenever the pid changes: a
# fork that skips Python's at-fork hooks (uWSGI without py-call-osafterfork)
# must not hand two workers the same tokens.
_token_prefix = ("", 0)  # (random part, the pid it was drawn in)
_token_counter = itertools.count()


def new_token() -> str:
    """A token unique to one attempt: the fast-path lock's value, the owner's tail."""
    global _token_prefix
    prefix, pid = _token_prefix
    if pid != os.getpid():
        prefix, pid = os.urandom(8).hex(), os.getpid()
        _token_prefix = (prefix, pid)
    return f"{prefix}{next(_token_counter):016x}"


def new_owner(token: str | None = None) -> str:
    """``host:pid:token``, the token unique to this attempt."""
    return f"{HOST}:{os.getpid()}:{token or new_token()}"


def execute(
    task_name: str,
    slot: datetime,
    policy: Policy,
    func: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    will_retry: WillRetry | None = None,
    on_busy: OnBusy | None = None,
) -> R | None:
    """Run ``func`` once for (``task_name``, ``slot``) across every instance."""
    alias, default_lease, prefix = taskguard_settings.for_claim()
    # Every call inside an open transaction is refused, the losing one too:
    # otherwise each instance but one would count a duplicate of a slot whose
    # only claimant then raised, and nothing would record it.
    ledger.ensure_autocommit(alias)
    lease = policy.lease_seconds or default_lease
    lock = get_backend()
    token = new_token()
    key = run_key(prefix, task_name, slot)

    # The losing call ends here: one round trip, no database query.
    count = on_busy is None  # a call that will be put back is no duplicate (yet)
    acquired = lock.acquire(key, token, lease, task_name, count=count)
    if acquired is Acquired.LOST:
        if on_busy is not None:
            _put_back(on_busy, lease, task_name)
        _duplicate(task_name, slot, RunState.RUNNING, policy)
        return None
    owner = new_owner(token)
    try:
        outcome = claim_slot(
            alias, task_name, slot, owner, lease, policy.on_stale, count_live=count
        )
    except BaseException:
        if acquired is Acquired.WON:
            lock.release(key, token)
        raise
    if isinstance(outcome, Taken):
        if acquired is Acquired.WON:
            lock.release(key, token)
        if on_busy is not None and outcome.state == RunState.RUNNING:
            _put_back(on_busy, _seconds_left(outcome.lease_until, lease), task_name)
        _duplicate(task_name, slot, outcome.state, policy)
        return None
    if policy.overlap == "skip" and _skip_for_overlap(alias, outcome):
        lock.release(key, token)
        return None
    return _run(outcome, lock, key, alias, func, args, kwargs, will_retry)


def _put_back(on_busy: OnBusy, seconds: float, task_name: str) -> NoReturn:
    on_busy(seconds)
    raise TaskGuardError(f"the on_busy hook of {task_name!r} returned; it must raise")


def _seconds_left(lease_until: datetime | None, lease: float) -> float:
    """How long a live lease has left (a hint: this clock, not the database's)."""
    if lease_until is None:
        return lease
    left = (lease_until - datetime.now(tz=lease_until.tzinfo)).total_seconds()
    return min(max(left, 0.0), lease)


def _duplicate(task_name: str, slot: datetime, state: str, policy: Policy) -> None:
    duplicate_suppressed.send(sender=task_name, slot=slot, state=state)
    logger.info("taskguard %s slot %s already taken (%s)", task_name, slot, state)
    if policy.on_duplicate == "raise":
        raise DuplicateRun(task_name, slot, state)


def _skip_for_overlap(alias: str, active: ActiveRun) -> bool:
    earlier = ledger.earlier_slot_running(alias, active.task_name, active.slot)
    if earlier is None:
        return False
    reason = f"overlap: slot {earlier.isoformat()} of this task is still running"
    _finish(alias, active, RunState.SKIPPED, reason)
    run_skipped.send(sender=active.task_name, slot=active.slot, reason=reason)
    return True


def _run(
    active: ActiveRun,
    lock: LockBackend,
    key: str,
    alias: str,
    func: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    will_retry: WillRetry | None = None,
) -> R:
    context = _current.set(active)
    beat = heartbeats.start(active, lock, key, alias)
    released = False
    try:
        try:
            # Inside the inner try: a receiver that raises fails this attempt
            # (recorded), instead of leaving the row running until its lease lapses.
            run_started.send(sender=active.task_name, run=active)
            result = func(*args, **kwargs)
        except BaseException as exc:
            heartbeats.stop(beat)
            # The fast-path lock goes first, in the same round trip that collects
            # the duplicates to fold into the row; the row (still running, fenced)
            # keeps deciding for anyone who wins Redis in between.
            duplicates, released = lock.release_counted(key, active.token), True
            if isinstance(exc, Exception):
                _record_raised(alias, active, exc, duplicates, will_retry)
                raise
            # KeyboardInterrupt, SystemExit: the process is going away, and it
            # must, whatever recording the interruption runs into.
            try:
                _record_raised(alias, active, exc, duplicates, will_retry)
            except Exception:
                logger.exception("taskguard could not record interrupted run %s", active.id)
            raise
        heartbeats.stop(beat)
        duplicates, released = lock.release_counted(key, active.token), True
        _finish(alias, active, RunState.SUCCEEDED, "returned", duplicates=duplicates)
        run_succeeded.send(sender=active.task_name, run=active, result=result)
        return result
    finally:
        heartbeats.stop(beat)
        _current.reset(context)
        if not released:
            lock.release(key, active.token)


def _record_raised(
    alias: str,
    active: ActiveRun,
    exc: BaseException,
    duplicates: int,
    will_retry: WillRetry | None,
) -> None:
    """Record a raising attempt's end and send the signal that goes with it."""
    state, reason = _finish_raised(alias, active, exc, duplicates, will_retry)
    if state == RunState.ABANDONED:
        run_abandoned.send(
            sender=active.task_name, run_id=active.id, slot=active.slot, reason=reason
        )
    else:
        run_failed.send(sender=active.task_name, run=active, exception=exc)


def _finish_raised(
    alias: str,
    active: ActiveRun,
    exc: BaseException,
    duplicates: int,
    will_retry: WillRetry | None = None,
) -> tuple[str, str]:
    """Record how a raising attempt ended; return the state and the reason recorded."""
    error = f"{type(exc).__name__}: {exc}"
    retry = _is_celery_retry(exc)
    ended = True
    if retry or _will_retry(will_retry, exc):
        state, ended = RunState.RETRYING, False
        reason = f"retry requested: {exc}" if retry else f"{error[:400]}; a retry will follow"
    elif isinstance(exc, Exception):
        state, reason = RunState.FAILED, error[:500]
    else:
        # KeyboardInterrupt, SystemExit: the process is going away mid-run.
        state, reason = RunState.ABANDONED, f"interrupted ({type(exc).__name__})"
    _finish(
        alias, active, state, reason, error=error, ended=ended, duplicates=duplicates, cause=exc
    )
    return state, reason


def _will_retry(will_retry: WillRetry | None, exc: BaseException) -> bool:
    if will_retry is None or not isinstance(exc, Exception):
        return False
    try:
        return bool(will_retry(exc))
    except Exception:
        logger.exception("taskguard will_retry hook failed; recording the attempt as failed")
        return False


def _is_celery_retry(exc: BaseException) -> bool:
    try:
        from celery.exceptions import Retry
    except ImportError:  # pragma: no cover - celery is an extra
        return False
    return isinstance(exc, Retry)


def _finish(
    alias: str,
    active: ActiveRun,
    to_state: str,
    reason: str,
    *,
    error: str = "",
    ended: bool = True,
    duplicates: int = 0,
    cause: BaseException | None = None,
) -> None:
    """Record the attempt's end, fenced: refused (``LeaseLost``) if the slot was taken over."""
    if not active.lease_valid():
        reason += " (after its lease had expired; no other attempt had taken over)"
    row = Row(active.id, RunState.RUNNING, active.attempt, active.fence, active.owner, None)
    sets = ledger.finish_assignments(alias, error, duplicates, ended=ended)
    step = [Step(to_state, reason)]
    try:
        updated = ledger.change(alias, row, step, actor=active.owner, sets=sets)
    except DatabaseError as exc:
        if not ledger.connection_lost(alias, exc):
            raise
        updated = _settle_finish(alias, row, to_state, step, sets)
    if updated is None:
        active.mark_lost(f"fenced out: finishing as {to_state} was refused")
        raise LeaseLost(
            f"{active.task_name!r} slot {active.slot.isoformat()} attempt {active.attempt}: "
            f"finishing as {to_state} was refused because another attempt took the slot over "
            f"or it was marked abandoned (fence {active.fence})"
        ) from cause


def _settle_finish(
    alias: str, row: Row, to_state: str, step: list[Step], sets: list[ledger.Assignment]
) -> Row | None:
    """The finish's outcome is unknown after a connection error: read back, retry once."""
    try:
        ledger.settle_connection(alias)
        current = ledger.read_by_id(alias, row.id)
        if current is None or current.fence != row.fence:
            return None
        if current.state == to_state:
            return current
        if current.state != RunState.RUNNING:
            return None
        return ledger.change(alias, row, step, actor=row.owner, sets=sets)
    except DatabaseError as exc:
        raise BackendUnavailable(
            f"the outcome of run {row.id} could not be recorded: database unreachable ({exc}); "
            f"the run stays 'running' until its lease expires and cleanup_locks abandons it"
        ) from exc
