"""The commands' discovery of schedules, and what they say about app modules it skipped.

Which commands go on when an installed app's ``tasks``/``jobs`` module cannot be
imported (the module is named on stderr with its error either way):

- ``pause_task``, ``resume_task``, ``cleanup_locks`` (:data:`OPERATOR`) go on whatever
  the module raised: they act on stored rows by name, an operator needs them most while
  something is broken, and discovery only adds and updates rows, never removes one.
- ``run_schedules`` and ``backfill`` (:data:`RUNNER`) go on past a missing dependency
  (``ImportError``) in a module that declares no schedule: such a module is usually a
  third-party app's Celery tasks, which they do not fire. They stop when the module is
  known to declare schedules (it registered one before the failing line, or a saved
  function schedule's function is in it): that is the project's own module after a
  broken deploy (``cannot import name``, a circular import, a new dependency not
  installed), and going on would fire the part that imported and record the rest
  ``missed`` with a false reason. Any other error is a bug in the project's code: they
  stop too.

Whatever the command, what a module registered before its import failed is forgotten:
its schedules are unknown to this process, not half known.

A module named in ``TASKGUARD["SCHEDULE_MODULES"]`` stops every command: it was asked for.
"""

from __future__ import annotations

import getpass
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from ..registry import Entry, sync, unimported
from .arguments import unknown_task


@dataclass(frozen=True)
class Tolerance:
    """Which app-module import errors a command goes on past."""

    errors: tuple[type[Exception], ...]
    stop_if_declared: bool  # stop anyway when the module is known to declare schedules
    mark_removed: bool  # mark removed the function schedules the code no longer declares


RUNNER = Tolerance((ImportError,), stop_if_declared=True, mark_removed=True)
OPERATOR = Tolerance((Exception,), stop_if_declared=False, mark_removed=False)


def sync_schedules(command: BaseCommand, tolerate: Tolerance) -> dict[str, Entry]:
    """``registry.sync``; each skipped module said on the command's stderr."""
    try:
        found = sync(tolerate.errors, tolerate.stop_if_declared, mark_removed=tolerate.mark_removed)
    except ImproperlyConfigured as exc:
        raise CommandError(str(exc)) from exc
    for skipped in unimported():
        command.stderr.write(f"warning: {skipped}")
    return found


def unknown_schedule(name: str, known: Iterable[str]) -> CommandError:
    """``unknown_task``, naming the modules discovery skipped (the task may be in one)."""
    return CommandError(f"{unknown_task(name, known)}{unimported_note()}")


def unimported_note() -> str:
    """A sentence naming the modules discovery skipped ("" when none was)."""
    skipped = unimported()
    if not skipped:
        return ""
    return ". It may be declared in a module that was skipped: " + "; ".join(map(str, skipped))


def operator() -> str:
    """Who runs a management command, as the schedule's history names them: ``user@host``."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name for this uid (a container): the process says enough
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()}"
