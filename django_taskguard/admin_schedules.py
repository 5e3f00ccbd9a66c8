"""The schedules in the Django admin: every ``TaskSchedule`` row, whatever declares it.

Code, a beat or django-celery-beat declares most schedules: those are read-only here. Data
schedules (source ``data``) are created, edited and deleted here with Django's add, change
and delete permissions, through the library's API (:mod:`.admin_data_schedules`): every
change is kept in the schedule's history; a deletion leaves the row as a tombstone (its
runs and history stay) that retire may delete later.

What an operator does goes through the library's own API, each a permission-gated POST
that keeps its event (who, from where, when, why): pause and resume
(``taskguard.pause_taskschedule``), acknowledge (``taskguard.acknowledge_taskschedule``),
retire (``taskguard.delete_taskschedule``), which deletes the row of a schedule no longer
declared; its runs and events stay (:mod:`.admin_schedule_actions`); run now and backfill
of data schedules (``taskguard.run_taskschedule``, ``taskguard.backfill_taskschedule``:
:mod:`.admin_schedule_run`).

A page judges its rows (only they) with one ``health.check()`` and reads their pauses' events in one
statement, so it costs the same with 5 rows as with ``list_per_page``.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.contrib.admin.views.main import ChangeList
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from . import admin_data_schedules as data_form
from . import data_schedules, health, ledger, timefmt
from .admin_schedule_actions import ScheduleActionsMixin
from .admin_schedule_run import RunActionsMixin
from .exceptions import BackendUnavailable, TaskGuardError
from .ledger import schedules as store
from .models import (
    ScheduleEvent,
    ScheduleEventKind,
    ScheduleEventOrigin,
    ScheduleSource,
    TaskSchedule,
)

if TYPE_CHECKING:
    ScheduleAdminBase = admin.ModelAdmin[TaskSchedule]
else:  # the admin classes are not subscriptable at runtime
    ScheduleAdminBase = admin.ModelAdmin

HEALTH_COLOURS = {health.OK: "#198754", health.PAUSED: "#6c757d", health.UNHEALTHY: "#dc3545"}
HISTORY_LENGTH = 100
_VERDICT = "_taskguard_schedule_verdict"
# A data schedule's page: what it shows whoever may change it, beside the form.
DATA_READONLY = (
    "name_display",
    "target_display",
    "target_kind",
    "task_name",
    "version",
    "next_slots_display",
    "health_display",
    "paused_display",
    "first_seen_display",
    "removed_display",
)


def data_fieldsets(*, add: bool, editable: bool) -> list[tuple[Any, dict[str, Any]]]:
    """A data schedule's page: its definition, and (once saved) its state."""
    what: tuple[Any, ...] = (
        ("entry", "function") if add else (("name_display", "target_display"), "target_kind")
    )
    fixed = gettext_lazy(
        "The name and the target are fixed once created: another name or target is another "
        "schedule (add it, then delete this one)."
    )
    first: dict[str, Any] = {"fields": (*what, "description")}
    if not add:
        first["description"] = fixed
    sets: list[tuple[Any, dict[str, Any]]] = [
        (None, first),
        (
            gettext_lazy("Schedule"),
            {"fields": ("cron", "every", "time_zone", ("starts", "ends"), "enabled")},
        ),
        (gettext_lazy("Arguments"), {"fields": ("args", "kwargs")}),
        (
            gettext_lazy("Catch-up"),
            {
                "fields": (
                    ("catchup", "grace"),
                    ("max_catchup", "pause_after_failures"),
                    ("jitter", "late_after"),
                )
            },
        ),
    ]
    if editable:
        sets.append((gettext_lazy("This change"), {"fields": ("reason",)}))
    if not add:
        state = (
            ("task_name", "version"),
            "next_slots_display",
            ("health_display", "paused_display"),
            ("first_seen_display", "removed_display"),
        )
        sets.insert(1, (gettext_lazy("State"), {"fields": state}))
    return sets


