"""The per-task overview page of the run admin, and its pause, resume and acknowledge
buttons.

``admin/taskguard/taskrun/overview/``: one row per task (registered schedules,
then the task names the ledger has runs of), unhealthy first, each schedule with its
latest acknowledgement and its history (who paused, resumed or acknowledged it, from
where, when, why). Pause, resume and acknowledge are POST forms, gated by the
``taskguard.pause_taskschedule`` permission (pause, resume) and
``taskguard.acknowledge_taskschedule`` (acknowledge), that call :mod:`.pauses` and
:mod:`.acknowledgements` (the same API as ``manage.py pause_task`` and ``acknowledge``)
and record the acting user in the schedule's history and in the admin's log.

``TaskOverview`` (a proxy, no table) puts "Tasks at a glance" in the app's index and the
admin's sidebar: its changelist is a redirect to the page.
"""

from __future__ import annotations

from datetime import datetime
from html import escape
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.http import urlencode
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext as _
from django.utils.translation import ngettext
from django.views.decorators.http import require_POST

from . import acknowledgements, overview, pauses, timefmt
from ._compat import OL_BREADCRUMBS
from .exceptions import BackendUnavailable, TaskGuardError
from .ledger import schedules as schedule_store
from .models import ScheduleEvent, ScheduleEventKind, ScheduleEventOrigin, TaskOverview, TaskRun
from .states import RunState

if TYPE_CHECKING:
    AdminBase = admin.ModelAdmin[TaskRun]
    OverviewEntryBase = admin.ModelAdmin[TaskOverview]
else:
    AdminBase = object
    OverviewEntryBase = admin.ModelAdmin

PAUSE_PERMISSION = "taskguard.pause_taskschedule"
ACKNOWLEDGE_PERMISSION = "taskguard.acknowledge_taskschedule"
# Strip colours beyond the run states' own (the admin's ``state_colours``): a slot with no run.
CELL_COLOURS = {
    overview.GAP: "#ffffff",
    overview.DUE: "#cfe2ff",
    overview.PAUSED: "#dee2e6",
}
RUN_ID = "0000run-id0000"  # stands for a run's id in its change URL
LINK_CELL = '<a href="{}" class="taskguard-cell {}" title="{}" style="background:{}"></a>'
SPAN_CELL = '<span class="taskguard-cell {}" title="{}" style="background:{}"></span>'
BADGES = {"ok": ("#198754", _("healthy")), "paused": ("#6c757d", _("paused"))}


