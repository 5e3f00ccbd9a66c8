"""The demo: 8 real processes fire the same schedule; every slot runs exactly once."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_taskguard.locks import backend_name
from django_taskguard.models import RunState, TaskRun
from example.jobs import DEMO_EVERY

# How long every instance gets to load Django and say "ready" (a busy machine is slow).
READY_TIMEOUT = 120.0


class Command(BaseCommand):
    help = (
        "Start N instances that all fire the same 2-second schedule and show that each "
        "slot ran exactly once. Exit status 0 only when it did."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--instances", type=int, default=8, help="default: %(default)s")
        parser.add_argument("--ticks", type=int, default=5, help="default: %(default)s")

    def handle(self, *args: Any, instances: int, ticks: int, **options: Any) -> None:
        if instances < 1 or ticks < 1:
            raise CommandError("--instances and --ticks must be at least 1")
        call_command("migrate", verbosity=0, interactive=False)
        db = settings.DATABASES["default"]["NAME"]
        self.stdout.write(
            f"taskguard demo: {instances} instances fire 'example.demo_tick' every "
            f"{DEMO_EVERY.total_seconds():g}s for {ticks} ticks "
            f"(backend: {backend_name()}, database: {db})"
        )
        with tempfile.TemporaryDirectory(prefix="taskguard-demo-") as directory:
            self._run(Path(directory) / "executions.log", instances, ticks)

    def _run(self, log: Path, instances: int, ticks: int) -> None:
        period = DEMO_EVERY.total_seconds()
        go = log.with_name("start-at")
        processes: list[subprocess.Popen[str]] = []
        readers: list[threading.Thread] = []
        try:
            for n in range(instances):
                processes.append(self._spawn(f"instance-{n + 1}", log, ticks, go))
            # Every instance says when it is up (Django loaded, ready to fire); only then is
            # the first tick chosen, on a fresh slot boundary: a slow start on a busy machine
            # must not make a late instance fire a later slot twice and leave one unfired.
            readers = _expect_ready(processes)
            start_at = (int((time.time() + 1) / period) + 1) * period
            first_slot = datetime.fromtimestamp(start_at).astimezone()
            go.with_suffix(".tmp").write_text(repr(start_at))
            go.with_suffix(".tmp").replace(go)  # all at once: no instance reads half a number
            for process in processes:
                _out, err = process.communicate(timeout=120 + ticks * period)
                if process.returncode != 0:
                    raise CommandError(f"an instance failed:\n{err}")
        finally:
            _stop(processes, readers)  # whatever went wrong, no instance is left running
        if backend_name() == "redis":
            # A call that lost after the winner had finished was counted in Redis only
            # (one round trip, no database query); cleanup_locks folds such counts into
            # the rows, as it does from cron in production. Its discovery skips (and says on
            # stderr) example.tasks when Celery is not installed, as `make demo` installs it.
            call_command("cleanup_locks", stdout=io.StringIO(), stderr=io.StringIO())
        self._report(log, first_slot, instances, ticks)

    def _spawn(self, name: str, log: Path, ticks: int, go: Path) -> subprocess.Popen[str]:
        manage = Path(sys.argv[0]).resolve()
        return subprocess.Popen(
            [
                sys.executable,
                str(manage),
                "demo_instance",
                "--name",
                name,
                "--log",
                str(log),
                "--ticks",
                str(ticks),
                "--go",
                str(go),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )

    def _report(self, log: Path, first_slot: datetime, instances: int, ticks: int) -> None:
        executions: dict[str, list[str]] = defaultdict(list)
        text = log.read_text() if log.exists() else ""
        for line in text.splitlines():
            slot, instance, pid, _fence = line.split()
            executions[slot].append(f"{instance} (pid {pid})")
        runs = TaskRun.objects.filter(task_name="example.demo_tick", slot__gte=first_slot)
        self.stdout.write("")
        self.stdout.write(f"{'slot (UTC)':<27} {'ran by':<26} {'duplicates suppressed':>21}")
        ok = True
        total_duplicates = 0
        for run in runs.order_by("slot"):
            ran_by = executions.get(run.slot.isoformat(), [])
            total_duplicates += run.duplicates
            once = len(ran_by) == 1 and run.state == RunState.SUCCEEDED
            ok &= once and run.duplicates == instances - 1
            who = ", ".join(ran_by) or "nobody"
            mark = "" if once else f"   <-- {run.state}, executed {len(ran_by)} times"
            self.stdout.write(f"{run.slot.isoformat():<27} {who:<26} {run.duplicates:>21}{mark}")
        slots = runs.count()
        executions_total = sum(len(v) for v in executions.values())
        self.stdout.write("")
        self.stdout.write(
            f"total: {slots} slots, {executions_total} executions, "
            f"{total_duplicates} duplicate calls suppressed, "
            f"{executions_total - len(executions)} duplicate executions, "
            f"{ticks - slots} lost slots"
        )
        if not ok or slots != ticks or executions_total != slots:
            raise CommandError("FAILED: some slot did not run exactly once")
        self.stdout.write(self.style.SUCCESS("OK: every slot ran exactly once"))


def _expect_ready(processes: list[subprocess.Popen[str]]) -> list[threading.Thread]:
    """Wait (at most READY_TIMEOUT seconds in all) for every instance's "ready" line.

    A pipe's readline has no timeout of its own: each first line is read in a thread, and
    the threads are returned for :func:`_stop` to join once the processes are gone."""
    lines: list[str | None] = [None] * len(processes)

    def read(n: int) -> None:
        stdout = processes[n].stdout
        assert stdout is not None
        lines[n] = stdout.readline()

    readers = [threading.Thread(target=read, args=(n,), daemon=True) for n in range(len(lines))]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + READY_TIMEOUT
    for n, reader in enumerate(readers):
        reader.join(max(0.0, deadline - time.monotonic()))
        if lines[n] is None:
            raise CommandError(
                f"instance-{n + 1} did not say it was ready within {READY_TIMEOUT:g}s"
            )
        if (lines[n] or "").strip() != "ready":
            processes[n].wait(timeout=10)
            assert processes[n].stderr is not None
            raise CommandError(f"an instance failed to start:\n{processes[n].stderr.read()}")
    return readers


def _stop(processes: list[subprocess.Popen[str]], readers: list[threading.Thread]) -> None:
    """Kill every instance still running, reap it, and close its pipes."""
    for process in processes:
        if process.poll() is None:
            process.kill()
    for process in processes:
        process.wait()
    for reader in readers:
        reader.join(5)  # each saw its pipe close
    for process in processes:
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
