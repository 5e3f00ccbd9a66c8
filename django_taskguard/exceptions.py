"""The one error family taskguard raises."""

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

    The guarded function did not run.
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
