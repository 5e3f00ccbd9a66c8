"""PostgreSQL: the hot statements' functions (``ledger.backends.postgresql.Function``,
migration 0013) are the backend's statements as the migration froze them, are called with
Django's default OPTIONS, and go with the migration."""

from __future__ import annotations

from datetime import timedelta
from importlib import import_module

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_taskguard import once_per_key, once_per_schedule
from django_taskguard.ledger.backends.postgresql import PostgreSQLBackend
from django_taskguard.models import RunState, TaskRun, TaskRunTransition

from .support.proc import BASE_SLOT

pytestmark = [
    pytest.mark.once,
    pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL only"),
]

MIGRATION = import_module("django_taskguard.migrations.0013_functions")
V1 = PostgreSQLBackend().functions


def bodies() -> dict[str, str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT proname, prosrc FROM pg_proc WHERE proname = ANY(%s)",
            [[function.name for function in V1]],
        )
        return dict(cursor.fetchall())


@pytest.mark.django_db
def test_the_databases_bodies_are_the_codes_text() -> None:
    """The migrations' frozen text is what the backend renders from its statements: a
    changed statement is a new version (``_v2``, a new migration), never a body changed
    under a name a database already holds."""
    assert bodies() == {function.name: function.body for function in V1}


@pytest.mark.django_db(transaction=True)
def test_winners_claim_and_finish_call_the_functions_with_their_transitions() -> None:
    @once_per_schedule(name="tests.functions")
    def body() -> str:
        return "ran"

    @once_per_key(key="k:{n}", name="tests.functions.keyed")
    def keyed(n: int) -> int:
        return n

    with CaptureQueriesContext(connection) as queries:
        assert body.run_for_slot(BASE_SLOT + timedelta(days=3)) == "ran"
        assert keyed(1) == 1
    sent = [query["sql"] for query in queries.captured_queries]
    for function in V1:
        assert sum(s.startswith(f"SELECT * FROM {function.name}(") for s in sent) >= 1, sent
    assert not any(s.startswith("WITH u AS") for s in sent), sent
    for name in ("tests.functions", "tests.functions.keyed"):
        run = TaskRun.objects.get(task_name=name)
        assert run.state == RunState.SUCCEEDED
        logged = TaskRunTransition.objects.filter(run=run).order_by("id")
        assert [(t.from_state, t.to_state) for t in logged] == [
            (RunState.PENDING, RunState.RUNNING),
            (RunState.RUNNING, RunState.SUCCEEDED),
        ]
        assert logged[0].at == run.started_at  # the function's statement time is the call's
        assert logged[1].at == run.finished_at


@pytest.mark.django_db(transaction=True)
def test_migration_backwards_drops_them_forwards_makes_them() -> None:
    with connection.schema_editor() as editor:
        MIGRATION.backwards(None, editor)
    assert bodies() == {}
    with connection.schema_editor() as editor:
        MIGRATION.forwards(None, editor)
    assert bodies() == {function.name: function.body for function in V1}
