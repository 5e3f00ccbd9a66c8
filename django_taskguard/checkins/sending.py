"""Sending check-ins off the task's path: one daemon thread per process, a bounded queue.

:func:`submit` only queues (the task never waits on a send); the thread, made on first use
and made again in a forked child (its parent's thread does not exist there), sends each
check-in to every configured service, up to ``attempts`` tries of ``timeout`` seconds each,
every try with the same check-in id (so a retried send is one check-in at the service).
A full queue drops the check-in: counted as a failure of every service, ``checkin_failed``
sent, logged once per burst. A send that fails its last try is counted
(:func:`failures`; ``taskguard_checkin_failures_total{service}`` in prometheus_client's
default registry when it is installed), logged with the service and status, and
``checkin_failed`` is sent from the sending thread.

:func:`flush` waits (bounded) until every queued check-in was sent; an ``atexit`` hook
flushes for at most ``timeout`` seconds.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from django.db import connections

from .. import ledger
from ..conf import taskguard_settings
from ..process import PerProcess, per_process
from ..signals import checkin_failed
from . import cronitor, healthchecks, monitors, sentry, webhook
from .config import SENDERS, number
from .events import CheckIn, checkin_id
from .http import SendError

logger = logging.getLogger("taskguard.checkins")

Send = Callable[[dict[str, Any], CheckIn, str, str, float], None]
SEND: dict[str, Send] = {
    "sentry": sentry.send,
    "healthchecks": healthchecks.send,
    "cronitor": cronitor.send,
    "webhook": webhook.send,
}
RETRY_PAUSE = 0.5  # seconds between two tries of one send (doubled each time)

_lock = threading.Lock()
_failures: PerProcess[Counter[str]] = per_process(Counter)  # a forked child counts its own
_prometheus: Any = None  # the Counter, once a failure was counted with prometheus_client


class _Worker:
    """The queue and thread of one process."""

    def __init__(self, size: int) -> None:
        self.queue: queue.Queue[CheckIn] = queue.Queue(maxsize=size)
        self.dropping = False  # in a burst of drops (logged once)
        self.thread = threading.Thread(target=self.loop, name="taskguard-checkins", daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while True:
            checkin = self.queue.get()
            try:
                deliver(checkin)
                if self.queue.empty():  # before task_done: a flush() sees no open connection
                    connections.close_all()  # this thread's own connections only
            except Exception as exc:  # the ledger unreachable, a bug: never let the thread die
                logger.exception("taskguard check-in of %s could not be sent", checkin.task)
                for service in _services():
                    _count(service)
                    _signal(service, checkin.event, f"{type(exc).__name__}: {exc}")
            finally:
                self.queue.task_done()


_workers: PerProcess[_Worker] = per_process(
    lambda: _Worker(int(number(taskguard_settings.CHECKINS, "queue")))
)


def _current() -> _Worker:
    worker = _workers.mine()
    if worker is not None:
        return worker
    with _lock:  # one thread per process, whichever thread queues first
        return _workers.get()


def submit(checkin: CheckIn) -> None:
    """Queue ``checkin`` for sending; never blocks, never raises."""
    worker = _current()
    try:
        worker.queue.put_nowait(checkin)
    except queue.Full:
        _dropped(worker, checkin)
    else:
        worker.dropping = False


def _services() -> list[str]:
    return [s for s in SENDERS if s in taskguard_settings.CHECKINS]


def _dropped(worker: _Worker, checkin: CheckIn) -> None:
    services = _services()
    if not worker.dropping:
        worker.dropping = True
        logger.warning(
            "taskguard check-ins: the queue is full (%d waiting); dropping check-ins "
            "(first: %s %s slot %s) until it drains",
            worker.queue.maxsize,
            checkin.event,
            checkin.task,
            checkin.slot.isoformat(),
        )
    for service in services:
        _count(service)
        _signal(service, checkin.event, "dropped: the check-in queue is full")


def deliver(checkin: CheckIn) -> None:
    """Send ``checkin`` to every configured service (the sending thread)."""
    settings = taskguard_settings.CHECKINS
    services = _services()
    if not services:
        return
    if checkin.verify_key and _keyed(checkin):
        return
    ident = checkin_id(ledger.identity(), checkin)
    timeout = number(settings, "timeout")
    attempts = int(number(settings, "attempts"))
    for service in services:
        slug = monitors.slug(settings, checkin.task, service)
        if slug is None:
            continue
        tries = 1 if service == "sentry" else attempts  # Sentry's transport retries itself
        _send(service, settings[service], checkin, ident, slug, timeout, tries)


def _keyed(checkin: CheckIn) -> bool:
    """Whether the check-in's row is an ``@once_per_key`` run's (never checked in)."""
    rows = ledger.runs().filter(task_name=checkin.task, slot=checkin.slot)
    if checkin.run_id is not None:
        rows = ledger.runs().filter(pk=checkin.run_id)
    return rows.filter(key__isnull=False).exists()


def _send(
    service: str,
    options: dict[str, Any],
    checkin: CheckIn,
    ident: str,
    slug: str,
    timeout: float,
    tries: int,
) -> None:
    pause = RETRY_PAUSE
    for attempt in range(1, tries + 1):
        try:
            SEND[service](options, checkin, ident, slug, timeout)
            return
        except SendError as exc:
            error = exc
        except Exception as exc:  # a bug or a library's surprise: counted the same
            error = SendError(f"{type(exc).__name__}: {exc}")
        if attempt < tries:
            time.sleep(pause)
            pause *= 2
    _count(service)
    logger.warning(
        "taskguard check-in to %s failed after %d tries (status %s): %s %s slot %s: %s",
        service,
        tries,
        error.status,
        checkin.event,
        checkin.task,
        checkin.slot.isoformat(),
        error,
    )
    _signal(service, checkin.event, str(error))


def _count(service: str) -> None:
    global _prometheus
    with _lock:
        _failures.get()[service] += 1
        if _prometheus is None:
            _prometheus = _prometheus_counter()
    if _prometheus is not False:
        _prometheus.labels(service=service).inc()


def _prometheus_counter() -> Any:
    """The failures Counter in prometheus_client's default registry (False: not installed)."""
    try:
        from prometheus_client import REGISTRY, Counter
    except ImportError:
        return False
    try:
        return Counter(
            "taskguard_checkin_failures",
            "Check-ins not delivered (or dropped), per service.",
            ["service"],
            registry=REGISTRY,
        )
    except ValueError:  # registered already, by someone else: counted here only
        logger.warning("taskguard_checkin_failures_total is registered already; not counted")
        return False


