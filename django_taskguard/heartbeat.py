"""Keeps live attempts' leases alive while their functions run.

Each attempt's renewal is independent of every other's. One scheduler thread per
process knows when each live attempt is due; it does no I/O, so it is never
late. It hands a due renewal to a small pool of renewer threads, each with its
own database connection, and each renewal is bounded: a statement and lock
timeout on PostgreSQL, a busy timeout on SQLite (:func:`renewal_timeout`, well
under the renewal interval). So a renewal stuck behind a row lock held elsewhere
ties up one renewer for at most that timeout, while the other renewers keep
every other attempt alive.

Why a bounded pool rather than a thread per attempt: a short call must stay
cheap (it starts no thread and opens no connection; it only registers), and a
process with many live attempts must not open as many connections. Renewers
are started only when a renewal is due and every renewer is busy, at most
:data:`MAX_RENEWERS` of them (so at most that many connections per process);
the most recently busy one is reused first, so the others fall idle, close their
connection and exit after :data:`IDLE_SECONDS`, and all of them do once no
attempt is live. Only with every renewer stuck at once does a healthy renewal
wait, and then for at most one renewal timeout per round of stuck ones ahead.

Nothing here waits for a renewal in flight: ``stop()`` returns at once. A
renewal that lands after the attempt ended is refused by the ledger (the row is
no longer ``running`` with that fence) and by the Redis lock (``EXTEND`` compares
the token, which a released key or a finished-slot marker never holds).

It never dies silently: every failure is caught, logged and counted; a failed
renewal is retried before the deadline, and an attempt whose lease cannot be
renewed before its deadline is declared lost (``lease_lost`` signal;
``current_run().check()`` raises).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import connections

from . import ledger
from .context import ActiveRun
from .locks import LockBackend
from .logfields import log_fields, run_log_fields
from .process import per_process

logger = logging.getLogger("taskguard.heartbeat")

MAX_RENEWERS = 4
"""Renewer threads (and database connections) per process, at most."""
IDLE_SECONDS = 60.0
"""A renewer with nothing to do for this long closes its connection and exits."""
NEVER = float("inf")


def renewal_timeout(lease_seconds: float) -> float:
    """How long one renewal may wait and run: a tenth of the lease, 0.5 s to 5 s.

    Well under the renewal interval (a third of the lease) for any lease of 5 s
    or more, so a timed-out renewal is retried several times before the deadline.
    """
    return max(0.5, min(lease_seconds / 10, 5.0))


@dataclass(eq=False)
class Beat:
    """One attempt the heartbeat keeps alive."""

    active: ActiveRun
    lock: LockBackend
    key: str
    next_at: float = field(default=0.0)
    failures: int = 0
    beats: int = 0
    busy: bool = False  # a renewal is in flight
    stopped: bool = False  # the attempt ended; a late answer must not declare it lost

    @property
    def interval(self) -> float:
        return self.active.lease_seconds / 3

    @property
    def timeout(self) -> float:
        return renewal_timeout(self.active.lease_seconds)


@dataclass(eq=False)
class Renewer:
    """One renewer thread's mailbox (its database connection is its thread's own)."""

    wake: threading.Condition
    job: Beat | None = None


def start_thread(target: Callable[[], None], name: str) -> None:
    """Start a daemon thread (a seam: tests make it fail as a real thread start can)."""
    threading.Thread(target=target, name=name, daemon=True).start()


class Heartbeats:
    """The per-process renewal service: ``start()`` an attempt, ``stop()`` it when it ends."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # the scheduler waits on it
        self._beats: set[Beat] = set()
        self._scheduler = False  # the scheduler thread runs
        self._renewers: list[Renewer] = []
        self._idle: list[Renewer] = []  # a stack: the most recently busy on top
        self._backlog: deque[Beat] = deque()  # due, while every renewer is busy
        # When the waiting scheduler looks next (-inf: it is not waiting, it will look
        # anyway). A new attempt wakes it only when due sooner: a short call wakes no thread.
        self._wake_at = float("-inf")

    def start(self, active: ActiveRun, lock: LockBackend, key: str) -> Beat:
        """Renew ``active``'s lease until ``stop()``; raises (and keeps nothing) on failure."""
        beat = Beat(active, lock, key)
        beat.next_at = time.monotonic() + beat.interval
        with self._lock:
            if not self._scheduler:
                start_thread(self._schedule, "taskguard-heartbeat")
                self._scheduler = True
            self._beats.add(beat)
            if beat.next_at < self._wake_at:
                self._cond.notify()
        return beat

    def stop(self, beat: Beat | None) -> None:
        """Stop renewing ``beat``; a renewal in flight is not waited for (it is refused)."""
        if beat is None:
            return
        with self._lock:
            beat.stopped = True
            self._beats.discard(beat)
            if not self._beats:
                for renewer in self._idle:  # nothing left to renew: hold no idle connection
                    renewer.wake.notify()

    def live(self) -> int:
        """How many attempts this process is renewing."""
        with self._lock:
            return len(self._beats)

    # -- the scheduler: no I/O, never late -------------------------------------------

    def _schedule(self) -> None:
        try:
            while True:
                with self._lock:
                    due, overdue = self._wait_due()
                    for beat in due:
                        beat.busy = True
                        self._dispatch(beat)
                for beat in overdue:  # outside the lock: lease_lost receivers run here
                    _lost(beat, _overdue(beat, in_flight=True))
        except BaseException:
            logger.exception("taskguard heartbeat crashed", extra=log_fields("heartbeat.crashed"))
            with self._lock:
                orphans, self._beats = list(self._beats), set()
                self._scheduler = False
            for beat in orphans:
                beat.active.mark_lost("the heartbeat thread crashed")

    def _wait_due(self) -> tuple[list[Beat], list[Beat]]:
        """Wait (under the lock) until renewals are due, or renewals in flight are overdue.

        ``(due, overdue)``: an attempt whose renewal is still in flight at its
        deadline is overdue, and declared lost without waiting for that renewal.
        """
        while True:
            self._staff_backlog()
            now = time.monotonic()
            due, overdue, wake_at = [], [], NEVER
            for beat in self._beats:
                if beat.busy:
                    if not beat.active.lost.is_set():
                        if beat.active.deadline <= now:
                            overdue.append(beat)
                        else:
                            wake_at = min(wake_at, beat.active.deadline)
                elif beat.next_at <= now:
                    due.append(beat)
                else:
                    wake_at = min(wake_at, beat.next_at)
            if due or overdue:
                return due, overdue
            self._wake_at = wake_at
            self._cond.wait(None if wake_at == NEVER else wake_at - now)
            self._wake_at = float("-inf")

    def _dispatch(self, beat: Beat) -> None:
        """Hand ``beat`` to the most recently busy idle renewer, a new one, or the backlog."""
        if self._idle:
            renewer = self._idle.pop()
            renewer.job = beat
            renewer.wake.notify()
        elif not (len(self._renewers) < MAX_RENEWERS and self._start_renewer(beat)):
            self._backlog.append(beat)  # the first renewer to be free takes it

    def _staff_backlog(self) -> None:
        """Renewals left waiting (a renewer could not start, or ended): start renewers."""
        while self._backlog and len(self._renewers) < MAX_RENEWERS:
            if not self._start_renewer(self._backlog[0]):
                return
            self._backlog.popleft()

    def _start_renewer(self, beat: Beat) -> bool:
        renewer = Renewer(threading.Condition(self._lock), job=beat)
        try:
            start_thread(lambda: self._renew_loop(renewer), "taskguard-renewer")
        except Exception:
            # Its deadline still applies: the scheduler declares it lost if nobody renews it.
            logger.exception(
                "taskguard could not start a heartbeat renewer",
                extra=run_log_fields("heartbeat.start_failed", beat.active),
            )
            return False
        self._renewers.append(renewer)
        return True

    # -- the renewers -------------------------------------------------------------------

    def _renew_loop(self, renewer: Renewer) -> None:
        try:
            while (beat := self._next_job(renewer)) is not None:
                try:
                    renew(beat)
                except BaseException as exc:
                    logger.exception(
                        "taskguard heartbeat failed for run %s",
                        beat.active.id,
                        extra=run_log_fields("heartbeat.failed", beat.active),
                    )
                    _lost(beat, "the heartbeat failed unexpectedly")
                    if not isinstance(exc, Exception):
                        raise
                finally:
                    with self._lock:
                        beat.busy = False
                        self._cond.notify()  # the scheduler: its next due time may have moved
        finally:
            with self._lock:
                if renewer in self._renewers:  # it crashed (an idle exit is already out)
                    self._renewers.remove(renewer)
                    self._cond.notify()  # the scheduler staffs the backlog again
            connections.close_all()  # this thread's own connections

    def _next_job(self, renewer: Renewer) -> Beat | None:
        """The renewal to do next, waiting for one; None: exit (idle too long, or no attempt)."""
        with self._lock:
            if renewer.job is None and self._backlog:
                return self._backlog.popleft()
            if renewer.job is None:
                self._idle.append(renewer)
                idle_until = time.monotonic() + IDLE_SECONDS
                while renewer.job is None and self._beats:
                    left = idle_until - time.monotonic()
                    if left <= 0:
                        break
                    renewer.wake.wait(left)
                if renewer.job is None:  # still in _idle: nobody handed it a job
                    self._idle.remove(renewer)
                    self._renewers.remove(renewer)
                    return None
            beat, renewer.job = renewer.job, None
            return beat


