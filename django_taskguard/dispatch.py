"""The batch path of ``run_schedules``: the schedules due at one slot, claimed together.

One statement claims a slot for many schedules (PostgreSQL), and each claim's lease
runs from that statement. So a claim is made only when a worker can start its body at
once, or very soon: one thread, the dispatcher, takes from the backlog no more schedules
than the pool has workers free now plus those it has been freeing within ``HORIZON``
(at most ``BATCH_CHUNK``), claims them, and puts the won attempts ahead of the pool's
queue. What the others left is claimed by them meanwhile: a copy
never holds claims it cannot start while another copy sits idle. A won attempt is
re-checked when it starts (see :meth:`Dispatcher.start_claimed`); one that cannot start
is given back.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, Protocol

from django.db import DatabaseError, connections
from django.utils import timezone

from . import ledger
from .batch import SuccessWriter
from .claim import Taken, claim_many
from .conf import taskguard_settings
from .context import ActiveRun
from .exceptions import BackendUnavailable
from .guard import duplicate, run_claimed
from .logfields import log_fields, run_log_fields
from .pauses import paused_reason, why
from .policy import Policy
from .pool import Pool
from .states import RunState

logger = logging.getLogger("taskguard.scheduler")

# Schedules claimed by one statement, at most.
BATCH_CHUNK = 100
# A claim may wait this long for a worker, judged by the rate the pool ends jobs at
# (seconds; well under half of any lease: see Dispatcher.start_claimed).
HORIZON = 0.5
# The dispatcher looks at its backlog (a stop, free workers) at least this often.
POLL_SECONDS = 1.0


class Entry(Protocol):
    """What the batch path needs of a schedule due at a slot: a code schedule's
    :class:`~.registry.Entry`, or a data schedule's :class:`~.data_firing.Firing`."""

    @property
    def task_name(self) -> str: ...

    @property
    def policy(self) -> Policy: ...

    @property
    def func(self) -> Callable[[], Any]: ...  # the body, without the guard

    @property
    def fire(self) -> Callable[[datetime], bool]: ...  # the one-task path: True if it ran


def version_of(entry: Entry) -> int | None:
    """The data schedule version that fires ``entry`` (recorded on the won claims' rows
    in one statement), None for a code schedule."""
    version = getattr(entry, "version", None)
    return version if isinstance(version, int) else None


RunOne = Callable[[Entry, datetime], None]  # the one-task path, on the pool
Log = Callable[[Entry, datetime, str, float], None]  # what a fire did, how long it took


NOT_RUN_HERE = "not run here (another call has it, or it is recorded)"


def not_run(entry: Entry, slot: datetime, otherwise: str) -> str:
    """Why a fired slot did not run in this call: the pause when that is why (the task is
    paused, by the cached answer, and the slot's row is ``skipped``), ``otherwise`` not: a
    call that lost to a copy which ran the slot before the pause was not stopped by it."""
    try:
        reason = paused_reason(entry.task_name)
        if reason is None:
            return otherwise
        row = ledger.read(entry.task_name, slot)
    except (BackendUnavailable, DatabaseError):  # only the log line's words depend on it
        return otherwise
    if row is None or row.state != RunState.SKIPPED:
        return otherwise
    return f"not run: the task is paused{why(reason)}; the slot is recorded skipped"


def batchable(entry: Entry, slot: datetime, now: datetime) -> bool:
    """A slot the batch claim decides like the one-task path would: on_stale="abandon",
    and not one that catchup="none" records missed for being late."""
    if entry.policy.on_stale != "abandon":
        return False
    return entry.policy.catchup != "none" or now - slot <= entry.policy.grace