class ReadOnlyMixin:
    """No add, change or delete: what the run admin and the overview's entry share (rows
    change only through the state machine's actions)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class OverviewMixin(AdminBase):
    """Adds the overview and its pause/resume views to the ``TaskRun`` admin."""

    state_colours: dict[str, str]

    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        return [
            path("overview/", wrap(self.overview_view), name="taskguard_taskrun_overview"),
            path(
                "overview/pause/",
                wrap(require_POST(self.pause_view)),
                name="taskguard_taskrun_pause",
            ),
            *super().get_urls(),
        ]

    def overview_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        number = request.GET.get("page", "1")
        try:
            verdict, rows, page = overview.overview(page=int(number) if number.isdigit() else 1)
        except BackendUnavailable as exc:
            self.message_user(request, str(exc), messages.ERROR)
            verdict, rows, page = None, [], None
        context = {
            **self.admin_site.each_context(request),
            "ol_breadcrumbs": OL_BREADCRUMBS,
            "title": _("Tasks at a glance"),
            "opts": self.opts,
            "verdict": verdict,
            "rows": [self._row(row) for row in rows],
            "page": page,
            "more": _more(page),
            "can_pause": request.user.has_perm(PAUSE_PERMISSION),
            "can_acknowledge": request.user.has_perm(ACKNOWLEDGE_PERMISSION),
            "legend": self._legend(),
        }
        return TemplateResponse(request, "admin/taskguard/taskrun/overview.html", context)

    def pause_view(self, request: HttpRequest) -> HttpResponse:
        action = request.POST.get("do", "")
        needed = ACKNOWLEDGE_PERMISSION if action == "acknowledge" else PAUSE_PERMISSION
        if not request.user.has_perm(needed):
            raise PermissionDenied
        name = request.POST.get("task", "")
        user = request.user.get_username()
        if action in ("pause", "acknowledge") and request.POST.get("confirm") != "yes":
            return self._confirm_overview(request, name, action)
        if action == "acknowledge":
            return self._acknowledge(request, name, user)
        if action == "pause":
            # The operator's words only: who and from where are the event's own fields.
            reason = " ".join(request.POST.get("reason", "").split())[:200]
            changed = pauses.pause(name, reason, by=user, origin=ScheduleEventOrigin.ADMIN)
            done = _("Paused %(task)s.")
            same = _("%(task)s is not a known schedule, or is paused already.")
        elif action == "resume":
            changed = pauses.resume(name, by=user, origin=ScheduleEventOrigin.ADMIN)
            done = _("Resumed %(task)s.")
            same = _("%(task)s is not a known schedule, or is not paused.")
        else:
            raise PermissionDenied
        if changed:
            self._log(request, name, f"{action}d from the task overview by {user}")
            self.message_user(request, done % {"task": name}, messages.SUCCESS)
        else:
            self.message_user(request, same % {"task": name}, messages.WARNING)
        return HttpResponseRedirect(reverse("admin:taskguard_taskrun_overview"))

    def _confirm_overview(
        self, request: HttpRequest, name: str, action: str, error: str = ""
    ) -> HttpResponse:
        """What pausing (acknowledging) does, a reason to give, and the button that does it
        (as the cleanup action asks before it abandons runs)."""
        title = _("Pause %(task)s?") if action == "pause" else _("Acknowledge %(task)s?")
        context = {
            **self.admin_site.each_context(request),
            "ol_breadcrumbs": OL_BREADCRUMBS,
            "title": title % {"task": name},
            "opts": self.opts,
            "task": name,
            "error": error,
        }
        template = f"admin/taskguard/taskrun/confirm_{action}.html"
        return TemplateResponse(request, template, context)

    def _acknowledge(self, request: HttpRequest, name: str, user: str) -> HttpResponse:
        """Acknowledge the schedule's problems up to now; without a reason, ask again."""
        reason = " ".join(request.POST.get("reason", "").split())[:200]
        try:
            done = acknowledgements.acknowledge(
                name, reason, by=user, origin=ScheduleEventOrigin.ADMIN
            )
        except BackendUnavailable as exc:
            self.message_user(request, str(exc), messages.ERROR)
            done = False
        except TaskGuardError as exc:
            return self._confirm_overview(request, name, "acknowledge", error=str(exc))
        if done:
            self._log(request, name, f"acknowledged from the task overview by {user}: {reason}")
            self.message_user(request, _("Acknowledged the problems of %(task)s.") % {"task": name})
        else:
            self.message_user(
                request, _("%(task)s is not a known schedule.") % {"task": name}, messages.WARNING
            )
        return HttpResponseRedirect(reverse("admin:taskguard_taskrun_overview"))

    def _log(self, request: HttpRequest, name: str, message: str) -> None:
        """Django's admin log, on the schedule's row (its History page)."""
        stored = schedule_store.get(name)
        if stored is not None:
            self.log_change(request, stored, message)  # type: ignore[arg-type]  # any model

    def _row(self, row: overview.TaskRow) -> dict[str, Any]:
        task = row.health
        colour, label = BADGES.get(task.status, ("#dc3545", ""))
        if not label:
            label = " + ".join(sorted({p.code for p in task.problems}))
        success = task.last_success
        return {
            "task": task.task,
            "schedule": task.words or _("no schedule registered"),
            "next_slot": _when(task.next_slot) if not task.paused else None,
            "last_success": _when(success.finished_at) if success else None,
            "badge": {"colour": colour, "label": label, "status": task.status},
            "problems": task.problems,
            "paused": task.paused,
            "paused_reason": task.paused_reason,
            "pause": _event(_current_pause(row)),
            "scheduled": task.schedule is not None,
            "can_acknowledge": task.registered and not task.healthy and not task.paused,
            "acknowledgement": _event(task.acknowledgement),
            "acknowledged_until": _stamp(task.acknowledged_until),
            "history": [_event(event) for event in row.history],
            "strip": self._strip(row.cells),
            "runs_url": reverse("admin:taskguard_taskrun_changelist")
            + "?"
            + urlencode({"task_name": task.task}),
        }

    def _strip(self, cells: list[overview.Cell]) -> SafeString:
        """The cells as HTML, built here with every value escaped: 30 per task through the
        template engine (or format_html) would cost more than the page's queries."""
        parts = []
        zone = timezone.get_current_timezone()
        # One reverse() for the page's up to 6,000 cells: the change URL with a placeholder.
        change = reverse("admin:taskguard_taskrun_change", args=[RUN_ID])
        colours = self._colours()
        for cell in cells:
            colour = colours[cell.state]
            title = f"{timefmt.both(cell.slot, zone)}: {cell.state}"
            values = (escape(cell.state), escape(title), escape(colour))
            if cell.run_id is None:
                parts.append(SPAN_CELL.format(*values))
            else:
                url = escape(change.replace(RUN_ID, str(cell.run_id)))
                parts.append(LINK_CELL.format(url, *values))
        return mark_safe("".join(parts))  # every value escaped above

    def _legend(self) -> list[tuple[str, str]]:
        states = [state.value for state in RunState]
        states += [overview.GAP, overview.DUE, overview.PAUSED]
        colours = self._colours()
        return [(state, colours[state]) for state in states]

    def _colours(self) -> dict[str, str]:
        """Every cell's colour by its state: a run's, or a slot's with no run."""
        return {**self.state_colours, **CELL_COLOURS}