def renew(beat: Beat) -> None:
    """Renew one attempt's lease once; declare it lost when that is no longer possible."""
    active = beat.active
    sent = time.monotonic()
    if beat.stopped or active.lost.is_set():
        beat.next_at = NEVER
        return
    if sent >= active.deadline:
        # Paused (SIGSTOP, a long GC, a frozen VM) or failing past the deadline: another
        # attempt may already hold the slot, so never quietly renew.
        _lost(beat, _overdue(beat))
        return
    try:
        renewed = ledger.renew(active.id, active.fence, active.lease_seconds, beat.timeout)
    except Exception:
        _failed(beat)
        return
    if renewed is None:
        _lost(beat, "another attempt took the slot over (fence changed)")
        return
    beat.beats += 1
    active.deadline = sent + active.lease_seconds
    beat.next_at = sent + beat.interval if not active.lost.is_set() else NEVER
    if beat.stopped:
        return  # ended meanwhile: its lock is released or marked finished; leave it
    if not beat.lock.extend(beat.key, active.token, active.lease_seconds):
        logger.info(
            "taskguard fast-path lock for run %s could not be extended",
            active.id,
            extra=run_log_fields("lock.extend_failed", active),
        )


def _failed(beat: Beat) -> None:
    """A renewal raised (timed out, connection lost): count it, retry soon, before the deadline."""
    beat.failures += 1
    try:
        ledger.settle_connection()  # this renewer's connection: the next renewal reconnects
    except Exception:
        logger.warning(
            "taskguard heartbeat could not close a failed connection",
            exc_info=True,
            extra=log_fields("connection.close_failed"),
        )
    if beat.stopped:
        beat.next_at = NEVER
        return
    logger.warning(
        "taskguard heartbeat could not renew run %s (%d failures)",
        beat.active.id,
        beat.failures,
        exc_info=True,
        extra=run_log_fields("heartbeat.renew_failed", beat.active),
    )
    retry_in = min(beat.interval, beat.timeout)
    beat.next_at = min(time.monotonic() + retry_in, beat.active.deadline)


def _overdue(beat: Beat, *, in_flight: bool = False) -> str:
    if in_flight:
        return (
            f"the lease was not renewed before its deadline (a renewal was still waiting "
            f"for the database; {beat.failures} had failed)"
        )
    if beat.failures:
        return (
            f"the lease was not renewed before its deadline ({beat.failures} renewals "
            f"failed or timed out)"
        )
    return "the lease expired before it could be renewed (process paused?)"


def _lost(beat: Beat, reason: str) -> None:
    if not beat.stopped:
        beat.active.mark_lost(reason)
    beat.next_at = NEVER  # nothing more to renew


class ThisProcess:
    """``heartbeats``: this process's :class:`Heartbeats`. A forked child makes its own:
    the parent's threads (and maybe its lock, held at the fork) are not the child's."""

    def __init__(self) -> None:
        self._mine = per_process(Heartbeats)

    def start(self, active: ActiveRun, lock: LockBackend, key: str) -> Beat:
        return self._mine.get().start(active, lock, key)

    def stop(self, beat: Beat | None) -> None:
        self._mine.get().stop(beat)

    def live(self) -> int:
        return self._mine.get().live()


heartbeats = ThisProcess()