class Dispatcher:
    """Claims the backlog's slots in batches as workers come free."""

    def __init__(
        self,
        pool: Pool,
        writer: SuccessWriter,
        stopping: threading.Event,
        run_one: RunOne,
        log: Log,
    ) -> None:
        self.pool = pool
        self.writer = writer
        self.stopping = stopping  # set: a claim gives its slot back instead of starting
        self._run_one = run_one
        self._log = log
        self._backlog: collections.deque[tuple[datetime, Entry]] = collections.deque()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._claiming = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="taskguard-claim", daemon=True)
        self._thread.start()

    def add(self, slot: datetime, entries: Iterable[Entry]) -> None:
        with self._lock:
            self._backlog.extend((slot, entry) for entry in entries)
            self._changed.notify_all()

    def clear(self) -> int:
        """Forget the slots not claimed yet (nothing ran them: the sweep records them
        missed unless another copy runs them); how many there were."""
        with self._lock:
            dropped = len(self._backlog)
            self._backlog.clear()
            return dropped

    def settle(self, timeout: float | None) -> bool:
        """Wait until every slot added was claimed (and its bodies submitted)."""
        with self._lock:
            return self._changed.wait_for(lambda: not self._backlog and not self._claiming, timeout)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._changed.notify_all()

    def _loop(self) -> None:
        try:
            while (taken := self._take()) is not None:
                try:
                    self._claim(*taken)
                except Exception:  # never: _claim decides every entry; but never die
                    logger.exception(
                        "the batch claim of slot %s failed",
                        taken[0],
                        extra=log_fields("claim.batch_failed", slot=taken[0]),
                    )
                finally:
                    with self._lock:
                        self._claiming = False
                        self._changed.notify_all()
        finally:
            connections.close_all()

    def _take(self) -> tuple[datetime, list[Entry]] | None:
        """The next schedules to claim (one slot, no more than the free workers)."""
        while True:
            with self._lock:
                self._changed.wait_for(lambda: bool(self._backlog) or self._closed)
                if self._closed:
                    return None
            free = self.pool.wait_free(POLL_SECONDS)
            if not free:
                continue
            # The workers free now, and those the pool has been freeing within the next
            # HORIZON seconds: short bodies are claimed in large batches, long ones in
            # as many as start at once.
            room = min(free + int(self.pool.rate() * HORIZON), BATCH_CHUNK)
            with self._lock:
                if not self._backlog:
                    continue
                slot = self._backlog[0][0]
                entries: list[Entry] = []
                while self._backlog and self._backlog[0][0] == slot and len(entries) < room:
                    entries.append(self._backlog.popleft()[1])
                self._claiming = True
                return slot, entries

    def _claim(self, slot: datetime, entries: list[Entry]) -> None:
        """Claim ``slot`` for ``entries``: each one won is started or given back, each
        taken is a duplicate, each of the others goes the one-task way."""
        now = timezone.now()
        late = [entry for entry in entries if not batchable(entry, slot, now)]
        entries = [entry for entry in entries if batchable(entry, slot, now)]
        decided = self._decide(slot, entries) if entries else {}
        _note_versions(slot, entries, decided)
        for entry in entries:  # the won first: their leases are running
            outcome = decided.get(entry.task_name)
            if isinstance(outcome, ActiveRun):
                self.pool.submit(functools.partial(self.start_claimed, entry, outcome), first=True)
        for entry in late + [e for e in entries if decided.get(e.task_name) is None]:
            self.pool.submit(functools.partial(self._run_one, entry, slot))
        for entry in entries:
            outcome = decided.get(entry.task_name)
            if isinstance(outcome, Taken):
                self._duplicate(entry, slot, outcome)

    def _decide(self, slot: datetime, entries: list[Entry]) -> dict[str, ActiveRun | Taken | None]:
        lease = taskguard_settings.LEASE_SECONDS
        wanted = [(entry.task_name, entry.policy.lease_seconds or lease) for entry in entries]
        try:
            decided = claim_many(slot, wanted)
        except Exception:
            logger.exception(
                "the batch claim of slot %s failed; firing one by one",
                slot,
                extra=log_fields("claim.batch_failed", slot=slot),
            )
            decided = None
        return {} if decided is None else decided

    def start_claimed(self, entry: Entry, active: ActiveRun) -> None:
        """Start an attempt the batch claim won, unless it can no longer start as the
        one-task path would start it: then give it back (and, unless stopping, fire the
        slot the one-task way, which claims it anew or records it late)."""
        why = self._cannot_start(entry, active)
        if why is not None:
            if _give_back(entry, active, why) and not self.stopping.is_set():
                self._run_one(entry, active.slot)
            return
        started = time.monotonic()
        ran = False

        def body() -> Any:
            nonlocal ran
            ran = True
            return entry.func()

        try:
            run_claimed(active, entry.policy, body, self.writer.record)
        except BaseException as exc:  # SystemExit from a body too: recorded failed
            outcome = f"raised {type(exc).__name__}: {exc}"
        else:
            outcome = "ran" if ran else not_run(entry, active.slot, "not run (recorded)")
        self._log(entry, active.slot, outcome, time.monotonic() - started)

    def _cannot_start(self, entry: Entry, active: ActiveRun) -> str | None:
        if self.stopping.is_set():
            return "run_schedules is stopping"
        # The heartbeat first renews a third of a lease after the start: half a lease
        # left is the least a body may start with.
        left = active.deadline - time.monotonic()
        if left < active.lease_seconds / 2:
            return f"{left:.1f}s of its {active.lease_seconds:g}s lease left when a worker was free"
        late = timezone.now() - active.slot
        if entry.policy.catchup == "none" and late > entry.policy.grace:
            return f"{late.total_seconds():.1f}s after its slot, past its grace"
        return None

    def _duplicate(self, entry: Entry, slot: datetime, taken: Taken) -> None:
        """Count the duplicate; a raising one (``on_duplicate="raise"``, a receiver that
        raises) is logged like the one-task path logs it, and the batch goes on."""
        try:
            duplicate(entry.task_name, slot, taken.state, entry.policy)
        except Exception as exc:
            outcome = f"raised {type(exc).__name__}: {exc}"
        else:
            outcome = "not run here (another call has it)"
        self._log(entry, slot, outcome, 0.0)


