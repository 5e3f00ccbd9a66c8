"""RQ glue: ``run_schedules --enqueue`` hands each due slot of an ``@enqueue_on`` function to
its RQ queue, once, and the worker's guarded call claims the slot the job carries.

- :mod:`.enqueue`: ``@enqueue_on(queue)``, ``enqueue_for_slot``, the job id of a slot;
- :mod:`.worker`: the slot source of guarded jobs (the job's ``meta``), retries.

Importing this module wires both in (the ``@enqueue_on`` decorator's module imports it in
every process that runs or enqueues such jobs). See docs/rq.md.
"""

from __future__ import annotations

from . import enqueue, worker
from .enqueue import RETRY_MAX_META, SLOT_META, enqueue_for_slot, enqueue_on, job_id_for
from .worker import rq_call_context

__all__ = [
    "RETRY_MAX_META",
    "SLOT_META",
    "enqueue_for_slot",
    "enqueue_on",
    "job_id_for",
    "register",
    "rq_call_context",
]


def register() -> None:
    """Wire RQ in (idempotent): ``@enqueue_on`` functions are found by ``run_schedules
    --enqueue``, and guarded jobs read their slot from the job's meta."""
    enqueue.register()
    worker.register()


register()
