"""One guarded call: claim the slot, run the function under a lease, record how it ended."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NoReturn, TypeAlias, TypeVar, cast

from django.utils import timezone

from . import ledger
from .claim import Taken, claim_slot
from .conf import taskguard_settings
from .context import ActiveRun, activate, calling
from .endings import ClassifyRaise, OnBusy, RecordSuccess, finish, record_raised, succeed
from .exceptions import BackendUnavailable, DuplicateRun, TaskGuardError
from .heartbeat import Beat, heartbeats
from .locks import Acquired, LockBackend, get_backend
from .locks.database import DatabaseLock
from .logfields import log_fields, run_log_fields
from .models import ScheduleEventOrigin
from .owner import actor, new_owner, new_token
from .pauses import pause, paused_reason, paused_words
from .policy import Policy
from .signals import (
    duplicate_suppressed,
    run_given_back,
    run_missed,
    run_skipped,
    run_started,
    run_succeeded,
)
from .states import TERMINAL_STATES, RunState
from .upkeep import maybe_upkeep

logger = logging.getLogger("taskguard.guard")
_ROW_LOCK = DatabaseLock()

# The state a duplicate reports when Redis's finished marker decided it (the row, in one
# of TERMINAL_STATES, was not read).
FINISHED = "finished"
R = TypeVar("R")


# Optional hooks a slot source (the Celery glue) passes for one call: classify_raise and
# on_busy (endings.ClassifyRaise, endings.OnBusy).


def execute(
    task_name: str,
    slot: datetime,
    policy: Policy,
    func: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    classify_raise: ClassifyRaise | None = None,
    on_busy: OnBusy | None = None,
    instance: str | None = None,
    key: str | None = None,
    message_id: str | None = None,
) -> R | None:
    """Run ``func`` once for (``task_name``, ``slot``) across every instance.

    With ``key`` (``@once_per_key``): once for (``task_name``, ``key``); ``slot``
    is then the call's time, recorded as the row's slot when it claims the key.
    ``message_id``: the message carrying the call (see :func:`begin`).
    """
    started = begin(
        task_name,
        slot,
        policy,
        classify_raise=classify_raise,
        on_busy=on_busy,
        instance=instance,
        key=key,
        message_id=message_id,
    )
    return run(started, func, args, kwargs)


def run(
    started: Started,
    func: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> R | None:
    """Run ``func`` as the attempt :func:`begin` started, or return what a refused call returns.

    Afterwards, :func:`upkeep.maybe_upkeep`: a look at a clock, and at most once per
    interval a thread that runs the upkeep (callers that have no other process for it:
    APScheduler, cron, django.tasks workers).
    """
    try:
        if isinstance(started, Refused):
            return cast("R | None", started.result)
        return started.run(func, args, kwargs)
    finally:
        maybe_upkeep()


@dataclass(frozen=True)
class Refused:
    """A call that does not run the function, and what it returns instead (``None``, or
    the stored result of a succeeded key)."""

    result: Any = None


REFUSED = Refused()
Started: TypeAlias = "Attempt | Refused"  # what begin() returns


def begin(
    task_name: str,
    slot: datetime,
    policy: Policy,
    *,
    classify_raise: ClassifyRaise | None = None,
    on_busy: OnBusy | None = None,
    instance: str | None = None,
    key: str | None = None,
    message_id: str | None = None,
) -> Started:
    """Claim (``task_name``, ``slot``): the attempt that will run the function, or a refusal
    (the duplicate is counted and signalled). Blocking: Redis and the database.

    ``message_id``: the message carrying the call (Celery's task id and retry count).
    After an attempt ended ``retrying`` with a retry that names its message
    (``Ending.retry_by``), only that message starts the next attempt; another copy is a
    counted duplicate, until the retry is overdue.
    """
    default_lease, horizon = taskguard_settings.for_claim
    # Every call inside an open transaction is refused, the losing one too:
    # otherwise each instance but one would count a duplicate of a slot whose
    # only claimant then raised, and nothing would record it.
    ledger.ensure_autocommit()
    if (
        key is None
        and timezone.now() - slot > horizon
        and _refused_as_pruned(task_name, slot, horizon)
    ):
        return REFUSED
    lease = policy.lease_seconds or default_lease
    lock = get_backend()
    token = new_token()
    lock_key = lock.key_for(task_name, slot, key)

    # The losing call ends here: one round trip, no database query.
    count = on_busy is None  # a call that will be put back is no duplicate (yet)
    acquired = lock.acquire(lock_key, token, lease, task_name, count=count, run_key=key or "")
    if acquired is Acquired.LOST:
        if on_busy is not None:
            _put_back(on_busy, lease, task_name)
        _duplicate(task_name, slot, RunState.RUNNING, policy, key)
        return REFUSED
    if acquired is Acquired.FINISHED:  # the slot is over: a put-back would only come back
        _duplicate(task_name, slot, FINISHED, policy, key)
        return _refused_with_result(task_name, key, policy)
    owner = new_owner(token, instance)
    try:
        outcome = claim_slot(
            task_name,
            slot,
            owner,
            lease,
            policy.on_stale,
            count_live=count,
            key=key,
            keep=policy.keep_seconds,
            take_missed=policy.catchup != "none",
            message_id=message_id,
        )
    except BaseException:
        if acquired is Acquired.WON:
            lock.release(lock_key, token)
        raise
    if isinstance(outcome, Taken):
        if acquired is Acquired.WON:
            # A terminal row (Redis was flushed, or its marker lapsed): put the marker
            # back, so the next late call is decided in Redis again. Not on a missed row:
            # backfill (and an on-time call) still takes it over, and a marker would refuse
            # them. Not for a key with a keep: its marker must not outlast the keep, and
            # only the row knows when the run ended.
            if outcome.state in TERMINAL_STATES and (key is None or policy.keep_seconds is None):
                lock.finish(lock_key, token)
            else:
                lock.release(lock_key, token)
        if on_busy is not None and outcome.state == RunState.RUNNING:
            left = lease if outcome.lease_left is None else min(max(outcome.lease_left, 0.0), lease)
            _put_back(on_busy, left, task_name)
        _duplicate(task_name, slot, outcome.state, policy, key)
        if outcome.state == RunState.SUCCEEDED:
            return _refused_with_result(task_name, key, policy)
        return REFUSED
    return Attempt(outcome, lock, lock_key, policy, classify_raise)


# The largest JSON result return_result=True stores (bytes); a larger one is not stored.
RESULT_MAX_BYTES = 64 * 1024


def _refused_with_result(task_name: str, key: str | None, policy: Policy) -> Refused:
    """What a duplicate of a succeeded key returns: its stored result (None without one)."""
    if key is None or not policy.return_result:
        return REFUSED
    stored = ledger.result_of(task_name, key)
    return REFUSED if stored is None else Refused(json.loads(stored))


def _store_result(active: ActiveRun, result: Any) -> None:
    """Store the attempt's result as JSON for its duplicates, bounded; never raises."""
    try:
        text = json.dumps(result, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        logger.warning(
            "taskguard %s key %r: the result is not JSON (%s); duplicates get None",
            active.task_name,
            active.key,
            exc,
            extra=run_log_fields("result.not_json", active, reason=exc),
        )
        return
    if len(text) > RESULT_MAX_BYTES:  # ASCII (json.dumps escapes the rest): chars = bytes
        logger.warning(
            "taskguard %s key %r: the result is %d bytes of JSON, more than %d; duplicates "
            "get None",
            active.task_name,
            active.key,
            len(text),
            RESULT_MAX_BYTES,
            extra=run_log_fields("result.too_large", active),
        )
        return
    try:
        ledger.store_result(active.id, active.fence, text)
    except BackendUnavailable as exc:
        logger.warning(
            "taskguard could not store the result of run %s (%s)",
            active.id,
            exc,
            extra=run_log_fields("result.store_failed", active, reason=exc),
        )


def _say_given_back(active: ActiveRun, reason: str) -> None:
    """Log the give-back and send ``run_given_back`` (a receiver's error is logged only)."""
    logger.warning(
        "taskguard %s slot %s: attempt %d given back (%s)",
        active.task_name,
        active.slot.isoformat(),
        active.attempt,
        reason,
        extra=run_log_fields("run.given_back", active, reason=reason),
    )
    try:
        run_given_back.send(sender=active.task_name, run=active, reason=reason)
    except Exception:  # the caller raises what ended the attempt, not this
        logger.exception(
            "a run_given_back receiver failed (run %s)",
            active.id,
            extra=run_log_fields("receiver.failed", active, reason="run_given_back"),
        )


def run_claimed(
    active: ActiveRun,
    policy: Policy,
    func: Callable[[], R],
    record_success: RecordSuccess | None = None,
) -> R | None:
    """Run an attempt that :func:`claim.claim_many` made (no Redis key: the row is the lock)."""
    return Attempt(active, _ROW_LOCK, "", policy, None, record_success).run(func, (), {})


def duplicate(task_name: str, slot: datetime, state: str, policy: Policy) -> None:
    """A batch claim found the slot taken (already counted on the row)."""
    _duplicate(task_name, slot, state, policy)


def refused_late(task_name: str, slot: datetime, policy: Policy, now: datetime) -> bool:
    """``catchup="none"``: a scheduled call later than ``grace`` after its slot is
    recorded ``missed`` and not run, and so is a slot handed to a task queue (``pending``)
    that a worker starts that late. False when it is in time, or when the slot has any
    other row (then the claim decides, as for any call)."""
    late = now - slot
    if policy.catchup != "none" or late <= policy.grace:
        return False
    reason = (
        f"late: called {late.total_seconds():.1f}s after its slot; catchup='none' runs a "
        f"slot only within its grace ({policy.grace.total_seconds():g}s)"
    )
    return _record_refusal(task_name, slot, RunState.MISSED, reason, end_pending=True)


def refused_early(task_name: str, slot: datetime, tolerance: timedelta) -> str | None:
    """A slot ahead of the database's clock by more than ``tolerance``: recorded
    ``skipped`` (once), and the reason returned; None when that clock says it is in time.

    The row takes the slot from nobody: the first call that is on time takes it over
    (``claim``), so a wrong clock never costs the slot.
    """
    now = ledger.database_now()
    if slot - now <= tolerance:
        return None
    reason = (
        f"slot {slot.isoformat()} is in the future (the database's clock says "
        f"{now.isoformat()}); a slot may be at most {tolerance.total_seconds():g}s ahead "
        f"(SLOT_TOLERANCE_SECONDS): a clock is wrong, the caller's or a beat's"
    )
    _record_refusal(task_name, slot, RunState.SKIPPED, reason)
    return reason


def _refused_as_pruned(task_name: str, slot: datetime, horizon: timedelta) -> bool:
    """A slot older than retention may have had its row pruned: never run it again.

    Recorded ``skipped`` unless its row is still there (then the row decides, as
    for any slot). The database decides which: one insert that does nothing when
    the row exists.
    """
    reason = (
        f"slot {slot.isoformat()} is older than the retention horizon (PRUNE_AFTER_DAYS = "
        f"{horizon.days}): its record may have been pruned, so it is never run"
    )
    return _record_refusal(task_name, slot, RunState.SKIPPED, reason)


def _record_refusal(
    task_name: str, slot: datetime, state: str, reason: str, *, end_pending: bool = False
) -> bool:
    """Record a slot this call will not run (``missed`` or ``skipped``), with its signal.

    False when the slot has a row already: then the claim decides, as for any call.
    ``end_pending``: a ``pending`` row (handed to a task queue, started by nobody) is
    ended with ``state`` instead, by compare-and-set (False when a claim got there first).
    """
    insert = ledger.insert_missed if state == RunState.MISSED else ledger.insert_skipped
    by = actor("guard")
    try:
        recorded = insert(task_name, slot, reason=reason, actor=by) is not None
        if not recorded and end_pending:
            recorded = ledger.end_pending_slot(
                task_name, slot, state=state, reason=reason, actor=by
            )
    except BackendUnavailable as exc:
        raise type(exc)(f"{task_name!r} did not run: {exc}") from exc  # NotMigrated stays so
    if not recorded:
        return False
    logger.warning(
        "taskguard %s slot %s: %s",
        task_name,
        slot.isoformat(),
        reason,
        extra=log_fields(
            "run.missed" if state == RunState.MISSED else "run.skipped",
            task=task_name,
            slot=slot,
            state=state,
            reason=reason,
        ),
    )
    signal = run_missed if state == RunState.MISSED else run_skipped
    signal.send(sender=task_name, slot=slot, reason=reason)
    return True


def _put_back(on_busy: OnBusy, seconds: float, task_name: str) -> NoReturn:
    on_busy(seconds)
    raise TaskGuardError(f"the on_busy hook of {task_name!r} returned; it must raise")


def _duplicate(
    task_name: str, slot: datetime, state: str, policy: Policy, key: str | None = None
) -> None:
    if key is None:
        duplicate_suppressed.send(sender=task_name, slot=slot, state=state)
        logger.info(
            "taskguard %s slot %s already taken (%s)",
            task_name,
            slot,
            state,
            extra=log_fields("run.duplicate", task=task_name, slot=slot, state=state),
        )
    else:
        duplicate_suppressed.send(sender=task_name, slot=slot, state=state, key=key)
        logger.info(
            "taskguard %s key %r already taken (%s)",
            task_name,
            key,
            state,
            extra=log_fields("run.duplicate", task=task_name, key=key, state=state),
        )
    if policy.on_duplicate == "raise":
        raise DuplicateRun(task_name, slot, state, key)


@dataclass(eq=False)
class Attempt:
    """A claimed attempt, from its claim to its recorded end.

    Both paths go through the same steps: :meth:`open`, then the function (called, or
    awaited by ``coroutines``), then :meth:`returned` or :meth:`raised`. Every step but
    the function's own is blocking (the database, Redis) and none needs the caller's
    thread: ``current_run()`` is set by the caller around the function.
    """

    active: ActiveRun
    lock: LockBackend
    key: str  # the lock key ("" for the row lock)
    policy: Policy
    classify_raise: ClassifyRaise | None = None
    record_success: RecordSuccess | None = None
    beat: Beat | None = None

    def run(
        self, func: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> R | None:
        """Run the function in this thread as this attempt; record how it ended."""
        if not self.open():
            return None
        with calling(self.active):
            try:
                result = func(*args, **kwargs)
            except BaseException as exc:
                self.raised(exc)
                raise
        return self.returned(result)

    def open(self) -> bool:
        """Start the attempt: its heartbeat and ``run_started``. False: it is not run
        (the task is paused, or overlaps an earlier slot): recorded ``skipped``, lock freed."""
        try:
            skipped = _skip_paused(self.active) or (
                _skip_for_overlap(self.active) if self.policy.overlap == "skip" else None
            )
        except BaseException as exc:
            self.give_back(not_started_reason(exc))
            raise
        if skipped is not None:  # recorded skipped: the skip stands whatever its receivers do
            self._free(ended=True)
            run_skipped.send(sender=self.active.task_name, slot=self.active.slot, reason=skipped)
            return False
        with activate(self.active):
            try:
                # A heartbeat that cannot start or a receiver that raises ends this
                # attempt before the function: the slot is given back (recorded),
                # instead of left running until its lease lapses.
                self.beat = heartbeats.start(self.active, self.lock, self.key)
                run_started.send(sender=self.active.task_name, run=self.active)
            except BaseException as exc:
                self.give_back(not_started_reason(exc))
                raise
        return True

    def give_back(self, reason: str) -> bool:
        """End this attempt before its function started: the slot or key is given back
        (:func:`ledger.give_back`: the row back in the state its claim found it in,
        ``reason`` in its log), the lock freed so that the next caller takes it, and
        ``run_given_back`` sent. Never raises; False when the attempt no longer ran (ended
        or taken over) or the database failed (then the row stays ``running`` until its
        lease lapses and cleanup records it ``abandoned``)."""
        heartbeats.stop(self.beat)
        active = self.active
        given = False
        try:
            given = _give_back(active, reason)
            if not given:
                logger.warning(
                    "taskguard run %s no longer running (ended or taken over); not given back",
                    active.id,
                    extra=run_log_fields("run.give_back_refused", active, reason=reason),
                )
        except Exception:
            logger.exception(
                "taskguard could not give back run %s (%s)",
                active.id,
                reason,
                extra=run_log_fields("run.give_back_failed", active, reason=reason),
            )
        finally:
            self._free(ended=False)
        if given:
            _say_given_back(active, reason)
        return given

    def returned(self, result: R) -> R:
        """Record that the function returned ``result`` (fenced: ``LeaseLost`` if taken over)."""
        heartbeats.stop(self.beat)
        try:
            if self.policy.return_result:
                _store_result(self.active, result)
            succeed(self.active, self.record_success)
        except BaseException:
            self._free(ended=False)
            raise
        # The row is terminal: the lock says so before any receiver runs, so that a call
        # made meanwhile meets the finished row on every backend (keep=0: the key is free).
        self._free(ended=True)
        run_succeeded.send(sender=self.active.task_name, run=self.active, result=result)
        return result

    def raised(self, exc: BaseException) -> None:
        """Record that the function raised ``exc``; never raises (the caller re-raises ``exc``)."""
        heartbeats.stop(self.beat)
        ended, freed = False, False

        def free(over: bool) -> None:  # the end is recorded: before any receiver runs
            nonlocal freed
            freed = True
            self._free(over)

        try:
            ended = record_raised(self.active, exc, self.classify_raise, free)
            if ended and self.policy.pause_after_failures:
                _pause_after_failures(self.active.task_name, self.policy.pause_after_failures)
        finally:
            if not freed:
                self._free(ended)

    def _free(self, ended: bool) -> None:
        try:
            _free(self.active, self.lock, self.key, ended, self.policy)
        finally:
            self.active.ended.set()


def _give_back(active: ActiveRun, reason: str) -> bool:
    """:func:`ledger.give_back` of ``active``: True when this call gave its row back."""
    changed = ledger.give_back(
        active.id,
        active.fence,
        active.owner,
        reason,
        claimed_from=active.claimed_from,
        retry_by=active.message_id,
        retry_within=taskguard_settings.RETRY_GRACE_SECONDS,
    )
    return changed is not None


# How much of an exception's text the reason of a give-back quotes.
REASON_EXCEPTION_CHARS = 200


def not_started_reason(exc: BaseException) -> str:
    """The reason an attempt ended by ``exc`` before its function started is given back
    (the exception's text cut to :data:`REASON_EXCEPTION_CHARS`)."""
    text = str(exc)
    if len(text) > REASON_EXCEPTION_CHARS:
        text = text[: REASON_EXCEPTION_CHARS - 1] + "…"
    what = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return f"ended before the function started ({what}): nothing ran, given back"


def _free(active: ActiveRun, lock: LockBackend, key: str, ended: bool, policy: Policy) -> None:
    """Release the lock (or leave the finished-slot marker); fold its duplicates into the row.

    A keyed run's marker lasts no longer than its ``keep``: after that the row decides
    whether the key may run again.
    """
    if ended:
        marker = policy.keep_seconds if active.key is not None else None
        duplicates = lock.finish(key, active.token, marker)
    else:
        duplicates = lock.release_counted(key, active.token)
    if duplicates:
        try:
            ledger.add_duplicates(active.task_name, active.slot, duplicates, active.key)
        except BackendUnavailable:
            logger.warning(
                "taskguard could not add %d duplicate calls to run %s",
                duplicates,
                active.id,
                extra=run_log_fields("duplicates.record_failed", active, duplicates=duplicates),
            )


def _skip_paused(active: ActiveRun) -> str | None:
    """Record the attempt ``skipped`` while its task is paused; the reason, or None."""
    paused = paused_reason(active.task_name)
    if paused is None:
        return None
    reason = paused_words(paused)
    finish(active, RunState.SKIPPED, reason)
    return reason


def _pause_after_failures(task_name: str, failures: int) -> None:
    """``pause_after_failures=N``: the Nth failure in a row pauses the task (never raises)."""
    try:
        if ledger.failed_streak(task_name, failures):
            reason = f"paused after {failures} failures in a row (pause_after_failures)"
            if pause(task_name, reason, by=actor("guard"), origin=ScheduleEventOrigin.POLICY):
                logger.warning(
                    "taskguard %s %s",
                    task_name,
                    reason,
                    extra=log_fields("task.paused", task=task_name, reason=reason),
                )
    except Exception:
        logger.exception(
            "taskguard could not check the failures of %s",
            task_name,
            extra=log_fields("pause.check_failed", task=task_name),
        )


def _skip_for_overlap(active: ActiveRun) -> str | None:
    """Record the attempt ``skipped`` while an earlier slot runs; the reason, or None."""
    earlier = ledger.earlier_slot_running(active.task_name, active.slot)
    if earlier is None:
        return None
    reason = f"overlap: slot {earlier.isoformat()} of this task is still running"
    finish(active, RunState.SKIPPED, reason)
    return reason
