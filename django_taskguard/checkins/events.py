"""A check-in as taskguard decided it, before any service's wording.

:class:`CheckIn` is built on the signalling thread from the signal's values only (no query):
everything that needs the database (the check-in id, the schedule) is worked out by the
sending thread.

Identity. A check-in's id is a UUID derived from the ledger's identity (a UUID stored in the
ledger's own row, so two databases never agree by accident), the task and the slot: every
process that sees the slot computes the same id, a retried send or a Celery retry reuses it,
and a start and its end (sent by different processes after a retry) meet at the service. A
slot's row is unique per task, so the (ledger, task, slot) triple names the row even where a
signal carries no run id (``run_skipped``). A ``missed`` check-in gets its own id (the same
triple and ``"missed"``): a slot recorded missed may still be claimed late and run, and that
run's start must not land on a check-in the service already closed. For the same reason an
attempt that takes over a run recorded ``abandoned`` (``on_stale="retry"``: the ``abandoned``
check-in closed the slot's id) starts and ends a check-in of its own: the triple and the
take-over's fence (``generation``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

# The namespace of every check-in id (uuid5), fixed forever: changing it changes every id.
NAMESPACE = uuid.UUID("6f3c1f0e-2a4b-5c7d-8e9f-a0b1c2d3e4f5")

START, END, MISSED, ABANDONED = "start", "end", "missed", "abandoned"
EVENTS = (START, END, MISSED, ABANDONED)
REASON_MAX_LENGTH = 1000


@dataclass(frozen=True)
class CheckIn:
    """One check-in to send to every configured service.

    ``state`` is the run's state it reports (``running`` for a start; ``succeeded``,
    ``failed``, ``skipped``, ``missed`` or ``abandoned``); ``ok`` whether the services should
    see it as healthy.
    """

    event: str
    task: str
    slot: datetime
    state: str
    ok: bool
    run_id: int | None = None
    attempt: int | None = None
    reason: str = ""
    duration: float | None = None  # seconds, when this process saw the start
    # The signal carried no run (``run_skipped``, ``run_abandoned``): the sending thread
    # reads whether the slot's row is a keyed run's (then no check-in).
    verify_key: bool = False
    # Set when the attempt took over a run recorded abandoned: its check-in is a new one.
    generation: str = ""

    def payload(self, checkin_id: str) -> dict[str, object]:
        """The webhook's JSON body (docs/monitoring.md)."""
        return {
            "event": self.event,
            "task": self.task,
            "slot": self.slot.isoformat(),
            "run_id": self.run_id,
            "state": self.state,
            "attempt": self.attempt,
            "reason": self.reason,
            "checkin_id": checkin_id,
            "duration": self.duration,
        }


def checkin_id(ledger_identity: str, checkin: CheckIn) -> str:
    """The check-in's id (a UUID string, see the module doc)."""
    name = f"{ledger_identity}\n{checkin.task}\n{checkin.slot.isoformat()}"
    if checkin.event == MISSED:
        name += "\nmissed"
    elif checkin.generation:
        name += f"\n{checkin.generation}"
    return str(uuid.uuid5(NAMESPACE, name))


def clipped(reason: str) -> str:
    """``reason`` cut to what a check-in carries."""
    if len(reason) <= REASON_MAX_LENGTH:
        return reason
    return reason[: REASON_MAX_LENGTH - 1] + "…"
