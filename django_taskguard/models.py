"""The run ledger: one ``TaskRun`` row per (task, slot), and its transition log."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from django.db import models
from django.db.models.functions import Now
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from ._compat import check_constraint
from .owner import Owner
from .states import ATTEMPT_STATES, PRUNABLE_STATES, RunState

__all__ = [
    "DatabaseNow",
    "Ledger",
    "RunState",
    "ScheduleEvent",
    "TargetKind",
    "TaskRun",
    "TaskRunTransition",
    "TaskSchedule",
    "Upkeep",
]

TASK_NAME_MAX_LENGTH = 255
# A key of ``@once_per_key`` is stored as given (sanitized); longer ones are refused.
KEY_MAX_LENGTH = 255


class DatabaseNow(Now):
    """The database's clock, in UTC, as the ledger's columns hold it.

    Django's ``Now()`` is ``CURRENT_TIMESTAMP(6)`` on MariaDB: the session's time
    zone, while Django stores UTC there. ``UTC_TIMESTAMP(6)`` is right whatever it is.
    """

    def as_mysql(self, compiler: Any, connection: Any, **extra_context: Any) -> Any:
        return self.as_sql(compiler, connection, template="UTC_TIMESTAMP(6)", **extra_context)


class TaskRunQuerySet(models.QuerySet["TaskRun"]):
    def running(self) -> TaskRunQuerySet:
        return self.filter(state=RunState.RUNNING)

    def stale(self) -> TaskRunQuerySet:
        """Running rows whose lease expired by the database's clock (owner presumed dead)."""
        return self.filter(state=RunState.RUNNING, lease_until__lte=DatabaseNow())

    def overdue(self) -> TaskRunQuerySet:
        """Stale running rows, and retrying rows whose retry is overdue (its deadline passed)."""
        return self.filter(state__in=ATTEMPT_STATES, lease_until__lte=DatabaseNow())

    def live(self) -> TaskRunQuerySet:
        """Running rows whose lease is still valid by the database's clock."""
        return self.filter(state=RunState.RUNNING, lease_until__gt=DatabaseNow())

    def finished(self) -> TaskRunQuerySet:
        """Runs finished for good (what retention may delete)."""
        return self.filter(state__in=PRUNABLE_STATES)

    def with_lease(self) -> TaskRunQuerySet:
        """Annotate ``lease_alive`` and ``db_now``, judged by the database's clock."""
        alive = models.Q(state=RunState.RUNNING, lease_until__gt=DatabaseNow())
        return self.annotate(
            lease_alive=models.ExpressionWrapper(alive, output_field=models.BooleanField()),
            db_now=DatabaseNow(),
        )


