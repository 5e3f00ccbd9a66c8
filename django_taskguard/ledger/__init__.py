"""The run ledger: the only code that reads or writes ``TaskRun`` and ``TaskRunTransition``.

Every function takes values and uses the database named by
``TASKGUARD["DATABASE_ALIAS"]``; the SQL is in :mod:`.backends`, one module per
database. State changes are checked against ``states.TRANSITIONS`` and
compare-and-set on the row as it was read (its state, and its fence for an owner's
write, and its lease by the database's clock where asked), so a stale writer changes
nothing; each is written with its transition rows in one atomic unit (one statement
on PostgreSQL; on MariaDB one compound statement, or the caller's transaction; one
transaction on SQLite).

Errors. Every maintenance read and write raises ``BackendUnavailable`` (``NotMigrated``
when taskguard's tables are missing) through the one translator, :data:`translated`
(which asks :func:`unreachable`). These raise the database's own ``DatabaseError``
instead, on purpose: their callers tell a lost reply (:func:`connection_lost`: the
statement may have committed) from a refusal, and settle the first by reading back or
trying again (``claim.py``, ``endings.py``, ``batch.py``, ``heartbeat.py``); a caller
that has nothing to settle translates with :func:`unreachable` or :data:`translated`
(``claim.py``, ``cleanup.abandon``):

- an attempt's statements: :func:`claim`, :func:`claim_many`, :func:`start_attempt`,
  :func:`take_over`, :func:`take_refused_early`, :func:`abandon`, :func:`reopen_key`,
  :func:`finish`, :func:`succeed_many`, :func:`renew`, and the compare-and-set under
  them, :func:`change`;
- their read-backs: :func:`read`, :func:`read_many`, :func:`read_by_id`;
- the ledger's own row, kept by signal handlers (``post_migrate``, sent by ``migrate``
  and ``flush``; ``post_save`` under ``loaddata``), whose command fails with the
  database's error: :func:`ensure_ledger_row`, :func:`fence_at_least`;
- querysets, run by their caller: :func:`runs`, :func:`transitions`, :func:`for_task`.

This module exports what the rest of the package (and its tests) call, nothing else: the
ledger's own helpers are imported from their submodule.
"""

from __future__ import annotations

from .attempts import (
    abandon,
    claim,
    claim_many,
    earlier_slot_running,
    finish,
    read,
    read_by_id,
    read_many,
    renew,
    reopen_key,
    result_of,
    start_attempt,
    store_result,
    succeed_many,
    take_over,
    take_refused_early,
)
from .core import (
    ERROR_MAX_LENGTH,
    REASON_MAX_LENGTH,
    Row,
    RunRef,
    Step,
    alias,
    change,
    clip,
    connection_lost,
    database_now,
    ensure_autocommit,
    ensure_ledger_row,
    ensure_reachable,
    fence_at_least,
    identity,
    identity_known,
    new_identity,
    runs,
    settle_connection,
    transitions,
    translated,
    unreachable,
)
from .maintenance import (
    count_prunable,
    delete_finished,
    for_task,
    in_flight,
    known_task_names,
    last_transition,
    prunable_ids,
    run_ref,
    running_in_pid_space,
    stale_runs,
    task_names,
)
from .monitoring import (
    FACTS_CHUNK,
    LastRun,
    SlotRun,
    StateSummary,
    TaskFacts,
    alive_since,
    earliest_live_slot,
    estimated_count,
    latest_in_state,
    problem_slots,
    recent_runs_of,
    task_facts,
    window_summary,
)
from .pending import (
    end_pending,
    end_pending_slot,
    give_back,
    give_back_pending,
    insert_pending,
    pend_refused_early,
    pending_of_data,
    tasks_pending,
)
from .records import (
    add_duplicates,
    count_other_copy,
    duplicates_of,
    failed_streak,
    insert_abandoned,
    insert_missed,
    insert_skipped,
    insert_unheld_many,
    keyed_token_holders,
    latest_slot,
    note_schedule_version,
    note_schedule_versions,
    pair_states,
    pairs_without_row,
    refused_early_many,
    row_exists,
    states_at,
    token_holders,
)

__all__ = [
    "ERROR_MAX_LENGTH",
    "FACTS_CHUNK",
    "REASON_MAX_LENGTH",
    "LastRun",
    "Row",
    "RunRef",
    "SlotRun",
    "StateSummary",
    "Step",
    "TaskFacts",
    "abandon",
    "add_duplicates",
    "alias",
    "alive_since",
    "change",
    "claim",
    "claim_many",
    "clip",
    "connection_lost",
    "count_other_copy",
    "count_prunable",
    "database_now",
    "delete_finished",
    "duplicates_of",
    "earlier_slot_running",
    "earliest_live_slot",
    "end_pending",
    "end_pending_slot",
    "ensure_autocommit",
    "ensure_ledger_row",
    "ensure_reachable",
    "estimated_count",
    "failed_streak",
    "fence_at_least",
    "finish",
    "for_task",
    "give_back",
    "give_back_pending",
    "identity",
    "identity_known",
    "in_flight",
    "insert_abandoned",
    "insert_missed",
    "insert_pending",
    "insert_skipped",
    "insert_unheld_many",
    "keyed_token_holders",
    "known_task_names",
    "last_transition",
    "latest_in_state",
    "latest_slot",
    "new_identity",
    "note_schedule_version",
    "note_schedule_versions",
    "pair_states",
    "pairs_without_row",
    "pend_refused_early",
    "pending_of_data",
    "problem_slots",
    "prunable_ids",
    "read",
    "read_by_id",
    "read_many",
    "recent_runs_of",
    "refused_early_many",
    "renew",
    "reopen_key",
    "result_of",
    "row_exists",
    "run_ref",
    "running_in_pid_space",
    "runs",
    "settle_connection",
    "stale_runs",
    "start_attempt",
    "states_at",
    "store_result",
    "succeed_many",
    "take_over",
    "take_refused_early",
    "task_facts",
    "task_names",
    "tasks_pending",
    "token_holders",
    "transitions",
    "translated",
    "unreachable",
    "window_summary",
]
