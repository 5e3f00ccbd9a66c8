"""The run ledger in the Django admin: read-only, with permission-gated cleanup actions.

Built for big ledgers: no full ``COUNT(*)`` per page (planner estimates on
PostgreSQL), a task filter and a date drill-down that probe indexes instead
of scanning, and lease liveness judged by the database clock in the page's
own query.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.paginator import Paginator
from django.db.models import Min, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from . import admin_schedules, ledger, timefmt
from ._compat import OL_BREADCRUMBS
from .admin_overview import OverviewMixin, ReadOnlyMixin
from .cleanup import cleanup_locks, release_lock
from .exceptions import BackendUnavailable
from .models import TaskRun, TaskRunQuerySet, TaskRunTransition
from .owner import Owner
from .panel import why_not_running
from .states import RunState

if TYPE_CHECKING:
    RunAdminBase = admin.ModelAdmin[TaskRun]
    TransitionInlineBase = admin.TabularInline[TaskRunTransition, TaskRun]
else:  # the admin classes are not subscriptable at runtime
    RunAdminBase = admin.ModelAdmin
    TransitionInlineBase = admin.TabularInline

__all__ = ["TaskRunAdmin", "admin_schedules"]  # admin_schedules registers TaskSchedule's

# Every state has its colour (tests/test_states.py checks that none is missing).
STATE_COLOURS: dict[str, str] = {
    RunState.PENDING: "#6c757d",
    RunState.RUNNING: "#0d6efd",
    RunState.RETRYING: "#b35900",
    RunState.SUCCEEDED: "#198754",
    RunState.FAILED: "#dc3545",
    RunState.SKIPPED: "#5f6b7a",
    RunState.ABANDONED: "#6f42c1",
    RunState.MISSED: "#e8590c",
}
# Below this many rows (by the planner's estimate) the paginator counts exactly.
EXACT_COUNT_BELOW = 10_000
MAX_TASK_CHOICES = 200
MAX_DATE_CHOICES = 60
# Runs one "Release lock" action handles (each is a few queries and a Redis call).
MAX_RELEASED = 1000


class EstimatedCountPaginator(Paginator):  # type: ignore[type-arg]
    """Exact counts on small results; the planner's row estimate on big PostgreSQL ones."""

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if isinstance(queryset, QuerySet):
            estimate = ledger.estimated_count(queryset)
            if estimate is not None and estimate >= EXACT_COUNT_BELOW:
                return estimate
        return super().count


class TaskNameFilter(admin.SimpleListFilter):
    """Task names found by a loose index scan on (task_name, slot), not a DISTINCT scan."""

    title = _("task")
    parameter_name = "task_name"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(name, name) for name in ledger.task_names(MAX_TASK_CHOICES)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(task_name=value) if value else queryset


class AdminRunQuerySet(TaskRunQuerySet):
    """Date drill-down values by index probes (one per bucket), never a full DISTINCT."""

    def datetimes(  # type: ignore[override]
        self, field_name: str, kind: str, order: str = "ASC", tzinfo: Any = None, **kw: Any
    ) -> list[datetime]:
        if field_name != "slot" or kind not in ("year", "month", "day"):
            return list(super().datetimes(field_name, kind, order, tzinfo, **kw))  # type: ignore[arg-type]
        zone = tzinfo or timezone.get_current_timezone()
        base = self.order_by()  # Django drops the unused annotations from the aggregate
        buckets: list[datetime] = []
        first = base.aggregate(first=Min("slot"))["first"]
        while first is not None and len(buckets) < MAX_DATE_CHOICES:
            bucket = _truncate(timezone.localtime(first, zone), kind)
            buckets.append(bucket)
            first = base.filter(slot__gte=_advance(bucket, kind)).aggregate(first=Min("slot"))[
                "first"
            ]
        return buckets if order == "ASC" else buckets[::-1]


def _truncate(value: datetime, kind: str) -> datetime:
    value = value.replace(hour=0, minute=0, second=0, microsecond=0, tzinfo=None)
    if kind in ("year", "month"):
        value = value.replace(day=1)
    if kind == "year":
        value = value.replace(month=1)
    return timezone.make_aware(value)


