"""Sending check-ins off the task's path: a daemon thread and a bounded queue per service.

:func:`submit` only queues (the task never waits on a send). Each configured service has a
thread of its own in each process (made on first use, and made again in a forked child,
where its parent's threads do not exist), so that a service that hangs delays no other
service's check-ins. It sends each check-in up to ``attempts`` tries of ``timeout`` seconds,
every try with the same check-in id (so a retried send is one check-in at the service).
A full queue drops the check-in for that service: counted as its failure,
``checkin_failed`` sent, logged once per burst. A send that fails its last try is counted
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
from ..logfields import log_fields
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

# A lock per process: a forked child's copy of its parent's lock may be held by a thread
# that does not exist in the child (uWSGI forks without running at-fork hooks).
_locks: PerProcess[threading.Lock] = per_process(threading.Lock)
_failures: PerProcess[Counter[str]] = per_process(Counter)  # a forked child counts its own
_prometheus: Any = None  # the Counter, once a failure was counted with prometheus_client


class _Worker:
    """The queue and thread of one service in one process."""

    def __init__(self, service: str, size: int) -> None:
        self.service = service
        self.queue: queue.Queue[CheckIn] = queue.Queue(maxsize=size)
        self.dropping = False  # in a burst of drops (logged once)
        self.thread = threading.Thread(
            target=self.loop, name=f"taskguard-checkins-{service}", daemon=True
        )
        self.thread.start()

    def loop(self) -> None:
        while True:
            checkin = self.queue.get()
            try:
                deliver(checkin, self.service)
                if self.queue.empty():  # before task_done: a flush() sees no open connection
                    connections.close_all()  # this thread's own connections only
            except Exception as exc:  # the ledger unreachable, a bug: never let the thread die
                logger.exception(
                    "taskguard check-in of %s to %s could not be sent",
                    checkin.task,
                    self.service,
                    extra=_checkin_log_fields("checkin.send_failed", checkin),
                )
                _count(self.service)
                _signal(self.service, checkin.event, f"{type(exc).__name__}: {exc}")
            finally:
                self.queue.task_done()


_workers: PerProcess[dict[str, _Worker]] = per_process(dict)


def _current(service: str) -> _Worker:
    with _locks.get():  # one thread per service and process, whichever thread queues first
        workers = _workers.get()
        worker = workers.get(service)
        if worker is None:
            size = int(number(taskguard_settings.CHECKINS, "queue"))
            worker = workers[service] = _Worker(service, size)
        return worker


def submit(checkin: CheckIn) -> None:
    """Queue ``checkin`` for every configured service; never blocks, never raises."""
    for service in _services():
        worker = _current(service)
        try:
            worker.queue.put_nowait(checkin)
        except queue.Full:
            _dropped(worker, checkin)
        else:
            worker.dropping = False


def _services() -> list[str]:
    return [s for s in SENDERS if s in taskguard_settings.CHECKINS]


def _dropped(worker: _Worker, checkin: CheckIn) -> None:
    if not worker.dropping:
        worker.dropping = True
        logger.warning(
            "taskguard check-ins to %s: the queue is full (%d waiting); dropping check-ins "
            "(first: %s %s slot %s) until it drains",
            worker.service,
            worker.queue.maxsize,
            checkin.event,
            checkin.task,
            checkin.slot.isoformat(),
            extra=_checkin_log_fields("checkin.dropped", checkin),
        )
    _count(worker.service)
    _signal(worker.service, checkin.event, "dropped: the check-in queue is full")


def deliver(checkin: CheckIn, service: str) -> None:
    """Send ``checkin`` to ``service`` (that service's sending thread)."""
    settings = taskguard_settings.CHECKINS
    if service not in settings:  # the settings changed since it was queued
        return
    slug = monitors.slug(settings, checkin.task, service)
    if slug is None:
        return
    if checkin.verify_key and _keyed(checkin):
        return
    ident = checkin_id(ledger.identity(), checkin)
    timeout = number(settings, "timeout")
    tries = 1 if service == "sentry" else int(number(settings, "attempts"))  # Sentry retries
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
        if attempt < tries and _worth_another_try(error):
            time.sleep(pause)
            pause *= 2
            continue
        break
    _count(service)
    logger.warning(
        "taskguard check-in to %s failed after %d tries (status %s): %s %s slot %s: %s",
        service,
        attempt,
        error.status,
        checkin.event,
        checkin.task,
        checkin.slot.isoformat(),
        error,
        extra=_checkin_log_fields("checkin.failed", checkin, reason=error),
    )
    _signal(service, checkin.event, str(error))


def _checkin_log_fields(event: str, checkin: CheckIn, **more: Any) -> dict[str, Any]:
    """The log record's fields of one check-in (``logfields``)."""
    fields: dict[str, Any] = {"task": checkin.task, "slot": checkin.slot, "run_id": checkin.run_id}
    return log_fields(event, **fields, attempt=checkin.attempt, state=checkin.state, **more)


def _worth_another_try(error: SendError) -> bool:
    """No answer, a 5xx or a 429 may pass; another 4xx (an unknown slug, a bad request)
    answers the same to every try."""
    status = error.status
    return status is None or status == 429 or not 400 <= status < 500


def _count(service: str) -> None:
    global _prometheus
    with _locks.get():
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
        logger.warning(
            "taskguard_checkin_failures_total is registered already; not counted",
            extra=log_fields("checkin.counter_registered"),
        )
        return False


def _signal(service: str, event: str, error: str) -> None:
    for receiver, answer in checkin_failed.send_robust(
        sender=service, service=service, event=event, error=error
    ):
        if isinstance(answer, Exception):
            logger.error(
                "a checkin_failed receiver (%r) raised: %r",
                receiver,
                answer,
                extra=log_fields("receiver.failed", reason="checkin_failed"),
            )


def failures() -> dict[str, int]:
    """Check-ins this process could not deliver (or dropped), per service."""
    with _locks.get():
        return dict(_failures.get())


def reset() -> None:
    """Forget the counts, and the threads: the next check-in starts them anew, with queues
    of the ``queue`` setting then (tests; the old threads send what they hold, then idle)."""
    with _locks.get():
        _failures.forget()
        _workers.forget()


def flush(timeout: float = 5.0) -> bool:
    """Wait up to ``timeout`` seconds until every queued check-in was sent (and Sentry's
    transport flushed); True when every queue drained in time."""
    deadline = time.monotonic() + timeout
    with _locks.get():
        workers = list((_workers.mine() or {}).values())
    drained = all(_drain(worker, deadline) for worker in workers)
    if "sentry" in taskguard_settings.CHECKINS:
        import sentry_sdk

        sentry_sdk.flush(max(0.0, deadline - time.monotonic()))
    return drained


def _drain(worker: _Worker, deadline: float) -> bool:
    with worker.queue.all_tasks_done:
        while worker.queue.unfinished_tasks:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            worker.queue.all_tasks_done.wait(left)
    return True


@atexit.register
def _flush_at_exit() -> None:
    if _workers.mine() is not None:
        try:
            flush(number(taskguard_settings.CHECKINS, "timeout"))
        except Exception:  # the interpreter is going away: never fail its exit
            logger.exception(
                "taskguard check-ins: the flush at exit failed",
                extra=log_fields("checkin.flush_failed"),
            )