def _note_versions(
    slot: datetime, entries: list[Entry], decided: dict[str, ActiveRun | Taken | None]
) -> None:
    """Record on the rows won the data schedule version of each (one statement per
    version); never raises, as :func:`~.decorators.note_version` (the claim is what counts)."""
    versions = {}
    for entry in entries:
        outcome = decided.get(entry.task_name)
        version = version_of(entry)
        if isinstance(outcome, ActiveRun) and version is not None:
            versions[outcome.id] = version
    if not versions:
        return
    try:
        ledger.note_schedule_versions(versions)
    except Exception as exc:
        logger.warning(
            "taskguard slot %s: the schedule versions of %d runs could not be recorded (%s)",
            slot.isoformat(),
            len(versions),
            exc,
            extra=log_fields("version.record_failed", slot=slot, reason=exc),
        )


def _give_back(entry: Entry, active: ActiveRun, why: str) -> bool:
    """Give back a claim whose body never started; True when it was."""
    reason = f"claimed in a batch, never started ({why}): nothing ran, given back"
    try:
        given = ledger.give_back(active.id, active.fence, active.owner, reason) is not None
    except BackendUnavailable:
        logger.exception(
            "could not give back %s slot %s (claimed, never started: %s); it stays running "
            "until its lease lapses and cleanup_locks records it abandoned",
            entry.task_name,
            active.slot.isoformat(),
            why,
            extra=run_log_fields("run.give_back_failed", active, reason=why),
        )
        return False
    finally:
        active.ended.set()
    if given:
        logger.info(
            "gave back %s slot %s, claimed and never started: %s",
            entry.task_name,
            active.slot.isoformat(),
            why,
            extra=run_log_fields("run.given_back", active, reason=why),
        )
    else:
        logger.warning(
            "%s slot %s: claimed, never started (%s), and no longer ours to give back",
            entry.task_name,
            active.slot.isoformat(),
            why,
            extra=run_log_fields("run.give_back_refused", active, reason=why),
        )
    return given