def _more(page: overview.Page | None) -> str:
    """What the later pages hold: "12 more healthy tasks", or how many need attention."""
    if page is None or not page.later:
        return ""
    if not page.later_unhealthy:
        return ngettext("%(n)d more healthy task", "%(n)d more healthy tasks", page.later) % {
            "n": page.later
        }
    return ngettext(
        "%(n)d more task (%(bad)d of them unhealthy)",
        "%(n)d more tasks (%(bad)d of them unhealthy)",
        page.later,
    ) % {"n": page.later, "bad": page.later_unhealthy}


def _current_pause(row: overview.TaskRow) -> ScheduleEvent | None:
    """The event of a paused task's pause (who, from where), when its history holds it."""
    if not row.health.paused:
        return None
    for event in row.history:  # newest first: the first pause is the one in force
        if event.kind == ScheduleEventKind.PAUSED:
            return event
        if event.kind == ScheduleEventKind.RESUMED:
            return None
    return None


def _event(event: ScheduleEvent | None) -> dict[str, Any] | None:
    """A schedule event as the page says it: what, who, from where, when, why."""
    if event is None:
        return None
    return {
        "kind": event.get_kind_display(),
        "by": event.by or _("someone unnamed"),
        "origin": event.get_origin_display(),
        "at": _stamp(event.at),
        "at_utc": timefmt.utc(event.at),
        "reason": event.reason,
        "until": _stamp(event.until),
    }


def _stamp(moment: datetime | None) -> str:
    """A moment as the page shows it (local time with seconds and zone)."""
    return timefmt.local(moment) if moment is not None else ""


def _when(moment: datetime | None) -> tuple[str, str, str] | None:
    """``(local date, local time with seconds and zone, UTC)`` for a page that shows both."""
    if moment is None:
        return None
    stamp = timefmt.local(moment)
    return stamp[:10], stamp[11:], timefmt.utc(moment)


@admin.register(TaskOverview)
class TaskOverviewAdmin(ReadOnlyMixin, OverviewEntryBase):
    """The app index's and the sidebar's "Tasks at a glance": a link to the overview page,
    shown to whoever may see the runs; nothing to add, change or delete."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.has_perm("taskguard.view_taskrun"))

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        overview = reverse("admin:taskguard_taskrun_overview", current_app=self.admin_site.name)
        return HttpResponseRedirect(overview)
