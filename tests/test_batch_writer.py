"""The scheduler's batched success writer (``batch.SuccessWriter``) over a dropped connection."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import DatabaseError, connections
from django.utils import timezone

from django_taskguard.batch import SuccessWriter
from django_taskguard.claim import claim_many
from django_taskguard.context import ActiveRun
from django_taskguard.models import RunState, TaskRun

from .test_missed import terminate_other_backends

pytestmark = pytest.mark.django_db(transaction=True)


def claimed(task: str, seconds_ago: int) -> ActiveRun:
    slot = timezone.now().replace(microsecond=0) - timedelta(seconds=seconds_ago)
    found = claim_many(slot, [(task, 30.0)])
    assert found is not None
    active = found[task]
    assert isinstance(active, ActiveRun)
    return active


def test_success_writer__survives_a_terminated_connection():
    if connections["default"].vendor != "postgresql":
        pytest.skip("pg_terminate_backend, and the one-statement write: PostgreSQL")
    writer = SuccessWriter()
    try:
        first, second, third = (claimed(f"tests.writer.{n}", 5) for n in "abc")
        assert writer.record(first, "returned") is True  # the writer's connection is open
        assert terminate_other_backends() >= 1
        with pytest.raises(DatabaseError):
            writer.record(second, "returned")  # its outcome unknown: the caller reads back
        assert writer.record(third, "returned") is True, "the next write reconnects"
        assert TaskRun.objects.get(id=third.id).state == RunState.SUCCEEDED
    finally:
        writer.close()
