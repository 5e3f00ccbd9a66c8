"""The PostgreSQL sequence that hands out fences (SQLite uses MAX(fence) + 1)."""

from django.db import migrations

SEQUENCE = "taskguard_fence"


def create_sequence(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE} AS bigint START 1 "
            f"OWNED BY taskguard_taskrun.fence"
        )


def drop_sequence(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP SEQUENCE IF EXISTS {SEQUENCE}")


class Migration(migrations.Migration):
    dependencies = [("taskguard", "0001_initial")]

    operations = [migrations.RunPython(create_sequence, drop_sequence, elidable=False)]
