"""The schedules admin's "run now" and "backfill": data schedules only.

Both are permission-gated POSTs (``taskguard.run_taskschedule``,
``taskguard.backfill_taskschedule``) that ask first on a page of their own and keep an event
with who asked. Neither runs a task's body in the web request: each slot is handed to the
schedule's executor through ``data_schedules.RUNNERS`` (a ``run_schedules`` copy, a Celery
worker, a django.tasks backend), which the guard then runs once.

Backfill previews first: the slots of the range (read in the schedule's own time zone unless
an offset is given) that have no row are handed out; those the sweep recorded missed are
listed apart and not handed out (``manage.py backfill`` takes them over); a range of more
than ``BACKFILL_MAX_SLOTS`` slots is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from . import data_schedules, ledger, timefmt
from ._compat import OL_BREADCRUMBS
from .admin_data_schedules import parse_moment, zone_of
from .conf import taskguard_settings
from .exceptions import BackendUnavailable, TaskGuardError
from .ledger import schedules as store
from .management.commands.backfill import BACKFILL_MAX_SLOTS
from .models import (
    RunState,
    ScheduleEventKind,
    ScheduleEventOrigin,
    ScheduleSource,
    TaskSchedule,
)
from .schedules import rebuild

if TYPE_CHECKING:
    AdminBase = admin.ModelAdmin[TaskSchedule]
else:
    AdminBase = object

PREVIEW_SHOWN = 100
ONE_MICROSECOND = timedelta(microseconds=1)


@dataclass(frozen=True)
class BackfillPlan:
    """The slots of a range: ``slots`` (no row: handed out), ``missed`` (recorded missed
    by the sweep: listed apart), how many have a row that ran or runs (``taken``) and how
    many are older than the ledger keeps (``too_old``)."""

    start: datetime
    end: datetime
    slots: list[datetime]
    missed: list[datetime]
    taken: int
    too_old: int


def plan_backfill(row: TaskSchedule, start: datetime, end: datetime) -> BackfillPlan:
    """What a backfill of ``row`` from ``start`` to ``end`` (both included) hands out.
    Raises TaskGuardError for a range that is empty, reversed or too long."""
    if end < start:
        raise TaskGuardError(_("the range ends before it starts"))
    now = timezone.now()
    first = start if row.starts is None else max(start, row.starts)
    last = min(end, now) if row.ends is None else min(end, now, row.ends)
    schedule = rebuild(row.cron, row.cron_day_or, store.zone_of(row), row.every)
    after = first - ONE_MICROSECOND
    count = schedule.count_between(after, last, BACKFILL_MAX_SLOTS + 1) if last > after else 0
    if count > BACKFILL_MAX_SLOTS:
        raise TaskGuardError(
            _("the range holds more than %(most)s slots of %(task)s: backfill it in parts")
            % {"most": f"{BACKFILL_MAX_SLOTS:,}", "task": row.task_name}
        )
    every = schedule.slots_between(after, last, count) if count else []
    floor = now - timedelta(days=taskguard_settings.PRUNE_AFTER_DAYS)
    recent = [slot for slot in every if slot >= floor]
    states = ledger.states_at(row.task_name, recent)
    missed = [slot for slot in recent if states.get(slot) == RunState.MISSED]
    todo = [slot for slot in recent if slot not in states]
    return BackfillPlan(
        start, end, todo, missed, len(states) - len(missed), len(every) - len(recent)
    )


class RunActionsMixin(AdminBase):
    """Run now and backfill: their permissions, pages and events."""

    def has_run_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("taskguard.run_taskschedule"))

    def has_backfill_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("taskguard.backfill_taskschedule"))

    @admin.action(description=gettext_lazy("Run now (data schedules)…"), permissions=["run"])
    def run_now_schedules(
        self, request: HttpRequest, queryset: QuerySet[TaskSchedule]
    ) -> HttpResponse | None:
        rows = self._data_rows(request, queryset)
        if not rows:
            return None
        if request.POST.get("confirm") != "yes":
            return self._page(request, rows, "run_now_schedules", _("Run these schedules now?"))
        user = request.user.get_username()
        for row in rows:
            try:
                said = data_schedules.run_now(row, by=user, origin=ScheduleEventOrigin.ADMIN)
            except (TaskGuardError, BackendUnavailable) as exc:
                self.message_user(
                    request,
                    _("Run now of %(task)s refused: %(error)s")
                    % {"task": row.task_name, "error": exc},
                    messages.ERROR,
                )
                continue
            self.log_change(request, row, f"run now: {said}")
            # Not started by the name: the admin capitalises a message (capfirst).
            self.message_user(
                request, _("Run now of %(task)s: %(said)s") % {"task": row.task_name, "said": said}
            )
        return None

    @admin.action(description=gettext_lazy("Backfill (data schedules)…"), permissions=["backfill"])
    def backfill_schedules(
        self, request: HttpRequest, queryset: QuerySet[TaskSchedule]
    ) -> HttpResponse | None:
        rows = self._data_rows(request, queryset)
        if not rows:
            return None
        if len(rows) > 1:
            self.message_user(
                request,
                _("Backfill one schedule at a time (its range is its own)."),
                messages.ERROR,
            )
            return None
        row = rows[0]
        title = _("Backfill %(task)s") % {"task": row.task_name}
        if not request.POST.get("from") and not request.POST.get("to"):
            return self._page(request, rows, "backfill_schedules", title)
        try:
            zone = zone_of(row.time_zone)
            start = parse_moment(request.POST.get("from", ""), zone)
            end = parse_moment(request.POST.get("to", ""), zone)
            plan = plan_backfill(row, start, end)
            if row.target_kind not in data_schedules.RUNNERS:
                raise TaskGuardError(
                    _("nothing here can hand out a %(kind)s slot of %(task)s")
                    % {"kind": row.target_kind, "task": row.task_name}
                )
        except (ValueError, TaskGuardError, BackendUnavailable) as exc:
            return self._page(request, rows, "backfill_schedules", title, error=str(exc))
        if request.POST.get("confirm") != "yes":
            return self._page(request, rows, "backfill_schedules", title, plan=plan)
        self._hand_out(request, row, plan)
        return None

    def _hand_out(self, request: HttpRequest, row: TaskSchedule, plan: BackfillPlan) -> None:
        user = request.user.get_username()
        runner = data_schedules.RUNNERS[row.target_kind]
        handed, failed = 0, []
        for slot in plan.slots:
            try:
                runner(row, slot, user)
                handed += 1
            except Exception as exc:  # said, and the others still handed out
                failed.append(f"{slot.isoformat()}: {exc}")
        reason = _(
            "from %(start)s to %(end)s: %(handed)d slots handed out, %(failed)d failed, "
            "%(missed)d recorded missed left, %(taken)d had a row"
        ) % {
            "start": plan.start.isoformat(),
            "end": plan.end.isoformat(),
            "handed": handed,
            "failed": len(failed),
            "missed": len(plan.missed),
            "taken": plan.taken,
        }
        try:
            store.record_event(
                row.task_name,
                ScheduleEventKind.BACKFILLED,
                origin=ScheduleEventOrigin.ADMIN,
                by=user,
                reason=reason,
            )
        except BackendUnavailable as exc:
            self.message_user(request, str(exc), messages.ERROR)
        self.log_change(request, row, f"backfill {reason}")
        level = messages.WARNING if failed else messages.SUCCESS
        done = ngettext(
            "Backfill of %(task)s: %(n)d slot handed out.",
            "Backfill of %(task)s: %(n)d slots handed out.",
            handed,
        ) % {"task": row.task_name, "n": handed}
        self.message_user(request, done, level)
        for failure in failed[:10]:
            self.message_user(request, failure, messages.ERROR)

    def _data_rows(
        self, request: HttpRequest, queryset: QuerySet[TaskSchedule]
    ) -> list[TaskSchedule]:
        """The selected live data schedules; the others are said to be left alone."""
        rows = list(queryset.order_by("task_name")[: self.list_per_page])
        data = [row for row in rows if row.source == ScheduleSource.DATA]
        others = [row.task_name for row in rows if row.source != ScheduleSource.DATA]
        gone = [row.task_name for row in data if row.removed_at is not None]
        if others:
            self.message_user(
                request,
                _(
                    "Run now and backfill are for data schedules; %(names)s are declared by the "
                    "code or a beat (backfill those with manage.py backfill)."
                )
                % {"names": ", ".join(others)},
                messages.WARNING,
            )
        if gone:
            self.message_user(
                request,
                _("Deleted, so nothing runs them: %(names)s.") % {"names": ", ".join(gone)},
                messages.WARNING,
            )
        return [row for row in data if row.removed_at is None]

    def _page(
        self,
        request: HttpRequest,
        rows: list[TaskSchedule],
        action: str,
        title: str,
        *,
        error: str = "",
        plan: BackfillPlan | None = None,
    ) -> TemplateResponse:
        """Ask first: what will run, and (backfill) the range and its preview."""
        zone = zone_of(rows[0].time_zone)
        context = {
            **self.admin_site.each_context(request),
            "ol_breadcrumbs": OL_BREADCRUMBS,
            "title": title,
            "opts": self.opts,
            "action": action,
            "rows": rows,
            "error": error,
            "crumb": rows[0] if len(rows) == 1 else None,
            "zone": getattr(zone, "key", str(zone)),
            "start": request.POST.get("from", ""),
            "end": request.POST.get("to", ""),
            "plan": plan,
            "preview": _preview(plan, zone) if plan is not None else None,
            "max_slots": f"{BACKFILL_MAX_SLOTS:,}",
            "selected": [str(row.pk) for row in rows],
            "select_across": "0",
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/taskguard/taskschedule/confirm_run.html", context)


def _preview(plan: BackfillPlan, zone: Any) -> dict[str, Any]:
    return {
        "slots": [timefmt.both(slot, zone) for slot in plan.slots[:PREVIEW_SHOWN]],
        "more": max(0, len(plan.slots) - PREVIEW_SHOWN),
        "missed": [timefmt.both(slot, zone) for slot in plan.missed[:PREVIEW_SHOWN]],
    }
