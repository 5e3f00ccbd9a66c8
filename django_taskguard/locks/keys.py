"""How the fast path's keys are named and read back: formatted and parsed here only.

The keys of one (task, slot) share a Redis Cluster hash tag, the part in
braces, so that every script (which touches the lock key and the claim record
together) stays in one hash slot:

- ``{prefix}:run:{<digest>:<slot>}``: the lock key (a token, or the finished
  marker);
- ``{prefix}:dup:{<digest>:<slot>}``: the slot's claim record.

``digest`` is a fixed-length hash of the task name (never raw user text),
``slot`` the slot in UTC (``20261121T210000.000000Z``). The prefix may not
contain braces: the first ``{`` of a key opens its hash tag.

A keyed run (``@once_per_key``) has ``k<key digest>`` in place of the slot:
``{prefix}:run:{<digest>:k<key digest>}``, the key hashed like the task name
(a key is user text: never in a Redis key raw).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from datetime import datetime
from datetime import timezone as dt_timezone

from django.core.exceptions import ImproperlyConfigured

RUN = "run"  # the lock key
CLAIM = "dup"  # the claim record
_LABEL = "%Y%m%dT%H%M%S.%fZ"


@functools.lru_cache(maxsize=1024)
def task_digest(task_name: str) -> str:
    """A fixed-length, key-safe stand-in for a task name of any length or alphabet."""
    return hashlib.sha256(task_name.encode("utf-8")).hexdigest()[:32]


@functools.lru_cache(maxsize=1024)
def slot_label(slot: datetime) -> str:
    """``20261121T210000.000000Z``: sortable, fixed-width, UTC."""
    return slot.astimezone(dt_timezone.utc).strftime(_LABEL)


KEYED = "k"  # the label of a keyed run: "k" and the key's digest


def key_digest(key: str) -> str:
    """A fixed-length, key-safe stand-in for an ``@once_per_key`` key."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def check_prefix(prefix: str) -> str:
    """``prefix``, or ``ImproperlyConfigured`` if it would break the keys' hash tag."""
    if "{" in prefix or "}" in prefix:
        raise ImproperlyConfigured(
            f"TASKGUARD['KEY_PREFIX'] {prefix!r} contains a brace: taskguard puts each "
            f"slot's keys in one Redis Cluster hash tag, {{...}}, after the prefix"
        )
    return prefix


def run_key(prefix: str, task_name: str, slot: datetime) -> str:
    """The lock key of one (task, slot)."""
    return f"{prefix}:{RUN}:{{{task_digest(task_name)}:{slot_label(slot)}}}"


def keyed_run_key(prefix: str, task_name: str, key: str) -> str:
    """The lock key of one (task, key) of ``@once_per_key``."""
    return f"{prefix}:{RUN}:{{{task_digest(task_name)}:{KEYED}{key_digest(key)}}}"


ENQUEUE = "enq"  # Celery's apply_once: the message queued or running for a key


def enqueue_key(prefix: str, task_name: str, key: str) -> str:
    """The record of the message ``apply_once`` published for (task, key)."""
    return f"{prefix}:{ENQUEUE}:{{{task_digest(task_name)}:{KEYED}{key_digest(key)}}}"


BEAT = "beat"  # a beat's claim of publishing one (entry, slot) (BEAT_CLAIM)


def beat_key(prefix: str, identity: str, slot: datetime) -> str:
    """The key by which one beat claims the publishing of (entry identity, slot)."""
    return f"{prefix}:{BEAT}:{task_digest(identity)}:{slot_label(slot)}"


def claim_key(run_key: str) -> str:
    """The claim record that goes with a lock key made by :func:`run_key`."""
    head, _, tail = run_key.rpartition(f":{RUN}:{{")
    return f"{head}:{CLAIM}:{{{tail}"


def lock_key(claim_key: str) -> str:
    """The lock key that goes with a claim record."""
    head, _, tail = claim_key.rpartition(f":{CLAIM}:{{")
    return f"{head}:{RUN}:{{{tail}"


def scan_pattern(prefix: str, kind: str) -> str:
    """The ``SCAN MATCH`` pattern of every key of ``kind`` (``RUN``/``CLAIM``) under ``prefix``."""
    return f"{_escaped(prefix)}:{kind}:{{*}}"


def ledger_pattern(prefix: str) -> str:
    """The ``SCAN MATCH`` pattern of every key under ``prefix``, of any kind."""
    return f"{_escaped(prefix)}:*"


def _escaped(prefix: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in prefix)


@dataclass(frozen=True)
class SlotKey:
    """A lock key or claim record, read back: of a slot, or of a key (``slot`` None)."""

    prefix: str
    kind: str  # RUN or CLAIM
    digest: str
    slot: datetime | None
    keyed: str | None = None  # the key's digest, for a keyed run

    def format(self) -> str:
        label = slot_label(self.slot) if self.slot is not None else f"{KEYED}{self.keyed}"
        return f"{self.prefix}:{self.kind}:{{{self.digest}:{label}}}"

    @classmethod
    def parse(cls, key: str) -> SlotKey | None:
        """The parts of a key made here, or None for any other key."""
        head, brace, tail = key.partition("{")
        if not brace or not tail.endswith("}"):
            return None
        prefix, _, kind = head.removesuffix(":").rpartition(":")
        digest, _, label = tail[:-1].partition(":")
        if kind not in (RUN, CLAIM) or not prefix or len(digest) != 32:
            return None
        if label.startswith(KEYED) and len(label) == 33:
            keyed = cls(prefix, kind, digest, None, label[1:])
            return keyed if keyed.format() == key else None
        try:
            slot = datetime.strptime(label, _LABEL).replace(tzinfo=dt_timezone.utc)
        except ValueError:
            return None
        parsed = cls(prefix, kind, digest, slot)
        return parsed if parsed.format() == key else None