def _signal(service: str, event: str, error: str) -> None:
    for receiver, answer in checkin_failed.send_robust(
        sender=service, service=service, event=event, error=error
    ):
        if isinstance(answer, Exception):
            logger.error("a checkin_failed receiver (%r) raised: %r", receiver, answer)


def failures() -> dict[str, int]:
    """Check-ins this process could not deliver (or dropped), per service."""
    with _lock:
        return dict(_failures.get())


def reset() -> None:
    """Forget the counts, and the thread: the next check-in starts one anew, with a queue
    of the ``queue`` setting then (tests; the old thread sends what it holds, then idles)."""
    with _lock:
        _failures.forget()
        _workers.forget()


def flush(timeout: float = 5.0) -> bool:
    """Wait up to ``timeout`` seconds until every queued check-in was sent (and Sentry's
    transport flushed); True when the queue drained in time."""
    worker = _workers.mine()
    deadline = time.monotonic() + timeout
    drained = True
    if worker is not None:
        with worker.queue.all_tasks_done:
            while worker.queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    drained = False
                    break
                worker.queue.all_tasks_done.wait(left)
    if "sentry" in taskguard_settings.CHECKINS:
        import sentry_sdk

        sentry_sdk.flush(max(0.0, deadline - time.monotonic()))
    return drained


@atexit.register
def _flush_at_exit() -> None:
    if _workers.mine() is not None:
        try:
            flush(number(taskguard_settings.CHECKINS, "timeout"))
        except Exception:  # the interpreter is going away: never fail its exit
            logger.exception("taskguard check-ins: the flush at exit failed")
