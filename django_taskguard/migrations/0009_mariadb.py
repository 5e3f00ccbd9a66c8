"""MariaDB: what the ledger needs there that Django's operations do not make.

Nothing is done on another database.

- The fence source, a ``SEQUENCE`` (as on PostgreSQL): not transactional, never goes
  back. It starts past the highest fence stored.
- The (task_name, key) unique index. Django leaves the conditional constraint out on
  MariaDB (no partial indexes; ``models.W036`` says so); a plain unique index is the same
  rule there, since InnoDB lets any number of rows have a NULL key.
- Binary text comparison of the ledger's and the schedules' tables
  (``utf8mb4_nopad_bin``): with a database's usual case-insensitive collation, task
  names or keys that differ only in case or trailing spaces would be one slot. The
  tables' default collation changes too, so later column changes keep it.
"""

from typing import Any

from django.db import migrations

SEQUENCE = "taskguard_fence"
INDEX = "taskguard_run_task_key"
RUN = "taskguard_taskrun"
BINARY = ("taskguard_taskrun", "taskguard_taskruntransition", "taskguard_taskschedule")
COLLATION = "utf8mb4_nopad_bin"


def forwards(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "mysql":
        return
    with schema_editor.connection.cursor() as cursor:
        for table in BINARY:
            cursor.execute(
                f"ALTER TABLE {table} CONVERT TO CHARACTER SET utf8mb4 COLLATE {COLLATION}"
            )
        cursor.execute(f"SELECT COALESCE(MAX(fence), 0) + 1 FROM {RUN}")
        (start,) = cursor.fetchone()
        cursor.execute(f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE} START WITH {int(start)}")
        cursor.execute(f"CREATE UNIQUE INDEX IF NOT EXISTS {INDEX} ON {RUN} (task_name, `key`)")


def backwards(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "mysql":
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(f"DROP INDEX IF EXISTS {INDEX} ON {RUN}")
        cursor.execute(f"DROP SEQUENCE IF EXISTS {SEQUENCE}")


class Migration(migrations.Migration):
    dependencies = [("taskguard", "0008_taskrun_key")]

    operations = [migrations.RunPython(forwards, backwards, elidable=False)]
