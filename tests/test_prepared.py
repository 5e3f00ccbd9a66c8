"""PostgreSQL: the ledger's hot statements are prepared by the server only when the project
lets psycopg prepare (``OPTIONS["prepare_threshold"]``), once per connection."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import connection

from django_taskguard import once_per_schedule
from django_taskguard.models import RunState, TaskRun, TaskRunTransition

from .support.proc import BASE_SLOT

pytestmark = [
    pytest.mark.once,
    pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL only"),
]

SLOT = BASE_SLOT + timedelta(days=1)


@pytest.fixture
def prepare_threshold(request: pytest.FixtureRequest) -> Iterator[None]:
    """The test's connection opened anew with ``OPTIONS["prepare_threshold"]`` set to the
    test's parameter (absent for None: Django's default), as a project's settings would."""
    options = connection.settings_dict["OPTIONS"]
    before = dict(options)
    connection.close()
    options.pop("prepare_threshold", None)
    if request.param is not None:
        options["prepare_threshold"] = request.param
    try:
        yield
    finally:
        connection.close()
        options.clear()
        options.update(before)


def prepared_statements() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [statement for (statement,) in cursor.fetchall()]


def run_three_slots() -> None:
    @once_per_schedule(name="tests.prepared")
    def body() -> str:
        return "ran"

    for minute in range(3):
        assert body.run_for_slot(SLOT + timedelta(minutes=minute)) == "ran"
    runs = TaskRun.objects.filter(task_name="tests.prepared")
    assert sorted(runs.values_list("state", flat=True)) == [RunState.SUCCEEDED] * 3
    logged = TaskRunTransition.objects.filter(run__task_name="tests.prepared")
    assert logged.count() == 6  # claimed and returned, each with its row's change


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("prepare_threshold", [0], indirect=True)
def test_prepare_threshold__claim_and_finish_prepared_once_per_connection(
    prepare_threshold: None,
) -> None:
    run_three_slots()
    prepared = prepared_statements()
    assert any(s.startswith("SELECT * FROM taskguard_claim_v1(") for s in prepared)
    assert any(s.startswith("SELECT * FROM taskguard_end_attempt_v1(") for s in prepared)
    assert len(prepared) == len(set(prepared))  # three calls, each statement prepared once
    connection.close()  # a new connection has nothing prepared: none is shared
    assert prepared_statements() == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("prepare_threshold", [None], indirect=True)
def test_django_default__nothing_prepared(prepare_threshold: None) -> None:
    """Django's default keeps connection poolers working: nothing prepared."""
    run_three_slots()
    assert prepared_statements() == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("prepare_threshold", [0, None], indirect=True)
def test_prepared_claim__a_migration_retyping_a_returned_column_does_not_break_the_connection(
    prepare_threshold: None,
) -> None:
    """A connection that prepared the claim, then a migration (another connection) that
    changes the type of a column the claim returns: PostgreSQL refuses the prepared plan
    ("cached plan must not change result type"); the ledger drops its prepared statements
    and runs the claim again, on this call and on every later one."""
    from django.db import connections

    from django_taskguard import ledger

    table = TaskRun._meta.db_table

    def retype(length: int) -> None:
        other = connections.create_connection("default")
        try:
            with other.cursor() as cursor:
                cursor.execute(f"ALTER TABLE {table} ALTER COLUMN owner TYPE varchar({length})")
        finally:
            other.close()

    first = ledger.claim("tests.retyped", SLOT, "o:1:a", 30.0, abandon_is_final=True)
    assert first.owner == "o:1:a"
    retype(300)
    try:
        for minute in (1, 2, 3):  # not once: every claim on this connection
            slot = SLOT + timedelta(minutes=minute)
            row = ledger.claim("tests.retyped", slot, f"o:1:{minute}", 30.0, abandon_is_final=True)
            assert (row.owner, row.state) == (f"o:1:{minute}", RunState.RUNNING)
    finally:
        connection.close()
        retype(TaskRun._meta.get_field("owner").max_length or 255)
    assert TaskRun.objects.filter(task_name="tests.retyped").count() == 4
