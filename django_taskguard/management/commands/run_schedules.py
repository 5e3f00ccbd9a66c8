"""``manage.py run_schedules``: fire every registered plain-function schedule, and every
data schedule of a function or django.tasks target, at its slots."""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
from argparse import ArgumentParser
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from ... import ledger, registry
from ...data_firing import KINDS, DataSchedules
from ...exceptions import BackendUnavailable
from ...ledger import schedules as store
from ...logfields import log_fields
from ...models import ScheduleSource
from ...registry import Entry
from ...scheduler import Scheduler, logger
from ..arguments import whole_number
from ..discovery import RUNNER, sync_schedules, unimported_note


class Command(BaseCommand):
    help = (
        "Fire every @once_per_schedule function (found in TASKGUARD['SCHEDULE_MODULES'] and "
        "the installed apps' tasks and jobs modules) at its slots, in this process, on a "
        "bounded thread pool. Run any number of copies on any number of hosts: each slot "
        "runs once. SIGTERM stops firing and waits for running calls (--stop-timeout). "
        "It also runs the upkeep (stale runs, Redis duplicate counts, the missed-slot "
        "sweep), one process at a time across the fleet. --enqueue hands each due slot to "
        "its task queue instead (django.tasks, Huey, RQ, django-q2, Dramatiq; one task per "
        "slot across every copy); the queue's workers run it. Data schedules (defined in the "
        "admin or by define_schedule) of a guarded function or a django.tasks task are fired "
        "too, and their changes picked up without a restart; with --enqueue a django.tasks "
        "target's slots go to its backend, a function target (it has no queue) runs here."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--once", action="store_true", help="Fire what is due now, wait for it, and exit."
        )
        parser.add_argument(
            "--enqueue",
            action="store_true",
            help="Enqueue each due slot to the task queue whose task wraps the schedule "
            "(django.tasks @task(), Huey @huey.task(), RQ @enqueue_on, django-q2 "
            "on_django_q, a Dramatiq actor above @once_per_schedule) instead of running it "
            "here.",
        )
        parser.add_argument(
            "--max-workers",
            type=whole_number(1, 256),
            default=8,
            help="Threads running guarded calls at once (default: 8).",
        )
        parser.add_argument(
            "--once-timeout",
            type=whole_number(1, 86_400, "seconds"),
            default=3600,
            help="With --once: how long the fired calls may take; after it the command "
            "exits non-zero and the calls still running are cut off (their leases lapse "
            "and cleanup_locks records them abandoned) (default: 3600).",
        )
        parser.add_argument(
            "--stop-timeout",
            type=whole_number(0, 86_400, "seconds"),
            default=30,
            help="After SIGTERM (or SIGINT), how long running calls may take to finish; a "
            "second signal exits at once (default: 30).",
        )
        parser.add_argument(
            "--sweep-every",
            type=whole_number(1, 86_400, "seconds"),
            default=60,
            help="Seconds between this copy's missed-slot sweeps (default: 60). The whole "
            "upkeep (stale runs, Redis duplicate counts, the missed-slot sweep) runs every "
            "TASKGUARD['UPKEEP_INTERVAL_SECONDS'], one process at a time across the fleet.",
        )
        parser.add_argument(
            "--no-batch",
            action="store_true",
            help="Claim each slot on its own (default: the schedules due at one slot are "
            "claimed together, in one statement, on PostgreSQL).",
        )
        parser.add_argument(
            "--task",
            action="append",
            default=None,
            help="Only this task (repeatable; default: every registered plain function and "
            "every data schedule of a function or a django.tasks task). A data schedule is "
            "named by its task name, target[name].",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        with self._console_log(options["verbosity"]):
            self._run(options)

    @contextmanager
    def _console_log(self, verbosity: int) -> Iterator[None]:
        """Log the fires to this command's stdout when the project configured no logging
        at all (and ``--verbosity`` is not 0), for this command only; a project that
        configured logging gets the records through its own handlers, untouched."""
        if verbosity == 0 or logger.hasHandlers():
            yield
            return
        handler = logging.StreamHandler(self.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)

    def _run(self, options: dict[str, Any]) -> None:
        try:
            ledger.ensure_reachable()
            found = sync_schedules(self, RUNNER)
            first_seen = {row.task_name: row.first_seen for row in store.stored()}
        except BackendUnavailable as exc:
            raise CommandError(f"run_schedules cannot start: {exc}") from exc
        entries = [e for e in found.values() if e.source == ScheduleSource.FUNCTION]
        wanted = options["task"]
        data: DataSchedules | None = DataSchedules(enqueue=options["enqueue"])
        if wanted:
            named = set(wanted) - {entry.task_name for entry in entries}
            try:
                data_names = set(store.live_data_names(KINDS, named)) if named else set()
            except BackendUnavailable as exc:
                raise CommandError(f"run_schedules cannot start: {exc}") from exc
            unknown = sorted(named - data_names)
            if unknown:
                raise CommandError(
                    f"no plain-function schedule nor data schedule (of a function or a "
                    f"django.tasks task) named {', '.join(unknown)}{unimported_note()}"
                )
            entries = [entry for entry in entries if entry.task_name in wanted]
            data = DataSchedules(data_names, enqueue=options["enqueue"]) if data_names else None
        if options["enqueue"]:
            _check_enqueue(entries)
        logger.info(
            "run_schedules: %d schedules (%s)",
            len(entries),
            ", ".join(entry.task_name for entry in entries) or "none registered",
            extra=log_fields("scheduler.started"),
        )
        scheduler = Scheduler(
            entries,
            max_workers=options["max_workers"],
            sweep_every=options["sweep_every"],
            first_seen=first_seen,
            batch=not options["no_batch"],
            enqueue=options["enqueue"],
            data=data,
        )
        if options["once"]:
            fired, finished = scheduler.run_once(options["once_timeout"])
            logger.info(
                "run_schedules --once: %d fires", fired, extra=log_fields("scheduler.once_done")
            )
            if not finished:
                raise CommandError(
                    f"--once: calls still running after {options['once_timeout']}s (see the log)"
                )
            return
        stop = SignalStop()
        stop.install()
        if not scheduler.run(stop, options["stop_timeout"]):
            raise CommandError("stopped with calls still running (see the log)")
        logger.info("run_schedules stopped", extra=log_fields("scheduler.stopped"))


class SignalStop:
    """The stop that SIGTERM and SIGINT request.

    A signal handler runs between two bytecodes of the main thread, which may hold any
    lock at that moment (a ``threading.Event``'s, a logging handler's): so the handler
    takes none. It counts the signal and writes a byte to a pipe; waiting is ``select``
    on the pipe, and the main loop logs the stop. A second signal exits at once
    (``os._exit``): an orchestrator's signals always end the process.
    """

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self.signum = 0
        self._logged = threading.Lock()  # taken by the first thread that logs the stop

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handler)
            signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:
            os.write(2, b"run_schedules: a second signal, exiting now\n")
            os._exit(128 + signum)
        self.signum = signum
        os.write(self._write, b"x")  # one byte, never more: the next signal exits

    def is_set(self) -> bool:
        return self.wait(0)

    def wait(self, timeout: float | None = None) -> bool:
        readable, _, _ = select.select([self._read], [], [], timeout)
        if readable and self._logged.acquire(blocking=False):  # once, never in the handler
            logger.info(
                "run_schedules: %s, no new fires",
                signal.Signals(self.signum).name,
                extra=log_fields("scheduler.stopping", reason=signal.Signals(self.signum).name),
            )
        return bool(readable)


def _check_enqueue(entries: list[Entry]) -> None:
    """--enqueue needs a task to enqueue for every schedule it fires: refuse otherwise,
    rather than run some in this process."""
    if not registry.QUEUE_FINDERS:
        raise CommandError(
            "--enqueue hands slots to a task queue: django.tasks (Django 6.0 or later, or "
            "pip install django-tasks), Huey, RQ, django-q2 or Dramatiq, and none is installed"
        )
    plain = sorted(entry.task_name for entry in entries if entry.enqueue is None)
    if plain:
        raise CommandError(
            f"--enqueue: {', '.join(plain)} {'is' if len(plain) == 1 else 'are'} not wrapped "
            f"by a task queue's task (django.tasks @task(), Huey @huey.task(), RQ "
            f"@enqueue_on(queue), django-q2 on_django_q, a Dramatiq actor), so there is no "
            f"queue to enqueue to. Put one above @once_per_schedule, or choose the schedules "
            f"to enqueue with --task (and run the others with run_schedules --task NAME, "
            f"without --enqueue)"
        )
