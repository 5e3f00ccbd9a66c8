"""Run states and the one table of allowed transitions.

Every state change of a ``TaskRun`` is checked here first; anything not in
``TRANSITIONS`` raises ``IllegalTransition``.
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

from .exceptions import IllegalTransition


class RunState(models.TextChoices):
    # not started: handed to a task queue (run_schedules --enqueue), or given back by an
    # attempt that ended before its function started; -> running | skipped
    # | abandoned | missed (the sweep: no worker started it within its grace)
    PENDING = "pending", _("pending")
    # an attempt holds the lease; -> succeeded | failed | retrying | skipped | abandoned
    # | pending, retrying or missed (given back: the attempt ended before its function
    # started, the row back in the state its claim found it in: GIVEN_BACK_TO)
    RUNNING = "running", _("running")
    # an attempt ended, another is due (Celery retry, takeover); -> running | failed | abandoned
    RETRYING = "retrying", _("retrying")
    # terminal: the function returned
    SUCCEEDED = "succeeded", _("succeeded")
    # terminal: the function raised and no retry follows
    FAILED = "failed", _("failed")
    # terminal: not run on purpose (overlap, no slot source, ...); the reason says why.
    # One exception: a row that only records a call refused for being ahead of the clock
    # (attempt 0, written before its slot) -> running: an on-time call takes it over, or
    # -> pending: an on-time copy hands the slot to its task queue; -> missed: nobody on
    # time came within its grace (the sweep)
    SKIPPED = "skipped", _("skipped")
    # the owner died (lease expired); -> retrying only under on_stale="retry"
    ABANDONED = "abandoned", _("abandoned")
    # a due slot that no instance claimed within its grace (written by the missed-slot
    # sweep, or by a call later than its grace under catchup="none"); -> running: a late
    # call under catchup="latest"/"all" may still take it (the transition log keeps the alarm)
    MISSED = "missed", _("missed")


TRANSITIONS: dict[str, frozenset[str]] = {
    RunState.PENDING: frozenset(
        {RunState.RUNNING, RunState.SKIPPED, RunState.ABANDONED, RunState.MISSED}
    ),
    RunState.RUNNING: frozenset(
        {
            RunState.SUCCEEDED,
            RunState.FAILED,
            RunState.RETRYING,
            RunState.SKIPPED,
            RunState.ABANDONED,
            RunState.PENDING,
            RunState.MISSED,
        }
    ),
    RunState.RETRYING: frozenset({RunState.RUNNING, RunState.FAILED, RunState.ABANDONED}),
    RunState.ABANDONED: frozenset({RunState.RETRYING}),
    RunState.SUCCEEDED: frozenset(),
    RunState.FAILED: frozenset(),
    # Only a row recording an early call's refusal (the ledger's compare-and-set checks it).
    RunState.SKIPPED: frozenset({RunState.RUNNING, RunState.PENDING, RunState.MISSED}),
    RunState.MISSED: frozenset({RunState.RUNNING}),
}

# Where an attempt that never entered its function gives its row back, by the state its
# claim found the row in (a row the claim created counts as pending): a slot handed out
# waits for a worker again, a missed slot stays missed (a late call may still take it),
# and a row that awaited a retry (a Celery retry, or a takeover of a dead attempt) awaits it
# again.
GIVEN_BACK_TO: dict[str, str] = {
    RunState.PENDING: RunState.PENDING,
    RunState.MISSED: RunState.MISSED,
    RunState.RETRYING: RunState.RETRYING,
    RunState.RUNNING: RunState.RETRYING,
    RunState.ABANDONED: RunState.RETRYING,
}

# States in which no attempt is live and none will follow on its own.
TERMINAL_STATES = frozenset({RunState.SUCCEEDED, RunState.FAILED, RunState.SKIPPED})
# Finished for good: what retention may delete. Never running or retrying; pending only when
# nobody started it for longer than retention (nothing ran: ``ledger.maintenance.prunable``).
PRUNABLE_STATES = tuple(sorted(TERMINAL_STATES | {RunState.ABANDONED, RunState.MISSED}))


def check_transition(from_state: str, to_state: str) -> None:
    """Raise ``IllegalTransition`` unless ``from_state -> to_state`` is allowed."""
    if to_state not in TRANSITIONS.get(from_state, frozenset()):
        # str(): a RunState member reads as its value ('succeeded'), like a plain string.
        raise IllegalTransition(f"a run cannot go from {str(from_state)!r} to {str(to_state)!r}")
