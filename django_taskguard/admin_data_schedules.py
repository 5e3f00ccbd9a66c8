"""Data schedules in the admin: the form that creates and edits them, their next slots and
their history as the change page shows them.

The form checks with :func:`data_schedules.validate` (the one validator of the admin and the
API; its ``ScheduleDefinitionError.field`` says which field shows the message) and the admin
saves through :func:`data_schedules.define_schedule`, never ``model.save()``: the change
and its reason are kept in the schedule's history. Moments typed into the form (starts,
ends) are read in the schedule's own time zone (Django's ``TIME_ZONE`` when it has none)
unless they give their own offset.
"""

from __future__ import annotations

import json
import zoneinfo
from datetime import datetime, timedelta, tzinfo
from functools import lru_cache
from typing import Any

from django import forms
from django.forms.fields import InvalidJSONInput
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from . import data_schedules, lateness, timefmt
from .data_schedules import ScheduleDefinitionError
from .ledger import schedules as store
from .models import Catchup, ScheduleEvent, ScheduleEventOrigin, ScheduleSource, TaskSchedule
from .moments import moment_problem
from .policy import Policy
from .schedules import rebuild

NEXT_SLOTS = 5
# How far ahead the next slots are looked for (a cron that fires once a year shows one).
NEXT_SLOTS_HORIZON = timedelta(days=400)
# The form's field for each part validate() names, where they differ.
FORM_FIELD = {"name": "entry", "target": "function"}
ZONES_DATALIST = "taskguard-time-zones"
REASON_MAX_LENGTH = 200
# An interval shorter than this fires a slot almost at once and again and again: run now by
# another name, so it needs run now's permission (taskguard.run_taskschedule).
FAST_EVERY = timedelta(seconds=60)


@lru_cache(maxsize=1)
def zone_names() -> tuple[str, ...]:
    return tuple(
        sorted(z for z in zoneinfo.available_timezones() if data_schedules.is_canonical_zone(z))
    )


class ZoneInput(forms.TextInput):
    """A text input offering every IANA zone name (a datalist): any name may be typed."""

    def render(
        self, name: str, value: Any, attrs: dict[str, Any] | None = None, renderer: Any = None
    ) -> SafeString:
        attrs = {**(attrs or {}), "list": ZONES_DATALIST, "autocomplete": "off"}
        options = format_html_join("", '<option value="{}">', ((zone,) for zone in zone_names()))
        return format_html(
            '{}<datalist id="{}">{}</datalist>',
            super().render(name, value, attrs, renderer),
            ZONES_DATALIST,
            options,
        )


