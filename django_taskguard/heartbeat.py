"""Keeps live attempts' leases alive while their functions run.

One daemon thread per process renews every live attempt of that process
(starting a thread, and a database connection, per call would cost more than
the claim itself). It never dies silently: every failure is caught, logged and
counted, and an attempt whose lease cannot be renewed before its deadline is
declared lost (``lease_lost`` signal; ``current_run().check()`` raises).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

from django.db import connections

from . import ledger
from .context import ActiveRun
from .locks import LockBackend

logger = logging.getLogger("taskguard.heartbeat")


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


class Heartbeats:
    """The per-process renewal service: ``start()`` an attempt, ``stop()`` it when it ends."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._beats: set[Beat] = set()
        self._thread: threading.Thread | None = None
        self._connected = False  # the thread has used its database connection since idle
        # When the waiting thread looks next (-inf: it is not waiting, it will look anyway).
        # A new attempt wakes it only when due sooner: a short call wakes no thread.
        self._wake_at = float("-inf")

    def start(self, active: ActiveRun, lock: LockBackend, key: str) -> Beat:
        if self._pid != os.getpid():
            self._reset()  # forked: the parent's thread (and maybe its lock) is not ours
        beat = Beat(active, lock, key)
        beat.next_at = time.monotonic() + beat.interval
        with self._cond:
            self._beats.add(beat)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="taskguard-heartbeat", daemon=True
                )
                self._thread.start()
            elif beat.next_at < self._wake_at:
                self._cond.notify_all()
        return beat

    def stop(self, beat: Beat) -> None:
        """Stop renewing ``beat``; waits for a renewal in flight so none lands after."""
        with self._cond:
            beat.stopped = True
            self._beats.discard(beat)
            if not self._beats and self._connected:
                self._cond.notify_all()  # the idle thread closes its database connection
            while beat.busy:
                self._cond.wait()

    def _loop(self) -> None:
        try:
            while True:
                due = self._due()
                if not due:
                    # Nothing left to renew: hold no idle database connection.
                    connections.close_all()
                    continue
                for beat in due:
                    self._beat_safely(beat)
        except BaseException:
            logger.exception("taskguard heartbeat crashed")
            with self._cond:
                orphans, self._beats = list(self._beats), set()
            for beat in orphans:
                beat.active.mark_lost("the heartbeat thread crashed")
        finally:
            connections.close_all()

    def _due(self) -> list[Beat]:
        with self._cond:
            while True:
                now = time.monotonic()
                due = [beat for beat in self._beats if beat.next_at <= now]
                if due:
                    for beat in due:
                        beat.busy = True
                    self._connected = True
                    return due
                if not self._beats and self._connected:
                    self._connected = False
                    return []
                pending = [beat.next_at for beat in self._beats if beat.next_at != float("inf")]
                self._wake_at = min(pending) if pending else float("inf")
                self._cond.wait(self._wake_at - now if pending else None)
                self._wake_at = float("-inf")

    def _beat_safely(self, beat: Beat) -> None:
        try:
            renew(beat)
        except Exception:
            logger.exception("taskguard heartbeat failed for run %s", beat.active.id)
            beat.active.mark_lost("the heartbeat failed unexpectedly")
        finally:
            with self._cond:
                beat.busy = False
                self._cond.notify_all()


def renew(beat: Beat) -> None:
    """Renew one attempt's lease once; declare it lost when that is no longer possible."""
    active = beat.active
    sent = time.monotonic()
    if sent >= active.deadline:
        # Paused (SIGSTOP, a long GC, a frozen VM) past the deadline: another
        # attempt may already hold the slot, so never quietly renew.
        _lost(beat, "the lease expired before it could be renewed (process paused?)")
        return
    try:
        renewed = ledger.renew(active.id, active.fence, active.lease_seconds)
    except Exception:
        beat.failures += 1
        logger.warning(
            "taskguard heartbeat could not renew run %s (%d failures)",
            active.id,
            beat.failures,
            exc_info=True,
        )
        ledger.settle_connection()
        # Retry soon, but never sleep past the deadline.
        beat.next_at = min(time.monotonic() + beat.interval, active.deadline)
        return
    if renewed is None:
        _lost(beat, "another attempt took the slot over (fence changed)")
        return
    beat.beats += 1
    active.deadline = sent + active.lease_seconds
    beat.next_at = sent + beat.interval
    if not beat.lock.extend(beat.key, active.token, active.lease_seconds):
        logger.info("taskguard fast-path lock for run %s could not be extended", active.id)


def _lost(beat: Beat, reason: str) -> None:
    if not beat.stopped:
        beat.active.mark_lost(reason)
    beat.next_at = float("inf")  # nothing more to renew


heartbeats = Heartbeats()
