"""The schedules in the Django admin: every ``TaskSchedule`` row, whatever declares it.

Read-only: code, a beat or django-celery-beat declares a schedule, so no field is edited
here. What an operator does goes through the library's own API, each a permission-gated
POST that keeps its event (who, from where, when, why): pause, resume and acknowledge
(``taskguard.pause_taskschedule``), and retire (``taskguard.delete_taskschedule``), which
deletes the row of a schedule the code no longer declares; its runs and events stay
(:mod:`.admin_schedule_actions`).

A page judges its rows with one ``health.check()`` and reads their pauses' events in one
statement, so it costs the same with 5 rows as with ``list_per_page``.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from . import health, ledger, timefmt
from .admin_schedule_actions import ScheduleActionsMixin
from .exceptions import BackendUnavailable
from .ledger import schedules as store
from .models import ScheduleEvent, ScheduleEventKind, TaskSchedule

if TYPE_CHECKING:
    ScheduleAdminBase = admin.ModelAdmin[TaskSchedule]
else:  # the admin classes are not subscriptable at runtime
    ScheduleAdminBase = admin.ModelAdmin

HEALTH_COLOURS = {health.OK: "#198754", health.PAUSED: "#6c757d", health.UNHEALTHY: "#dc3545"}
HISTORY_LENGTH = 100
_VERDICT = "_taskguard_schedule_verdict"


class RemovedFilter(admin.SimpleListFilter):
    title = gettext_lazy("removed")
    parameter_name = "removed"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [
            ("yes", gettext_lazy("removed (no longer declared)")),
            ("no", gettext_lazy("declared")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() in ("yes", "no"):
            return queryset.filter(removed_at__isnull=self.value() == "no")
        return queryset


class ScheduleChangeList(ChangeList):
    """Judges the page's rows once and reads their pauses' events in one statement."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        self.result_list = list(self.result_list)
        self.model_admin.annotate(request, self.result_list)  # type: ignore[attr-defined]


