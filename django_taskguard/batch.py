"""Writing many successes in one statement, for ``run_schedules``.

A scheduler that claims a thousand slots a second pays a commit per finished attempt;
:class:`SuccessWriter` gathers the attempts that returned during a few milliseconds
and records them ``succeeded`` together (each still fenced on its own row). A worker
waits for its own attempt's write before it goes on, so what it reports is recorded.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

from django.db import connections

from . import ledger
from .context import ActiveRun
from .logfields import log_fields
from .states import RunState

logger = logging.getLogger("taskguard.batch")

FLUSH_SECONDS = 0.01
MAX_BATCH = 500


class SuccessWriter:
    """A thread that records ``succeeded`` for the attempts handed to :meth:`record`."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[ActiveRun, str, Future[bool]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._loop, name="taskguard-succeed", daemon=True)
        self._thread.start()

    def record(self, active: ActiveRun, reason: str) -> bool:
        """Record ``active`` succeeded; False when it was fenced out (the slot was taken
        over or abandoned). Raises the database's error when the write failed."""
        done: Future[bool] = Future()
        self._queue.put((active, reason, done))
        return done.result()

    def close(self) -> None:
        self._queue.put(None)

    def _loop(self) -> None:
        try:
            while (first := self._queue.get()) is not None:
                batch = [first]
                closing = self._gather(batch)
                self._write(batch)
                if closing:
                    return
        finally:
            connections.close_all()

    def _gather(self, batch: list[tuple[ActiveRun, str, Future[bool]]]) -> bool:
        """Add what arrives within FLUSH_SECONDS (at most MAX_BATCH); True on close."""
        while len(batch) < MAX_BATCH:
            try:
                item = self._queue.get(timeout=FLUSH_SECONDS)
            except queue.Empty:
                return False
            if item is None:
                return True
            batch.append(item)
        return False

    def _write(self, batch: list[tuple[ActiveRun, str, Future[bool]]]) -> None:
        """Record ``batch``; a write that raised hands its error to the waiting workers
        (each reads its own row back) and drops this thread's connection, so that the
        next batch reconnects instead of failing on a dead one."""
        items = [(a.id, a.fence, a.owner, reason) for a, reason, _ in batch]
        try:
            recorded = ledger.succeed_many(items)
        except Exception as exc:
            for _, _, done in batch:
                done.set_exception(exc)
            _settle()
            return
        for active, reason, done in batch:
            if recorded is not None:
                done.set_result(active.id in recorded)
                continue
            try:  # no one-statement write here (SQLite, MariaDB): one by one
                done.set_result(_one(active, reason))
            except Exception as exc:
                done.set_exception(exc)
                _settle()


def _settle() -> None:
    try:
        ledger.settle_connection()
    except Exception:
        logger.warning(
            "taskguard could not close the success writer's connection",
            exc_info=True,
            extra=log_fields("connection.close_failed"),
        )


def _one(active: ActiveRun, reason: str) -> bool:
    row = ledger.finish(
        active.id, active.attempt, active.fence, active.owner, RunState.SUCCEEDED, reason
    )
    return row is not None
