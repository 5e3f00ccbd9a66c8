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

# The sets of states that mean something, each named once here: the code tests a state
# against the set's name, never a list of its own. Tuples, so that a statement given one as
# parameters gets them in one order. tests/test_states.py walks every member through them.

# Terminal: no attempt is live and none will follow on its own. A call that meets one is a
# duplicate whatever it asked (see DUPLICATE_STATES), and a slot whose row is terminal keeps
# Redis's finished marker (the Lua ACQUIRE answers it as always counted). The one row a call
# may still take is a skipped one at attempt 0 that only records an early call's refusal
# (the claim's compare-and-set decides).
TERMINAL_STATES: tuple[str, ...] = (RunState.SUCCEEDED, RunState.FAILED, RunState.SKIPPED)
# Counts as a duplicate: a second call that meets a row in one of these states does not run
# and is counted a duplicate, whatever its policy. Besides them, a call is counted on a
# running row whose lease is alive (unless it asked not to be counted) and, under
# on_stale="abandon", on an abandoned row (abandoned for good); on any other row it runs.
DUPLICATE_STATES: tuple[str, ...] = TERMINAL_STATES
# Live: an attempt may be running or is due (handed out or given back, running, awaiting
# its retry). Health does not judge such a slot by its outcome yet.
LIVE_STATES: tuple[str, ...] = (RunState.PENDING, RunState.RUNNING, RunState.RETRYING)
# An attempt owns the row: it runs under its lease, or it ended and a retry is due. The row's
# ``lease_until`` is the deadline (the lease; the retry's) after which it is overdue.
ATTEMPT_STATES: tuple[str, ...] = (RunState.RUNNING, RunState.RETRYING)
# Ended: an attempt ran and its run is over (it returned, it raised for good, or its owner
# died): the runs a task's failure streak and health's "its last runs" count.
ENDED_STATES: tuple[str, ...] = (RunState.SUCCEEDED, RunState.FAILED, RunState.ABANDONED)
# Outcome: how a slot came out, for the health verdict: the latest slot in one of these is
# the task's latest outcome, a problem unless it succeeded (skipped slots and slots in
# flight are not outcomes).
# (the problems: those that did not succeed, which an operator acknowledges).
PROBLEM_STATES: tuple[str, ...] = (RunState.FAILED, RunState.ABANDONED, RunState.MISSED)
OUTCOME_STATES: tuple[str, ...] = (RunState.SUCCEEDED, *PROBLEM_STATES)
# Timed: the function ran to its end (returned or raised) and the attempt recorded when; the
# runs whose durations the metrics report.
TIMED_STATES: tuple[str, ...] = (RunState.SUCCEEDED, RunState.FAILED)
# Finished for good: what retention may delete (``TaskRun.objects.finished()``), and the
# rows a keyed call whose ``keep`` ran out deletes to run again. Never running or retrying;
# pending only when nobody started it for longer than retention (``ledger.maintenance.prunable``).
PRUNABLE_STATES: tuple[str, ...] = tuple(
    sorted((*TERMINAL_STATES, RunState.ABANDONED, RunState.MISSED))
)


def check_transition(from_state: str, to_state: str) -> None:
    """Raise ``IllegalTransition`` unless ``from_state -> to_state`` is allowed."""
    if to_state not in TRANSITIONS.get(from_state, frozenset()):
        # str(): a RunState member reads as its value ('succeeded'), like a plain string.
        raise IllegalTransition(f"a run cannot go from {str(from_state)!r} to {str(to_state)!r}")
