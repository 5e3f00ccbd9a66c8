"""Data schedules of Celery tasks, fired by taskguard's beat schedulers (no django-celery-beat).

Both ``TaskguardScheduler`` and ``TaskguardDatabaseScheduler`` mix in
:class:`DataSchedulesMixin`: when the beat starts it reads every live, enabled data schedule
whose target is a Celery task into a beat entry (:class:`DataEntry`), kept in the beat's
schedule under a key of its own (:data:`KEY_PREFIX` and the schedule's task name, so that a
settings entry of the same name is another entry). Each message carries the beat's headers:
``taskguard_slot`` (the nominal slot, jitter or not), ``taskguard_schedule`` (the data
schedule's name: the worker records ``target[name]``) and ``taskguard_version``.

From then on the beat asks the database every :data:`POLL_SECONDS` which data schedules
changed (re-reading :data:`POLL_OVERLAP`, and every one every :data:`RELOAD_SECONDS`) and
applies them by version (docs/celery.md, "Data schedules with Celery beat"):

- created, or enabled again: no slot before that (``first_seen``, or the mark the change
  set in ``swept_until``) is sent; those due since then (within the grace) are sent at the
  poll;
- an edit that moves the slots (cron, interval, zone, starts, ends): the old schedule's
  slots due by the edit and not sent yet are sent; then the new schedule's slots after the
  edit only;
- an edit that keeps them: the next slot is sent with the new arguments;
- disabled, deleted, or no longer a Celery task: nothing more is sent.

A database error never stops the beat: it is logged and the read is tried again later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from datetime import datetime, timedelta
from typing import Any, cast

from celery.beat import ScheduleEntry
from celery.schedules import BaseSchedule, schedstate
from django.utils import timezone

from ... import data_schedules, ledger
from ...ledger import schedules as store
from ...ledger.core import translated
from ...logfields import log_fields
from ...models import Catchup, TargetKind, TaskSchedule
from ...policy import Policy
from ...schedules import StoredSchedule, rebuild
from .headers import (
    GRACE_HEADER,
    SCHEDULE_HEADER,
    UTC,
    VERSION_HEADER,
)

# How often a beat asks the database which data schedules changed (seconds).
POLL_SECONDS = 2.0
# Each poll reads again the changes of the last minute: a change committed after a later
# one (a long transaction) or stamped by a clock a little behind is still seen.
POLL_OVERLAP = timedelta(seconds=60)
# Every data schedule is read again this often (a backstop for anything a poll missed).
RELOAD_SECONDS = 600.0
# A failed read is tried again this soon (seconds).
RETRY_SECONDS = 10.0
# The beat's schedule key of a data schedule's entry: no settings entry is named so.
KEY_PREFIX = "taskguard data schedule "
KINDS = (TargetKind.CELERY,)
# At most this many owed slots of one schedule are sent when a poll sees a change.
OWED_MAX = 100
# At most this many due data entries are checked against their rows in one query.
CHECK_MAX = 1_000
_HORIZON = timedelta(days=800)

logger = logging.getLogger("taskguard.celery")


class DataDue(BaseSchedule):
    """A data schedule's slots as a celery schedule: due once per slot (its own zone and DST
    rule), each sent ``offset`` (its jitter) after it, none outside ``starts``/``ends``.

    It is a taskguard ``Schedule`` too (``latest_slot``), so the beat stamps the nominal slot.
    """

    def __init__(
        self,
        stored: StoredSchedule,
        offset: timedelta = timedelta(0),
        starts: datetime | None = None,
        ends: datetime | None = None,
        app: Any = None,
    ) -> None:
        super().__init__(app=app)
        self.stored = stored
        self.offset = offset
        self.starts = starts
        self.ends = ends

    def now(self) -> datetime:
        return timezone.now()  # Django's clock, as the stamp reads it

    def latest_slot(self, now: datetime) -> datetime:
        """The newest slot whose send has come (none after ``ends``)."""
        moment = now.astimezone(UTC) - self.offset
        if self.ends is not None and moment > self.ends:
            moment = self.ends
        return self.stored.latest_slot(moment)

    def slots_between(self, start: datetime, end: datetime, limit: int) -> list[datetime]:
        return self.stored.slots_between(start, end, limit)

    def count_between(self, start: datetime, end: datetime, cap: int) -> int:
        return self.stored.count_between(start, end, cap)

    def in_window(self, slot: datetime) -> bool:
        """``slot`` is within ``starts``/``ends``."""
        return (self.starts is None or slot >= self.starts) and (
            self.ends is None or slot <= self.ends
        )

    def owed(self, after: datetime, until: datetime) -> list[datetime]:
        """The slots in ``(after, until]`` within the window (at most :data:`OWED_MAX`)."""
        if until <= after:
            return []
        slots = self.stored.slots_between(after, until, OWED_MAX)
        return [slot for slot in slots if self.in_window(slot)]

    def is_due(self, last_run_at: datetime) -> schedstate:
        now = timezone.now()
        slot = self.latest_slot(now)
        due = last_run_at.astimezone(UTC) < slot and self.in_window(slot)
        moment = now - self.offset
        ahead = self.stored.slots_between(moment, moment + _HORIZON, 1)
        if not ahead or (self.ends is not None and ahead[0] > self.ends):
            return schedstate(is_due=due, next=3600.0)
        return schedstate(is_due=due, next=max((ahead[0] - moment).total_seconds(), 0.0))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DataDue):
            return NotImplemented
        return self._slots() == other._slots()

    def __hash__(self) -> int:
        return hash(self._slots())

    def _slots(self) -> tuple[Any, ...]:
        return (self.stored, self.offset, self.starts, self.ends)

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__class__, self._slots()

    def __repr__(self) -> str:
        return f"<data schedule {self.stored!r} +{self.offset}>"


class DataEntry(ScheduleEntry):
    """A data schedule's beat entry; its name is its key in the beat's schedule."""

    @property
    def task_name(self) -> str:
        """The name its runs are recorded under (``target[name]``)."""
        return str(self.name)[len(KEY_PREFIX) :]

    @property
    def schedule_name(self) -> str:
        return str(self._headers()[SCHEDULE_HEADER])

    @property
    def version(self) -> int:
        return int(self._headers()[VERSION_HEADER])

    @property
    def key(self) -> str:
        return str(self.name)

    @property
    def sent_at(self) -> datetime:
        """When its last slot was sent (or the floor it was built with)."""
        last = self.last_run_at
        assert last is not None
        return last

    def _headers(self) -> dict[str, Any]:
        headers: dict[str, Any] = (self.options or {})["headers"]
        return headers

    def save(self) -> None:
        """Nothing to save (django-celery-beat's scheduler saves the entries it sent)."""


def schedule_of(row: TaskSchedule) -> DataDue:
    """The celery schedule of the data schedule ``row``."""
    stored = rebuild(row.cron, row.cron_day_or, store.zone_of(row), row.every)
    offset = data_schedules.jitter_offset(row.task_name, row.jitter)
    return DataDue(stored, offset, row.starts, row.ends)


def entry_of(
    row: TaskSchedule,
    last_run_at: datetime,
    app: Any = None,
    policies: dict[str, Policy] | None = None,
) -> DataEntry:
    """The beat entry of the data schedule ``row``, last sent at ``last_run_at``
    (``policies``: the targets' looked up already, by name)."""
    headers: dict[str, Any] = {SCHEDULE_HEADER: row.entry, VERSION_HEADER: row.version}
    # An empty catch-up or grace: the target's, as found here.
    followed = data_schedules.followed(row, policies)
    if followed.catchup == Catchup.NONE:
        # catchup="none": a message later than the grace is recorded missed by the worker.
        headers[GRACE_HEADER] = followed.grace.total_seconds()
    return DataEntry(
        name=KEY_PREFIX + row.task_name,
        task=row.function,
        last_run_at=last_run_at,
        schedule=schedule_of(row),
        args=tuple(row.args),
        kwargs=dict(row.kwargs),
        options={"headers": headers},
        app=app,
    )


def floor_of(row: TaskSchedule) -> datetime:
    """No slot at or before this is sent: the schedule's creation, or the mark its last
    re-enable or slot-moving edit set (``swept_until``)."""
    return max(row.first_seen, row.swept_until or row.first_seen)


def skipped(row: TaskSchedule, known: DataEntry | None) -> bool:
    """Whether ``row`` is more than one version newer than the entry this beat has (it
    never saw the versions between)."""
    return known is not None and row.changed_at is not None and row.version > known.version + 1


class DataSchedules:
    """The data schedule entries of one beat, kept in step with the database."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.entries: dict[str, DataEntry] = {}  # by key
        self.cursor: datetime | None = None
        self.next_poll = 0.0
        self.next_reload = 0.0
        self.warned: set[str] = set()
        # Slots a change owes (sent at once): an entry and the slot to stamp it with.
        self.owed: list[tuple[DataEntry, datetime]] = []
        # The rows read at send time, by key (None: no row), until the next poll.
        self.checked: dict[str, TaskSchedule | None] = {}
        # The targets' policies, by name (what a schedule's empty fields follow): each
        # looked up once per poll, whatever its schedules.
        self.policies: dict[str, Policy] = {}

    def take_owed(self) -> list[tuple[DataEntry, datetime]]:
        owed, self.owed = self.owed, []
        return owed

    def due_in(self) -> float:
        return max(self.next_poll - time.monotonic(), 0.0)

    def refresh(self) -> tuple[list[DataEntry], list[str]] | None:
        """Read what changed (everything at a full reload) when it is time; return the
        entries to put in the schedule and the keys to take out (None: nothing to do)."""
        clock = time.monotonic()
        if clock < self.next_poll:
            return None
        full = self.cursor is None or clock >= self.next_reload
        try:
            # The cursor is the database's clock, the one that stamps changed_at (a beat's
            # own clock ahead would miss every change until the next reload).
            started = ledger.database_now()
            if full:
                with translated:
                    rows = list(store.data_schedules(KINDS).filter(removed_at__isnull=True))
            else:
                assert self.cursor is not None
                rows = store.data_changed_since(self.cursor - POLL_OVERLAP)
        except Exception:
            self.next_poll = clock + RETRY_SECONDS
            logger.exception(
                "taskguard beat could not read the data schedules; trying again in %g s",
                RETRY_SECONDS,
                extra=log_fields("beat.data_read_failed"),
            )
            return None
        self.next_poll = clock + POLL_SECONDS
        self.checked = {}
        self.policies = {}
        if full:
            self.next_reload = clock + RELOAD_SECONDS
        self.cursor = started
        return self.apply(rows, full=full)

    def apply(
        self, rows: list[TaskSchedule], *, full: bool = False
    ) -> tuple[list[DataEntry], list[str]]:
        """Take in ``rows`` (newer versions than this beat has; ``full``: every live one,
        the others are gone)."""
        put: list[DataEntry] = []
        gone: list[str] = []
        seen: set[str] = set()
        for row in rows:
            key = KEY_PREFIX + row.task_name
            seen.add(key)
            known = self.entries.get(key)
            if known is not None and row.version <= known.version:
                continue
            if row.removed_at is not None or not row.enabled or row.target_kind not in KINDS:
                if self.entries.pop(key, None) is not None:
                    gone.append(key)
                continue
            try:
                entry = self._entry(row, known)
                if not full:
                    now = timezone.now()
                    self.owed += self._owed(row, entry, known, now)
            except Exception as exc:
                self._say_once(row, f"its schedule cannot be read here ({exc})")
                if self.entries.pop(key, None) is not None:
                    gone.append(key)
                continue
            self.entries[key] = entry
            put.append(entry)
        if full:
            for key in set(self.entries) - seen:
                del self.entries[key]
                gone.append(key)
        return put, gone

    def _entry(self, row: TaskSchedule, known: DataEntry | None) -> DataEntry:
        schedule = schedule_of(row)
        floor = floor_of(row)
        if skipped(row, known):
            # Versions this beat never saw: the slots due by the latest change are owed by
            # the versions in effect at their times (:meth:`_owed`); the entry's after it.
            assert known is not None and row.changed_at is not None
            last = max(known.sent_at, floor, row.changed_at)
        elif known is not None and known.schedule == schedule:
            last = max(known.sent_at, floor)  # same slots: the next one, new arguments
        else:
            last = floor  # new, or moved: the new schedule's slots after the edit only
        return entry_of(row, last, self.app, self.policies)

    def _owed(
        self, row: TaskSchedule, entry: DataEntry, known: DataEntry | None, now: datetime
    ) -> list[tuple[DataEntry, datetime]]:
        """The slots a change seen by a poll owes, sent at once (as ``run_schedules`` does):

        - created or enabled again: those after the change and within the grace, the latest
          aside (the entry sends it), so that a one-second schedule created two seconds ago
          loses none;
        - moved: the old schedule's slots due by the edit that this beat did not send yet
          (never lost), with what they were due with; the new schedule's start after the
          edit (never early).
        """
        schedule = cast(DataDue, entry.schedule)
        if known is None:
            latest = schedule.latest_slot(now)
            grace = data_schedules.followed(row, self.policies).grace
            since = max(floor_of(row), now - grace - schedule.offset)
            return [(entry, slot) for slot in schedule.owed(since, latest) if slot != latest]
        old = cast(DataDue, known.schedule)
        if skipped(row, known):
            return self._owed_by_versions(row, known, now)
        if old == schedule:
            return []
        edit = row.changed_at or now  # (a tick's now can be older than an edit it reads)
        grace = data_schedules.followed(row, self.policies).grace
        since = max(known.sent_at, now - grace - old.offset)
        return [(known, slot) for slot in old.owed(since, old.latest_slot(edit + old.offset))]

    def _owed_by_versions(
        self, row: TaskSchedule, known: DataEntry, now: datetime
    ) -> list[tuple[DataEntry, datetime]]:
        """The slots due by ``row``'s change that this beat did not send, each owed by the
        version in effect at its time if that one (enabled) had it, sent with its entry
        (its arguments and version): a beat that was stopped, or whose polls failed,
        across several changes sends no slot of a disabled window, none that an interval
        in effect then did not have."""
        assert row.changed_at is not None
        grace = data_schedules.followed(row, self.policies).grace
        since = max(known.sent_at, now - grace - cast(DataDue, known.schedule).offset)
        history = store.timeline(row, since)
        owed: list[tuple[DataEntry, datetime]] = []
        for span in history.spans(since, row.changed_at):
            entry = entry_of(span.version.row(row), since, self.app, self.policies)
            slots = span.schedule.slots_between(span.start, span.end, OWED_MAX)
            owed += [(entry, slot) for slot in slots if span.in_window(slot)]
        return owed[-OWED_MAX:]

    def read_at_send(self, keys: Collection[str]) -> None:
        """Read the rows of ``keys`` (entries due now) as they are now, in one query."""
        names = {key: key[len(KEY_PREFIX) :] for key in keys}
        rows = store.data_rows(names.values())
        for key, name in names.items():
            self.checked[key] = rows.get(name)

    def sent(self, entry: DataEntry) -> None:
        """``entry`` is this one's next instance (its slot was sent)."""
        known = self.entries.get(entry.key)
        if known is not None and known.version == entry.version:
            self.entries[entry.key] = entry

    def _say_once(self, row: TaskSchedule, why: str) -> None:
        if row.task_name in self.warned:
            return
        self.warned.add(row.task_name)
        logger.warning(
            "taskguard beat: data schedule %s is not sent: %s",
            row.task_name,
            why,
            extra=log_fields("beat.data_not_sent", task=row.task_name, reason=why),
        )


class DataSchedulesMixin:
    """Fires the data schedules of Celery tasks (mixed in before the scheduler)."""

    app: Any

    def data_schedules(self) -> DataSchedules:
        found = self.__dict__.get("_taskguard_data")
        if found is None:
            found = self.__dict__["_taskguard_data"] = DataSchedules(self.app)
        assert isinstance(found, DataSchedules)
        return found

    def data_entries(self) -> dict[str, DataEntry]:
        """The data schedule entries, by key (a scheduler that reads its schedule again
        merges them in)."""
        return dict(self.data_schedules().entries)

    def schedule_changed_here(self) -> None:
        """Count a change of the beat's entries (data schedules put or taken out, the
        settings or django-celery-beat entries read): the next tick rebuilds its heap."""
        self.__dict__["_taskguard_changes"] = self.__dict__.get("_taskguard_changes", 0) + 1

    def schedules_equal(self, old: Any, new: Any) -> bool:
        """Celery's comparison, asked on every tick, made O(1) when nothing changed.

        Celery compares every entry of the schedule with its copy of the last tick (21 ms a
        tick with 20,000 data schedules). Equal without a look at the entries when the
        schedule is the same dict as at the last tick and :meth:`schedule_changed_here`
        was not called since; otherwise (a new dict: the file scheduler's shelf saved,
        django-celery-beat's rows read again) Celery's own comparison decides.
        """
        changes = self.__dict__.get("_taskguard_changes", 0)
        seen = self.__dict__.get("_taskguard_seen")
        self.__dict__["_taskguard_seen"] = (changes, new)
        if seen is not None and seen[1] is new:
            return bool(seen[0] == changes)
        equal: bool = super().schedules_equal(old, new)  # type: ignore[misc]
        return equal and (seen is None or seen[0] == changes)

    def refresh_data_schedules(self) -> None:
        """Apply what changed to the beat's schedule; never raises."""
        data = self.data_schedules()
        first, known = data.cursor is None, set(data.entries)
        changed = data.refresh()
        if changed is None:
            return
        put, gone = changed
        if not (put or gone):
            return
        self._update_schedule(put, gone)
        if first:
            logger.info(
                "taskguard beat: %d data %s loaded",
                len(put),
                "schedule" if len(put) == 1 else "schedules",
                extra=log_fields("beat.data_loaded"),
            )
            return
        added = sum(1 for entry in put if entry.key not in known)
        logger.info(
            "taskguard beat: data schedules: %d added, %d changed, %d removed",
            added,
            len(put) - added,
            len(gone),
            extra=log_fields("beat.data_refreshed"),
        )

    def _update_schedule(self, put: list[DataEntry], gone: list[str]) -> None:
        """Put ``put`` in the beat's schedule, take ``gone`` out, send the slots owed."""
        self.schedule_changed_here()
        schedule: Any = getattr(self, "schedule")  # noqa: B009 (a property of the scheduler)
        for key in gone:
            schedule.pop(key, None)
        for entry in put:
            schedule[entry.name] = entry
        for entry, slot in self.data_schedules().take_owed():
            try:
                self.send_slot(entry, slot)  # type: ignore[attr-defined]
            except Exception:
                logger.exception(
                    "taskguard beat could not send %s slot %s",
                    entry.task_name,
                    slot.isoformat(),
                    extra=log_fields("beat.send_failed", task=entry.task_name, slot=slot),
                )

    def apply_async(self, entry: Any, *args: Any, **kwargs: Any) -> Any:
        """Send ``entry``; a data schedule's only if its row is still the one it was built
        from (:meth:`still_scheduled`)."""
        if isinstance(entry, DataEntry) and not self.still_scheduled(entry):
            return None
        return super().apply_async(entry, *args, **kwargs)  # type: ignore[misc]

    def still_scheduled(self, entry: DataEntry) -> bool:
        """Whether ``entry``'s row still exists, enabled, at the entry's version.

        Read once for every data entry due now (one query, kept until the next poll): a
        schedule deleted and retired between two polls (no tombstone) is not sent; a newer
        version is applied as a poll would (the slots it owes sent, its entry due next).
        A read that fails sends it (the workers' claim still holds).
        """
        data = self.data_schedules()
        if entry.key not in data.checked:
            try:
                data.read_at_send({entry.key, *self._data_due_now()})
            except Exception:
                logger.exception(
                    "taskguard beat could not read %s before sending",
                    entry.key,
                    extra=log_fields("beat.data_read_failed", task=entry.task_name),
                )
                return True
        row = data.checked.get(entry.key)
        if row is not None and row.version <= entry.version:
            return True
        known = data.entries.get(entry.key)
        if known is not None and known.version == entry.version:
            # As a poll would see it: from the entry as it was before this send.
            data.entries[entry.key] = entry
        if row is None:  # deleted and retired since the last poll
            data.entries.pop(entry.key, None)
            put: list[DataEntry] = []
            gone = [entry.key]
        else:
            put, gone = data.apply([row])
        logger.info(
            "taskguard beat: %s changed since the last poll; not sent",
            entry.task_name,
            extra=log_fields("beat.data_changed", task=entry.task_name),
        )
        self._update_schedule(put, gone)
        return False

    def _data_due_now(self) -> list[str]:
        """The keys of the data entries due now (at most :data:`CHECK_MAX`), read from
        Celery's heap (the top of its tree, never the whole)."""
        heap: list[Any] = getattr(self, "_heap", None) or []
        now = timezone.now().timestamp()
        keys: list[str] = []
        todo = [0]
        while todo and len(keys) < CHECK_MAX:
            index = todo.pop()
            if index >= len(heap) or heap[index][0] > now:
                continue
            if isinstance(heap[index][2], DataEntry):
                keys.append(heap[index][2].key)
            todo += [2 * index + 1, 2 * index + 2]
        return keys

    def reserve(self, entry: Any) -> Any:
        new = super().reserve(entry)  # type: ignore[misc]
        if isinstance(new, DataEntry):
            self.data_schedules().sent(new)
            schedule: Any = getattr(self, "schedule")  # noqa: B009
            if new.name in schedule:
                schedule[new.name] = new
        return new

    def tick(self, *args: Any, **kwargs: Any) -> float:
        self.refresh_data_schedules()
        interval: float = super().tick(*args, **kwargs)  # type: ignore[misc]
        return min(interval, max(self.data_schedules().due_in(), 0.1))
