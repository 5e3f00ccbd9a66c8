"""Keeps an attempt's lease alive while its function runs.

The heartbeat never dies silently: every failure is caught, logged and
counted, and if the lease cannot be renewed before its deadline the attempt
is declared lost (``lease_lost`` signal; ``current_run().check()`` raises).
"""

from __future__ import annotations

import logging
import threading
import time

from django.db import connections

from . import ledger
from .context import ActiveRun
from .locks import LockBackend

logger = logging.getLogger("taskguard.heartbeat")


class Heartbeat(threading.Thread):
    def __init__(self, run: ActiveRun, lock: LockBackend, key: str, alias: str) -> None:
        super().__init__(name=f"taskguard-heartbeat-{run.id}", daemon=True)
        self.active = run
        self.lock = lock
        self.key = key
        self.alias = alias
        self.interval = run.lease_seconds / 3
        self.failures = 0
        self.beats = 0
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=max(self.interval, 1.0) + 5.0)

    def run(self) -> None:
        try:
            while not self._stopping.wait(self._next_wait()):
                self.beat()
                if self.active.lost.is_set():
                    return
        except BaseException:
            logger.exception("taskguard heartbeat crashed for run %s", self.active.id)
            self.declare_lost("the heartbeat thread crashed")
        finally:
            connections[self.alias].close()

    def _next_wait(self) -> float:
        # Renew on schedule, but never sleep past the deadline when renewals fail.
        left = self.active.deadline - time.monotonic()
        return max(0.0, min(self.interval, left))

    def beat(self) -> None:
        active = self.active
        sent = time.monotonic()
        if sent >= active.deadline:
            # Paused (SIGSTOP, a long GC, a frozen VM) past the deadline: another
            # attempt may already hold the slot, so never quietly renew.
            self.declare_lost("the lease expired before it could be renewed (process paused?)")
            return
        try:
            renewed = ledger.renew(self.alias, active.id, active.fence, active.lease_seconds)
        except Exception:
            self.failures += 1
            logger.warning(
                "taskguard heartbeat could not renew run %s (%d failures)",
                active.id,
                self.failures,
                exc_info=True,
            )
            connections[self.alias].close()
            if time.monotonic() >= active.deadline:
                self.declare_lost("the lease could not be renewed before its deadline")
            return
        if renewed is None:
            self.declare_lost("another attempt took the slot over (fence changed)")
            return
        self.beats += 1
        active.deadline = sent + active.lease_seconds
        if not self.lock.extend(self.key, active.token, active.lease_seconds):
            logger.info("taskguard fast-path lock for run %s could not be extended", active.id)

    def declare_lost(self, reason: str) -> None:
        self.active.mark_lost(reason)
