"""The upkeep: what keeps the ledger true between runs, run by the processes a deployment has.

One upkeep does, in order, each part on its own (a part that fails is recorded and the
others still run):

- ``stale``: runs whose lease lapsed (their owner died) and retries that never came are
  recorded ``abandoned``, their locks released (:func:`cleanup.cleanup_locks`);
- ``lock``: the lock backend's sweep (Redis: the duplicate counts that losing calls left
  are folded into their rows, slots whose Redis winner died before its row are recorded,
  orphan keys removed);
- ``schedules``: the schedules this process declares are saved (``registry.sync``), so
  that a schedule only ever called by guarded calls (APScheduler, cron) is known: once per
  process (the code does not change under it), never marking any removed (only the
  processes that fire schedules do: ``run_schedules``), and without the zone-conflict log
  that ``run_schedules`` and check ``taskguard.W020`` give;
- ``missed``: the missed-slot sweep, and pending slots nobody started
  (:func:`missed.sweep_missed`).

That is ``cleanup_locks`` without ``--dry-run``. One process at a time across the fleet
runs it, and not again before ``UPKEEP_INTERVAL_SECONDS`` (within :data:`LEEWAY` of it):
the lease on the one ``Upkeep`` row (:mod:`.ledger.upkeep`), which also records how the
latest run ended, for the health verdict. The run renews its lease while it works
(:class:`Keeping`), so a long part does not let another process start beside it; a run
whose lease was taken all the same (its renewals failed until it lapsed) stops before its
next part.

:func:`maybe_upkeep` is what the processes call (``run_schedules``, the beat schedulers,
Celery workers after each task and their main process on a :class:`Timer`, every guarded
call after it ended): a look at a
monotonic clock, and at most once per interval per process a daemon thread that takes the
lease and runs the upkeep. The caller never waits for it, and nothing of it raises into
the caller.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.db import connections

from . import ledger, registry
from .cleanup import call_backend, cleanup_locks
from .conf import taskguard_settings
from .exceptions import BackendUnavailable
from .ledger import upkeep as store
from .locks import get_backend
from .logfields import log_fields
from .missed import sweep_missed
from .owner import actor, new_token

logger = logging.getLogger("taskguard.upkeep")

# A lease outlives a run that takes this long (twice the interval, and at least this):
# a holder that died is replaced after its lease lapses.
HOLD_AT_LEAST = timedelta(seconds=10)
# Fleet-wide, an upkeep may start this share of the interval early: a process whose
# previous attempt started a little later than its own run (thread start, a slow query)
# is not turned away for a whole interval.
LEEWAY = 0.1
# With the automatic upkeep off (or a setting it cannot read), how often a process looks
# at the setting again.
RECHECK_SECONDS = 60.0


def unique(who: str) -> str:
    """A lease holder: ``who`` and a token of this attempt (``ran_by`` shows ``who``)."""
    return f"{who}{store.HOLDER_TAIL}{new_token()}"


def hold_for(interval: float) -> timedelta:
    return max(timedelta(seconds=2 * interval), HOLD_AT_LEAST)


def run_upkeep(holder: str | None = None, interval: float | None = None) -> dict[str, Any]:
    """Take the fleet-wide lease and run the upkeep once; what it did.

    ``{"taken": False}`` when another process holds the lease or ran it within the
    interval. Never raises: a part that failed is named in ``errors`` (and in the
    ``Upkeep`` row's ``error``), and the lease that could not be taken says why.
    """
    holder = holder or unique(actor("upkeep"))
    seconds = interval or _interval() or RECHECK_SECONDS
    every = timedelta(seconds=seconds * (1 - LEEWAY))
    try:
        taken = store.take(holder, hold_for(seconds), every)
    except Exception as exc:
        logger.warning(
            "taskguard upkeep: the lease could not be taken (%s)",
            exc,
            extra=log_fields("upkeep.lease_failed", reason=exc),
        )
        _settle()
        return {"taken": False, "errors": [f"lease: {exc}"]}
    if not taken:
        return {"taken": False}
    with Keeping(holder, hold_for(seconds)) as lease:
        result, errors = work(lease.held)
    if lease.lost.is_set():  # said when it stopped; the row is the new holder's
        return {"taken": True, **result, "errors": [*errors, LOST], "lost": True}
    finish(holder, result, errors)
    return {"taken": True, **result, "errors": errors}


LOST = "lease: lost to another process; the run stopped"


class Keeping:
    """Renew ``holder``'s lease while its run works: a daemon thread every third of the
    lease (a part that takes longer than the lease keeps it), and :meth:`held` between
    parts. A renewal refused (another process took the lease after it lapsed) sets
    :attr:`lost`; a renewal that fails (the database down) is tried again."""

    def __init__(self, holder: str, hold: timedelta) -> None:
        self.holder, self.hold = holder, hold
        self.lost = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._renew_often, name="taskguard-upkeep-lease")
        self._thread.daemon = True

    def __enter__(self) -> Keeping:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def held(self) -> bool:
        """Renew now; False when the lease is lost (said once, for this run)."""
        if not self.lost.is_set():
            self._renew()
            if self.lost.is_set():
                logger.warning(
                    "taskguard upkeep by %s lost its lease to another process; it stops "
                    "(its result is not recorded)",
                    self.holder,
                    extra=log_fields("upkeep.lease_lost", owner=self.holder),
                )
                return False
        return not self.lost.is_set()

    def _renew_often(self) -> None:
        try:
            while not self._done.wait(self.hold.total_seconds() / 3) and not self.lost.is_set():
                self._renew()
        finally:
            connections.close_all()  # this thread's own connections

    def _renew(self) -> None:
        try:
            if not store.renew(self.holder, self.hold):
                self.lost.set()
        except Exception as exc:
            logger.debug(
                "taskguard upkeep by %s could not renew its lease (%s)",
                self.holder,
                exc,
                extra=log_fields("upkeep.renew_failed", owner=self.holder, reason=exc),
            )
            _settle()


def finish(holder: str, result: dict[str, Any], errors: list[str]) -> None:
    """Record the end of ``holder``'s upkeep (or cleanup) and give the lease back; never raises."""
    try:
        if not store.finish(holder, result, "\n".join(errors)):
            logger.warning(
                "taskguard upkeep by %s outlived its lease: another process took it; its "
                "result is not recorded",
                holder,
                extra=log_fields("upkeep.lease_lost", owner=holder),
            )
    except Exception as exc:
        logger.warning(
            "taskguard upkeep by %s could not record its end (%s)",
            holder,
            exc,
            extra=log_fields("upkeep.record_failed", owner=holder, reason=exc),
        )
        _settle()


def give_back(holder: str) -> None:
    """Give the lease back without recording a run (it did not finish); never raises."""
    try:
        store.release(holder)
    except Exception as exc:
        logger.warning(
            "taskguard upkeep by %s could not give its lease back (%s)",
            holder,
            exc,
            extra=log_fields("upkeep.give_back_failed", owner=holder, reason=exc),
        )
        _settle()


def take_now(holder: str, interval: float | None = None) -> bool:
    """Take the lease whenever the latest upkeep ran (an operator's ``cleanup_locks``), for
    :func:`hold_now`; False: another process holds it (raises ``BackendUnavailable``)."""
    return store.take(holder, hold_now(interval), timedelta(0))


def hold_now(interval: float | None = None) -> timedelta:
    """How long :func:`take_now`'s lease is held (and renewed for: :class:`Keeping`)."""
    return hold_for(interval or _interval() or RECHECK_SECONDS)


def work(held: Callable[[], bool] | None = None) -> tuple[dict[str, Any], list[str]]:
    """Every part of the upkeep, each on its own; (what they did, what failed). ``held``,
    asked before each part: False stops the run there (its lease was lost).

    A part that fails because a server does not answer (``BackendUnavailable``: Redis or
    the database down) is a known outage, not a bug: one warning line per process when
    parts start failing (no traceback), and one when they work again; every failure is
    still in the errors (the ``Upkeep`` row, which the health verdict reports). Any other
    error is logged with its traceback each time."""
    result: dict[str, Any] = {}
    errors: list[str] = []
    unavailable: dict[str, BackendUnavailable] = {}
    ran: list[str] = []
    for name, part in PARTS:
        if held is not None and not held():
            break
        ran.append(name)
        try:
            result.update(part())
        except BackendUnavailable as exc:
            unavailable[name] = exc
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            _settle()
        except Exception as exc:
            logger.exception(
                "taskguard upkeep: %s failed; the other parts go on",
                name,
                extra=log_fields("upkeep.part_failed", reason=name),
            )
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            _settle()
    _say_outages(unavailable, [name for name in ran if name not in unavailable])
    return result, errors


# The parts failing in this process for an outage (said once until they work again).
_outages: set[str] = set()


def _say_outages(unavailable: dict[str, BackendUnavailable], worked: list[str]) -> None:
    """One line for the parts that started failing for an outage, and one when the outage
    is over (no part fails for one); a part still failing is said at DEBUG only. A part
    that works within the outage (it had nothing to do that needed the server) is not
    said to work again until the outage is over."""
    if not unavailable:
        if _outages:
            back = ", ".join(name for name in worked if name in _outages)
            _outages.clear()
            logger.warning(
                "taskguard upkeep: %s runs again",
                back,
                extra=log_fields("upkeep.part_available", reason=back),
            )
        return
    new = [name for name in unavailable if name not in _outages]
    for name, exc in unavailable.items():
        if name not in new:
            logger.debug(
                "taskguard upkeep: %s still cannot run (%s)",
                name,
                exc,
                extra=log_fields("upkeep.part_unavailable", reason=exc),
            )
    if new:
        _outages.update(new)
        first = unavailable[new[0]]
        logger.warning(
            "taskguard upkeep: %s cannot run (%s); the other parts go on, the health check "
            "reports it, and this is said again only after it has worked again "
            "(logged once per outage)",
            ", ".join(new),
            first,
            extra=log_fields("upkeep.part_unavailable", reason=first),
        )


def _stale() -> dict[str, Any]:
    done = cleanup_locks(scan_orphans=False)
    return {"stale_runs": done.stale_runs, "released_locks": done.released_locks}


def _lock_sweep() -> dict[str, Any]:
    unrecorded, orphans = call_backend(get_backend().sweep, None, False)
    return {"unrecorded_slots": unrecorded, "orphan_keys": orphans}


_saved_here = threading.Event()  # this process saved its schedules once


def _schedules() -> dict[str, Any]:
    if _saved_here.is_set():
        return {}
    found = registry.sync(tolerate=(Exception,), say_conflicts=False)
    _saved_here.set()
    return {"schedules": len(found)}


def _missed() -> dict[str, Any]:
    swept = sweep_missed()
    return {"missed_slots": swept.missed_slots, "paused_slots": swept.paused_slots}


PARTS: list[tuple[str, Callable[[], dict[str, Any]]]] = [
    ("stale", _stale),
    ("lock", _lock_sweep),
    ("schedules", _schedules),
    ("missed", _missed),
]


def _settle() -> None:
    try:
        ledger.settle_connection()
    except Exception:
        logger.debug(
            "taskguard upkeep: a failed connection could not be closed",
            exc_info=True,
            extra=log_fields("connection.close_failed"),
        )


# -- the per-process gate ---------------------------------------------------------


class _Gate:
    """When this process may next attempt an upkeep (monotonic), and its thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.next_at = 0.0
        self.thread: threading.Thread | None = None
        self.asked = False  # forget() was called: runs under Django's test environment too


_gate = _Gate()


def _after_fork() -> None:
    """A forked child starts afresh: its parent's thread is not its own, nor its lock."""
    global _gate
    _gate = _Gate()
    _outages.clear()  # this process has said nothing yet


os.register_at_fork(after_in_child=_after_fork)

# A process that ends soon after a guarded call (a cron job) waits this long at exit for
# its upkeep thread, so that the upkeep it started finishes and is recorded, instead of
# dying with the lease held (the next one would wait for the lease to lapse).
EXIT_WAIT_SECONDS = 30.0


@atexit.register
def _at_exit() -> None:
    thread = _gate.thread
    if thread is not None and thread.is_alive():
        thread.join(EXIT_WAIT_SECONDS)


def due_here() -> bool:
    """Whether this process attempts an upkeep now (at most once per interval; never while
    its previous attempt runs); moves the gate on when it does. Never blocks."""
    gate = _gate
    now = time.monotonic()
    if now < gate.next_at or not gate.lock.acquire(blocking=False):
        return False
    try:
        if now < gate.next_at or (gate.thread is not None and gate.thread.is_alive()):
            return False
        if not gate.asked and _testing():
            gate.next_at = now + RECHECK_SECONDS
            return False
        interval = _interval()
        gate.next_at = now + (interval or RECHECK_SECONDS)
        return interval is not None
    finally:
        gate.lock.release()


def automatic() -> bool:
    """Whether the automatic upkeep is on (``UPKEEP_INTERVAL_SECONDS`` is not None)."""
    return _interval() is not None


def _testing() -> bool:
    """Whether Django's test environment is set up (its test runner, pytest-django): no
    automatic upkeep there unless a test asks (:func:`forget`). A thread writing to the test
    database beside the tests would lock SQLite under them, and see none of their rows in
    a test's transaction; ``setup_test_environment`` gives ``django.core.mail`` its outbox."""
    from django.core import mail

    return hasattr(mail, "outbox")


def _interval() -> float | None:
    try:
        return taskguard_settings.UPKEEP_INTERVAL_SECONDS
    except Exception as exc:  # ImproperlyConfigured: said, never replaced by a default
        logger.error(
            "taskguard upkeep: not run (%s)", exc, extra=log_fields("upkeep.not_run", reason=exc)
        )
        return None


# Integrations' vetoes: a process for which one returns True starts no automatic upkeep
# (RQ's work horse: it ends with os._exit after its job, and an upkeep thread would die there
# holding the fleet-wide lease, keeping every other process's upkeep off until it lapsed).
VETOES: list[Callable[[], bool]] = []


def maybe_upkeep() -> bool:
    """Start the upkeep in a daemon thread when this process is due to attempt it; True
    when a thread started. Never blocks, never raises: the caller's work is done."""
    try:
        if any(veto() for veto in VETOES) or not due_here():
            return False
        thread = threading.Thread(target=_in_thread, name="taskguard-upkeep", daemon=True)
        _gate.thread = thread
        thread.start()
        return True
    except Exception:
        logger.exception(
            "taskguard upkeep: could not start its thread", extra=log_fields("upkeep.start_failed")
        )
        return False


def upkeep_wait() -> float:
    """Seconds until this process is next due to attempt an upkeep (at least 1): how long
    a loop that calls :func:`maybe_upkeep` may sleep."""
    return max(_gate.next_at - time.monotonic(), 1.0)


class Timer:
    """A thread that attempts the upkeep whenever this process is due (:func:`maybe_upkeep`),
    for a process that may call nothing guarded for hours: an idle Celery worker's main
    process (whose tasks run elsewhere, or never come). :meth:`stop` ends it and waits for
    the upkeep it started, so a stopped process leaves no thread behind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Start the thread unless it runs, or the automatic upkeep is off; True: started."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return False
            if not automatic():  # read once: settings do not change under a running worker
                return False
            self._stopped.clear()
            self._thread = threading.Thread(
                target=self._tick, name="taskguard-upkeep-timer", daemon=True
            )
            self._thread.start()
            return True

    def stop(self, timeout: float = EXIT_WAIT_SECONDS) -> None:
        """End the thread, then wait (at most ``timeout``) for an upkeep it started, which is
        then recorded instead of holding the fleet-wide lease until it lapses."""
        with self._lock:
            thread, self._thread = self._thread, None
        self._stopped.set()
        if thread is not None:
            thread.join(timeout)
            join(timeout)

    def _tick(self) -> None:
        # The gate's wait is infinite while a test turned the upkeep off (forget(off=True)).
        while not self._stopped.wait(min(upkeep_wait(), RECHECK_SECONDS)):
            maybe_upkeep()


def _in_thread() -> None:
    try:
        run_upkeep()
    except BaseException:
        logger.exception("taskguard upkeep failed", extra=log_fields("upkeep.failed"))
    finally:
        connections.close_all()  # this thread's own connections


def join(timeout: float | None = None) -> None:
    """Wait for this process's upkeep thread, if one runs (a graceful stop, tests)."""
    thread = _gate.thread
    if thread is not None:
        thread.join(timeout)


def forget(*, off: bool = False, asked: bool = True) -> None:
    """Reset this process's gate: the next call may attempt at once, under Django's test
    environment too (a test of the upkeep); ``off``: no automatic upkeep in this process
    until the next ``forget()``; ``asked=False``: as a process that no test asked for."""
    _after_fork()
    _gate.asked = asked
    if off:
        _gate.next_at = math.inf