@admin.register(TaskSchedule)
class TaskScheduleAdmin(ScheduleActionsMixin, ScheduleAdminBase):
    # Narrow enough for a 1280 px screen beside the admin's two sidebars: a removed
    # schedule says so under its name, a paused one why under its health, and a moment
    # takes two lines (date, then time).
    list_display = (
        "task_display",
        "source_display",
        "schedule_display",
        "next_slot_column",
        "last_success_column",
        "health_column",
    )
    list_display_links = ("task_display",)
    list_filter = ("source", "paused", RemovedFilter)
    search_fields = ("task_name",)
    ordering = ("task_name",)
    list_per_page = 50
    show_full_result_count = False
    change_form_template = "admin/taskguard/taskschedule/change_form.html"
    fields = (
        "task_name",
        ("source_display", "function"),
        "schedule_display",
        ("catchup", "grace", "max_catchup", "pause_after_failures"),
        ("next_slot_display", "last_success_display"),
        "health_display",
        "paused_display",
        "acknowledged_display",
        ("first_seen_display", "removed_display"),
    )
    readonly_fields = (
        "task_name",
        "source_display",
        "function",
        "schedule_display",
        "catchup",
        "grace",
        "max_catchup",
        "pause_after_failures",
        "next_slot_display",
        "last_success_display",
        "health_display",
        "paused_display",
        "acknowledged_display",
        "first_seen_display",
        "removed_display",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[TaskSchedule]:
        return super().get_queryset(request).using(ledger.alias())

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return ScheduleChangeList

    def get_object(self, request: HttpRequest, object_id: str, from_field: Any = None) -> Any:
        found = super().get_object(request, object_id, from_field)
        if found is not None:
            self.annotate(request, [found])
        return found

    def annotate(self, request: HttpRequest, rows: list[TaskSchedule]) -> None:
        """Give each row its verdict and its latest pause's event (who, from where)."""
        verdict = self._verdict(request)
        try:
            paused = store.latest_events(
                ScheduleEventKind.PAUSED, [row.task_name for row in rows if row.paused]
            )
        except BackendUnavailable:
            paused = {}
        for row in rows:
            row.taskguard_health = verdict.get(row.task_name)  # type: ignore[attr-defined]
            row.taskguard_pause = paused.get(row.task_name)  # type: ignore[attr-defined]

    def _verdict(self, request: HttpRequest) -> dict[str, health.TaskHealth]:
        """Every task judged once per request, whatever the number of rows shown."""
        verdict: dict[str, health.TaskHealth] | None = getattr(request, _VERDICT, None)
        if verdict is None:
            try:
                verdict = {task.task: task for task in health.check().tasks}
            except BackendUnavailable as exc:
                self.message_user(request, str(exc), messages.ERROR)
                verdict = {}
            setattr(request, _VERDICT, verdict)
        return verdict

    # Read-only: code declares schedules; the actions are the only writes.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a row goes only through "retire", and only once it is removed

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Whoever may view the runs may view their schedules."""
        return super().has_view_permission(request, obj) or bool(
            request.user.has_perm("taskguard.view_taskrun")
        )

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        row = self.get_object(request, object_id)
        context = dict(extra_context or {})
        if row is not None:
            context["history"] = [_event(event) for event in _events(request, self, row)]
            context["runs_url"] = runs_url(row.task_name)
            context["can_pause"] = self.has_pause_permission(request)
            context["can_retire"] = self.has_retire_permission(request)
        return super().change_view(request, object_id, form_url, context)

    # -- columns ------------------------------------------------------------------------

    @admin.display(description=gettext_lazy("task"), ordering="task_name")
    def task_display(self, row: TaskSchedule) -> SafeString:
        """The name (breaking after a dot rather than widen the table); a removed
        schedule's "removed" and when under it."""
        *packages, last = row.task_name.split(".")
        name = format_html_join("", "{}.<wbr>", ((part,) for part in packages))
        removed = ""
        if row.removed_at is not None:
            removed = format_html(
                '<br><span class="taskguard-removed quiet" title="{}">{} {}</span>',
                timefmt.utc(row.removed_at),
                _("removed"),
                timefmt.local(row.removed_at)[:10],
            )
        return format_html(
            '<span style="overflow-wrap:anywhere">{}{}</span>{}', name, last, removed
        )

    @admin.display(description=gettext_lazy("next slot"))
    def next_slot_column(self, row: TaskSchedule) -> SafeString | str:
        return _moment(_next_slot(row), two_lines=True)

    @admin.display(description=gettext_lazy("last success"))
    def last_success_column(self, row: TaskSchedule) -> SafeString | str:
        return _moment(_last_success(row), two_lines=True)

    @admin.display(description=gettext_lazy("health"))
    def health_column(self, row: TaskSchedule) -> SafeString:
        """The verdict, and under it a paused schedule's why, by whom, since when."""
        if not row.paused:
            return self.health_display(row)
        return format_html("{}<br>{}", self.health_display(row), self.paused_display(row))

    @admin.display(description=gettext_lazy("source"), ordering="source")
    def source_display(self, row: TaskSchedule) -> SafeString:
        """The source, and under it where it is declared and the beat entry's name."""
        where = " · ".join(part for part in (row.declared_in, row.entry) if part)
        under = format_html('<br><span class="quiet">{}</span>', where) if where else ""
        return format_html("{}{}", row.source, under)

    @admin.display(description=gettext_lazy("schedule"))
    def schedule_display(self, row: TaskSchedule) -> str:
        return health.describe(row)

    @admin.display(description=gettext_lazy("next slot"))
    def next_slot_display(self, row: TaskSchedule) -> SafeString | str:
        return _moment(_next_slot(row))

    @admin.display(description=gettext_lazy("last success"))
    def last_success_display(self, row: TaskSchedule) -> SafeString | str:
        return _moment(_last_success(row))

    @admin.display(description=gettext_lazy("health"))
    def health_display(self, row: TaskSchedule) -> SafeString:
        judged = _health(row)
        if row.removed_at is not None or judged is None:
            return format_html('<span class="quiet">{}</span>', _("not judged"))
        label = {health.OK: _("healthy"), health.PAUSED: _("paused")}.get(judged.status, "")
        label = label or " + ".join(sorted({problem.code for problem in judged.problems}))
        return format_html(
            '<span class="taskguard-health" data-status="{}" title="{}" style="background:{};'
            "color:#fff;padding:2px 8px;border-radius:9px;font-size:11px;font-weight:600;"
            'white-space:nowrap">{}</span>',
            judged.status,
            "; ".join(f"{problem.code}: {problem.detail}" for problem in judged.problems),
            HEALTH_COLOURS[judged.status],
            label,
        )

    @admin.display(description=gettext_lazy("paused"), ordering="paused")
    def paused_display(self, row: TaskSchedule) -> SafeString | str:
        """Why, by whom (from where), since when."""
        if not row.paused:
            return "—"
        event: ScheduleEvent | None = getattr(row, "taskguard_pause", None)
        who = ""
        if event is not None:
            origin = event.get_origin_display()
            who = _("by %(by)s from %(origin)s") % {"by": event.by or "?", "origin": origin}
        since = _("since %(at)s") % {"at": ""} if row.paused_at else ""
        return format_html(
            '<span class="taskguard-paused" style="overflow-wrap:anywhere">{}<br>'
            '<span class="quiet">{} {}{}</span></span>',
            row.paused_reason or _("paused"),
            who,
            since,
            _moment(row.paused_at, two_lines=True) if row.paused_at else "",
        )

    @admin.display(description=gettext_lazy("acknowledged until"))
    def acknowledged_display(self, row: TaskSchedule) -> SafeString | str:
        return _moment(row.acknowledged_until)

    @admin.display(description=gettext_lazy("first seen"))
    def first_seen_display(self, row: TaskSchedule) -> SafeString | str:
        return _moment(row.first_seen)

    @admin.display(description=gettext_lazy("removed"), ordering="removed_at")
    def removed_display(self, row: TaskSchedule) -> SafeString | str:
        if row.removed_at is None:
            return "—"
        return format_html('<span class="taskguard-removed">{}</span>', _moment(row.removed_at))


def runs_url(task_name: str) -> str:
    """The run changelist filtered to ``task_name``'s runs."""
    changelist = reverse("admin:taskguard_taskrun_changelist")
    return f"{changelist}?{urlencode({'task_name': task_name})}"


def _events(request: HttpRequest, admin_: TaskScheduleAdmin, row: TaskSchedule) -> list[Any]:
    try:
        return store.events(row.task_name, HISTORY_LENGTH)
    except BackendUnavailable as exc:
        admin_.message_user(request, str(exc), messages.ERROR)
        return []


def _event(event: ScheduleEvent) -> dict[str, Any]:
    return {
        "kind": event.kind,
        "at": timefmt.both(event.at),
        "by": event.by or "—",
        "origin": event.get_origin_display(),
        "reason": event.reason,
        "until": timefmt.both(event.until) if event.until else "",
    }


def _health(row: TaskSchedule) -> health.TaskHealth | None:
    judged: health.TaskHealth | None = getattr(row, "taskguard_health", None)
    return judged


def _next_slot(row: TaskSchedule) -> datetime | None:
    judged = _health(row)
    if row.paused or row.removed_at is not None or judged is None:
        return None
    return judged.next_slot


def _last_success(row: TaskSchedule) -> datetime | None:
    judged = _health(row)
    success = judged.last_success if judged is not None else None
    return success.finished_at if success is not None else None


def _moment(moment: datetime | None, two_lines: bool = False) -> SafeString | str:
    """Local time with its zone and seconds, UTC on hover; in two lines (the date, then the
    time) in the list, as the run admin's slots."""
    if moment is None:
        return "—"
    day, _space, time = timefmt.local(moment).partition(" ")
    shown = "{}<br>{}" if two_lines else "{} {}"
    return format_html(
        f'<span title="{{}}" style="white-space:nowrap">{shown}</span>',
        timefmt.utc(moment),
        day,
        time,
    )
