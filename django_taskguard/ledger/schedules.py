"""The schedule registry's table: the only code that reads or writes ``TaskSchedule``.

Written by ``run_schedules``, ``cleanup_locks``, ``pause_task``/``resume_task`` and
:func:`django_taskguard.registry.sync` (never at import or app-ready); read by the
missed-slot sweep, the scheduler and the admin. Every query uses ``DATABASE_ALIAS``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator, Sequence
from copy import copy as copy_of
from dataclasses import dataclass, fields, replace
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any

from django.db import IntegrityError, connections, transaction
from django.db.models import (
    Case,
    Count,
    DateTimeField,
    F,
    Max,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Value,
    When,
    Window,
)
from django.db.models.functions import Coalesce, Greatest, RowNumber
from django.utils import timezone

from ..exceptions import BackendUnavailable
from ..logfields import log_fields
from ..models import (
    ScheduleEvent,
    ScheduleEventKind,
    ScheduleEventOrigin,
    ScheduleSource,
    TaskSchedule,
)
from ..schedules import StoredSchedule, rebuild
from . import owed
from .core import alias, clip, database_now, dialect, translated

logger = logging.getLogger("taskguard.ledger")

PAUSED_REASON_MAX_LENGTH = 500


@dataclass(frozen=True)
class Record:
    """What the code says about one schedule (everything but the pause and the sweep's mark)."""

    task_name: str
    source: str
    function: str
    cron: str
    cron_day_or: bool
    every: timedelta | None
    time_zone: str
    default_zone: str  # Django's TIME_ZONE where it was saved
    catchup: str
    grace: timedelta
    max_catchup: int
    pause_after_failures: int | None
    entry: str = ""  # a beat entry's name (source celery)
    declared_in: str = ""  # the function's module, CELERY_BEAT_SCHEDULE, django-celery-beat
    late_after: timedelta | None = None  # health's late-start bound (None: the setting's)


_CODE_FIELDS = [field.name for field in fields(Record) if field.name != "task_name"]
# What most reads of the schedules leave unread (fetched on access): a data schedule's
# arguments and description (up to 64 KB each) and its owed windows (the sweep reads them
# through ledger/owed.py). At 100,000 schedules, most of the bytes.
UNREAD = ("args", "kwargs", "description", "owed")


def stored() -> list[TaskSchedule]:
    """Every known schedule, by task name, without a data schedule's arguments and
    description (read on access: what health and the schedulers' bookkeeping never need, at
    100,000 schedules most of the bytes)."""
    rows = TaskSchedule.objects.using(alias()).defer(*UNREAD)
    with translated:
        return list(rows.order_by("task_name"))


def get(task_name: str) -> TaskSchedule | None:
    with translated:
        return TaskSchedule.objects.using(alias()).filter(task_name=task_name).first()


def names() -> list[str]:
    with translated:
        return list(
            TaskSchedule.objects.using(alias())
            .order_by("task_name")
            .values_list("task_name", flat=True)
        )


def functions_under(module: str) -> list[str]:
    """The task names of the saved function schedules whose function is in ``module``."""
    with translated:
        return list(
            TaskSchedule.objects.using(alias())
            .filter(source=ScheduleSource.FUNCTION, function__startswith=f"{module}.")
            .order_by("task_name")
            .values_list("task_name", flat=True)
        )


def save(records: Sequence[Record], now: datetime | None = None) -> int:
    """Insert or update the schedules the code declares; ``first_seen`` is kept, the
    pause and ``swept_until`` are never touched. A data schedule of the same name is left
    alone (an imported beat entry whose old beat still runs). Returns how many were saved."""
    now = now or timezone.now()
    records = _not_data(records)
    rows = [
        TaskSchedule(
            task_name=record.task_name,
            first_seen=now,
            last_seen=now,
            **{name: getattr(record, name) for name in _CODE_FIELDS},
        )
        for record in records
    ]
    # MariaDB names no conflict target: its upsert meets any unique key, and task_name is
    # the only one a new row (no id yet) can meet.
    features = connections[alias()].features
    target = ["task_name"] if features.supports_update_conflicts_with_target else None
    with translated:
        TaskSchedule.objects.using(alias()).bulk_create(
            rows,
            batch_size=500,
            update_conflicts=True,
            unique_fields=target,
            # The slots may have moved: the sweep looks at each saved schedule next time.
            update_fields=[*_CODE_FIELDS, "last_seen", "sweep_due_at"],
        )
    return len(rows)


def _not_data(records: Sequence[Record]) -> Sequence[Record]:
    """``records`` but those whose name is a live data schedule's (said once per save). A
    deleted data schedule's row (its tombstone) of the same name is deleted, as a retire
    does (its runs and its events stay): the code's schedule takes the name."""
    if not records:
        return records
    names = [record.task_name for record in records]
    rows = TaskSchedule.objects.using(alias()).filter(
        source=ScheduleSource.DATA, task_name__in=names
    )
    with translated:
        rows.filter(removed_at__isnull=False).delete()
        taken = set(rows.values_list("task_name", flat=True))
    if not taken:
        return records
    logger.warning(
        "taskguard: %s are data schedules (imported from django-celery-beat, or defined with "
        "that name): not saved as declared schedules; stop the beats that still declare them",
        ", ".join(sorted(taken)),
        extra=log_fields("schedule.data_conflict", reason=", ".join(sorted(taken))),
    )
    return [record for record in records if record.task_name not in taken]


def zone_of(row: TaskSchedule) -> str:
    """The zone a stored cron runs in: its own, else the saving copy's TIME_ZONE ("" for an
    interval, or a row saved before the zone was kept: this process's TIME_ZONE)."""
    return row.time_zone or (row.default_zone if row.cron else "")


def zone_conflicts(zone: str, registered: Collection[str]) -> list[tuple[str, str]]:
    """``(task, zone)`` of the stored crons among ``registered`` (the schedules this copy
    fires) without a zone of their own that a copy whose TIME_ZONE is not ``zone`` saved:
    such copies fire them at other instants. A row no copy registers any more (a schedule
    removed from the code, after a fleet-wide TIME_ZONE change) fires nowhere: no conflict.
    """
    found = TaskSchedule.objects.using(alias()).exclude(cron="").filter(time_zone="")
    found = found.exclude(default_zone="").exclude(default_zone=zone).order_by("task_name")
    with translated:  # filtered here, not in SQL: a list of names could pass the parameter limit
        rows = list(found.values_list("task_name", "default_zone"))
    return [(task, theirs) for task, theirs in rows if task in registered]


def paused() -> dict[str, str]:
    """The paused tasks and why."""
    with translated:
        found = TaskSchedule.objects.using(alias()).filter(paused=True)
        return dict(found.values_list("task_name", "paused_reason"))


def set_paused(task_name: str, reason: str | None) -> bool:
    """Pause ``task_name`` (``reason``) or resume it (``None``); False when it is unknown
    or already so. The latest pause's start and end are kept (:func:`pause_window`)."""
    queryset = TaskSchedule.objects.using(alias()).filter(task_name=task_name)
    with translated:
        if reason is None:
            return bool(
                queryset.filter(paused=True).update(
                    paused=False, resumed_at=timezone.now(), paused_reason="", sweep_due_at=None
                )
            )
        return bool(
            queryset.filter(paused=False).update(
                paused=True,
                paused_at=timezone.now(),
                resumed_at=None,
                paused_reason=clip(reason, PAUSED_REASON_MAX_LENGTH),
                sweep_due_at=None,
            )
        )


def change_pause(
    task_name: str,
    reason: str | None,
    *,
    origin: ScheduleEventOrigin,
    by: str = "",
    note: str = "",
) -> bool:
    """Pause ``task_name`` (``reason``) or resume it (``None``) and keep its event (who,
    from where; ``note``: why), in one transaction: a pause is never made without its
    event, nor the event kept without the pause. False when it is unknown or already so
    (nothing kept then)."""
    kind = ScheduleEventKind.RESUMED if reason is None else ScheduleEventKind.PAUSED
    with translated, transaction.atomic(using=alias()):
        changed = set_paused(task_name, reason)
        if changed:
            record_event(task_name, kind, origin=origin, by=by, reason=note)
    return changed


@dataclass(frozen=True)
class PauseWindow:
    """A pause of a schedule: from ``start`` (None: since ever) until ``end`` (None: still
    paused). The row keeps the latest; its history (:func:`pause_windows`) the earlier ones."""

    start: datetime | None
    end: datetime | None

    def covers(self, slot: datetime) -> bool:
        """Whether the task was paused at ``slot``."""
        return (self.start is None or slot >= self.start) and (self.end is None or slot < self.end)


def pause_window(row: TaskSchedule) -> PauseWindow | None:
    """``row``'s latest pause (None: never paused, or no pause time kept)."""
    if row.paused:
        return PauseWindow(row.paused_at, None)
    if row.paused_at is not None and row.resumed_at is not None:
        return PauseWindow(row.paused_at, row.resumed_at)
    return None


def pause_windows(row: TaskSchedule) -> list[PauseWindow]:
    """Every pause of ``row`` its history keeps (each ``paused`` event until the next
    ``resumed``), and its latest from the row itself (a pause older than the history)."""
    return pause_windows_many([row])[row.task_name]


def pause_windows_many(rows: Sequence[TaskSchedule]) -> dict[str, list[PauseWindow]]:
    """:func:`pause_windows` of each of ``rows``, by task name: one statement per 500 of
    them that were ever paused (a row never paused, ``paused_at`` empty, has no pause its
    history could add: a pause event is always written with the row's pause), none for
    the others."""
    kinds = [ScheduleEventKind.PAUSED, ScheduleEventKind.RESUMED]
    ever = [row.task_name for row in rows if row.paused_at is not None]
    histories: dict[str, list[tuple[str, datetime]]] = {}
    with translated:
        for start in range(0, len(ever), 500):
            found = ScheduleEvent.objects.using(alias()).filter(
                task_name__in=ever[start : start + 500], kind__in=kinds
            )
            for name, kind, at in found.order_by("at", "id").values_list("task_name", "kind", "at"):
                histories.setdefault(name, []).append((kind, at))
    return {row.task_name: _windows(row, histories.get(row.task_name, [])) for row in rows}


def _windows(row: TaskSchedule, history: Sequence[tuple[str, datetime]]) -> list[PauseWindow]:
    windows: list[PauseWindow] = []
    start: datetime | None = None
    for kind, at in history:
        if kind == ScheduleEventKind.PAUSED and start is None:
            start = at
        elif kind == ScheduleEventKind.RESUMED and start is not None:
            windows.append(PauseWindow(start, at))
            start = None
    if start is not None and (row.paused or row.resumed_at is not None):
        windows.append(PauseWindow(start, None if row.paused else row.resumed_at))
    latest = pause_window(row)
    return windows if latest is None else [*windows, latest]


def mark_swept(task_name: str, until: datetime) -> None:
    """The sweep checked every slot of ``task_name`` up to ``until`` (never moves back);
    the sweep looks at it next time (and sets when it next needs to)."""
    queryset = TaskSchedule.objects.using(alias()).filter(task_name=task_name)
    with translated:
        queryset.filter(Q(swept_until__isnull=True) | Q(swept_until__lt=until)).update(
            swept_until=until, sweep_due_at=None
        )


# -- the sweep at scale: only the schedules that have something due -----------------------

# ``sweep_due_at`` of a schedule with no slot left to judge (it ended): an edit of its
# slots sets it empty again.
NEVER = datetime(9999, 1, 1, tzinfo=dt_timezone.utc)
# Marks written per statement where the database limits parameters (SQLite's 999).
MARKS_PER_STATEMENT = 900


def _judged() -> QuerySet[TaskSchedule]:
    """The schedules the sweep judges (:func:`watched`, in SQL), enabled, without the
    fields it never reads."""
    rows = TaskSchedule.objects.using(alias()).filter(removed_at__isnull=True, enabled=True)
    beat_entries = (
        TaskSchedule.objects.using(alias())
        .filter(source=ScheduleSource.CELERY, removed_at__isnull=True)
        .exclude(entry="")
        .values("function")
    )
    rows = rows.exclude(
        Q(source=ScheduleSource.CELERY, entry="", task_name__in=Subquery(beat_entries))
    )
    return rows.defer(*UNREAD)


def sweep_due(now: datetime, task: str | None = None) -> list[int]:
    """The ids of the schedules the sweep judges whose ``sweep_due_at`` is empty or at or
    before ``now``, in order: a range scan of its index (the schedules with nothing due
    cost nothing; :func:`sweep_page` reads the rows a page at a time)."""
    rows = _judged().filter(Q(sweep_due_at__isnull=True) | Q(sweep_due_at__lte=now))
    if task is not None:
        rows = rows.filter(task_name=task)
    with translated:
        return list(rows.order_by("id").values_list("id", flat=True))


def sweep_page(ids: Sequence[int]) -> list[TaskSchedule]:
    """The schedules of ``ids`` the sweep still judges, by id."""
    with translated:
        return list(_judged().filter(id__in=list(ids)).order_by("id"))


def judged_named(task_names: Sequence[str], *, every: bool = False) -> list[TaskSchedule]:
    """The schedules among ``task_names`` that the sweep judges, by task name (``every``:
    the removed and disabled ones too: a slot handed out before a schedule was deleted or
    disabled still has to end)."""
    found: list[TaskSchedule] = []
    every_row = TaskSchedule.objects.using(alias()).defer(*UNREAD)
    rows = every_row if every else _judged()
    with translated:
        for start in range(0, len(task_names), 500):
            part = list(task_names[start : start + 500])
            found += rows.filter(task_name__in=part).order_by("task_name")
    return found


def mark_swept_many(marks: Sequence[tuple[TaskSchedule, datetime | None, datetime]]) -> None:
    """For each ``(row, until, due)``: the sweep checked ``row``'s slots up to ``until``
    (None: it judged none; never moves back) and next needs to look at it at ``due``, kept
    only if the row is still as the sweep read it (its ``version``, and its
    ``sweep_due_at``, which every writer of its slots empties): else it stays empty, "look
    next time".

    One statement per group of rows with the same values (10,000 schedules of one cron
    swept to the same slot: one), of at most :data:`MARKS_PER_STATEMENT` rows where the
    database limits parameters."""
    if not marks:
        return
    d = dialect()
    if d.marks_in_one_statement:
        params: list[Any] = [
            [row.id for row, _, _ in marks],
            [until for _, until, _ in marks],
            [due for _, _, due in marks],
            [row.version for row, _, _ in marks],
            [row.sweep_due_at for row, _, _ in marks],
        ]
        with translated, connections[alias()].cursor() as cursor:
            cursor.execute(d.mark_swept_many, params)
        _remember(marks)
        return
    groups: dict[tuple[datetime | None, datetime, int, datetime | None], list[int]] = {}
    for row, until, due in marks:
        groups.setdefault((until, due, row.version, row.sweep_due_at), []).append(row.id)
    rows = TaskSchedule.objects.using(alias())
    most = connections[alias()].features.max_query_params
    with translated:
        for (until, due, version, read), ids in groups.items():
            step = len(ids) if most is None else MARKS_PER_STATEMENT
            for start in range(0, len(ids), step):
                part = rows.filter(id__in=ids[start : start + step])
                unchanged = Q(version=version) & (
                    Q(sweep_due_at__isnull=True) if read is None else Q(sweep_due_at=read)
                )
                swept = (
                    {"swept_until": Greatest(Coalesce(F("swept_until"), _at(until)), _at(until))}
                    if until is not None
                    else {}
                )
                part.update(
                    sweep_due_at=Case(
                        When(unchanged, then=_at(due)),
                        default=Value(None),
                        output_field=DateTimeField(),
                    ),
                    **swept,
                )
    _remember(marks)


def _remember(marks: Sequence[tuple[TaskSchedule, datetime | None, datetime]]) -> None:
    """The rows as written (their next look), for the sweep's next batch of the same rows
    (if a writer emptied it meanwhile, the next batch's mark leaves it empty too)."""
    for row, _, due in marks:
        row.sweep_due_at = due


def _at(when: datetime) -> Value:
    return Value(when, output_field=DateTimeField())


# -- the history: pauses, resumes, acknowledgements, retirements ---------------------------

EVENT_BY_MAX_LENGTH = 255


def record_event(
    task_name: str,
    kind: ScheduleEventKind,
    *,
    origin: ScheduleEventOrigin,
    by: str = "",
    reason: str = "",
    until: datetime | None = None,
    at: datetime | None = None,
) -> ScheduleEvent:
    """Keep one thing done to a schedule (who, from where, when, why)."""
    event = ScheduleEvent(
        task_name=task_name,
        kind=kind,
        origin=origin,
        by=clip(by, EVENT_BY_MAX_LENGTH),
        reason=clip(reason, PAUSED_REASON_MAX_LENGTH),
        until=until,
        at=at or timezone.now(),
    )
    with translated:
        event.save(using=alias())
    return event


def events(task_name: str, limit: int = 100) -> list[ScheduleEvent]:
    """``task_name``'s latest events, newest first."""
    with translated:
        found = ScheduleEvent.objects.using(alias()).filter(task_name=task_name)
        return list(found.order_by("-at", "-id")[:limit])


def latest_events(
    kind: ScheduleEventKind, task_names: Collection[str] | None = None
) -> dict[str, ScheduleEvent]:
    """Each task's newest ``kind`` event (of ``task_names`` only, when given: an admin page's
    rows), in one statement whatever the number of tasks."""
    if task_names is not None and not task_names:
        return {}
    events = ScheduleEvent.objects.using(alias()).filter(kind=kind)
    newest = events.filter(task_name=OuterRef("task_name")).order_by("-at", "-id").values("id")
    found = events.filter(id=Subquery(newest[:1]))
    if task_names is not None:
        found = found.filter(task_name__in=list(task_names))
    with translated:
        return {event.task_name: event for event in found}


def histories(task_names: Sequence[str], per_task: int) -> dict[str, list[ScheduleEvent]]:
    """Each named task's latest ``per_task`` events, newest first: one statement per 500
    tasks, numbering each task's events newest first (a window function) so that a task
    with a long history reads no more than ``per_task`` of them."""
    found: dict[str, list[ScheduleEvent]] = {name: [] for name in task_names}
    newest_first = [F("at").desc(), F("id").desc()]
    number = Window(RowNumber(), partition_by=[F("task_name")], order_by=newest_first)
    with translated:
        for start in range(0, len(task_names), 500):
            part = list(task_names[start : start + 500])
            events_of = ScheduleEvent.objects.using(alias()).filter(task_name__in=part)
            latest = events_of.annotate(number=number).filter(number__lte=per_task)
            for event in latest.order_by("task_name", "number"):
                found[event.task_name].append(event)
    return found


def acknowledge(task_name: str, until: datetime) -> bool:
    """Mark the problems of ``task_name``'s slots at or before ``until`` acknowledged (never
    moves back); False when the schedule is unknown. The caller records the event."""
    queryset = TaskSchedule.objects.using(alias()).filter(task_name=task_name)
    with translated:
        if not queryset.exists():
            return False
        queryset.filter(
            Q(acknowledged_until__isnull=True) | Q(acknowledged_until__lt=until)
        ).update(acknowledged_until=until)
    return True


def mark_removed(
    declared: Collection[str],
    sources: Collection[str],
    now: datetime,
    *,
    entry: str | None = None,
) -> list[str]:
    """Schedules of ``sources`` not in ``declared`` are marked removed (from ``now``); those
    in it are declared again. Returns the names newly marked. ``entry=""`` limits it to the
    rows that are not beat entries (what the code declares, not what a beat does)."""
    rows = TaskSchedule.objects.using(alias()).filter(source__in=list(sources))
    if entry is not None:
        rows = rows.filter(entry=entry)
    return _mark(rows, declared, now)


def _mark(rows: QuerySet[TaskSchedule], declared: Collection[str], now: datetime) -> list[str]:
    """Among ``rows``, mark removed those not in ``declared`` and declare again those in it;
    the names newly marked."""
    with translated:
        gone = [
            name
            for name in rows.filter(removed_at__isnull=True).values_list("task_name", flat=True)
            if name not in declared
        ]
        back = [
            name
            for name in rows.filter(removed_at__isnull=False).values_list("task_name", flat=True)
            if name in declared
        ]
        for start in range(0, len(gone), 500):
            rows.filter(task_name__in=gone[start : start + 500]).update(removed_at=now)
        for start in range(0, len(back), 500):
            rows.filter(task_name__in=back[start : start + 500]).update(
                removed_at=None, sweep_due_at=None
            )
    return gone


def retire(task_name: str) -> bool:
    """Delete a removed schedule's row (its runs and its events stay); False when unknown,
    declared again (a sync may have declared it since the admin's page was drawn), or
    still owing the sweep slots before its deletion (``owed_due_at``: retire it after)."""
    rows = TaskSchedule.objects.using(alias()).filter(
        task_name=task_name, removed_at__isnull=False, owed_due_at__isnull=True
    )
    with translated:
        deleted, _ = rows.delete()
    return bool(deleted)


# -- beat entries: kept in step by taskguard's beat schedulers ------------------------------


def mark_entries_removed(declared_in: str, declared: Collection[str], now: datetime) -> list[str]:
    """Beat entries of one scheduler kind (``declared_in``: ``CELERY_BEAT_SCHEDULE`` or
    ``django-celery-beat``) not in ``declared`` are marked removed (from ``now``); those in
    it are declared again. Function schedules are never touched. Returns the names newly
    marked."""
    rows = TaskSchedule.objects.using(alias()).filter(
        source=ScheduleSource.CELERY, declared_in=declared_in
    )
    return _mark(rows.exclude(entry=""), declared, now)


def watched(rows: Sequence[TaskSchedule]) -> list[TaskSchedule]:
    """The schedules among ``rows`` that the sweep and health judge: not removed, not a
    disabled data schedule (nothing fires it), and not the own schedule of a Celery task
    that beat entries fire (a beat stamps every message with its entry, so the runs are
    recorded as ``task[entry]``, never under the plain Celery task name: that row has no
    slot of its own to miss)."""
    live = [row for row in rows if row.removed_at is None and row.enabled]
    beaten = {row.function for row in live if row.source == ScheduleSource.CELERY and row.entry}
    return [
        row
        for row in live
        if row.entry or row.source != ScheduleSource.CELERY or row.task_name not in beaten
    ]


# -- data schedules: defined in the admin or by define_schedule -----------------------------

# What a data schedule's definition holds (``TaskSchedule`` fields), in the order its
# history lists a change; the rest of a row is the sweep's and the pause's.
DEFINITION_FIELDS = (
    "entry",
    "function",
    "target_kind",
    "cron",
    "cron_day_or",
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
# The fields that move a schedule's slots: an edit of one is judged from the edit on.
SLOT_FIELDS = ("cron", "cron_day_or", "every", "time_zone", "starts", "ends")


class NotDataSchedule(Exception):
    """The task name belongs to a schedule declared elsewhere (code, a beat)."""

    def __init__(self, row: TaskSchedule) -> None:
        self.row = row
        where = row.declared_in or row.source
        super().__init__(f"{row.task_name} is already a {row.source} schedule ({where})")


@dataclass(frozen=True)
class Defined:
    """What :func:`define` did: ``kind`` is ``created``, ``edited``, ``enabled``,
    ``disabled`` or ``unchanged``; ``row`` the schedule as saved."""

    kind: str
    row: TaskSchedule
    changes: dict[str, list[object]]


def _jsonable(value: object) -> object:
    """A definition's value as its history keeps it (JSON)."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, datetime):
        return value.isoformat()
    return value


# The grace a schedule's slots are judged by (``data_schedules.grace_of``: a data
# schedule's own, else its target's): an owed window keeps the ended definition's.
GraceOf = Callable[[TaskSchedule], timedelta]


def define(
    task_name: str,
    values: dict[str, object],
    *,
    origin: ScheduleEventOrigin,
    grace_of: GraceOf,
    by: str = "",
    reason: str = "",
    first_seen: datetime | None = None,
    adopt: Collection[str] = (),
) -> Defined:
    """Create or update the data schedule ``task_name`` with ``values`` (every field of
    :data:`DEFINITION_FIELDS`) and keep the change in its history, in one transaction.

    Each change bumps ``version`` and ``changed_at`` (the database's clock: what the
    schedulers poll); a change of its slots (:data:`SLOT_FIELDS`) or a re-enable marks it
    swept up to now, so that the slots the old definition (or the pause of a disabled one)
    never fired are not recorded missed. A deleted schedule defined again is revived, its
    version going on. ``first_seen``: no slot before it fires (an import keeps the last run
    of the schedule it replaces). ``grace_of``: the grace the definition before followed
    (its owed window is judged by it). ``adopt``: the ``declared_in`` of other schedules this
    one may take over (an imported django-celery-beat entry's row; its runs are the same).
    Raises :class:`NotDataSchedule` when a schedule of another kind has the name."""
    try:
        return _define(task_name, values, origin, grace_of, by, reason, first_seen, adopt)
    except BackendUnavailable as exc:
        if not isinstance(exc.__cause__, IntegrityError):
            raise
        # Another process created the same schedule between our read and our insert:
        # ours is then an edit of theirs (the row exists now, and is locked in turn).
        return _define(task_name, values, origin, grace_of, by, reason, first_seen, adopt)


def _define(
    task_name: str,
    values: dict[str, object],
    origin: ScheduleEventOrigin,
    grace_of: GraceOf,
    by: str,
    reason: str,
    first_seen: datetime | None,
    adopt: Collection[str],
) -> Defined:
    rows = TaskSchedule.objects.using(alias())
    with translated, transaction.atomic(using=alias()):
        _write_first(rows.filter(task_name=task_name))
        row = rows.select_for_update().filter(task_name=task_name).first()
        now = timezone.now()
        # The change's instant by the database's clock, read under the row's lock: its
        # ``changed_at`` (what the schedulers take as the edit), and where the sweep stops
        # judging the old definition and starts the new one.
        changed = database_now()
        if row is not None and row.source != ScheduleSource.DATA:
            if row.declared_in not in adopt:
                raise NotDataSchedule(row)
            row.source = ScheduleSource.DATA
            row.declared_in = ""
            row.removed_at = None
            row.version = _last_version(task_name)
            kind = ScheduleEventKind.CREATED
            changes = _created(values)
        elif row is None or row.removed_at is not None:
            kind = ScheduleEventKind.CREATED
            changes = _created(values)
            if row is None:
                row = TaskSchedule(
                    task_name=task_name,
                    source=ScheduleSource.DATA,
                    first_seen=first_seen or now,
                    last_seen=now,
                    swept_until=None,
                    # A retired schedule's name defined again: its versions go on, so that
                    # no copy takes the new definition for one it has applied already.
                    version=_last_version(task_name),
                    **{name: values[name] for name in DEFINITION_FIELDS},
                )
            else:
                row.removed_at = None
                row.first_seen = first_seen or changed
                row.swept_until = changed
        else:
            changes = _edits(row, values)
            if not changes:
                return Defined("unchanged", row, {})
            if set(changes) == {"enabled"}:
                kind = (
                    ScheduleEventKind.ENABLED if values["enabled"] else ScheduleEventKind.DISABLED
                )
            else:
                kind = ScheduleEventKind.EDITED
            if any(name in changes for name in SLOT_FIELDS) or not values["enabled"]:
                # The definition judged until now ends here: its slots the sweep has not
                # judged yet are owed (ledger/owed.py); the new one is judged from here.
                owed.owe(row, zone_of(row), grace_of(row), changed)
            if any(name in changes for name in SLOT_FIELDS) or (
                "enabled" in changes and values["enabled"]
            ):
                mark = row.swept_until
                row.swept_until = changed if mark is None else max(mark, changed)
                # Its slots count from now: health does not wait for a slot of the new
                # definition from before the edit (never fired, by design).
                row.first_seen = max(row.first_seen, changed)
        row.sweep_due_at = None  # its slots or its mark may have moved: the sweep looks next time
        for name in DEFINITION_FIELDS:
            setattr(row, name, values[name])
        row.version += 1
        row.last_seen = now
        row.changed_at = changed
        row.save(using=alias())
        ScheduleEvent(
            task_name=task_name,
            kind=kind,
            origin=origin,
            by=clip(by, EVENT_BY_MAX_LENGTH),
            reason=clip(reason, PAUSED_REASON_MAX_LENGTH),
            # The change's time by the database's clock (its ``changed_at``): the history
            # says which version was in effect at each slot (:func:`timeline`).
            at=changed,
            version=row.version,
            changes=changes,
        ).save(using=alias())
    return Defined(str(kind), row, changes)


def define_many(
    definitions: Sequence[tuple[str, dict[str, object]]],
    *,
    origin: ScheduleEventOrigin,
    grace_of: GraceOf,
    by: str = "",
    reason: str = "",
) -> int:
    """Create many new data schedules at once (``(task_name, values)`` each, as
    :func:`define` takes them): a statement per 500 rows and per 500 ``created`` events,
    instead of :func:`define`'s transaction each. A name that has a row already (a live,
    deleted or other schedule) goes through :func:`define` (an update, a revival, or
    :class:`NotDataSchedule`). Returns how many were created in bulk."""
    rows = TaskSchedule.objects.using(alias())
    names = [name for name, _ in definitions]
    with translated:
        taken: set[str] = set()
        for start in range(0, len(names), 500):
            part = names[start : start + 500]
            taken.update(rows.filter(task_name__in=part).values_list("task_name", flat=True))
    fresh = [(name, values) for name, values in definitions if name not in taken]
    # A name retired before goes on from its history's newest version.
    versions: dict[str, int] = {}
    with translated:
        for start in range(0, len(fresh), 500):
            part = [name for name, _ in fresh[start : start + 500]]
            found = ScheduleEvent.objects.using(alias()).filter(task_name__in=part)
            newest = found.values("task_name").annotate(newest=Max("version")).order_by()
            versions.update((got["task_name"], int(got["newest"] or 0)) for got in newest)
    for name, values in definitions:
        if name in taken:
            define(name, values, origin=origin, grace_of=grace_of, by=by, reason=reason)
    now = timezone.now()
    changed_at = database_now()
    new = [
        TaskSchedule(
            task_name=name,
            source=ScheduleSource.DATA,
            first_seen=now,
            last_seen=now,
            version=versions.get(name, 0) + 1,
            changed_at=changed_at,
            **{field: values[field] for field in DEFINITION_FIELDS},
        )
        for name, values in fresh
    ]
    events = [
        ScheduleEvent(
            task_name=name,
            kind=ScheduleEventKind.CREATED,
            origin=origin,
            by=clip(by, EVENT_BY_MAX_LENGTH),
            reason=clip(reason, PAUSED_REASON_MAX_LENGTH),
            at=changed_at,
            version=versions.get(name, 0) + 1,
            changes={field: [None, _jsonable(values[field])] for field in DEFINITION_FIELDS},
        )
        for name, values in fresh
    ]
    with translated, transaction.atomic(using=alias()):
        rows.bulk_create(new, batch_size=500)
        ScheduleEvent.objects.using(alias()).bulk_create(events, batch_size=500)
    return len(new)


def _last_version(task_name: str) -> int:
    """The newest version ``task_name``'s history records (0: none)."""
    events = ScheduleEvent.objects.using(alias()).filter(task_name=task_name)
    found = events.aggregate(newest=Max("version"))["newest"]
    return int(found or 0)


def would_define(
    task_name: str, values: dict[str, object], *, adopt: Collection[str] = ()
) -> Defined:
    """What :func:`define` would do with the same arguments, writing nothing (a dry run):
    its ``kind`` (``adopted`` for a schedule of another kind it would take over), the row
    as it is (unsaved when new) and the changes. Raises :class:`NotDataSchedule`."""
    with translated:
        row = TaskSchedule.objects.using(alias()).filter(task_name=task_name).first()
    if row is not None and row.source != ScheduleSource.DATA:
        if row.declared_in not in adopt:
            raise NotDataSchedule(row)
        return Defined("adopted", row, _created(values))
    if row is None or row.removed_at is not None:
        return Defined("created", row or TaskSchedule(task_name=task_name), _created(values))
    changes = _edits(row, values)
    if not changes:
        return Defined("unchanged", row, {})
    if set(changes) == {"enabled"}:
        return Defined("enabled" if values["enabled"] else "disabled", row, changes)
    return Defined("edited", row, changes)


def _created(values: dict[str, object]) -> dict[str, list[object]]:
    return {name: [None, _jsonable(values[name])] for name in DEFINITION_FIELDS}


def _edits(row: TaskSchedule, values: dict[str, object]) -> dict[str, list[object]]:
    return {
        name: [_jsonable(getattr(row, name)), _jsonable(values[name])]
        for name in DEFINITION_FIELDS
        if getattr(row, name) != values[name]
    }


def _write_first(rows: QuerySet[TaskSchedule]) -> None:
    """On SQLite, take the database's write lock before the read (a no-op update): a
    transaction that reads first and then writes is refused at once ("database is
    locked") when another writer holds it, instead of waiting out the busy timeout.
    Elsewhere ``select_for_update`` locks the row."""
    if connections[alias()].vendor == "sqlite":
        rows.update(version=F("version"))


def delete_data(
    task_name: str,
    *,
    origin: ScheduleEventOrigin,
    grace_of: GraceOf,
    by: str = "",
    reason: str = "",
) -> TaskSchedule | None:
    """Delete a data schedule: it fires nothing from now on (every scheduler drops it at
    its next poll) and its row stays as a tombstone (``removed_at``, disabled, a new version)
    so that the schedulers see the deletion; its runs and history stay. Retiring the
    removed schedule deletes the row. None: no such live data schedule."""
    rows = TaskSchedule.objects.using(alias()).filter(
        task_name=task_name, source=ScheduleSource.DATA, removed_at__isnull=True
    )
    with translated, transaction.atomic(using=alias()):
        _write_first(rows)
        row = rows.select_for_update().first()
        if row is None:
            return None
        now = timezone.now()
        changed = database_now()  # as in _define
        owed.owe(row, zone_of(row), grace_of(row), changed)
        # Kept so that the history says whether the version before was enabled.
        changes = {"enabled": [True, False]} if row.enabled else {}
        row.removed_at = now
        row.enabled = False
        row.version += 1
        row.changed_at = changed
        row.save(using=alias())
        ScheduleEvent(
            task_name=task_name,
            kind=ScheduleEventKind.DELETED,
            origin=origin,
            by=clip(by, EVENT_BY_MAX_LENGTH),
            reason=clip(reason, PAUSED_REASON_MAX_LENGTH),
            at=changed,
            version=row.version,
            changes=changes,
        ).save(using=alias())
    return row


def data_schedules(target_kinds: Collection[str] | None = None) -> QuerySet[TaskSchedule]:
    """The data schedules (deleted ones too: their tombstones), of ``target_kinds`` when
    given; a queryset the caller narrows and runs under :data:`translated`."""
    rows = TaskSchedule.objects.using(alias()).filter(source=ScheduleSource.DATA)
    if target_kinds is not None:
        rows = rows.filter(target_kind__in=list(target_kinds))
    return rows


@dataclass(frozen=True)
class DataTarget:
    """A target of live, enabled data schedules: how many, and what those following its
    policy (their catch-up or grace left empty) would need of it."""

    target: str
    kind: str
    schedules: int
    following_catchup: int  # schedules whose catch-up is the target's
    longest_jitter: timedelta | None  # the longest jitter of those following its grace


def data_targets(limit: int) -> list[DataTarget]:
    """The targets of the live, enabled data schedules, at most ``limit`` (one grouped
    query, whatever the schedules)."""
    rows = data_schedules().filter(removed_at__isnull=True, enabled=True)
    grouped = rows.values("function", "target_kind").annotate(
        schedules=Count("pk"),
        following_catchup=Count("pk", filter=Q(catchup="")),
        longest_jitter=Max("jitter", filter=Q(grace__isnull=True)),
    )
    with translated:
        return [
            DataTarget(
                found["function"],
                found["target_kind"],
                found["schedules"],
                found["following_catchup"],
                found["longest_jitter"],
            )
            for found in grouped.order_by("function", "target_kind")[:limit]
        ]


def data_schedule_names(target: str, target_kind: str, limit: int) -> list[str]:
    """The names (``entry``) of at most ``limit`` live, enabled data schedules of ``target``
    (of that kind), in order."""
    rows = data_schedules().filter(
        removed_at__isnull=True, enabled=True, function=target, target_kind=target_kind
    )
    with translated:
        return list(rows.order_by("entry").values_list("entry", flat=True)[:limit])


def data_following(
    target: str, target_kind: str, limit: int, *, grace_below: timedelta, catchup: bool
) -> tuple[int, list[str]]:
    """The live, enabled data schedules of ``target`` (of that kind) that follow a value of its
    policy their definition cannot have: its grace when their jitter is ``grace_below`` or
    longer, its catch-up (when ``catchup``: a Celery target's ``all``). How many, and the
    names of at most ``limit``, in order."""
    wrong = Q(grace__isnull=True, jitter__gte=grace_below)
    if catchup:
        wrong |= Q(catchup="")
    rows = data_schedules().filter(
        wrong, removed_at__isnull=True, enabled=True, function=target, target_kind=target_kind
    )
    with translated:
        return rows.count(), list(rows.order_by("entry").values_list("entry", flat=True)[:limit])


def data_changed_since(
    since: datetime, target_kinds: Collection[str] | None = None, *, light: bool = False
) -> list[TaskSchedule]:
    """The data schedules changed (created, edited, deleted) at or after ``since`` by the
    database's clock (indexed: the cost does not grow with the schedules that did not
    change). ``light``: without their arguments and description (up to 64 KB each; read
    when due: :func:`data_rows`)."""
    rows = data_schedules(target_kinds).filter(changed_at__gte=since)
    if light:
        rows = rows.defer(*UNREAD)
    with translated:
        return list(rows.order_by("id"))


# Read by run_schedules when a data schedule falls due: what it runs with, at most this
# many schedules per query.
READ_CHUNK = 1_000


def live_data(
    target_kinds: Collection[str], names: Collection[str] | None = None
) -> Iterator[TaskSchedule]:
    """The enabled, not deleted data schedules of ``target_kinds`` (of ``names`` when given),
    without their arguments and description (read when due: :func:`data_rows`)."""
    rows = data_schedules(target_kinds).filter(removed_at__isnull=True, enabled=True)
    if names is not None:
        rows = rows.filter(task_name__in=list(names))
    with translated:
        yield from (rows.defer(*UNREAD).order_by("id").iterator(chunk_size=READ_CHUNK))


def data_rows(task_names: Collection[str]) -> dict[str, TaskSchedule]:
    """The data schedules named ``task_names`` as they are now (their arguments, their
    version), in one query per :data:`READ_CHUNK` names."""
    names = sorted(set(task_names))
    found: dict[str, TaskSchedule] = {}
    with translated:
        for start in range(0, len(names), READ_CHUNK):
            chunk = names[start : start + READ_CHUNK]
            for row in data_schedules().filter(task_name__in=chunk):
                found[row.task_name] = row
    return found


def arguments_at(row: TaskSchedule, version: int) -> tuple[list[object], dict[str, object]]:
    """The arguments (``args``, ``kwargs``) the data schedule ``row`` had at ``version``: its
    current ones with the edits after ``version`` undone, from its history (a slot the old
    definition owed runs with what it said)."""
    args: list[object] = list(row.args)
    kwargs: dict[str, object] = dict(row.kwargs)
    later = ScheduleEvent.objects.using(alias()).filter(
        task_name=row.task_name, version__gt=version, version__lte=row.version
    )
    with translated:
        for changes in later.order_by("-version", "-id").values_list("changes", flat=True):
            # A creation (a deleted schedule's name defined again) says nothing before it.
            if "args" in changes and changes["args"][0] is not None:
                args = list(changes["args"][0])
            if "kwargs" in changes and changes["kwargs"][0] is not None:
                kwargs = dict(changes["kwargs"][0])
    return args, kwargs


# -- a data schedule's versions: which definition was in effect at a slot ----------------

_DURATIONS = ("every", "grace", "jitter", "late_after")
_MOMENTS = ("starts", "ends")


def _from_json(name: str, value: object) -> object:
    """A definition's value as :func:`_jsonable` kept it in the history, read back."""
    if value is None:
        return None
    if name in _DURATIONS:
        return timedelta(seconds=float(value))  # type: ignore[arg-type]
    if name in _MOMENTS:
        return datetime.fromisoformat(str(value))
    return value


@dataclass(frozen=True)
class Version:
    """One saved version of a data schedule: its definition (``values``, every field of
    :data:`DEFINITION_FIELDS`), in effect for the slots after ``since`` (its change's time
    by the database's clock, its ``changed_at``) up to the next version's; ``live``: not
    deleted (nor before a deleted schedule's name was defined again)."""

    number: int
    since: datetime | None
    values: dict[str, Any]
    live: bool

    @property
    def fires(self) -> bool:
        """Whether anything fired its slots (live and enabled)."""
        return self.live and bool(self.values["enabled"])

    def row(self, current: TaskSchedule) -> TaskSchedule:
        """``current`` (the schedule's row as it is now) as it was at this version: an
        unsaved copy, what a scheduler builds a definition from."""
        copy = copy_of(current)
        for name, value in self.values.items():
            setattr(copy, name, value)
        copy.version = self.number
        copy.changed_at = self.since
        if self.live:
            copy.removed_at = None
        else:
            copy.enabled = False
            copy.removed_at = current.removed_at or self.since or current.changed_at
        return copy


@dataclass(frozen=True)
class Timeline:
    """The versions of one data schedule in effect from some moment on, oldest first: which
    definition a slot belongs to. A slot at or before a change's instant is the version
    before's (as the owed windows and a moving edit have it); the oldest version read covers
    every earlier slot (the schedulers' floors, ``first_seen`` and ``swept_until``, say
    where its slots begin)."""

    task_name: str
    versions: tuple[Version, ...]
    default_zone: str
    read_from: datetime  # the versions in effect from this moment on were read

    def at(self, slot: datetime) -> Version:
        """The version in effect at ``slot``."""
        for version in reversed(self.versions):
            if version.since is None or version.since < slot:
                return version
        return self.versions[0]

    def fires(self, slot: datetime) -> Version | None:
        """The version in effect at ``slot`` if it had that slot (enabled, live, within its
        ``starts``/``ends``, one of its cron's or interval's slots), else None."""
        version = self.at(slot)
        if not version.fires:
            return None
        values = version.values
        if (values["starts"] is not None and slot < values["starts"]) or (
            values["ends"] is not None and slot > values["ends"]
        ):
            return None
        schedule = self._schedule(version)
        if schedule is None or schedule.latest_slot(slot) != slot:
            return None
        return version

    def spans(self, after: datetime, until: datetime) -> list[Span]:
        """The versions that fired in ``(after, until]``, each with its schedule and the
        part of that window it was in effect for, oldest first."""
        found: list[Span] = []
        for index, version in enumerate(self.versions):
            following = self.versions[index + 1].since if index + 1 < len(self.versions) else None
            # The oldest version read covers every earlier slot (as :meth:`at` has it).
            start = after if index == 0 or version.since is None else max(after, version.since)
            end = until if following is None else min(until, following)
            if not version.fires or end <= start:
                continue
            schedule = self._schedule(version)
            if schedule is not None:
                found.append(Span(version, schedule, start, end))
        return found

    def _schedule(self, version: Version) -> StoredSchedule | None:
        values = version.values
        zone = values["time_zone"] or (self.default_zone if values["cron"] else "")
        try:
            return rebuild(values["cron"] or "", bool(values["cron_day_or"]), zone, values["every"])
        except Exception:  # a zone this process lacks: its slots cannot be told here
            return None


@dataclass(frozen=True)
class Span:
    """A version of a data schedule in effect over ``(start, end]``, and its slots."""

    version: Version
    schedule: StoredSchedule
    start: datetime
    end: datetime

    def in_window(self, slot: datetime) -> bool:
        """``slot`` is within the version's ``starts``/``ends``."""
        starts, ends = self.version.values["starts"], self.version.values["ends"]
        return (starts is None or slot >= starts) and (ends is None or slot <= ends)


def timeline(row: TaskSchedule, since: datetime) -> Timeline:
    """The versions of the data schedule ``row`` (as it is now) in effect at ``since`` and
    after, from its history: each older one is the newer with the changes its event keeps
    undone (one statement, read newest first until the version in effect at ``since``).

    A history that stops short (a creation: nothing before it; a missing event) ends the
    read: the oldest version found covers every earlier slot, except a deleted schedule's
    name defined again, before which nothing fired (a version that does not fire)."""
    if set(DEFINITION_FIELDS) & row.get_deferred_fields():  # a poll's light row
        with translated:
            row = TaskSchedule.objects.using(alias()).get(pk=row.pk)
    current = Version(
        row.version,
        row.changed_at,
        {name: getattr(row, name) for name in DEFINITION_FIELDS},
        row.removed_at is None,
    )
    found: list[Version] = []
    events = ScheduleEvent.objects.using(alias()).filter(
        task_name=row.task_name, version__isnull=False, version__lte=row.version
    )
    with translated:
        for event in events.order_by("-version", "-id").iterator(chunk_size=50):
            if event.version != current.number:
                break  # a version without its event: nothing is known before it
            if current.since is None:  # an older version's: its own event's time
                current = replace(current, since=event.at)
            assert current.since is not None
            if current.since < since:
                break  # in effect at ``since``: nothing older matters
            if event.kind == ScheduleEventKind.CREATED:
                if event.version > 1:  # a deleted (or other) schedule's name: none before
                    found.append(current)
                    current = Version(event.version - 1, None, dict(current.values), False)
                break
            before = dict(current.values)
            changes = event.changes if isinstance(event.changes, dict) else {}
            for name, pair in changes.items():
                if name in before and isinstance(pair, list) and len(pair) == 2:
                    before[name] = _from_json(name, pair[0])
            live = current.live or event.kind == ScheduleEventKind.DELETED
            found.append(current)
            # The older version's change time is its own event's (the next one read).
            current = Version(event.version - 1, None, before, live)
    found.append(current)
    found.reverse()
    return Timeline(row.task_name, tuple(found), row.default_zone, since)


def live_data_names(target_kinds: Collection[str], names: Collection[str]) -> list[str]:
    """Which of ``names`` are live data schedules of ``target_kinds``."""
    rows = data_schedules(target_kinds).filter(removed_at__isnull=True, task_name__in=list(names))
    with translated:
        return list(rows.values_list("task_name", flat=True))
