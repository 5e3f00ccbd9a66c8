"""Enqueue de-duplication: ``apply_once`` publishes a task unless a message with the same
key is already queued or running, and then returns that message's result instead.

The record of the message is a Redis key on the ``REDIS_ALIAS`` server (the lock's
client, whatever ``BACKEND`` says), ``{prefix}:enq:{<task digest>:k<key digest>}``,
holding the message's task id:

- ``apply_once`` takes it with ``SET NX GET PX ttl`` (one round trip): taken, the task
  is published under that id; held, nothing is published and the holder's
  ``AsyncResult`` is returned. A publish that fails gives the record back.
- The worker renews it for ``ttl`` when the message starts, and when the task ends
  (succeeded or failed, not a retry) deletes it, or keeps it ``keep`` seconds more;
  both compare the task id (another message's record is never touched).
- A message lost in the broker (purged, a broker that dropped it) blocks its key for
  ``ttl`` at most: the record lapses. The message is published with ``expires=ttl``
  unless told otherwise, so a copy that turns up after its record lapsed is revoked
  by the worker instead of running next to a newer one. That is never silent: the
  worker records the expired message as a ``skipped`` run (reason ``expired``) and frees
  its record; a ``countdown``/``eta`` beyond ``ttl`` (a message that could only expire)
  is refused at the call. A retry keeps the message's expiry (``ttl`` counts from the
  first publish): ``OnceTask.retry`` refuses a countdown beyond what is left of it; on
  another task base such a retry expires and is recorded as an expired retry.
- A caller-chosen ``task_id`` is the record's value like any other: a second call with
  the same id finds it held and publishes nothing.
- ``Reject(requeue=True)`` keeps the record (the message is back in the queue).

This saves duplicate messages; it is not the guarantee. A task body under
``@once_per_key`` (same key) still runs at most once whatever the queue holds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from celery import Task
from celery.exceptions import Reject
from celery.result import AsyncResult
from celery.signals import task_postrun, task_prerun, task_revoked
from celery.utils.time import maybe_make_aware
from django.db import close_old_connections
from django.utils import timezone
from kombu.utils.uuid import uuid

from ... import ledger
from ...exceptions import InvalidSchedule, TaskGuardError
from ...keyed import check_key, keep_seconds
from ...locks import claim_or_read, enqueue_key, extend_claim, redis_key_prefix, release_claim
from ...logfields import log_fields
from ...owner import actor
from ...signals import run_skipped
from .headers import ENQUEUE_HEADER, message_headers

logger = logging.getLogger("taskguard.celery")

# How long a queued or running message blocks its key when nothing frees it (lost).
DEFAULT_TTL = timedelta(hours=1)


def apply_once(
    task: Task[Any, Any],
    args: Iterable[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    key: str | None = None,
    ttl: timedelta = DEFAULT_TTL,
    keep: timedelta | None = None,
    **options: Any,
) -> AsyncResult[Any]:
    """``task.apply_async(args, kwargs, **options)`` unless a message of ``task`` with
    ``key`` is queued or running: then nothing is published and that message's
    ``AsyncResult`` is returned.

    ``key``: defaults to the key of the task's ``@once_per_key`` body for these
    arguments. ``ttl``: the longest a message blocks its key if it is lost (it is
    also the message's ``expires`` unless given). ``keep``: how long the key stays
    blocked after the task ends (default: freed at once).
    """
    args = tuple(args or ())
    kwargs = dict(kwargs or {})
    run_key = check_key(key if key is not None else _body_key(task, args, kwargs), task.name)
    ttl_seconds = _seconds(ttl, "ttl")
    keep_for = keep_seconds(keep)
    _refuse_delay_beyond(task, options, ttl_seconds)
    record = enqueue_key(redis_key_prefix(), task.name, run_key)
    task_id = str(options.pop("task_id", None) or uuid())
    holder = claim_or_read(record, task_id, ttl_seconds)
    if holder is not None:
        logger.info(
            "taskguard %s key %r is queued as %s: not published",
            task.name,
            run_key,
            holder,
            extra=log_fields("enqueue.queued", task=task.name, key=run_key),
        )
        return task.AsyncResult(holder)
    headers = dict(options.pop("headers", None) or {})
    headers[ENQUEUE_HEADER] = {"key": run_key, "ttl": ttl_seconds, "keep": keep_for}
    options.setdefault("expires", ttl_seconds)
    try:
        return task.apply_async(args, kwargs, task_id=task_id, headers=headers, **options)
    except BaseException:
        try:
            release_claim(record, task_id)
        except Exception as exc:
            logger.warning(
                "taskguard could not give back %s (%s); it lapses",
                record,
                exc,
                extra=log_fields(
                    "enqueue.give_back_failed", task=task.name, key=run_key, reason=exc
                ),
            )
        raise


def _refuse_delay_beyond(task: Task[Any, Any], options: dict[str, Any], ttl: float) -> None:
    """A ``countdown``/``eta`` later than ``ttl``: the message would expire (and its record
    lapse) before a worker may run it. Refused, so that it is not lost silently."""
    countdown, eta = options.get("countdown"), options.get("eta")
    delay = None
    if countdown is not None:
        delay = float(countdown)
    elif isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    if isinstance(eta, datetime):
        delay = (maybe_make_aware(eta, task.app.timezone) - timezone.now()).total_seconds()
    if delay is not None and delay >= ttl:
        raise TaskGuardError(
            f"apply_once({task.name}): countdown/eta of {delay:.0f}s is beyond ttl "
            f"({ttl:g}s): the message would expire before it may run; give apply_once a "
            f"ttl= longer than the delay"
        )


def _seconds(value: timedelta, name: str) -> float:
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise InvalidSchedule(f"{name}= must be a positive timedelta, got {value!r}")
    return value.total_seconds()


def _body_key(task: Task[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    key_of = getattr(getattr(task, "__wrapped__", None), "key_of", None)
    if not callable(key_of):
        raise InvalidSchedule(
            f"apply_once({task.name}) needs key=: its body is not under @once_per_key"
        )
    if getattr(task.run, "__self__", None) is task:
        args = (task, *args)  # bind=True: the body's first parameter is the task
    return str(key_of(*args, **kwargs))


class OnceTask(Task):  # type: ignore[type-arg]
    """A Celery task base with ``apply_once`` (``@shared_task(base=OnceTask)``)."""

    def apply_once(
        self,
        args: Iterable[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> AsyncResult[Any]:
        """See :func:`apply_once`."""
        return apply_once(self, args, kwargs, **options)

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: Exception | None = None,
        throw: bool = True,
        eta: datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's retry, refused when the retry of an ``apply_once`` message would come
        after the message expires (the retry keeps the expiry, so the worker would discard
        it unseen): the task's own error ``exc`` is raised, as when retries run out, and the
        refusal logged; with no ``exc``, ``TaskGuardError`` says why."""
        now = timezone.now()
        if eta is not None:
            delay = (maybe_make_aware(eta, self.app.timezone) - now).total_seconds()
        else:
            delay = float(countdown if countdown is not None else self.default_retry_delay or 0)
        refused = retry_refusal(self, self.request, delay, max_retries)
        if refused is not None:
            if exc is None:
                raise TaskGuardError(refused)
            logger.error(
                "%s; the task fails with its own error instead",
                refused,
                extra=log_fields("enqueue.retry_refused", task=self.name, reason=refused),
            )
            raise exc
        return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)


