"""The admin's per-task overview: one row per task, its health and a strip of its last slots.

Read through :mod:`.health` and :mod:`.ledger`: per task, the health verdict's
index probes and, for the tasks of the page shown (``OVERVIEW_PAGE`` rows, the
unhealthy first), one backward scan of the (task_name, slot) index for the strip,
so the page costs the same on a million runs as on ten, and its strips and HTML the
same with thousands of tasks as with a hundred.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from . import health, ledger
from .ledger import schedules as schedule_store
from .models import ScheduleEvent

STRIP_LENGTH = 30
# A schedule's history on the page: its latest pauses, resumes and acknowledgements.
HISTORY_LENGTH = 10
# Rows per page: every task is judged, but strips are read and drawn for one page.
OVERVIEW_PAGE = 100
# A strip cell with no run: "gap" (due past its grace, nothing recorded; the
# missed-slot sweep may not have run yet), "due" (within its grace), "paused".
GAP, DUE, PAUSED = "gap", "due", "paused"


@dataclass(frozen=True)
class Cell:
    slot: datetime
    state: str  # a RunState value, or GAP / DUE / PAUSED
    run_id: int | None = None


@dataclass
class TaskRow:
    health: health.TaskHealth
    cells: list[Cell] = field(default_factory=list)  # oldest first
    history: list[ScheduleEvent] = field(default_factory=list)  # newest first

    @property
    def counts(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for cell in self.cells:
            found[cell.state] = found.get(cell.state, 0) + 1
        return found


@dataclass(frozen=True)
class Page:
    """Which rows of the overview a page shows, and what the later pages hold."""

    number: int  # from 1
    pages: int
    later: int  # tasks on the pages after this one
    later_unhealthy: int  # ... of them unhealthy


def overview(
    length: int = STRIP_LENGTH, page: int = 1
) -> tuple[health.Verdict, list[TaskRow], Page]:
    """Every known task judged, the unhealthy first; page ``page`` of ``OVERVIEW_PAGE``
    rows, each with its last ``length`` slots (strips are read for that page only)."""
    verdict = health.check()
    ordered = sorted(verdict.tasks, key=lambda task: (task.healthy, task.task))
    size = OVERVIEW_PAGE
    pages = max(1, -(-len(ordered) // size))
    number = min(max(page, 1), pages)
    shown, later = ordered[(number - 1) * size : number * size], ordered[number * size :]
    names = [task.task for task in shown]
    recent = ledger.recent_runs_of(names, length)
    histories = schedule_store.histories(names, HISTORY_LENGTH)
    rows = [
        TaskRow(
            task, strip(task, recent[task.task], verdict.checked_at, length), histories[task.task]
        )
        for task in shown
    ]
    unhealthy = sum(1 for task in later if not task.healthy)
    return verdict, rows, Page(number, pages, len(later), unhealthy)


def strip(
    task: health.TaskHealth, runs: list[ledger.SlotRun], now: datetime, length: int
) -> list[Cell]:
    """The task's last ``length`` slots, oldest first: its runs, and for a scheduled task
    the due slots that have none (gaps)."""
    cells = {run.slot: Cell(run.slot, run.state, run.id) for run in runs}
    if task.schedule is not None:
        for slot in health.expected_slots(task.schedule, now, length):
            if slot in cells or (task.first_seen is not None and slot < task.first_seen):
                continue
            state = DUE if slot > now - task.grace else GAP
            if task.paused and (task.paused_at is None or slot >= task.paused_at):
                state = PAUSED
            cells[slot] = Cell(slot, state)
    newest = sorted(cells)[-length:]
    return [cells[slot] for slot in newest]