def zone_of(time_zone: str) -> tzinfo:
    """The zone a data schedule's moments are typed and shown in: its own, else TIME_ZONE."""
    if time_zone:
        try:
            return zoneinfo.ZoneInfo(time_zone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            pass
    return timezone.get_default_timezone()


def parse_moment(given: str, zone: tzinfo) -> datetime:
    """A date and time typed by a user: in ``zone`` unless it gives its own offset, within
    the bounds of :mod:`.moments`. Raises ValueError saying what is expected."""
    try:
        parsed = parse_datetime(given.strip().replace("T", " "))
    except ValueError:
        parsed = None
    if parsed is None:
        raise ValueError(
            _("%(given)r is not a date and time (2026-11-26 21:00, or ISO 8601)") % {"given": given}
        )
    aware = timezone.make_aware(parsed, zone) if timezone.is_naive(parsed) else parsed
    if (problem := moment_problem(aware, _("a date and time"))) is not None:
        raise ValueError(problem)
    return aware


def show_moment(moment: datetime | None, zone: tzinfo) -> str:
    if moment is None:
        return ""
    try:
        return f"{moment.astimezone(zone):%Y-%m-%d %H:%M:%S}"
    except OverflowError:  # stored out of bounds (by SQL, an older version): with its offset
        return moment.isoformat(sep=" ")


JSON_HELP = gettext_lazy("JSON, checked against the target's signature.")


class ArgumentsField(forms.JSONField):
    """A JSON field whose text is nested too deep for the parser (``RecursionError``) is a
    form error, not a 500; ``validate`` refuses what is deeper than ``JSON_MAX_DEPTH``."""

    def to_python(self, value: Any) -> Any:
        try:
            return super().to_python(value)
        except RecursionError:
            raise forms.ValidationError(data_schedules.TOO_DEEP, code="invalid") from None

    def bound_data(self, data: Any, initial: Any) -> Any:
        try:
            return super().bound_data(data, initial)
        except RecursionError:
            return InvalidJSONInput(data)


class DataScheduleForm(forms.ModelForm):  # type: ignore[type-arg]
    """A data schedule's definition, checked by ``data_schedules.validate``; saving is the
    admin's (``define_schedule``), never the model's.

    What the editor may do besides add and change, set by the admin on the form class:
    ``may_pause`` (``taskguard.pause_taskschedule``: without it ``enabled`` is read-only, its
    posted value ignored, since disabling stops the slots as a pause does) and ``may_run``
    (``taskguard.run_taskschedule``: without it an interval under ``FAST_EVERY`` is refused).
    """

    may_pause = False
    may_run = False

    entry = forms.CharField(
        label=gettext_lazy("name"),
        max_length=data_schedules.NAME_MAX_LENGTH,
        help_text=gettext_lazy(
            "Fixed once created (another name is another schedule). Its runs are recorded "
            "as target[name]."
        ),
    )
    function = forms.CharField(
        label=gettext_lazy("target"),
        max_length=500,
        help_text=gettext_lazy(
            "What it runs: an @once_per_schedule function's task name, a Celery task's name "
            "or a django.tasks task's dotted path. Fixed once created (another target is "
            "another schedule)."
        ),
    )
    cron = forms.CharField(
        label=gettext_lazy("cron"),
        required=False,
        max_length=255,
        help_text=gettext_lazy("Five fields, e.g. 0 9 * * 1-5; or give an interval below."),
    )
    every = forms.DurationField(
        label=gettext_lazy("every"),
        required=False,
        help_text=gettext_lazy("An interval instead of a cron: seconds, or HH:MM:SS."),
    )
    time_zone = forms.CharField(
        label=gettext_lazy("time zone"),
        required=False,
        max_length=64,
        widget=ZoneInput(attrs={"size": 30}),
        help_text=gettext_lazy(
            "The cron's IANA zone (Europe/Berlin); empty: Django's TIME_ZONE. An interval "
            "has none (its slots are UTC)."
        ),
    )
    args = ArgumentsField(
        label=gettext_lazy("positional arguments"),
        required=False,
        initial=list,
        help_text=format_html("{} {}", gettext_lazy("A JSON list, e.g. [42]."), JSON_HELP),
    )
    kwargs = ArgumentsField(
        label=gettext_lazy("keyword arguments"),
        required=False,
        initial=dict,
        help_text=format_html(
            "{} {}", gettext_lazy('A JSON object, e.g. {"tenant_id": 42}.'), JSON_HELP
        ),
    )
    enabled = forms.BooleanField(label=gettext_lazy("enabled"), required=False, initial=True)
    starts = forms.CharField(
        label=gettext_lazy("starts"),
        required=False,
        help_text=gettext_lazy(
            "No slot before this fires. In the schedule's time zone unless you give an offset."
        ),
    )
    ends = forms.CharField(
        label=gettext_lazy("ends"),
        required=False,
        help_text=gettext_lazy(
            "No slot after this fires. In the schedule's time zone unless you give an offset."
        ),
    )
    catchup = forms.ChoiceField(
        label=gettext_lazy("catch-up"),
        required=False,
        choices=[("", gettext_lazy("the target's")), *Catchup.choices],
        help_text=gettext_lazy("Empty: the target's, followed if it changes."),
    )
    grace = forms.DurationField(
        label=gettext_lazy("grace"),
        required=False,
        help_text=gettext_lazy(
            "Empty: the target's, followed if it changes. Seconds, or HH:MM:SS."
        ),
    )
    max_catchup = forms.IntegerField(
        label=gettext_lazy("max catch-up"),
        required=False,
        help_text=gettext_lazy("Empty: the target's, followed if it changes."),
    )
    pause_after_failures = forms.IntegerField(
        label=gettext_lazy("pause after failures"),
        required=False,
        help_text=gettext_lazy("Empty: the target's (or never), followed if it changes."),
    )
    jitter = forms.DurationField(
        label=gettext_lazy("jitter"),
        required=False,
        help_text=gettext_lazy(
            "Spread each start by up to this (a stable hash of the schedule); the slot stays "
            "the nominal time."
        ),
    )
    late_after = forms.DurationField(
        label=gettext_lazy("late after"),
        required=False,
        help_text=gettext_lazy(
            "Health: its last LATE_START_RUNS slots all starting later than this after their "
            "time make it unhealthy. Empty: the target's, else TASKGUARD['LATE_START_SECONDS'], "
            "followed if it changes. Seconds, or HH:MM:SS."
        ),
    )
    description = forms.CharField(
        label=gettext_lazy("description"),
        required=False,
        max_length=data_schedules.DESCRIPTION_MAX_LENGTH,
        widget=forms.Textarea(attrs={"rows": 2, "cols": 60}),
    )
    reason = forms.CharField(
        label=gettext_lazy("reason for the change"),
        required=False,
        max_length=REASON_MAX_LENGTH,
        widget=forms.TextInput(attrs={"size": 60}),
        help_text=gettext_lazy("Kept in the schedule's history with who changed what."),
    )

    class Meta:
        model = TaskSchedule
        fields = (
            "entry",
            "function",
            "cron",
            "every",
            "time_zone",
            "args",
            "kwargs",
            "enabled",
            "starts",
            "ends",
            "catchup",
            "grace",
            "max_catchup",
            "pause_after_failures",
            "jitter",
            "late_after",
            "description",
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        row = self.instance
        if row.pk is not None:  # an edit: the stored values, moments in the schedule's zone
            # Name and target are fixed (shown read-only, not posted): not form fields.
            self.fields.pop("entry", None)
            self.fields.pop("function", None)
            zone = zone_of(row.time_zone)
            self.initial["starts"] = show_moment(row.starts, zone)
            self.initial["ends"] = show_moment(row.ends, zone)
            self._say_followed(data_schedules.target_policy(row.function))
        else:
            self.initial["catchup"] = ""  # the model's default is a code schedule's
        if not self.may_pause:
            # Disabled: Django ignores what is posted for it and keeps the initial value
            # (the row's; a new schedule is enabled).
            enabled = self.fields["enabled"]
            enabled.disabled = True
            enabled.help_text = _(
                "Disabling or enabling needs the permission to pause and resume "
                "(taskguard.pause_taskschedule)."
            )
        self.values: dict[str, Any] = {}

    def _say_followed(self, policy: Policy) -> None:
        """What an empty field follows, as the target says it now (its decorator, here):
        an empty field stays empty, and follows the target when its policy changes."""
        fields = self.fields
        catchup = fields["catchup"]
        assert isinstance(catchup, forms.ChoiceField)
        catchup.choices = [
            ("", _("the target's (%(value)s)") % {"value": policy.catchup}),
            *Catchup.choices,
        ]
        fields["grace"].help_text = _(
            "Empty: the target's (%(value)s), followed if it changes. Seconds, or HH:MM:SS."
        ) % {"value": _seconds(policy.grace)}
        fields["max_catchup"].help_text = _(
            "Empty: the target's (%(value)s), followed if it changes."
        ) % {"value": policy.max_catchup}
        pause = policy.pause_after_failures
        fields["pause_after_failures"].help_text = _(
            "Empty: the target's (%(value)s), followed if it changes."
        ) % {"value": _("never") if pause is None else pause}
        setting = lateness.bound(None)
        if policy.late_after is not None:
            late = _("%(value)s, the target's") % {"value": _seconds(policy.late_after)}
        elif setting is not None:
            late = _("%(value)s, the setting's") % {"value": _seconds(setting)}
        else:
            late = _("none, no lateness rule")
        fields["late_after"].help_text = _(
            "Health: its last LATE_START_RUNS slots all starting later than this after their "
            "time make it unhealthy. Empty: the target's, else TASKGUARD['LATE_START_SECONDS'], "
            "followed if they change (now: %(followed)s). Seconds, or HH:MM:SS."
        ) % {"followed": late}

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if self.errors:
            return cleaned
        row = self.instance
        name = row.entry if row.pk is not None else cleaned.get("entry", "")
        target = row.function if row.pk is not None else cleaned.get("function", "")
        zone = zone_of(cleaned.get("time_zone", ""))
        moments: dict[str, datetime | None] = {}
        for field in ("starts", "ends"):
            given = cleaned.get(field, "")
            try:
                moments[field] = parse_moment(given, zone) if given else None
            except ValueError as exc:
                self.add_error(field, str(exc))
        if self.errors:
            return cleaned
        args = cleaned.get("args")
        kwargs = cleaned.get("kwargs")
        try:
            task_name, values = data_schedules.validate(
                name,
                target,
                cron=cleaned.get("cron") or None,
                # an edit keeps the row's day rule (an imported celery crontab's: both days)
                cron_day_or=row.cron_day_or if row.pk is not None else True,
                every=cleaned.get("every"),
                time_zone=cleaned.get("time_zone") or None,
                args=[] if args is None else args,
                kwargs={} if kwargs is None else kwargs,
                enabled=bool(cleaned.get("enabled")),
                starts=moments["starts"],
                ends=moments["ends"],
                catchup=cleaned.get("catchup") or None,
                grace=cleaned.get("grace"),
                max_catchup=cleaned.get("max_catchup"),
                pause_after_failures=cleaned.get("pause_after_failures"),
                jitter=cleaned.get("jitter"),
                late_after=cleaned.get("late_after"),
                description=cleaned.get("description", ""),
            )
        except ScheduleDefinitionError as exc:
            field = FORM_FIELD.get(exc.field, exc.field)
            self.add_error(field if field in self.fields else None, str(exc))
            return cleaned
        if row.pk is None:
            self._refuse_taken(task_name)
        self._refuse_fast(values["every"])
        self.values = {"task_name": task_name, **values}
        return cleaned

    def _refuse_fast(self, every: timedelta | None) -> None:
        """An interval under ``FAST_EVERY`` set without the run permission (one the row
        already has may stay: its other fields are still editable)."""
        if self.may_run or every is None or every >= FAST_EVERY:
            return
        if self.instance.pk is not None and self.instance.every == every:
            return
        self.add_error(
            "every",
            _(
                "An interval under %(seconds)d seconds fires the schedule at once and again "
                "and again: it needs the permission to run a schedule now "
                "(taskguard.run_taskschedule)."
            )
            % {"seconds": FAST_EVERY.total_seconds()},
        )

    def _refuse_taken(self, task_name: str) -> None:
        taken = store.get(task_name)
        if taken is None or (taken.source == ScheduleSource.DATA and taken.removed_at):
            return  # new, or a deleted schedule defined again (its version goes on)
        if taken.source == ScheduleSource.DATA:
            message = _("%(name)s exists already: edit it instead.")
        else:
            message = _("%(name)s is already a schedule declared by the code or a beat.")
        self.add_error("entry", message % {"name": task_name})

    def _post_clean(self) -> None:
        """No model validation nor instance update: define_schedule saves (and checks)."""


def define(form: DataScheduleForm, user: str) -> TaskSchedule:
    """Save the form's definition through the API, kept with who, from where and why."""
    values = form.values
    reason = " ".join(form.cleaned_data.get("reason", "").split())
    return data_schedules.define_schedule(
        values["entry"],
        values["function"],
        cron=values["cron"] or None,
        cron_day_or=values["cron_day_or"],
        every=values["every"],
        time_zone=values["time_zone"] or None,
        args=values["args"],
        kwargs=values["kwargs"],
        enabled=values["enabled"],
        starts=values["starts"],
        ends=values["ends"],
        catchup=values["catchup"],
        grace=values["grace"],
        max_catchup=values["max_catchup"],
        pause_after_failures=values["pause_after_failures"],
        jitter=values["jitter"],
        late_after=values["late_after"],
        description=values["description"],
        by=user,
        reason=reason,
        origin=ScheduleEventOrigin.ADMIN,
    )


def next_slots(row: TaskSchedule, count: int = NEXT_SLOTS) -> list[datetime]:
    """The schedule's next ``count`` slots from now, within its starts and ends (none for
    a disabled, deleted or paused one: nothing fires them)."""
    if row.removed_at is not None or not row.enabled or row.paused:
        return []
    try:
        schedule = rebuild(row.cron, row.cron_day_or, store.zone_of(row), row.every)
    except Exception:  # a row another version wrote: shown, not computed
        return []
    now = timezone.now()
    after = now if row.starts is None else max(now, row.starts - timedelta(microseconds=1))
    try:
        until = after + NEXT_SLOTS_HORIZON if row.ends is None else row.ends
        return schedule.slots_between(after, until, count) if until > after else []
    except OverflowError:  # starts or ends stored out of bounds (by SQL, an older version)
        return []


def slot_rows(row: TaskSchedule) -> list[dict[str, str]]:
    """The next slots as the change page shows them: in the schedule's zone, and in UTC."""
    zone = zone_of(row.time_zone)
    return [
        {"here": timefmt.local(slot, zone), "utc": timefmt.utc(slot), "iso": slot.isoformat()}
        for slot in next_slots(row)
    ]


def _seconds(delta: timedelta) -> str:
    return f"{delta.total_seconds():g} s"


# Left empty, these follow the schedule's target (data_schedules.followed).
FOLLOWING = frozenset(("catchup", "grace", "max_catchup", "pause_after_failures", "late_after"))


def _shown(value: Any, field: str = "") -> str:
    if value is None or value == "":
        return _("— (the target's)") if field in FOLLOWING else "—"
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


# What the history calls the fields the form does not show.
CHANGE_LABELS = {
    "cron_day_or": gettext_lazy("cron day rule (True: day of month OR day of week)"),
    "target_kind": gettext_lazy("target kind"),
}


def change_label(field: str) -> str:
    """A changed field as the form labels it (``function``: "target")."""
    form_field = DataScheduleForm.base_fields.get(field)
    label = form_field.label if form_field is not None else CHANGE_LABELS.get(field)
    return str(label or field)


def changes_of(event: ScheduleEvent) -> list[dict[str, str]]:
    """An event's changes field by field, labelled as on the form (``before`` empty for a
    creation)."""
    changes = event.changes if isinstance(event.changes, dict) else {}
    shown = []
    for field, pair in changes.items():
        before, after = pair if isinstance(pair, list) and len(pair) == 2 else (None, pair)
        if event.kind == "created" and after in (None, "", [], {}):
            continue  # a creation lists what it set
        shown.append(
            {
                "field": field,
                "label": change_label(field),
                "before": "" if event.kind == "created" else _shown(before, field),
                "after": _shown(after, field),
            }
        )
    return shown