class TaskRun(models.Model):
    """What happened to one schedule slot of one task."""

    task_name = models.CharField(_("task"), max_length=TASK_NAME_MAX_LENGTH)
    slot = models.DateTimeField(
        _("slot"),
        help_text=_(
            "The schedule fire time, in UTC (a keyed run: when its key was first claimed)."
        ),
    )
    # NULL, not "": a slot's row has no key, and the (task, key) index leaves NULLs out.
    key = models.CharField(  # noqa: DJ001
        _("key"),
        max_length=KEY_MAX_LENGTH,
        null=True,
        blank=True,
        default=None,
        help_text=_("The key of an @once_per_key run (empty for a schedule slot)."),
    )
    # NULL, not "": "" is no JSON; only @once_per_key(return_result=True) stores one.
    result = models.TextField(  # noqa: DJ001
        _("result"),
        null=True,
        blank=True,
        default=None,
        help_text=_("The JSON result of an @once_per_key(return_result=True) run."),
    )
    state = models.CharField(
        _("state"), max_length=16, choices=RunState.choices, default=RunState.PENDING
    )
    attempt = models.PositiveIntegerField(_("attempt"), default=0)
    fence = models.BigIntegerField(
        _("fence"),
        null=True,
        blank=True,
        help_text=_("Grows with every attempt; a stale owner's writes are refused by it."),
    )
    owner = models.CharField(_("owner"), max_length=255, blank=True, default="")
    created_at = models.DateTimeField(_("created at"), default=timezone.now)
    started_at = models.DateTimeField(_("started at"), null=True, blank=True)
    lease_until = models.DateTimeField(_("lease until"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished at"), null=True, blank=True)
    error = models.TextField(_("error"), blank=True, default="")
    duplicates = models.PositiveIntegerField(
        _("duplicates"), default=0, help_text=_("Attempts that found the slot taken.")
    )
    # NULL: no retry is awaited from a particular message (any caller may start it).
    schedule_version = models.PositiveIntegerField(
        _("schedule version"),
        null=True,
        blank=True,
        default=None,
        editable=False,
        help_text=_("A data schedule's run: the version of the schedule that fired it."),
    )
    retry_by = models.CharField(  # noqa: DJ001
        _("retry by"),
        max_length=255,
        null=True,
        blank=True,
        default=None,
        editable=False,
        help_text=_(
            "While retrying: the message (Celery task id) that carries the retry; only it "
            "starts the next attempt, other copies are duplicates."
        ),
    )

    objects = TaskRunQuerySet.as_manager()

    class Meta:
        verbose_name = _("task run")
        verbose_name_plural = _("task runs")
        ordering = ["-slot", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["task_name", "slot"], name="taskguard_run_task_slot"),
            # One row per (task, key) for @once_per_key; slot rows (key NULL) are not in it.
            models.UniqueConstraint(
                fields=["task_name", "key"],
                condition=models.Q(key__isnull=False),
                name="taskguard_run_task_key",
            ),
            check_constraint(models.Q(state__in=RunState.values), "taskguard_run_state_valid"),
        ]
        indexes = [
            models.Index(fields=["state", "lease_until"], name="taskguard_run_state_lease"),
            models.Index(fields=["fence"], name="taskguard_run_fence"),
            models.Index(fields=["-slot", "-id"], name="taskguard_run_slot_desc"),
            # The admin's state filter and prune_runs: state, newest slot first.
            models.Index(fields=["state", "-slot", "-id"], name="taskguard_run_state_slot"),
            # Health, metrics and the overview: a task's latest run in a state, by index probe.
            models.Index(fields=["task_name", "state", "-slot"], name="taskguard_run_task_state"),
        ]
        permissions = [("cleanup_taskrun", _("Can clean up stale locks and release locks"))]

    def __str__(self) -> str:
        if self.key is not None:
            return f"{self.task_name} [{self.key}] ({self.state})"
        return f"{self.task_name} @ {self.slot.isoformat()} ({self.state})"

    @property
    def duration(self) -> timedelta | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at

    @property
    def host(self) -> str:
        """The host part of ``owner`` (see ``owner.Owner``)."""
        parsed = Owner.parse(self.owner)
        return parsed.host if parsed is not None else ""

    @property
    def pid(self) -> int | None:
        parsed = Owner.parse(self.owner)
        return parsed.pid if parsed is not None else None


class TaskOverview(TaskRun):
    """No table of its own (a proxy): the admin's "Tasks at a glance" entry, so that the
    app's index and the sidebar link to the overview page (``admin_overview``)."""

    class Meta:
        proxy = True
        verbose_name = _("tasks at a glance")
        verbose_name_plural = _("tasks at a glance")
        default_permissions = ()  # seen with view_taskrun, as the page is


class TaskRunTransition(models.Model):
    """One state change of a run, written in the same transaction as the change."""

    run = models.ForeignKey(
        TaskRun, on_delete=models.CASCADE, related_name="transitions", verbose_name=_("run")
    )
    from_state = models.CharField(_("from"), max_length=16, choices=RunState.choices)
    to_state = models.CharField(_("to"), max_length=16, choices=RunState.choices)
    at = models.DateTimeField(_("at"), default=timezone.now)
    reason = models.TextField(_("reason"), blank=True, default="")
    owner = models.CharField(_("owner"), max_length=255, blank=True, default="")

    class Meta:
        verbose_name = _("transition")
        verbose_name_plural = _("transitions")
        ordering = ["at", "id"]

    def __str__(self) -> str:
        return f"{self.from_state} -> {self.to_state}"


class Ledger(models.Model):
    """This ledger database itself: one row, written by a migration.

    ``identity`` tells this ledger's Redis keys from another project's on a
    shared Redis; ``fence`` is the fence counter where the database has no
    sequence (SQLite). Neither ever goes back: retention never touches this row.
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    identity = models.UUIDField(_("identity"), default=uuid.uuid4, editable=False)
    fence = models.BigIntegerField(_("last fence"), default=0)

    class Meta:
        verbose_name = _("ledger")
        verbose_name_plural = _("ledger")
        constraints = [check_constraint(models.Q(id=1), "taskguard_ledger_single_row")]

    def __str__(self) -> str:
        return f"ledger {self.identity}"


class Catchup(models.TextChoices):
    """What a scheduler does with slots that fell due while nothing fired them."""

    LATEST = "latest", _("latest: run the latest slot only")
    NONE = "none", _("none: a slot later than its grace is recorded missed, not run")
    ALL = "all", _("all: run every missed slot in order, at most max_catchup")


class ScheduleSource(models.TextChoices):
    FUNCTION = "function", _("a decorated function (run_schedules fires it)")
    CELERY = "celery", _("a Celery task or beat entry (a beat fires it)")
    DATA = "data", _("a data schedule (defined in the admin or by define_schedule)")


class TargetKind(models.TextChoices):
    """What a data schedule runs, which decides what fires it."""

    FUNCTION = "function", _("a guarded function (run_schedules runs it in its process)")
    CELERY = "celery", _("a Celery task (taskguard's beat sends it, a worker runs it)")
    DJANGO_TASKS = (
        "django_tasks",
        _("a django.tasks task (run_schedules runs it, or enqueues it with --enqueue)"),
    )


class TaskSchedule(models.Model):
    """A known schedule: what the missed-slot sweep, pause/resume and the admin read.

    Written by ``run_schedules``, ``cleanup_locks`` and ``ledger.schedules.sync`` from the
    in-process registry, never at import or app-ready. The schedule is stored in a
    form it can be rebuilt from: a cron expression (with its time zone and day rule)
    or an interval.
    """

    task_name = models.CharField(_("task"), max_length=TASK_NAME_MAX_LENGTH, unique=True)
    source = models.CharField(
        _("source"), max_length=16, choices=ScheduleSource.choices, default=ScheduleSource.FUNCTION
    )
    function = models.CharField(
        _("function"),
        max_length=500,
        blank=True,
        default="",
        help_text=_(
            "Its dotted path (a Celery task's name; a data schedule's target: what it runs)."
        ),
    )
    cron = models.CharField(_("cron"), max_length=255, blank=True, default="")
    cron_day_or = models.BooleanField(
        _("cron day rule: or"),
        default=True,
        help_text=_("Cron's rule (day of month OR day of week); False for celery crontabs."),
    )
    every = models.DurationField(_("every"), null=True, blank=True)
    time_zone = models.CharField(
        _("time zone"),
        max_length=64,
        blank=True,
        default="",
        help_text=_("Empty: Django's TIME_ZONE."),
    )
    default_zone = models.CharField(
        _("default time zone"),
        max_length=64,
        blank=True,
        default="",
        help_text=_(
            "Django's TIME_ZONE in the copy that last saved it: a cron without its own time "
            "zone runs in it."
        ),
    )
    # A code schedule stores what its decorator (or beat entry) says; a data schedule stores
    # what its definition sets, empty where it follows its target's decorator
    # (``data_schedules.followed`` reads both).
    catchup = models.CharField(
        _("catch-up"),
        max_length=8,
        choices=Catchup.choices,
        blank=True,
        default=Catchup.LATEST,
        help_text=_("Empty (a data schedule's): its target's."),
    )
    grace = models.DurationField(
        _("grace"), null=True, blank=True, help_text=_("Empty (a data schedule's): its target's.")
    )
    max_catchup = models.PositiveIntegerField(
        _("max catch-up"),
        null=True,
        blank=True,
        help_text=_("Empty (a data schedule's): its target's."),
    )
    pause_after_failures = models.PositiveIntegerField(
        _("pause after failures"),
        null=True,
        blank=True,
        help_text=_("Empty: never (a data schedule's: its target's, else never)."),
    )
    late_after = models.DurationField(
        _("late after"),
        null=True,
        blank=True,
        help_text=_(
            "Its last LATE_START_RUNS slots all starting later than this after their time "
            "make it unhealthy; empty: TASKGUARD['LATE_START_SECONDS'] (a data schedule's: "
            "its target's, else that setting)."
        ),
    )
    paused = models.BooleanField(_("paused"), default=False)
    paused_at = models.DateTimeField(
        _("paused at"),
        null=True,
        blank=True,
        help_text=_("When the latest pause began (kept after a resume: the sweep labels by it)."),
    )
    resumed_at = models.DateTimeField(
        _("resumed at"),
        null=True,
        blank=True,
        help_text=_("When the latest pause ended (empty while paused or never paused)."),
    )
    paused_reason = models.TextField(_("paused reason"), blank=True, default="")
    first_seen = models.DateTimeField(_("first seen"), default=timezone.now)
    last_seen = models.DateTimeField(_("last seen"), default=timezone.now)
    swept_until = models.DateTimeField(
        _("swept until"),
        null=True,
        blank=True,
        help_text=_("Slots at or before this were checked by the missed-slot sweep."),
    )
    sweep_due_at = models.DateTimeField(
        _("sweep due at"),
        null=True,
        blank=True,
        help_text=_(
            "When the missed-slot sweep next needs to look at it (its first slot after "
            "swept until, plus its grace); empty: at the next sweep."
        ),
    )
    owed = models.JSONField(
        _("owed windows"),
        default=list,
        blank=True,
        help_text=_(
            "Slots of a definition that a change ended (an edit of its slots, a disable, a "
            "deletion) which the sweep has not judged yet: each window is judged once its "
            "grace has passed."
        ),
    )
    owed_due_at = models.DateTimeField(
        _("owed due at"),
        null=True,
        blank=True,
        db_index=True,
        help_text=_("When the sweep next judges an owed window; empty: none is left."),
    )
    entry = models.CharField(
        _("name"),
        max_length=200,
        blank=True,
        default="",
        help_text=_(
            "A beat entry's name (source celery) or a data schedule's: its runs are recorded "
            "as task[name]."
        ),
    )
    declared_in = models.CharField(
        _("declared in"),
        max_length=255,
        blank=True,
        default="",
        help_text=_(
            "Where it is declared: the function's module, CELERY_BEAT_SCHEDULE, or "
            "django-celery-beat."
        ),
    )
    removed_at = models.DateTimeField(
        _("removed at"),
        null=True,
        blank=True,
        help_text=_(
            "When the code (or the beat) stopped declaring it; empty while declared. A removed "
            "schedule is not swept nor judged; retire it to delete its row (its runs stay)."
        ),
    )
    acknowledged_until = models.DateTimeField(
        _("acknowledged until"),
        null=True,
        blank=True,
        help_text=_(
            "Problems of slots at or before this were acknowledged (see the schedule's events): "
            "they no longer fail health; a later one does."
        ),
    )

    # -- data schedules (source data): what the admin or define_schedule says ------------
    target_kind = models.CharField(
        _("target kind"), max_length=16, choices=TargetKind.choices, blank=True, default=""
    )
    args = models.JSONField(_("positional arguments"), default=list, blank=True)
    kwargs = models.JSONField(_("keyword arguments"), default=dict, blank=True)
    enabled = models.BooleanField(
        _("enabled"),
        default=True,
        help_text=_("A disabled schedule fires nothing and is not judged (a pause records skips)."),
    )
    starts = models.DateTimeField(
        _("starts"), null=True, blank=True, help_text=_("No slot before this fires.")
    )
    ends = models.DateTimeField(
        _("ends"), null=True, blank=True, help_text=_("No slot after this fires.")
    )
    jitter = models.DurationField(
        _("jitter"),
        null=True,
        blank=True,
        help_text=_(
            "Spread the start after each slot by up to this, by a stable hash of the schedule "
            "(the slot itself stays the nominal time)."
        ),
    )
    description = models.TextField(_("description"), blank=True, default="")
    version = models.PositiveIntegerField(
        _("version"), default=0, help_text=_("A data schedule's: grows with every change.")
    )
    changed_at = models.DateTimeField(
        _("changed at"),
        null=True,
        blank=True,
        help_text=_("A data schedule's latest change, by the database's clock."),
    )

    class Meta:
        verbose_name = _("task schedule")
        verbose_name_plural = _("task schedules")
        ordering = ["task_name"]
        constraints = [
            check_constraint(
                models.Q(cron="", every__isnull=False)
                | (~models.Q(cron="") & models.Q(every=None)),
                "taskguard_schedule_cron_or_every",
            ),
            check_constraint(
                models.Q(catchup__in=Catchup.values)
                | models.Q(source=ScheduleSource.DATA, catchup=""),
                "taskguard_schedule_catchup",
            ),
            # Only a data schedule follows its target; a code schedule stores its values.
            check_constraint(
                models.Q(source=ScheduleSource.DATA)
                | models.Q(grace__isnull=False, max_catchup__isnull=False),
                "taskguard_schedule_code_policy",
            ),
        ]
        indexes = [
            models.Index(fields=["changed_at"], name="taskguard_schedule_changed"),
            models.Index(fields=["sweep_due_at"], name="taskguard_schedule_sweep_due"),
        ]
        permissions = [
            ("pause_taskschedule", _("Can pause and resume scheduled tasks")),
            ("run_taskschedule", _("Can run a schedule now")),
            ("backfill_taskschedule", _("Can backfill a schedule's slots")),
            ("acknowledge_taskschedule", _("Can acknowledge a schedule's problems")),
        ]

    def __str__(self) -> str:
        return f"{self.task_name} ({self.cron or self.every})"


class ScheduleEventKind(models.TextChoices):
    PAUSED = "paused", _("paused")
    RESUMED = "resumed", _("resumed")
    ACKNOWLEDGED = "acknowledged", _("acknowledged")
    RETIRED = "retired", _("retired")
    CREATED = "created", _("created")
    EDITED = "edited", _("edited")
    ENABLED = "enabled", _("enabled")
    DISABLED = "disabled", _("disabled")
    DELETED = "deleted", _("deleted")
    RAN_NOW = "run_now", _("run now")
    BACKFILLED = "backfill", _("backfilled")


class ScheduleEventOrigin(models.TextChoices):
    ADMIN = "admin", _("the admin")
    COMMAND = "command", _("a management command")
    POLICY = "pause_after_failures", _("pause_after_failures")
    CODE = "code", _("a call in code (API)")


class ScheduleEvent(models.Model):
    """What an operator (or a policy) did to a schedule: every pause, resume, acknowledgement
    and retirement, and every change to a data schedule (with what changed and the version
    it made), kept (keyed by task name, so a retired schedule's history stays)."""

    task_name = models.CharField(_("task"), max_length=TASK_NAME_MAX_LENGTH)
    kind = models.CharField(_("event"), max_length=16, choices=ScheduleEventKind.choices)
    at = models.DateTimeField(_("at"), default=timezone.now)
    by = models.CharField(
        _("by"), max_length=255, blank=True, default="", help_text=_("A user, or a process.")
    )
    origin = models.CharField(_("from"), max_length=24, choices=ScheduleEventOrigin.choices)
    reason = models.TextField(_("reason"), blank=True, default="")
    until = models.DateTimeField(
        _("until"),
        null=True,
        blank=True,
        help_text=_("An acknowledgement covers the problems of slots at or before this."),
    )
    version = models.PositiveIntegerField(
        _("version"),
        null=True,
        blank=True,
        help_text=_("A data schedule's version after this change."),
    )
    changes = models.JSONField(
        _("changes"),
        default=dict,
        blank=True,
        help_text=_("What changed: each field's value before and after."),
    )

    class Meta:
        verbose_name = _("schedule event")
        verbose_name_plural = _("schedule events")
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["task_name", "at"], name="taskguard_event_task_at")]

    def __str__(self) -> str:
        return f"{self.task_name} {self.kind} at {self.at:%Y-%m-%d %H:%M:%S}"


class Upkeep(models.Model):
    """The upkeep's lease and its latest run: one row (written by :mod:`django_taskguard.upkeep`).

    ``held_until`` is a lease taken by compare-and-set, so that one process at a time across
    the fleet runs it; ``finished_at`` is what the health verdict reads ("upkeep has not run").
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    holder = models.CharField(_("holder"), max_length=255, blank=True, default="")
    held_until = models.DateTimeField(_("held until"), null=True, blank=True)
    started_at = models.DateTimeField(_("started at"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished at"), null=True, blank=True)
    ran_by = models.CharField(_("ran by"), max_length=255, blank=True, default="")
    error = models.TextField(_("error"), blank=True, default="")
    result = models.JSONField(_("result"), default=dict, blank=True)

    class Meta:
        verbose_name = _("upkeep")
        verbose_name_plural = _("upkeep")
        constraints = [check_constraint(models.Q(id=1), "taskguard_upkeep_single_row")]

    def __str__(self) -> str:
        return f"upkeep (last finished {self.finished_at})"