def _advance(bucket: datetime, kind: str) -> datetime:
    naive = bucket.replace(tzinfo=None)
    if kind == "year":
        naive = naive.replace(year=naive.year + 1)
    elif kind == "month":
        naive = naive.replace(year=naive.year + naive.month // 12, month=naive.month % 12 + 1)
    else:
        naive = naive + timedelta(days=1)
    return timezone.make_aware(naive)


class TransitionInline(TransitionInlineBase):
    model = TaskRunTransition
    fields = ("at_display", "from_state", "to_state", "reason", "owner")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = False

    def get_queryset(self, request: HttpRequest) -> QuerySet[TaskRunTransition]:
        return super().get_queryset(request).using(ledger.alias())

    @admin.display(description=_("at"))
    def at_display(self, transition: TaskRunTransition) -> str:
        """With seconds and zone, UTC beside, as every other time of the admin: ten
        transitions of one retried slot within a minute are told apart."""
        return timefmt.both(transition.at)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # The history is part of the run: whoever may view the run sees it.
        opts = TaskRun._meta
        return bool(
            request.user.has_perm(f"{opts.app_label}.view_{opts.model_name}")
            or request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")
        )

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(TaskRun)
class TaskRunAdmin(ReadOnlyMixin, OverviewMixin, RunAdminBase):  # states change only by actions
    # Narrow enough for a 1280 px screen beside the admin's two sidebars: under a run's state
    # go its lease (running) and its attempt (a retry), under its task its key (keyed), and a
    # slot takes two lines (date, then time).
    list_display = (
        "state_badge",
        "task_display",
        "slot_display",
        "owner_display",
        "duration_display",
        "duplicates",
    )
    list_display_links = ("task_display",)
    list_filter = ("state", TaskNameFilter)
    date_hierarchy = "slot"
    search_fields = ("task_name", "key", "owner")
    ordering = ("-slot", "-id")
    show_full_result_count = False
    if hasattr(admin, "ShowFacets"):  # Django 5.0+: facet counts scan the table
        show_facets = admin.ShowFacets.NEVER
    paginator = EstimatedCountPaginator
    list_per_page = 50
    inlines = (TransitionInline,)
    actions = ("cleanup_stale_locks", "release_locks")
    change_form_template = "admin/taskguard/taskrun/change_form.html"
    change_list_template = "admin/taskguard/taskrun/change_list.html"
    state_colours = STATE_COLOURS
    fields = (
        ("task_name", "slot_at", "key", "schedule_version"),
        ("state", "attempt", "fence"),
        "owner",
        ("created", "started", "finished"),
        ("lease_until_at", "duplicates", "retry_by"),
        "error",
        "result",
    )
    readonly_fields = (
        "task_name",
        "slot_at",
        "key",
        "schedule_version",
        "state",
        "attempt",
        "fence",
        "owner",
        "created",
        "started",
        "finished",
        "lease_until_at",
        "duplicates",
        "retry_by",
        "error",
        "result",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[TaskRun]:
        queryset = super().get_queryset(request).using(ledger.alias())
        admin_queryset = AdminRunQuerySet(model=TaskRun, query=queryset.query, using=queryset.db)
        return admin_queryset.with_lease()

    def has_cleanup_permission(self, request: HttpRequest) -> bool:
        opts = self.opts
        return bool(request.user.has_perm(f"{opts.app_label}.cleanup_{opts.model_name}"))

    @admin.display(description=_("state"), ordering="state")
    def state_badge(self, run: TaskRun) -> SafeString:
        return format_html(
            '<span class="taskguard-state" style="background:{};color:#fff;padding:2px 8px;'
            'border-radius:9px;font-size:11px;font-weight:600;white-space:nowrap">{}</span>{}{}',
            STATE_COLOURS[run.state],
            run.get_state_display(),
            self.lease_display(run),
            self.attempt_display(run),
        )

    def attempt_display(self, run: TaskRun) -> SafeString | str:
        """Under the state of a run past its first attempt: which attempt it is."""
        if run.attempt <= 1:
            return ""
        return format_html(
            '<br><span class="quiet">{}</span>', _("attempt %(n)d") % {"n": run.attempt}
        )

    @admin.display(description=_("task"), ordering="task_name")
    def task_display(self, run: TaskRun) -> SafeString:
        """The task's name, and under it the key of a keyed run or the version of the data
        schedule that fired it; a long name breaks between its words (after a dot or an
        underscore) rather than push the table past the screen, never inside one."""
        key = format_html('<br><span class="quiet">{}</span>', run.key) if run.key else ""
        return format_html(
            '<span style="overflow-wrap:break-word">{}{}{}</span>',
            admin_schedules.breakable(run.task_name),
            key,
            self.version_display(run),
        )

    def version_display(self, run: TaskRun) -> SafeString | str:
        """Under a data schedule's run's task: the version of the schedule that fired it (a
        line, not a column: the list fits a 1280 px screen)."""
        if run.schedule_version is None:
            return ""
        return format_html(
            '<br><span class="taskguard-version quiet" title="{}">v{}</span>',
            _("schedule version"),
            run.schedule_version,
        )

    @admin.display(description=_("slot"), ordering="slot")
    def slot_display(self, run: TaskRun) -> SafeString:
        """The date, then the time with its zone: two lines however narrow; UTC on hover."""
        day, _space, time = timefmt.local(run.slot).partition(" ")
        return format_html(
            '<span title="{}" style="white-space:nowrap">{}<br>{}</span>',
            timefmt.utc(run.slot),
            day,
            time,
        )

    @admin.display(description=_("owner"), ordering="owner")
    def owner_display(self, run: TaskRun) -> SafeString | str:
        """Where it ran (the worker's name and pid); the whole owner, token too, on hover."""
        parsed = Owner.parse(run.owner)
        if parsed is None:
            return run.owner or "—"
        return format_html(
            '<span title="{}" style="white-space:nowrap">{}</span>', run.owner, parsed.process
        )

    @admin.display(description=_("slot"))
    def slot_at(self, run: TaskRun) -> str:
        return timefmt.both(run.slot)

    @admin.display(description=_("created at"))
    def created(self, run: TaskRun) -> str:
        return timefmt.both(run.created_at)

    @admin.display(description=_("started at"))
    def started(self, run: TaskRun) -> str:
        return timefmt.both(run.started_at) if run.started_at else "—"

    @admin.display(description=_("finished at"))
    def finished(self, run: TaskRun) -> str:
        return timefmt.both(run.finished_at) if run.finished_at else "—"

    @admin.display(description=_("lease until"))
    def lease_until_at(self, run: TaskRun) -> str:
        return timefmt.both(run.lease_until) if run.lease_until else "—"

    @admin.display(description=_("duration"))
    def duration_display(self, run: TaskRun) -> str:
        end = run.finished_at or (getattr(run, "db_now", None) if run.state == "running" else None)
        if run.started_at is None or end is None:
            return "—"
        return _human(end - run.started_at)

    def lease_display(self, run: TaskRun) -> SafeString | str:
        """Under a running run's state: its lease, alive or expired (by the database clock)."""
        if run.state != RunState.RUNNING or run.lease_until is None:
            return ""
        if getattr(run, "lease_alive", False):
            shown = format_html('<span style="color:#198754">{}</span>', _("alive"))
        else:
            shown = format_html('<strong style="color:#dc3545">{}</strong>', _("expired"))
        return format_html(
            '<br><span class="quiet" style="white-space:nowrap">{} {}</span>', _("lease"), shown
        )

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        run = self.get_object(request, object_id)
        context = dict(extra_context or {})
        if run is not None:
            context["subtitle"] = f"{run.task_name} @ {timefmt.both(run.slot)} ({run.state})"
            context["why"] = why_not_running(run)
            context["can_cleanup"] = self.has_cleanup_permission(request)
        return super().change_view(request, object_id, form_url, context)

    @admin.action(description=_("Clean up stale locks"), permissions=["cleanup"])
    def cleanup_stale_locks(
        self, request: HttpRequest, queryset: QuerySet[TaskRun]
    ) -> TemplateResponse | None:
        if request.POST.get("confirm") != "yes":
            return self._confirm(
                request, queryset, "cleanup_stale_locks", _("Clean up stale locks")
            )
        user = request.user.get_username()
        try:
            result = cleanup_locks(runs=queryset, user=user)
        except BackendUnavailable as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return None
        for touched in result.runs:  # each run's History page says who and why
            run = TaskRun(
                pk=touched.run_id, task_name=touched.task, slot=touched.slot, state="abandoned"
            )
            self.log_change(request, run, f"abandoned: {touched.reason}")
        runs = ngettext("Abandoned %d stale run", "Abandoned %d stale runs", result.stale_runs) % (
            result.stale_runs,
        )
        locks = ngettext("released %d lock", "released %d locks", result.released_locks) % (
            result.released_locks,
        )
        self.message_user(request, f"{runs}; {locks}.", messages.SUCCESS)
        return None

    @admin.action(description=_("Release lock (owner confirmed dead)"), permissions=["cleanup"])
    def release_locks(
        self, request: HttpRequest, queryset: QuerySet[TaskRun]
    ) -> TemplateResponse | None:
        if request.POST.get("confirm") != "yes":
            return self._confirm(request, queryset, "release_locks", _("Release lock"))
        outcomes: dict[str, int] = {}
        chosen = queryset.order_by("pk").values_list("pk", "task_name", "slot", "state")
        user = request.user.get_username()
        try:
            for run_id, task_name, slot, state in chosen[:MAX_RELEASED]:
                outcome = release_lock(run_id, user=user)
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                if outcome in ("abandoned", "released"):
                    state = RunState.ABANDONED if outcome == "abandoned" else state
                    run = TaskRun(pk=run_id, task_name=task_name, slot=slot, state=state)
                    self.log_change(request, run, f"lock {outcome}: admin action by {user}")
        except BackendUnavailable as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return None
        if chosen[MAX_RELEASED : MAX_RELEASED + 1].exists():
            self.message_user(
                request,
                _("Only the first %(n)d selected runs were handled; run the action again.")
                % {"n": MAX_RELEASED},
                messages.WARNING,
            )
        freed = outcomes.get("abandoned", 0) + outcomes.get("released", 0)
        self.message_user(
            request,
            ngettext("Released %d lock.", "Released %d locks.", freed) % freed,
            messages.SUCCESS,
        )
        live = outcomes.get("live", 0)
        if live:
            self.message_user(
                request,
                ngettext(
                    "%d run was left alone: its owner's lease is still valid.",
                    "%d runs were left alone: their owners' leases are still valid.",
                    live,
                )
                % live,
                messages.WARNING,
            )
        return None

    def _confirm(
        self, request: HttpRequest, queryset: QuerySet[TaskRun], action: str, title: Any
    ) -> TemplateResponse | None:
        shown = list(queryset.order_by("pk")[: self.list_per_page])
        stale = sum(1 for run in shown if _is_stale(run))
        if action == "cleanup_stale_locks" and not stale and len(shown) < self.list_per_page:
            # Nothing to confirm: say so, instead of asking to clean up 0 runs.
            self.message_user(
                request,
                ngettext(
                    "None of the %(n)d selected runs is stale (running, its lease expired): "
                    "nothing to clean up.",
                    "None of the %(n)d selected runs is stale (running, its lease expired): "
                    "nothing to clean up.",
                    len(shown),
                )
                % {"n": len(shown)},
                messages.WARNING,
            )
            return None
        context = {
            **self.admin_site.each_context(request),
            "ol_breadcrumbs": OL_BREADCRUMBS,
            "title": title,
            "opts": self.opts,
            "action": action,
            "runs": shown,
            "stale": stale,
            "live": sum(1 for run in shown if getattr(run, "lease_alive", False)),
            "more": len(shown) == self.list_per_page,
            "selected": request.POST.getlist(ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across", "0"),
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/taskguard/taskrun/confirm_action.html", context)


def _is_stale(run: TaskRun) -> bool:
    return run.state == RunState.RUNNING and not getattr(run, "lease_alive", True)


def _human(delta: timedelta) -> str:
    seconds = max(0, int(delta.total_seconds()))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"
