"""Celery beat side: schedulers that stamp each message with the slot it was due for.

``TaskguardScheduler`` (``beat_schedule`` in settings) and, in :mod:`.beat_db`,
``TaskguardDatabaseScheduler`` (django-celery-beat) add two headers to every
message they publish: ``taskguard_slot`` (ISO-8601 UTC, the fire time the
entry was due for) and ``taskguard_schedule`` (the entry's name). Interval
entries fire on epoch-aligned multiples of their interval, so every beat,
whenever it started, fires and stamps the same slots. Import the schedulers
from ``django_taskguard.contrib.celery``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from celery.beat import PersistentScheduler, ScheduleEntry
from celery.schedules import crontab, schedstate
from celery.schedules import schedule as interval_schedule
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from ... import schedules, upkeep
from ...conf import taskguard_settings
from ...locks import claim_once, redis_key_prefix, release_claim
from ...locks.keys import beat_key
from ...logfields import log_fields
from ...owner import new_owner
from .data_entries import DataEntry, DataSchedulesMixin
from .entries import SETTINGS, BeatEntry, RegisteringMixin
from .headers import (
    SCHEDULE_HEADER,
    SLOT_HEADER,
    UTC,
    cron_of,
    slot_for,
    task_identity,
    zone_name,
)

BEAT_CLAIM_TTL = 3600  # seconds a beat's claim on (entry, slot) is kept in Redis

logger = logging.getLogger("taskguard.celery")


# --- beat side -------------------------------------------------------------------


class EpochInterval(interval_schedule):
    """A celery interval that is due on multiples of ``run_every`` since the epoch.

    Celery's own interval is due ``run_every`` after the entry last ran, so two
    beats started at different times fire at different moments (and drift).
    This one is due once per epoch-aligned slot that began after the entry
    last ran: every beat fires at the same instants and stamps the same slot.
    """

    run_every: timedelta

    def is_due(self, last_run_at: datetime) -> schedstate:
        now = self.maybe_make_aware(self.now()).astimezone(UTC)
        slot = schedules.IntervalSchedule(self.run_every).latest_slot(now)
        until_next = (slot + self.run_every - now).total_seconds()
        last = self.maybe_make_aware(last_run_at).astimezone(UTC)
        return schedstate(is_due=last < slot, next=until_next)


class SlotDue:
    """A crontab due once per taskguard slot of it, mixed in before celery's class.

    Celery's crontab is due by its own arithmetic on wall time, which does not fire in
    the second pass of a repeated hour; this one is due when a slot (its latest fire
    time at or before now, with taskguard's DST rule, docs/schedules.md) began after the
    entry last ran: every beat and ``run_schedules`` fire, and stamp, the same slots.
    """

    def is_due(self, last_run_at: datetime) -> schedstate:
        schedule: Any = self
        now = schedule.maybe_make_aware(schedule.now()).astimezone(UTC)
        cron = cron_of(schedule)
        slot = cron.latest_slot(now)
        ahead = cron.slots_between(now, now + timedelta(days=800), 1)
        until_next = (ahead[0] - now).total_seconds() if ahead else 3600.0
        last = schedule.maybe_make_aware(last_run_at).astimezone(UTC)
        return schedstate(is_due=last < slot, next=until_next)


class SlotCrontab(SlotDue, crontab):
    """A celery ``crontab`` due once per taskguard slot (:class:`SlotDue`)."""


def slot_due(schedule: Any, kind: type) -> Any:
    """``schedule`` (a crontab) as ``kind`` (a :class:`SlotDue` subclass of its class)."""
    copy: Any = object.__new__(kind)
    copy.__dict__.update(schedule.__dict__)
    return copy


def aligned(schedule: Any) -> Any:
    """``schedule`` with plain celery intervals of a second or more made epoch-aligned,
    and a plain crontab due once per taskguard slot (:class:`SlotDue`).

    ``relative=True`` asks celery to align the interval to its resolution on the
    app's clock (a daily entry at local midnight, an hourly one at the top of the
    local hour). Every beat must agree on it, so it becomes the equivalent
    crontab in the app's time zone; an interval with no such equivalent is
    refused, never silently moved.
    """
    if type(schedule) is crontab:
        return slot_due(schedule, SlotCrontab)
    if type(schedule) is not interval_schedule:
        return schedule
    plain: Any = schedule
    if plain.run_every < timedelta(seconds=1):
        return schedule
    if plain.relative:
        return relative_crontab(plain)
    return EpochInterval(plain.run_every, plain.relative, nowfun=plain.nowfun, app=plain.app)


def relative_crontab(plain: Any) -> Any:
    """The crontab, in the app's time zone, that a ``relative=True`` interval means."""
    seconds = int(plain.run_every.total_seconds())
    whole = plain.run_every == timedelta(seconds=seconds)
    if whole and seconds < 60 and 60 % seconds == 0:
        # Whole seconds dividing a minute: every zone's offset is whole minutes, so
        # the epoch's multiples are the local ones too.
        return EpochInterval(plain.run_every, True, nowfun=plain.nowfun, app=plain.app)
    if whole and seconds == 86_400:
        return SlotCrontab(minute=0, hour=0, app=plain.app)
    if whole and seconds % 3600 == 0 and 24 % (seconds // 3600) == 0:
        return SlotCrontab(minute=0, hour=f"*/{seconds // 3600}", app=plain.app)
    if whole and seconds % 60 == 0 and 60 % (seconds // 60) == 0:
        return SlotCrontab(minute=f"*/{seconds // 60}", app=plain.app)
    raise ImproperlyConfigured(
        f"a relative=True interval of {plain.run_every} has no aligned equivalent every beat "
        f"agrees on: use a divisor of a minute, an hour or a day, exactly a day, a crontab, "
        f"or relative=False (taskguard then aligns it to the Unix epoch, in UTC)"
    )


class TaskguardEntry(ScheduleEntry):
    """A ``beat_schedule`` entry whose interval is epoch-aligned."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.schedule = aligned(self.schedule)


class StampingMixin:
    """Publishes each due entry with ``taskguard_slot`` / ``taskguard_schedule`` headers."""

    app: Any
    _warned: set[str]

    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        if advance:
            entry = self.reserve(entry)  # type: ignore[attr-defined]
        stamped = self.stamp(entry, timezone.now())  # the clock freeze_now moves
        return self._publish(entry, stamped, producer, **kwargs)

    def send_slot(self, entry: Any, slot: datetime) -> Any:
        """Publish ``entry`` for ``slot``, a slot its schedule owes (not the latest one):
        claimed and recorded as :meth:`apply_async` does."""
        return self._publish(entry, self.stamp(entry, timezone.now(), slot=slot), None)

    def _publish(self, entry: Any, stamped: Any, producer: Any, **kwargs: Any) -> Any:
        slot = stamped.options["headers"].get(SLOT_HEADER)
        sent: dict[str, str] = self.__dict__.setdefault("_sent_slots", {})
        if slot is not None and sent.get(entry.name) == slot:
            # django-celery-beat reloads entries from rows that other beats may not
            # have synced yet; never publish the same slot of an entry twice.
            logger.info(
                "taskguard beat: %s slot %s already sent by this beat",
                entry.name,
                slot,
                extra=log_fields("beat.already_sent", task=entry.task, slot=slot),
            )
            return None
        claim = None
        if slot is not None and taskguard_settings.BEAT_CLAIM:
            name = schedule_name(entry)
            claim = beat_claim(entry.task, name, datetime.fromisoformat(slot))
            if claim is None:
                logger.info(
                    "taskguard beat: %s slot %s was sent by another beat",
                    entry.name,
                    slot,
                    extra=log_fields("beat.sent_elsewhere", task=entry.task, slot=slot),
                )
                return None
        try:
            result = super().apply_async(  # type: ignore[misc]
                stamped, producer=producer, advance=False, **kwargs
            )
        except BaseException:
            # Not sent (the broker is down): give the slot back, or every other beat
            # would skip it and nothing would send it.
            if claim is not None:
                claim.release()
            raise
        if slot is not None:
            sent[entry.name] = slot
        return result

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Celery's tick, then the upkeep when this beat is due to attempt it (a thread);
        a beat whose entries are far apart still wakes for it."""
        interval: float = super().tick(*args, **kwargs)  # type: ignore[misc]
        upkeep.maybe_upkeep()
        return min(interval, upkeep.upkeep_wait())

    def close(self) -> None:
        """Celery's close, then wait for the upkeep thread a tick started (at most
        ``upkeep.EXIT_WAIT_SECONDS``, as a process's exit does): a beat that stops leaves
        no thread behind, and the upkeep it started ends and is recorded instead of
        holding the fleet's lease until it lapses."""
        try:
            super().close()  # type: ignore[misc]
        finally:
            upkeep.join(upkeep.EXIT_WAIT_SECONDS)

    def stamp(self, entry: Any, now: datetime, slot: datetime | None = None) -> Any:
        """A copy of ``entry`` that carries the slot headers (of ``slot``, else of the
        slot its schedule is due for at ``now``)."""
        try:
            slot = slot or slot_for(entry.schedule, now)
        except Exception:
            logger.exception(
                "taskguard could not compute the slot of beat entry %s",
                entry.name,
                extra=log_fields("beat.slot_failed", task=entry.task),
            )
            slot = None
        headers = dict(entry.options.get("headers") or {})
        headers[SCHEDULE_HEADER] = schedule_name(entry)
        if slot is None:
            self._warn_once(entry)
        else:
            headers[SLOT_HEADER] = slot.isoformat()
        # A shallow copy by hand: ScheduleEntry.__reduce__ (which copy.copy uses) does
        # not fit ModelEntry's constructor.
        stamped = object.__new__(type(entry))
        stamped.__dict__.update(entry.__dict__)
        stamped.options = {**entry.options, "headers": headers}
        return stamped

    def _warn_once(self, entry: Any) -> None:
        warned = self.__dict__.setdefault("_warned", set())
        if entry.name not in warned:
            warned.add(entry.name)
            logger.warning(
                "taskguard beat: entry %s has a schedule without slots (%r); its messages "
                "carry no taskguard_slot, so a guarded task needs its own cron=/every=",
                entry.name,
                entry.schedule,
                extra=log_fields("beat.no_slots", task=entry.task),
            )


def schedule_name(entry: Any) -> str:
    """The schedule name a message of ``entry`` carries: a data schedule's own name (its
    entry's key in the beat's schedule is another), else the entry's name."""
    return entry.schedule_name if isinstance(entry, DataEntry) else str(entry.name)


class TaskguardScheduler(DataSchedulesMixin, RegisteringMixin, StampingMixin, PersistentScheduler):
    """Celery's file-backed scheduler, stamping slots; run any number of them.

    Its entries are registered schedules (:mod:`.entries`), saved when it starts; it also
    fires the data schedules of Celery tasks (:mod:`.data_entries`).
    """

    Entry = TaskguardEntry
    declared_in = SETTINGS

    def setup_schedule(self) -> None:
        super().setup_schedule()
        warn_timezone(self.app)
        self.register_entries()
        self.refresh_data_schedules()
        self.schedule_changed_here()

    def taskguard_entries(self) -> list[BeatEntry]:
        """The settings entries (data schedules are rows already)."""
        entries: list[Any] = [e for e in self.schedule.values() if not isinstance(e, DataEntry)]
        return [
            BeatEntry(e.name, e.task, e.schedule, e.options.get("headers") or {}) for e in entries
        ]


def warn_timezone(app: Any) -> None:
    """Say so when crontab entries fire in a zone other than Django's ``TIME_ZONE``."""
    from django.conf import settings

    beat_zone = zone_name(app.timezone)
    if settings.USE_TZ and beat_zone != settings.TIME_ZONE:
        logger.warning(
            "taskguard beat: celery's timezone is %s but Django's TIME_ZONE is %s; crontab "
            "entries fire (and are stamped) in %s, while @once_per_schedule(cron=...) reads "
            "cron in %s. Set CELERY_TIMEZONE = TIME_ZONE to keep them the same.",
            beat_zone,
            settings.TIME_ZONE,
            beat_zone,
            settings.TIME_ZONE,
            extra=log_fields(
                "beat.timezone_mismatch", reason=f"{beat_zone} != {settings.TIME_ZONE}"
            ),
        )


# --- BEAT_CLAIM -------------------------------------------------------------------


@dataclass(frozen=True)
class BeatClaim:
    """This beat's claim on publishing one (entry, slot); ``key`` None: Redis erred."""

    key: str | None
    owner: str

    def release(self) -> None:
        """Give the slot back (compare-and-delete): its publish failed."""
        if self.key is None:
            return
        try:
            release_claim(self.key, self.owner)
        except Exception as exc:
            logger.warning(
                "taskguard beat could not give back %s (%s); it lapses in %d s",
                self.key,
                exc,
                BEAT_CLAIM_TTL,
                extra=log_fields("beat.give_back_failed", owner=self.owner, reason=exc),
            )


def beat_claim(task_name: str, entry_name: str, slot: datetime) -> BeatClaim | None:
    """Claim the publishing of (entry, slot) for this beat; None: another beat has it.

    One ``SET NX EX`` on the REDIS_ALIAS cache's server, through the lock's own
    client (short socket timeout, no retries). An error means "send anyway"
    (a claim with no key): the worker's claim is the guarantee, this only saves
    the duplicate messages. The caller releases the claim if its publish fails.
    """
    owner = new_owner()
    identity = task_identity(task_name, entry_name)
    try:
        key = beat_key(redis_key_prefix(), identity, slot)
        return BeatClaim(key, owner) if claim_once(key, owner, BEAT_CLAIM_TTL) else None
    except Exception as exc:
        logger.warning(
            "taskguard beat claim of %s at %s failed (%s); sending anyway",
            identity,
            slot.isoformat(),
            exc,
            extra=log_fields("beat.claim_failed", task=task_name, slot=slot, reason=exc),
        )
        return BeatClaim(None, owner)
