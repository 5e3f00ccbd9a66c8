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
  by the worker instead of running next to a newer one.

This saves duplicate messages; it is not the guarantee. A task body under
``@once_per_key`` (same key) still runs at most once whatever the queue holds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from celery import Task
from celery.result import AsyncResult
from celery.signals import task_postrun, task_prerun
from kombu.utils.uuid import uuid

from ...exceptions import InvalidSchedule
from ...keyed import check_key, keep_seconds
from ...locks import claim_or_read, enqueue_key, extend_claim, redis_key_prefix, release_claim
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
    record = enqueue_key(redis_key_prefix(), task.name, run_key)
    task_id = str(options.pop("task_id", None) or uuid())
    holder = claim_or_read(record, task_id, ttl_seconds)
    if holder != task_id:
        logger.info(
            "taskguard %s key %r is queued as %s: not published", task.name, run_key, holder
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
            logger.warning("taskguard could not give back %s (%s); it lapses", record, exc)
        raise


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


def _record_of(task: Task[Any, Any] | None) -> tuple[str, dict[str, Any]] | None:
    if task is None:
        return None
    found = message_headers(task.request).get(ENQUEUE_HEADER)
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
        logger.exception("taskguard could not renew the enqueue record of %s", task_id)


def ended(
    task_id: str = "", task: Task[Any, Any] | None = None, state: str = "", **kwargs: Any
) -> None:
    """A message of ``apply_once`` ended: free its key (or keep it ``keep`` more)."""
    if state == "RETRY":
        return  # the retry is the same message id: its key stays taken
    try:
        found = _record_of(task)
        if found is None:
            return
        record, header = found
        keep = header.get("keep")
        if keep:
            extend_claim(record, task_id, float(keep))
        else:
            release_claim(record, task_id)
    except Exception:
        logger.exception("taskguard could not free the enqueue record of %s", task_id)


def register() -> None:
    """Connect the worker's receivers (idempotent: dispatch_uid)."""
    task_prerun.connect(started, dispatch_uid="taskguard.enqueue.started", weak=False)
    task_postrun.connect(ended, dispatch_uid="taskguard.enqueue.ended", weak=False)