def _editable(row: TaskSchedule) -> bool:
    """A live data schedule (a deleted one's tombstone is history: define it again)."""
    return row.source == ScheduleSource.DATA and row.removed_at is None


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
class TaskScheduleAdmin(RunActionsMixin, ScheduleActionsMixin, ScheduleAdminBase):
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
    actions = (*ScheduleActionsMixin.actions, "run_now_schedules", "backfill_schedules")
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
        "late_after",
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
        "late_after",
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
        verdict = self._verdict(request, [row.task_name for row in rows])
        try:
            paused = store.latest_events(
                ScheduleEventKind.PAUSED, [row.task_name for row in rows if row.paused]
            )
        except BackendUnavailable:
            paused = {}
        for row in rows:
            row.taskguard_health = verdict.get(row.task_name)  # type: ignore[attr-defined]
            row.taskguard_pause = paused.get(row.task_name)  # type: ignore[attr-defined]

    def _verdict(self, request: HttpRequest, names: list[str]) -> dict[str, health.TaskHealth]:
        """The rows shown judged (only they: the page costs the same at 100,000 schedules as
        at 100), once per request."""
        verdict: dict[str, health.TaskHealth] = getattr(request, _VERDICT, None) or {}
        wanted = [name for name in names if name not in verdict]
        if wanted:
            try:
                judged = health.check(schedules=wanted).tasks
                verdict.update((task.task, task) for task in judged)
            except BackendUnavailable as exc:
                self.message_user(request, str(exc), messages.ERROR)
            setattr(request, _VERDICT, verdict)
        return verdict

    # Code and beat schedules are read-only (the actions are their only writes); data
    # schedules are added, changed and deleted with Django's permissions, through the API.
    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_change_permission(request, obj) and (obj is None or _editable(obj))

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # A code schedule's row goes only through "retire", and only once it is removed;
        # no "delete selected": a data schedule is deleted from its page, one at a time.
        return obj is not None and _editable(obj) and super().has_delete_permission(request, obj)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Whoever may view the runs may view their schedules."""
        return super().has_view_permission(request, obj) or bool(
            request.user.has_perm("taskguard.view_taskrun")
        )

    def get_actions(self, request: HttpRequest, action_location: Any = None) -> dict[str, Any]:
        # Django 6.1 says where the actions are shown (``action_location``; an override
        # without the parameter is deprecated there); earlier versions do not.
        if action_location is None:
            found = super().get_actions(request)
        else:
            found = super().get_actions(request, action_location=action_location)  # type: ignore[call-arg]
        found.pop("delete_selected", None)  # deleting goes through delete_schedule
        return found

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        if obj is not None and obj.source != ScheduleSource.DATA:
            return [(None, {"fields": self.fields})]
        editable = self.has_change_permission(request, obj) if obj else True
        return data_fieldsets(add=obj is None, editable=editable)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        if obj is None:
            return ()
        if obj.source != ScheduleSource.DATA:
            return self.readonly_fields
        return DATA_READONLY

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        if obj is None or obj.source == ScheduleSource.DATA:
            kwargs["form"] = data_form.DataScheduleForm
        form = super().get_form(request, obj, change, **kwargs)
        if issubclass(form, data_form.DataScheduleForm):  # a class made for this request
            form.may_pause = self.has_pause_permission(request)
            form.may_run = self.has_run_permission(request)
        return form

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        """Through define_schedule (validated, versioned, kept in the history), never
        ``obj.save()``; ``obj`` becomes the saved row."""
        saved = data_form.define(form, request.user.get_username())
        for field in TaskSchedule._meta.concrete_fields:
            setattr(obj, field.attname, getattr(saved, field.attname))
        obj._state.adding = False
        obj._state.db = saved._state.db

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        """Nothing related to save (the history is written with the change)."""

    def delete_model(self, request: HttpRequest, obj: TaskSchedule) -> None:
        """The row stays as a tombstone (removed, disabled, a new version) so that every
        scheduler sees the deletion; its runs and history stay."""
        user = request.user.get_username()
        data_schedules.delete_schedule(
            obj.entry, obj.function, by=user, origin=ScheduleEventOrigin.ADMIN
        )

    def response_delete(self, request: HttpRequest, obj_display: str, obj_id: Any) -> Any:
        """One true message (the schedule was removed, not deleted: Django's own says "was
        deleted successfully"), then the change list as Django goes there."""
        self.message_user(
            request,
            _(
                "The schedule “%(name)s” was removed: nothing fires it any more. Its row "
                "stays, marked removed, with its runs and its history, until you retire it."
            )
            % {"name": obj_display},
        )
        if self.has_change_permission(request, None):
            return HttpResponseRedirect(
                reverse("admin:taskguard_taskschedule_changelist", current_app=self.admin_site.name)
            )
        return HttpResponseRedirect(reverse("admin:index", current_app=self.admin_site.name))

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        try:
            return super().changeform_view(request, object_id, form_url, extra_context)
        except TaskGuardError as exc:  # the ledger refused the save: said, never a 500
            self.message_user(request, str(exc), messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())

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
            context["can_acknowledge"] = self.has_acknowledge_permission(request)
            context["can_retire"] = self.has_retire_permission(request)
            live_data = row.source == ScheduleSource.DATA and row.removed_at is None
            context["can_run"] = live_data and self.has_run_permission(request)
            context["can_backfill"] = live_data and self.has_backfill_permission(request)
        return super().change_view(request, object_id, form_url, context)

    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """One history: the HISTORY button opens the schedule's own (every pause, resume,
        run now, backfill, edit and acknowledgement, on its page), not Django's admin log."""
        row = self.get_object(request, unquote(object_id))
        if row is None or not self.has_view_or_change_permission(request, row):
            return super().history_view(request, object_id, extra_context)  # Django's refusal
        change = reverse(
            f"admin:{self.opts.app_label}_{self.opts.model_name}_change",
            args=[quote(row.pk)],
            current_app=self.admin_site.name,
        )
        return HttpResponseRedirect(f"{change}#taskguard-history")

    @admin.display(description=gettext_lazy("name"))
    def name_display(self, row: TaskSchedule) -> str:
        return row.entry

    @admin.display(description=gettext_lazy("target"))
    def target_display(self, row: TaskSchedule) -> str:
        return row.function

    @admin.display(description=gettext_lazy("next slots"))
    def next_slots_display(self, row: TaskSchedule) -> SafeString | str:
        """The next slots in the schedule's own zone, and in UTC."""
        if row.removed_at is not None:
            return _("none: deleted")
        if not row.enabled:
            return _("none: disabled")
        if row.paused:
            return _("none: paused")
        slots = data_form.slot_rows(row)
        if not slots:
            return _("none (past its end)")
        return format_html(
            '<ol class="taskguard-next-slots" style="margin:0;padding-left:1.5em">{}</ol>',
            format_html_join(
                "",
                '<li data-slot="{}">{} <span class="quiet">({})</span></li>',
                ((slot["iso"], slot["here"], slot["utc"]) for slot in slots),
            ),
        )

    # -- columns ------------------------------------------------------------------------

    @admin.display(description=gettext_lazy("task"), ordering="task_name")
    def task_display(self, row: TaskSchedule) -> SafeString:
        """The name (breaking between its words rather than widen the table); a removed
        schedule's "removed" and when under it."""
        removed = ""
        if row.removed_at is not None:
            removed = format_html(
                '<br><span class="taskguard-removed quiet" title="{}">{} {}</span>',
                timefmt.utc(row.removed_at),
                _("removed"),
                timefmt.local(row.removed_at)[:10],
            )
        return format_html(
            '<span style="overflow-wrap:break-word">{}</span>{}', breakable(row.task_name), removed
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
        disabled = _("disabled") if row.source == ScheduleSource.DATA and not row.enabled else ""
        where = " · ".join(part for part in (row.declared_in, row.entry, disabled) if part)
        under = format_html('<br><span class="quiet">{}</span>', breakable(where)) if where else ""
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
            '<span class="taskguard-paused" style="overflow-wrap:break-word">{}<br>'
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


# Where a dotted name may wrap: after a dot or an underscore, and before an entry's "[".
NAME_BREAKS = re.compile(r"(?<=[._])|(?=\[)")


def breakable(name: str) -> SafeString:
    """``name`` with a line-break opportunity (``<wbr>``) between its words, so that a
    narrow column wraps ``myapp.jobs.every_minute`` as ``myapp.jobs.every_`` / ``minute``,
    never inside a word (a hyphen is one already)."""
    parts = ((part,) for part in NAME_BREAKS.split(name) if part)
    return format_html_join(mark_safe("<wbr>"), "{}", parts)


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
        "version": event.version if event.version is not None else "",
        "changes": data_form.changes_of(event),
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
