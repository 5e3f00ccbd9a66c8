"""PostgreSQL: the hot statements as PL/pgSQL functions (``ledger.backends.postgresql.Function``).

Nothing is done on another database. Reversible: going back drops them, and the
release before this one never calls them.
"""

from typing import Any

from django.db import migrations

from django_taskguard.ledger.backends.postgresql import PostgreSQLBackend


def forwards(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        for function in PostgreSQLBackend().functions:
            cursor.execute(function.create)


def backwards(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        for function in PostgreSQLBackend().functions:
            cursor.execute(function.drop)


class Migration(migrations.Migration):
    dependencies = [("taskguard", "0012_taskschedule_default_zone")]

    operations = [migrations.RunPython(forwards, backwards, elidable=False)]
