"""The schedules admin's actions: pause, resume, acknowledge and retire.

Each is a permission-gated POST through the library's own API (:mod:`.pauses`,
:mod:`.acknowledgements`, ``ledger.schedules.retire``) that keeps its event (who, from
where, when, why) and says what it did. Pause, acknowledge and retire ask first on an
intermediate page, as Django's delete confirmation does. A user without an action's
permission is refused (403), not told "no action selected".
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from . import acknowledgements, pauses, timefmt
from ._compat import OL_BREADCRUMBS
from .exceptions import BackendUnavailable, TaskGuardError
from .ledger import schedules as store
from .models import ScheduleEventKind, ScheduleEventOrigin, TaskSchedule
from .moments import moment_problem

if TYPE_CHECKING:
    AdminBase = admin.ModelAdmin[TaskSchedule]
else:
    AdminBase = object

# Which permission each action needs (``has_<name>_permission``): asked before Django's own
# dispatch, so that a user without it is refused (403) rather than told "no action selected".
ACTION_PERMISSIONS = {
    "pause_schedules": "pause",
    "resume_schedules": "pause",
    "acknowledge_schedules": "acknowledge",
    "retire_schedules": "retire",
    "run_now_schedules": "run",  # admin_schedule_run
    "backfill_schedules": "backfill",
}
REASON_MAX_LENGTH = 200


class ScheduleActionsMixin(AdminBase):
    """Adds the actions, their permissions and their intermediate page to the admin."""

    actions: tuple[str, ...] = (
        "pause_schedules",
        "resume_schedules",
        "acknowledge_schedules",
        "retire_schedules",
    )

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("taskguard.pause_taskschedule"))

    def has_acknowledge_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("taskguard.acknowledge_taskschedule"))

    def has_retire_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("taskguard.delete_taskschedule"))

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if request.method == "POST" and "index" in request.POST:
            needed = ACTION_PERMISSIONS.get(request.POST.get("action", ""))
            if needed is not None and not getattr(self, f"has_{needed}_permission")(request):
                raise PermissionDenied
        return super().changelist_view(request, extra_context)

    @admin.action(description=gettext_lazy("Pause…"), permissions=["pause"])
    def pause_schedules(
        self, request: HttpRequest, queryset: QuerySet[TaskSchedule]
    ) -> HttpResponse | None:
        if request.POST.get("confirm") != "yes":
            return self._ask(request, queryset, "pause_schedules", _("Pause these schedules?"))
        user = request.user.get_username()
        # The operator's words only: who and from where are the event's own fields.
        reason = " ".join(request.POST.get("reason", "").split())[:REASON_MAX_LENGTH]
        origin = ScheduleEventOrigin.ADMIN
        done = self._each(
            request, queryset, lambda name: pauses.pause(name, reason, by=user, origin=origin)
        )
        self._report(request, done, _("Paused %(names)s."), _("Already paused: %(names)s."))
        return None

    @admin.action(description=gettext_lazy("Resume"), permissions=["pause"])
    def resume_schedules(self, request: HttpRequest, queryset: QuerySet[TaskSchedule]) -> None:
        user = request.user.get_username()
        origin = ScheduleEventOrigin.ADMIN
        done = self._each(
            request, queryset, lambda name: pauses.resume(name, by=user, origin=origin)
        )
        self._report(request, done, _("Resumed %(names)s."), _("Not paused: %(names)s."))

    @admin.action(description=gettext_lazy("Acknowledge problems…"), permissions=["acknowledge"])
    def acknowledge_schedules(
        self, request: HttpRequest, queryset: QuerySet[TaskSchedule]
    ) -> HttpResponse | None:
        title = _("Acknowledge the problems of these schedules?")
        if request.POST.get("confirm") != "yes":
            return self._ask(request, queryset, "acknowledge_schedules", title)
        reason = " ".join(request.POST.get("reason", "").split())[:REASON_MAX_LENGTH]
        try:
            until = _parse_until(request.POST.get("until", ""))
            if not reason:
                raise TaskGuardError(acknowledgements.REASON_REQUIRED)
            user, origin = request.user.get_username(), ScheduleEventOrigin.ADMIN
            done = self._each(
                request,
                queryset,
                lambda name: acknowledgements.acknowledge(
                    name, reason, until=until, by=user, origin=origin
                ),
            )
        except TaskGuardError as exc:  # asked again, with what was wrong
            return self._ask(request, queryset, "acknowledge_schedules", title, error=str(exc))
        self._report(request, done, _("Acknowledged %(names)s."), _("Unknown: %(names)s."))
        return None

    @admin.action(
        description=gettext_lazy("Retire (removed schedules only)…"), permissions=["retire"]
    )
    def retire_schedules(
        self, request: HttpRequest, queryset: QuerySet[TaskSchedule]
    ) -> HttpResponse | None:
        if request.POST.get("confirm") != "yes":
            return self._ask(request, queryset, "retire_schedules", _("Retire these schedules?"))
        still = queryset.filter(removed_at__isnull=True)
        declared = list(still.values_list("task_name", flat=True))
        # A deleted data schedule owes the sweep its slots before the deletion (judged after
        # their grace): its row goes after that, not before (ledger/owed.py).
        owing = queryset.filter(removed_at__isnull=False, owed_due_at__isnull=False)
        waiting = list(owing.order_by("task_name").values_list("task_name", "owed_due_at"))
        user = request.user.get_username()
        done = self._each(
            request,
            queryset.filter(removed_at__isnull=False, owed_due_at__isnull=True),
            lambda name: _retire(name, user),
        )
        self._report(
            request, done, _("Retired %(names)s (their runs stay)."), _("Gone already: %(names)s.")
        )
        if declared:
            self.message_user(
                request,
                _("Not retired, still declared by the code or a beat: %(names)s.")
                % {"names": ", ".join(declared)},
                messages.WARNING,
            )
        for name, due in waiting:
            assert due is not None  # filtered on owed_due_at
            self.message_user(
                request,
                _(
                    "Not retired yet: %(name)s's slots due before its deletion are judged by "
                    "the missed-slot sweep after their grace (from %(due)s); retire it then."
                )
                % {"name": name, "due": timefmt.both(due)},
                messages.WARNING,
            )
        return None

    def _each(
        self, request: HttpRequest, queryset: QuerySet[TaskSchedule], do: Any
    ) -> dict[bool, list[str]] | None:
        """``do(name)`` for each selected schedule: the names it changed, and the others;
        None (said) when the ledger could not be reached."""
        done: dict[bool, list[str]] = {True: [], False: []}
        try:
            for row in queryset.order_by("task_name"):
                changed = bool(do(row.task_name))
                done[changed].append(row.task_name)
                if changed and request.POST.get("action") != "retire_schedules":
                    self.log_change(request, row, f"{request.POST['action']}: {row.task_name}")
        except BackendUnavailable as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return None
        return done

    def _report(
        self, request: HttpRequest, done: dict[bool, list[str]] | None, did: str, same: str
    ) -> None:
        if done is None:
            return
        if done[True]:
            self.message_user(request, did % {"names": ", ".join(done[True])}, messages.SUCCESS)
        if done[False]:
            self.message_user(request, same % {"names": ", ".join(done[False])}, messages.WARNING)

    def _ask(
        self,
        request: HttpRequest,
        queryset: QuerySet[TaskSchedule],
        action: str,
        title: str,
        error: str = "",
    ) -> TemplateResponse:
        """The intermediate page (as Django's delete confirmation): what the action does to
        which schedules, and the reason (and ``until``) it asks."""
        rows = list(queryset.order_by("task_name")[: self.list_per_page])
        context = {
            **self.admin_site.each_context(request),
            "ol_breadcrumbs": OL_BREADCRUMBS,
            "title": title,
            "opts": self.opts,
            "action": action,
            "rows": rows,
            "more": len(rows) == self.list_per_page,
            "crumb": rows[0] if len(rows) == 1 else None,
            "declared": [row.task_name for row in rows if row.removed_at is None],
            "error": error,
            "reason": request.POST.get("reason", ""),
            "until": request.POST.get("until", ""),
            "zone": timezone.get_current_timezone_name(),
            "selected": request.POST.getlist(ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across", "0"),
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(
            request, "admin/taskguard/taskschedule/confirm_action.html", context
        )


def _retire(task_name: str, user: str) -> bool:
    """Delete the row, then keep the event (a row already gone keeps no event)."""
    if not store.retire(task_name):
        return False
    store.record_event(
        task_name, ScheduleEventKind.RETIRED, origin=ScheduleEventOrigin.ADMIN, by=user
    )
    return True


def _parse_until(given: str) -> datetime | None:
    """An acknowledgement's ``until``: empty (now), or a date and time, in the current time
    zone unless it says its own."""
    given = given.strip()
    if not given:
        return None
    try:
        parsed = parse_datetime(given.replace("T", " "))
    except ValueError:
        parsed = None
    if parsed is None:
        raise TaskGuardError(
            _("%(given)r is not a date and time (2026-11-26 21:00, or ISO 8601)") % {"given": given}
        )
    aware = timezone.make_aware(parsed) if timezone.is_naive(parsed) else parsed
    if (problem := moment_problem(aware, "until")) is not None:
        raise TaskGuardError(problem)
    return aware
