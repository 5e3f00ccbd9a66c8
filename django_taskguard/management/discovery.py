"""The commands' discovery of schedules, and what they say about app modules it skipped.

Which commands go on when an installed app's ``tasks``/``jobs`` module cannot be
imported (the module is named on stderr with its error either way):

- ``pause_task``, ``resume_task``, ``cleanup_locks`` (:data:`OPERATOR`) go on whatever
  the module raised: they act on stored rows by name, an operator needs them most while
  something is broken, and discovery only adds and updates rows, never removes one.
- ``run_schedules`` and ``backfill`` (:data:`RUNNER`) go on past a missing dependency
  (``ImportError``): such a module is usually a third-party app's Celery tasks, which
  they do not fire, and a schedule it declared keeps its row, so its slots are still
  swept ``missed`` and fail health. Any other error is a bug in the project's code: they
  stop, so that a deploy which broke a module of schedules fails at start instead of
  quietly recording its slots missed.

A module named in ``TASKGUARD["SCHEDULE_MODULES"]`` stops every command: it was asked for.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from ..registry import Entry, sync, unimported
from .arguments import unknown_task

RUNNER: tuple[type[Exception], ...] = (ImportError,)
OPERATOR: tuple[type[Exception], ...] = (Exception,)


def sync_schedules(command: BaseCommand, tolerate: tuple[type[Exception], ...]) -> dict[str, Entry]:
    """``registry.sync``; each skipped module said on the command's stderr."""
    try:
        found = sync(tolerate)
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
