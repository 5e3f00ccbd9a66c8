"""PostgreSQL: the hot statements as PL/pgSQL functions (``ledger.backends.postgresql.Function``).

Their text as of this migration, frozen as migrations are: the backend renders the same
functions from its statements, and ``tests/test_functions.py`` fails when the two differ (a
changed statement is a new version, ``_v2``, created by a new migration). Nothing is done
on another database. Reversible: going back drops them, and the release before this one
never calls them.
"""

from typing import Any

from django.db import migrations

CREATE = [
    (
        "CREATE OR REPLACE FUNCTION taskguard_claim_v1(p_task varchar, p_slot timestamptz, "
        "p_owner varchar, p_lease float8, p_count_live boolean, p_abandon_final boolean) "
        "RETURNS TABLE (o_id bigint, o_state varchar, o_attempt integer, o_fence bigint, "
        "o_owner varchar, o_lease_until timestamptz, o_left numeric) LANGUAGE plpgsql "
        "VOLATILE AS $taskguard$ BEGIN RETURN QUERY WITH u AS (INSERT INTO taskguard_taskrun "
        "AS r (task_name, slot, state, attempt, fence, owner, created_at, started_at, "
        "lease_until, error, duplicates) VALUES (p_task, p_slot, 'running', 1, "
        "nextval('taskguard_fence'), p_owner, statement_timestamp(), statement_timestamp(), "
        "statement_timestamp() + make_interval(secs => p_lease), '', 0) ON CONFLICT "
        "(task_name, slot) DO UPDATE SET duplicates = r.duplicates + CASE WHEN r.state IN "
        "('failed', 'skipped', 'succeeded') OR (r.state = 'running' AND r.lease_until > "
        "statement_timestamp() AND p_count_live) OR (r.state = 'abandoned' AND "
        "p_abandon_final) THEN 1 ELSE 0 END RETURNING id, state, attempt, fence, owner, "
        "lease_until, EXTRACT(EPOCH FROM lease_until - statement_timestamp())), t AS (INSERT "
        "INTO taskguard_taskruntransition (run_id, from_state, to_state, at, reason, owner) "
        "SELECT id, 'pending', 'running', statement_timestamp(), 'claimed', owner  FROM u "
        "WHERE owner = p_owner) SELECT * FROM u; END; $taskguard$"
    ),
    (
        "CREATE OR REPLACE FUNCTION taskguard_claim_key_v1(p_task varchar, p_slot "
        "timestamptz, p_key varchar, p_owner varchar, p_lease float8, p_count_live boolean, "
        "p_abandon_final boolean) RETURNS TABLE (o_id bigint, o_state varchar, o_attempt "
        "integer, o_fence bigint, o_owner varchar, o_lease_until timestamptz, o_left numeric)"
        " LANGUAGE plpgsql VOLATILE AS $taskguard$ BEGIN RETURN QUERY WITH u AS (INSERT INTO "
        'taskguard_taskrun AS r (task_name, slot, "key", state, attempt, fence, owner, '
        "created_at, started_at, lease_until, error, duplicates) VALUES (p_task, p_slot, "
        "p_key, 'running', 1, nextval('taskguard_fence'), p_owner, statement_timestamp(), "
        "statement_timestamp(), statement_timestamp() + make_interval(secs => p_lease), '', "
        '0) ON CONFLICT (task_name, "key") WHERE "key" IS NOT NULL DO UPDATE SET duplicates ='
        " r.duplicates + CASE WHEN r.state IN ('failed', 'skipped', 'succeeded') OR (r.state "
        "= 'running' AND r.lease_until > statement_timestamp() AND p_count_live) OR (r.state "
        "= 'abandoned' AND p_abandon_final) THEN 1 ELSE 0 END RETURNING id, state, attempt, "
        "fence, owner, lease_until, EXTRACT(EPOCH FROM lease_until - statement_timestamp())),"
        " t AS (INSERT INTO taskguard_taskruntransition (run_id, from_state, to_state, at, "
        "reason, owner) SELECT id, 'pending', 'running', statement_timestamp(), 'claimed', "
        "owner  FROM u WHERE owner = p_owner) SELECT * FROM u; END; $taskguard$"
    ),
    (
        "CREATE OR REPLACE FUNCTION taskguard_end_attempt_v1(p_state varchar, p_error text, "
        "p_duplicates integer, p_id bigint, p_expected varchar, p_fence bigint, p_actor "
        "varchar, p_reason text) RETURNS TABLE (o_id bigint, o_state varchar, o_attempt "
        "integer, o_fence bigint, o_owner varchar, o_lease_until timestamptz) LANGUAGE "
        "plpgsql VOLATILE AS $taskguard$ BEGIN RETURN QUERY WITH u AS (UPDATE "
        "taskguard_taskrun AS r SET state = p_state, error = p_error, finished_at = "
        "statement_timestamp(), duplicates = r.duplicates + p_duplicates WHERE r.id = p_id "
        "AND r.state = p_expected AND r.fence = p_fence RETURNING id, state, attempt, fence, "
        "owner, lease_until), t AS (INSERT INTO taskguard_taskruntransition (run_id, "
        "from_state, to_state, at, reason, owner) SELECT u.id, v.f, v.t, "
        "statement_timestamp(), v.r, p_actor FROM u, (VALUES (p_expected, p_state, p_reason, "
        "0)) AS v(f, t, r, n) ORDER BY v.n) SELECT * FROM u; END; $taskguard$"
    ),
]
DROP = [
    "DROP FUNCTION IF EXISTS taskguard_claim_v1(p_task varchar, p_slot timestamptz, p_owner varchar, p_lease float8, p_count_live boolean, p_abandon_final boolean)",
    "DROP FUNCTION IF EXISTS taskguard_claim_key_v1(p_task varchar, p_slot timestamptz, p_key varchar, p_owner varchar, p_lease float8, p_count_live boolean, p_abandon_final boolean)",
    "DROP FUNCTION IF EXISTS taskguard_end_attempt_v1(p_state varchar, p_error text, p_duplicates integer, p_id bigint, p_expected varchar, p_fence bigint, p_actor varchar, p_reason text)",
]


def forwards(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        for statement in CREATE:
            schema_editor.execute(statement, params=None)


def backwards(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        for statement in DROP:
            schema_editor.execute(statement, params=None)


class Migration(migrations.Migration):
    dependencies = [("taskguard", "0012_taskschedule_default_zone")]

    operations = [migrations.RunPython(forwards, backwards, elidable=False)]