def retry_refusal(
    task: Task[Any, Any], request: Any, delay: float, max_retries: int | None = None
) -> str | None:
    """Why ``OnceTask.retry`` refuses a retry ``delay`` seconds from now (None: it does not):
    the retry of an ``apply_once`` message keeps its expiry and would come after it."""
    limit = task.max_retries if max_retries is None else max_retries
    if not isinstance(task, OnceTask) or request.called_directly or request.is_eager:
        return None
    if request.expires is None or (limit is not None and request.retries + 1 > limit):
        return None  # no expiry, or no retry: Celery raises the task's error
    if not isinstance(message_headers(request).get(ENQUEUE_HEADER), dict):
        return None
    raw: Any = request.expires  # an ISO string in a message, a datetime when applied
    expires = maybe_make_aware(
        datetime.fromisoformat(raw) if isinstance(raw, str) else raw, task.app.timezone
    )
    left = (expires - timezone.now()).total_seconds()
    if delay < left:
        return None
    return (
        f"{task.name}: a retry due in {delay:.0f}s comes after its apply_once message "
        f"expires, in {max(left, 0):.0f}s (ttl counts from the first publish; a retry keeps "
        f"the expiry): it would be discarded unseen; give apply_once a longer ttl= or the "
        f"retry a shorter countdown"
    )


