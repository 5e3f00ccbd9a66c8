"""The one error family taskguard raises.

Which exception, raised where, and what the caller should do::

    TaskGuardError              the base class; raised itself for a call taskguard refuses:
    |                           a claim inside an open transaction (ledger.ensure_autocommit),
    |                           a prune inside the retention horizon (retention.prune_runs),
    |                           current_run() outside a guarded call, an on_busy hook that
    |                           returned, a claim still contended after its rounds (claim.py,
    |                           a key's claim: ledger.attempts), a Celery message without a
    |                           slot (contrib.celery.worker), the test kit's misuse.
    |                           -> fix the call; a contended claim may simply be called again.
    +-- InvalidSchedule         (also ValueError) a cron string, interval, slot or task name:
    |                           at decoration, registration or enqueue time.
    |                           -> fix the declaration; nothing was recorded.
    +-- InvalidKey              (also ValueError) @once_per_key's key cannot be built, stored or
    |                           told apart: at call time, before the claim.
    |                           -> fix key=; the function did not run.
    +-- IllegalTransition       a state change states.TRANSITIONS does not allow
    |                           (states.check_transition, before any ledger write).
    |                           -> a bug in taskguard: report it.
    +-- BackendUnavailable      the ledger's database (every maintenance read and write, through
    |   |                       ledger.translated; a guarded call's claim and refusals, claim.py
    |   |                       and guard.py) or, with ON_REDIS_ERROR="fail", Redis (locks.redis,
    |   |                       cleanup, locks.redis_sweep) cannot be reached, or SQLite's write
    |   |                       lock was held past its timeout ("is busy").
    |   |                       From a claim: the function did not run -> call again later.
    |   |                       From a finish (endings.py: "the outcome of run N could not be
    |   |                       recorded"): the function ran; its row stays running until its
    |   |                       lease expires and cleanup_locks records it abandoned.
    |   |                       Commands exit non-zero (check_schedules: 2).
    |   +-- NotMigrated         the database answers but taskguard's tables are missing or
    |                           older than this version (ledger.core.unreachable decides).
    |                           -> run manage.py migrate taskguard (check_schedules exits 3).
    +-- LeaseLost               this attempt no longer owns its slot: current_run().check()
    |                           after the lease was not renewed by its deadline or the attempt
    |                           ended (context.py); a finish the fence refused (endings.py).
    |                           -> stop side effects; another attempt may hold the slot.
    +-- DuplicateRun            the slot or key was taken (guard.py, on_duplicate="raise"
                                only; the default returns None).
                                -> nothing to do: it ran, runs, or was recorded elsewhere.

The ledger's hot paths raise the database's own errors on purpose (the list is in
``ledger/__init__``'s docstring): a guarded call's claim, finish and heartbeat settle
them (read back, try again) or raise them as ``BackendUnavailable``. A queryset
(``current_run().run``, ``ledger.runs()``) raises them where it is evaluated.
"""

from __future__ import annotations

from datetime import datetime


class TaskGuardError(Exception):
    """Base class of every error raised by taskguard."""


class InvalidSchedule(TaskGuardError, ValueError):
    """A cron string, interval, slot or task name that cannot be used."""


class InvalidKey(TaskGuardError, ValueError):
    """A key of ``@once_per_key`` that cannot be built, stored or told apart."""


class IllegalTransition(TaskGuardError):
    """A state change that the transition table does not allow."""


class BackendUnavailable(TaskGuardError):
    """The database (or, with ON_REDIS_ERROR="fail", Redis) cannot be reached.

    Raised by a claim, the guarded function did not run; raised by its finish ("the
    outcome of run N could not be recorded"), it ran (see the module's docstring).
    """


class NotMigrated(BackendUnavailable):
    """The ledger's database answers, but taskguard's tables are missing or older than this
    version: ``manage.py migrate`` was not run there. The guarded function did not run."""


class LeaseLost(TaskGuardError):
    """This attempt no longer holds the lease for its slot.

    Raised by ``current_run().check()`` once the lease could not be renewed
    before its deadline, and by a guarded call whose finish was refused by the
    fence because another attempt took the slot over.
    """


class DuplicateRun(TaskGuardError):
    """The slot (or key) was already taken (raised only with ``on_duplicate="raise"``)."""

    def __init__(self, task_name: str, slot: datetime, state: str, key: str | None = None) -> None:
        self.task_name = task_name
        self.slot = slot
        self.state = state
        self.key = key
        what = f"key {key!r}" if key is not None else f"slot {slot.isoformat()}"
        super().__init__(f"{task_name!r} already has {what} ({state})")
