"""The ``extra`` fields of every taskguard log record: built here only.

Every record of the package carries all of :data:`FIELDS` (None where one does not
apply), so that a JSON formatter or structlog's ``ProcessorFormatter`` can rely on
them without parsing the sentence; ``event`` is a stable, dotted lowercase name
from :data:`EVENTS` (docs/logging.md lists them). An ``@once_per_key`` key is never
logged raw: ``key`` is its digest, the one its Redis keys use.

``Logger.makeRecord`` refuses (``KeyError``) an ``extra`` key that is an attribute of
``LogRecord`` (``name``, ``msg``, ``args``, ``module``, ``process``, ``thread``,
``taskName`` since Python 3.12, ...) or ``message``/``asctime``: none of these fields
is one (tests/test_log_fields.py checks).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Protocol

from .locks.keys import key_digest

FIELDS = (
    "event",
    "task",
    "slot",
    "key",
    "run_id",
    "attempt",
    "fence",
    "state",
    "reason",
    "owner",
    "duplicates",
)

REASON_MAX_LENGTH = 2000  # an exception's text can be long; the sentence keeps it whole

EVENTS = frozenset(
    {
        # a run, its lease and its end
        "lease.lost",
        "run.abandoned",
        "run.abandon_skipped",
        "run.duplicate",
        "run.missed",
        "run.skipped",
        "run.given_back",
        "run.give_back_failed",
        "run.give_back_refused",
        "run.taken_over",
        "record.failed",
        "result.not_json",
        "result.too_large",
        "result.store_failed",
        "duplicates.record_failed",
        "version.record_failed",
        "hook.failed",
        "receiver.failed",
        "attempt.end_failed",
        "claim.interrupted",
        "claim.batch_failed",
        "task.paused",
        "pause.check_failed",
        "pause.read_failed",
        # the heartbeat and the locks
        "heartbeat.renew_failed",
        "heartbeat.failed",
        "heartbeat.crashed",
        "heartbeat.start_failed",
        "lock.extend_failed",
        "connection.close_failed",
        "redis.unavailable",
        "redis.available",
        "redis.acquire_failed",
        # the sweep, cleanup and upkeep
        "sweep.missed",
        "sweep.called_early",
        "sweep.pending_expired",
        "sweep.partial",
        "sweep.owed_dropped",
        "sweep.schedule_failed",
        "sweep.failed",
        "cleanup.startup",
        "cleanup.startup_failed",
        "cleanup.busy",
        "cleanup.guard_lost",
        "cleanup.guard_release_failed",
        "claim.held_again",
        "upkeep.lease_failed",
        "upkeep.lease_lost",
        "upkeep.renew_failed",
        "upkeep.record_failed",
        "upkeep.give_back_failed",
        "upkeep.not_run",
        "upkeep.start_failed",
        "upkeep.part_failed",
        "upkeep.part_unavailable",
        "upkeep.part_available",
        "upkeep.failed",
        # schedules and run_schedules
        "schedule.duplicate_name",
        "schedule.removed",
        "schedule.zone_conflict",
        "schedule.data_conflict",
        "schedule.not_fired",
        "schedule.target_unfound",
        "scheduler.started",
        "scheduler.fired",
        "scheduler.once_done",
        "scheduler.stopping",
        "scheduler.stop_timeout",
        "scheduler.stopped",
        "scheduler.clock_back",
        "scheduler.job_failed",
        "scheduler.data_loaded",
        "scheduler.data_read_failed",
        "scheduler.retry_dropped",
        "scheduler.missed_recorded",
        # check-ins
        "checkin.failed",
        "checkin.dropped",
        "checkin.send_failed",
        "checkin.not_queued",
        "checkin.no_client",
        "checkin.schedule_unread",
        "checkin.counter_registered",
        "checkin.flush_failed",
        # OpenTelemetry (OPENTELEMETRY)
        "otel.duplicates_failed",
        "otel.figures_failed",
        "otel.spans_full",
        "otel.span_end_failed",
        # Huey
        "huey.send_failed",
        # Celery
        "beat.already_sent",
        "beat.sent_elsewhere",
        "beat.claim_failed",
        "beat.give_back_failed",
        "beat.slot_failed",
        "beat.no_slots",
        "beat.timezone_mismatch",
        "beat.entry_unreadable",
        "beat.not_monitored",
        "beat.save_failed",
        "beat.read_failed",
        "beat.data_read_failed",
        "beat.data_loaded",
        "beat.data_refreshed",
        "beat.data_changed",
        "beat.data_not_sent",
        "beat.send_failed",
        "message.deferred",
        "enqueue.queued",
        "enqueue.give_back_failed",
        "enqueue.retry_refused",
        "enqueue.renew_failed",
        "enqueue.free_failed",
        "enqueue.discard_failed",
        "enqueue.expired",
        # RQ (contrib.rq)
        "rq.job_exists",
    }
)


class Attempt(Protocol):
    """What the fields read of an attempt in progress (``context.ActiveRun``)."""

    @property
    def id(self) -> int: ...
    @property
    def task_name(self) -> str: ...
    @property
    def slot(self) -> datetime: ...
    @property
    def key(self) -> str | None: ...
    @property
    def attempt(self) -> int: ...
    @property
    def fence(self) -> int | None: ...
    @property
    def owner(self) -> str: ...


class Run(Attempt, Protocol):
    """What the fields read of a ``TaskRun`` row or a ledger ``RunRef``."""

    @property
    def state(self) -> str: ...


def log_fields(
    event: str,
    *,
    task: str | None = None,
    slot: datetime | str | None = None,
    key: str | None = None,
    run_id: int | None = None,
    attempt: int | None = None,
    fence: int | None = None,
    state: str | None = None,
    reason: object = None,
    owner: str | None = None,
    duplicates: int | None = None,
) -> dict[str, Any]:
    """The ``extra`` of one record: every field of :data:`FIELDS`, None where unknown.

    ``slot`` becomes ISO-8601, ``key`` its digest, ``reason`` (text or an exception)
    a string of at most ``REASON_MAX_LENGTH`` characters.
    """
    return {
        "event": event,
        "task": task,
        "slot": slot.isoformat() if isinstance(slot, datetime) else slot,
        "key": None if key is None else key_digest(key),
        "run_id": run_id,
        "attempt": attempt,
        "fence": fence,
        "state": None if state is None else str(state),
        "reason": None if reason is None else str(reason)[:REASON_MAX_LENGTH],
        "owner": owner,
        "duplicates": duplicates,
    }


def run_log_fields(event: str, active: Attempt, **more: Any) -> dict[str, Any]:
    """:func:`log_fields` of an attempt in progress; ``more`` adds or overrides fields."""
    known: dict[str, Any] = {
        "task": active.task_name,
        "slot": active.slot,
        "key": active.key,
        "run_id": active.id,
        "attempt": active.attempt,
        "fence": active.fence,
        "owner": active.owner,
    }
    return log_fields(event, **{**known, **more})


def row_log_fields(event: str, row: Run, **more: Any) -> dict[str, Any]:
    """:func:`log_fields` of a ``TaskRun`` row (or a ledger ``RunRef``: the same names)."""
    known: dict[str, Any] = {
        "task": row.task_name,
        "slot": row.slot,
        "key": row.key,
        "run_id": row.id,
        "attempt": row.attempt,
        "fence": row.fence,
        "state": row.state,
        "owner": row.owner,
    }
    duplicates = getattr(row, "duplicates", None)  # a RunRef has none
    if duplicates is not None:
        known["duplicates"] = duplicates
    return log_fields(event, **{**known, **more})
