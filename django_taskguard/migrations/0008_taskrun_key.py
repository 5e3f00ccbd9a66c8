"""Keyed runs (``@once_per_key``): nullable ``key`` and ``result`` columns and a partial
unique index on (task_name, key) where key is not null.

None rewrites the table. Adding a nullable column with no default is a catalog
change (PostgreSQL and SQLite). On PostgreSQL the index is built with
``CREATE UNIQUE INDEX CONCURRENTLY`` (so this migration is not atomic): it scans
the table once but takes only a SHARE UPDATE EXCLUSIVE lock, so claims and
finishes go on while it is built. The (task_name, slot) constraint is left as it
is: keyed rows carry the time of their claim as their slot (see ``ledger.claim``).
"""

from typing import Any

from django.db import migrations, models

INDEX = "taskguard_run_task_key"
TABLE = "taskguard_taskrun"


def create_index(apps: Any, schema_editor: Any) -> None:
    TaskRun = apps.get_model("taskguard", "TaskRun")
    constraint = _constraint()
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.add_constraint(TaskRun, constraint)
        return
    with schema_editor.connection.cursor() as cursor:
        # A build interrupted earlier leaves an INVALID index of this name: drop it first.
        cursor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}")
        cursor.execute(
            f'CREATE UNIQUE INDEX CONCURRENTLY {INDEX} ON {TABLE} (task_name, "key") '
            f'WHERE "key" IS NOT NULL'
        )


def drop_index(apps: Any, schema_editor: Any) -> None:
    TaskRun = apps.get_model("taskguard", "TaskRun")
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.remove_constraint(TaskRun, _constraint())
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}")


def _constraint() -> models.UniqueConstraint:
    return models.UniqueConstraint(
        fields=["task_name", "key"], condition=models.Q(key__isnull=False), name=INDEX
    )


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("taskguard", "0007_taskrun_task_state")]

    operations = [
        migrations.AddField(
            model_name="taskrun",
            name="key",
            field=models.CharField(
                blank=True,
                default=None,
                help_text="The key of an @once_per_key run (empty for a schedule slot).",
                max_length=255,
                null=True,
                verbose_name="key",
            ),
        ),
        migrations.AddField(
            model_name="taskrun",
            name="result",
            field=models.TextField(
                blank=True,
                default=None,
                help_text="The JSON result of an @once_per_key(return_result=True) run.",
                null=True,
                verbose_name="result",
            ),
        ),
        migrations.AlterField(
            model_name="taskrun",
            name="slot",
            field=models.DateTimeField(
                help_text=(
                    "The schedule fire time, in UTC (a keyed run: when its key was first claimed)."
                ),
                verbose_name="slot",
            ),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddConstraint(model_name="taskrun", constraint=_constraint())
            ],
            database_operations=[migrations.RunPython(create_index, drop_index, elidable=False)],
        ),
    ]