def _record_of(
    task: Task[Any, Any] | None, request: Any = None
) -> tuple[str, dict[str, Any]] | None:
    if task is None:
        return None
    found = message_headers(request if request is not None else task.request).get(ENQUEUE_HEADER)
    if not isinstance(found, dict) or not isinstance(found.get("key"), str):
        return None
    return enqueue_key(redis_key_prefix(), task.name, found["key"]), found


def started(task_id: str = "", task: Task[Any, Any] | None = None, **kwargs: Any) -> None:
    """A message of ``apply_once`` starts: its record lives ``ttl`` more from now."""
    try:
        found = _record_of(task)
        if found is not None:
            extend_claim(found[0], task_id, float(found[1].get("ttl") or 0) or 1.0)
    except Exception:
        logger.exception(
            "taskguard could not renew the enqueue record of %s",
            task_id,
            extra=log_fields("enqueue.renew_failed", task=task.name if task else None),
        )


def ended(
    task_id: str = "",
    task: Task[Any, Any] | None = None,
    state: str = "",
    retval: Any = None,
    **kwargs: Any,
) -> None:
    """A message of ``apply_once`` ended: free its key (or keep it ``keep`` more)."""
    if state == "RETRY":
        return  # the retry is the same message id: its key stays taken
    try:
        found = _record_of(task)
        if found is None:
            return
        record, header = found
        if isinstance(retval, Reject) and getattr(retval, "requeue", False):
            # The message is back in the queue: its key stays taken, for ttl from now.
            extend_claim(record, task_id, float(header.get("ttl") or 0) or 1.0)
            return
        keep = header.get("keep")
        if keep:
            extend_claim(record, task_id, float(keep))
        else:
            release_claim(record, task_id)
    except Exception:
        logger.exception(
            "taskguard could not free the enqueue record of %s",
            task_id,
            extra=log_fields("enqueue.free_failed", task=task.name if task else None, state=state),
        )


def revoked(
    request: Any = None, expired: bool = False, sender: Task[Any, Any] | None = None, **_: Any
) -> None:
    """A message of ``apply_once`` the worker discards (revoked, or ``expired``): free its
    key; an expired one is also recorded as a ``skipped`` run with the reason.

    Runs on the worker's consumer thread, whose database connection may have outlived
    the server's idle timeout or ``CONN_MAX_AGE`` since its last use (the key's prefix
    and the record read and write the ledger): closed first if so, as for a request."""
    try:
        close_old_connections()
        found = _record_of(sender, request)
        if found is None or sender is None:
            return
        record, header = found
        task_id = str(getattr(request, "id", "") or "")
        release_claim(record, task_id)
        if expired:
            _record_expired(sender.name, task_id, header, int(request.retries or 0))
    except Exception:
        logger.exception(
            "taskguard could not record the discarded message %s",
            request,
            extra=log_fields("enqueue.discard_failed", task=sender.name if sender else None),
        )


def _record_expired(task_name: str, task_id: str, header: dict[str, Any], retries: int) -> None:
    """A skipped row keyed by now (not by the key: that would block it), with the reason."""
    ttl = float(header.get("ttl") or 0)
    why = (
        f"retry {retries} of apply_once message {task_id} for key {header['key']!r} expired "
        f"before a worker ran it (ttl {ttl:g}s counts from the first publish and the retry "
        f"kept that expiry: the retry's countdown, or its wait in the queue, outlived it)"
        if retries
        else f"apply_once message {task_id} for key {header['key']!r} expired before a "
        f"worker ran it (ttl {ttl:g}s: the workers were down or busy that long)"
    )
    reason = f"expired: {why}; its key is free"
    logger.warning(
        "taskguard %s: %s",
        task_name,
        reason,
        extra=log_fields("enqueue.expired", task=task_name, state="skipped", reason=reason),
    )
    ledger.ensure_autocommit()
    slot = timezone.now()
    if ledger.insert_skipped(task_name, slot, reason=reason, actor=actor("worker")) is not None:
        run_skipped.send(sender=task_name, slot=slot, reason=reason, key=header["key"])


def register() -> None:
    """Connect the worker's receivers (idempotent: dispatch_uid)."""
    task_prerun.connect(started, dispatch_uid="taskguard.enqueue.started", weak=False)
    task_postrun.connect(ended, dispatch_uid="taskguard.enqueue.ended", weak=False)
    task_revoked.connect(revoked, dispatch_uid="taskguard.enqueue.revoked", weak=False)
