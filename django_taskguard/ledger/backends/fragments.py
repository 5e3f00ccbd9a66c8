"""What every backend's SQL shares, written once: the tables, the column lists, the
duplicate-count rule, the early-refusal test, and the ``SET`` clauses of the changes.

Templates name the database's own expressions in braces (``{now}``, ``{lease}``,
``{fence}``, ``{key}``...); :meth:`Backend.format <.base.Backend.format>` fills them in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ...models import Ledger, TaskRun, TaskRunTransition, TaskSchedule
from ...states import TERMINAL_STATES, RunState

RUN = TaskRun._meta.db_table
LEDGER = Ledger._meta.db_table
TRANSITION = TaskRunTransition._meta.db_table
SCHEDULE = TaskSchedule._meta.db_table
FENCE_SEQUENCE = "taskguard_fence"
# What the hot paths read back. Unqualified: SQLite rejects qualified names in RETURNING.
ROW = "id, state, attempt, fence, owner, lease_until"
TRANSITION_COLUMNS = "run_id, from_state, to_state, at, reason, owner"
# This ledger's identity (a UUID), in its own row.
IDENTITY = f"SELECT identity FROM {LEDGER} WHERE id = 1"
# The columns of a new run, in the order the claims' VALUES give them.
CLAIMED_COLUMNS = (
    "state, attempt, fence, owner, created_at, started_at, lease_until, error, duplicates"
)
# Named parameters: the owner, the lease's seconds, and :data:`CLAIM_STATES`.
CLAIMED_VALUES = "%(running)s, 1, {fence}, %(owner)s, {now}, {now}, {lease_named}, '', 0"
# The ``claimed`` transition of the rows a claim made (``... FROM <its rows>``).
CLAIMED = (
    "INSERT INTO {transition} ({columns}) "
    "SELECT id, %(pending)s, %(running)s, {now}, 'claimed', owner "
)
# A run of a slot (no key) whose first attempt started: its start is its first (a retry
# moves ``started_at`` on). ``{r}``: the table's alias; parameter: the first attempt (1).
FIRST_START = "{r}.started_at IS NOT NULL AND {r}.attempt = %s AND {r}.{{key}} IS NULL"
# One transition row: run, from, to, reason, actor (at = the database's now).
TRANSITION_ROW = "(%s, %s, %s, {now}, %s, %s)"


def in_states(name: str, states: Iterable[str]) -> str:
    """A set of states as named parameters, ``%(name_0)s, %(name_1)s, ...`` (their values:
    :func:`state_params`), for ``state IN (...)``: state names are never pasted into SQL."""
    return ", ".join(f"%({name}_{n})s" for n in range(len(list(states))))


def state_params(name: str, states: Iterable[str]) -> dict[str, str]:
    """The values of :func:`in_states`' parameters."""
    return {f"{name}_{n}": str(state) for n, state in enumerate(sorted(states))}


def counts_duplicate(
    row: str = "r.", live: str = "%(count_live)s", abandoned: str = "%(abandon_is_final)s"
) -> str:
    """The duplicate-count rule, the one copy of it: a claim that finds the slot plainly
    taken counts a duplicate. Terminal (``states.TERMINAL_STATES``); running under a live
    lease (when ``live`` holds: a caller that will be put back is counted when it comes
    back); abandoned (when ``abandoned`` holds: abandoned for good). ``row``: how the
    existing row's columns are qualified (``r.``; MariaDB's ``ON DUPLICATE KEY UPDATE``:
    bare names). Its states are :data:`CLAIM_STATES`."""
    return (
        f"{row}state IN ({in_states('terminal', TERMINAL_STATES)}) "
        f"OR ({row}state = %(running)s AND {row}lease_until > {{now}} AND {live}) "
        f"OR ({row}state = %(abandoned)s AND {abandoned})"
    )


# The states a claim's statements name (its row, its transition, the duplicate-count rule).
CLAIM_STATES: dict[str, str] = {
    **state_params("terminal", TERMINAL_STATES),
    "pending": RunState.PENDING.value,
    "running": RunState.RUNNING.value,
    "abandoned": RunState.ABANDONED.value,
    "skipped": RunState.SKIPPED.value,
}
# Those of a claim's ``claimed`` transition alone.
CLAIMED_STATES: dict[str, str] = {
    "pending": RunState.PENDING.value,
    "running": RunState.RUNNING.value,
}


# A (skipped) row that only records a call refused for being ahead of the clock: nothing
# ever held it, and it was written before its slot came (no other writer does that). The
# first on-time call takes it over; it does not count as the slot's row.
REFUSED_EARLY = "attempt = 0 AND created_at < slot"


@dataclass(frozen=True)
class Sets:
    """The ``SET`` clauses of a change, named, with their ``%s`` in order.

    ``new_fence``: the change hands out a fence (SQLite moves its counter on first).
    """

    clauses: tuple[str, ...]
    new_fence: bool = False


NO_SETS = Sets(())
START_ATTEMPT = Sets(  # owner, lease seconds
    (
        "attempt = r.attempt + 1",
        "fence = {fence}",
        "owner = %s",
        "started_at = {now}",
        "lease_until = {lease}",
        "finished_at = NULL",
        "retry_by = NULL",
    ),
    new_fence=True,
)
# An on-time call takes a row that only recorded an early call's refusal: the duplicate
# its claim counted on finding the row is taken back (it is no duplicate, it runs).
TAKE_REFUSED_EARLY = Sets(
    (
        *START_ATTEMPT.clauses,
        "error = ''",
        "duplicates = CASE WHEN r.duplicates > 0 THEN r.duplicates - 1 ELSE 0 END",
    ),
    new_fence=True,
)
# An on-time copy hands to its task queue a slot whose row only recorded an early call's
# refusal: the row is handed out now (the sweep ends a pending row by when it was).
PEND_REFUSED_EARLY = Sets(("error = ''", "finished_at = NULL", "created_at = {now}"))
# The sweep: a due slot whose row only recorded an early call's refusal, and that no
# on-time call took within its grace.
MISS_REFUSED_EARLY = Sets(("error = %s", "finished_at = {now}"))
END_ATTEMPT = Sets(("error = %s", "finished_at = {now}", "duplicates = r.duplicates + %s"))
# An attempt after which another follows (a Celery retry): the lease says by when, and
# retry_by which message carries it (NULL: any caller may start the next attempt).
PAUSE_ATTEMPT = Sets(
    ("error = %s", "lease_until = {lease}", "duplicates = r.duplicates + %s", "retry_by = %s")
)
ABANDON = Sets(("error = %s", "duplicates = r.duplicates + %s"))
# An attempt that never entered its function, given back (the next claim counts the attempt
# again and hands out a new fence). To ``pending`` or ``missed``: the attempt count as before
# the claim, no owner, not started, and ``finished_at`` when it was given back (the sweep
# and retention judge a given-back row by it; the next claim clears it).
GIVE_BACK = Sets(
    (
        "attempt = r.attempt - 1",
        "owner = ''",
        "started_at = NULL",
        "lease_until = NULL",
        "finished_at = {now}",
    )
)
# To ``retrying``: the attempt count as before the claim, no owner, the retry due within
# the lease given (parameters: seconds, the message that may start it, NULL: any caller).
GIVE_BACK_RETRY = Sets(
    ("attempt = r.attempt - 1", "owner = ''", "lease_until = {lease}", "retry_by = %s")
)
