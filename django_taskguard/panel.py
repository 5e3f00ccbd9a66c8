"""The admin's "why is this not running?" panel for one run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.utils.translation import gettext as _

from . import ledger, registry, timefmt
from .conf import taskguard_settings
from .decorating import on_stale_of
from .exceptions import BackendUnavailable
from .locks import get_backend
from .locks.database import DatabaseLock
from .models import TaskRun
from .owner import token_of
from .states import RunState


@dataclass
class Why:
    summary: str
    title: str = ""
    facts: list[tuple[str, str]] = field(default_factory=list)
    stale: bool = False


def why_not_running(run: TaskRun) -> Why:
    """Explain a run's state from its row, its last transition and its lock key."""
    now = ledger.database_now()
    last = ledger.last_transition(run.pk)
    # A reason often starts with the state it led to ("missed: no instance claimed it"):
    # said once, after the state.
    reason = _without_state(last.reason, last.to_state) if last is not None else ""
    why = Why(_summary(run, now, reason), _title(run, now))
    why.facts.append((_("holder"), run.owner or "—"))
    if run.state == RunState.RUNNING and run.lease_until is not None:
        why.stale = run.lease_until <= now
        why.facts.append((_("lease expiry"), _relative(run.lease_until, now)))
        renewed = run.lease_until - timedelta(seconds=taskguard_settings.LEASE_SECONDS)
        why.facts.append(
            (
                _("heartbeat age"),
                _("about %(age)s (if the task uses the default LEASE_SECONDS)")
                % {"age": _relative(renewed, now)},
            )
        )
    if last is not None:
        why.facts.append((_("last transition"), f"{last.from_state} → {last.to_state}: {reason}"))
    if not isinstance(get_backend(), DatabaseLock):
        why.facts.append((_("Redis key holder"), _redis_holder(run)))
    return why


def _without_state(reason: str, state: str) -> str:
    return reason.removeprefix(f"{state}: ")


def _title(run: TaskRun, now: datetime) -> str:
    if run.state == RunState.RUNNING and run.lease_until is not None and run.lease_until > now:
        return _("Running now")
    if run.state == RunState.SUCCEEDED:
        return _("Finished")
    return _("Why is this not running?")


def _summary(run: TaskRun, now: datetime, reason: str) -> str:
    return SUMMARIES[run.state](run, now, reason)


def _running(run: TaskRun, now: datetime, reason: str) -> str:
    if run.lease_until is not None and run.lease_until > now:
        return _("Running now: %(owner)s holds the lease.") % {"owner": run.owner}
    return _(
        "The owner stopped renewing its lease and is presumed dead. "
        "cleanup_locks (or the “Clean up stale locks” action) will mark it abandoned."
    )


def _pending(run: TaskRun, now: datetime, reason: str) -> str:
    return _("Due but not started: no worker has picked the slot up yet.")


def _retrying(run: TaskRun, now: datetime, reason: str) -> str:
    return _("Attempt %(n)d ended and a retry is due; the next attempt takes the slot.") % {
        "n": run.attempt
    }


def _missed(run: TaskRun, now: datetime, reason: str) -> str:
    return _(
        "Missed: %(reason)s. Nothing ran for this slot; manage.py backfill runs it, if it "
        "should still run."
    ) % {"reason": reason or _("no instance fired it in time")}


def _skipped(run: TaskRun, now: datetime, reason: str) -> str:
    return _("Skipped on purpose: %(reason)s") % {"reason": reason or "—"}


def _failed(run: TaskRun, now: datetime, reason: str) -> str:
    return _("Failed: %(error)s") % {"error": (run.error or reason or "—")[:300]}


def _succeeded(run: TaskRun, now: datetime, reason: str) -> str:
    return _("Finished: this slot ran and will not run again.")


def _abandoned(run: TaskRun, now: datetime, reason: str) -> str:
    """What becomes of an abandoned run: the task's own ``on_stale``, where it is known."""
    on_stale = on_stale_of(run.task_name)
    entry = registry.entries().get(run.task_name)  # a Celery task's name, found by discovery
    if on_stale is None and entry is not None:
        on_stale = entry.policy.on_stale
    if on_stale is None:
        return _(
            "Abandoned: its owner died. Its on_stale is not known to this process (no "
            "guarded function of this name was imported here): under “abandon” (the default) "
            "the slot is not run again, under “retry” the next call for it takes it over."
        )
    if on_stale == "retry":
        return _(
            'Abandoned: its owner died. This task has on_stale="retry": the next call '
            "for this slot takes it over as attempt %(n)d."
        ) % {"n": run.attempt + 1}
    return _(
        'Abandoned: its owner died. This task has on_stale="abandon": the slot is not run again.'
    )


# The summary of a run, by its state: every state has one (a new state without one
# fails tests/test_states.py, and a KeyError here, never a wrong default).
SUMMARIES: dict[str, Callable[[TaskRun, datetime, str], str]] = {
    RunState.PENDING: _pending,
    RunState.RUNNING: _running,
    RunState.RETRYING: _retrying,
    RunState.SUCCEEDED: _succeeded,
    RunState.FAILED: _failed,
    RunState.SKIPPED: _skipped,
    RunState.ABANDONED: _abandoned,
    RunState.MISSED: _missed,
}


def _redis_holder(run: TaskRun) -> str:
    key = get_backend().key_for(run.task_name, run.slot, run.key)
    try:
        holder = get_backend().holder(key)
    except (BackendUnavailable, OSError) as exc:
        return _("unknown (Redis unreachable: %(error)s)") % {"error": exc}
    except Exception as exc:  # the client's own errors
        return _("unknown (%(error)s)") % {"error": exc}
    if holder is None:
        return _("none (%(key)s is free)") % {"key": key}
    if holder == token_of(run.owner):
        return _("this run's owner (%(key)s)") % {"key": key}
    return _("another attempt, token %(token)s (%(key)s)") % {"token": holder, "key": key}


def _relative(moment: datetime, now: datetime) -> str:
    seconds = int((moment - now).total_seconds())
    if seconds >= 0:
        return _("%(at)s (in %(s)d s)") % {"at": timefmt.both(moment), "s": seconds}
    return _("%(at)s (%(s)d s ago)") % {"at": timefmt.both(moment), "s": -seconds}
