"""The scheduler's batched success writer (``batch.SuccessWriter``) over a dropped connection."""

from __future__ import annotations

import sqlite3
import threading
from datetime import timedelta

import pytest
from django.db import DatabaseError, connections
from django.utils import timezone

from django_taskguard.batch import SuccessWriter
from django_taskguard.claim import claim_many, claim_slot
from django_taskguard.context import ActiveRun
from django_taskguard.models import RunState, TaskRun
from django_taskguard.owner import new_owner

from .test_missed import terminate_other_backends

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]


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


def test_success_writer__a_failed_one_by_one_write_reaches_its_worker(monkeypatch):
    """SQLite writes one row at a time: a write that fails (the database locked past its
    timeout by another process's transaction) raises in the waiting worker, and the writer
    goes on; before, it ended the writer thread and every later worker waited forever."""
    if connections["default"].vendor != "sqlite":
        pytest.skip("the one-by-one write: SQLite")
    monkeypatch.setitem(connections.settings["default"]["OPTIONS"], "timeout", 0.5)
    writer = SuccessWriter()
    first, second = (
        claim_slot(f"tests.writer.{n}", timezone.now(), new_owner(), 30.0, "abandon") for n in "xy"
    )
    assert isinstance(first, ActiveRun) and isinstance(second, ActiveRun)
    outcome: list[object] = []

    def record(active: ActiveRun) -> None:
        try:
            outcome.append(writer.record(active, "returned"))
        except Exception as exc:
            outcome.append(exc)

    holder = sqlite3.connect(connections["default"].settings_dict["NAME"])
    try:
        holder.execute("BEGIN IMMEDIATE")  # another process holds SQLite's write lock
        worker = threading.Thread(target=record, args=(first,), daemon=True)
        worker.start()
        worker.join(30)
        assert not worker.is_alive(), "the worker got an answer"
        assert isinstance(outcome[0], Exception), outcome
    finally:
        holder.rollback()
        holder.close()
    try:
        worker = threading.Thread(target=record, args=(second,), daemon=True)
        worker.start()
        worker.join(30)
        assert outcome[1:] == [True], "the writer went on"
    finally:
        writer.close()
