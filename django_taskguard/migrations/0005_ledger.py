"""The ledger's own row: its identity (Redis keys of two projects on one Redis never
meet) and, on SQLite, the fence counter that never goes back."""

import uuid

from django.db import migrations, models

import django_taskguard._compat


def create_row(apps, schema_editor):  # type: ignore[no-untyped-def]
    Ledger = apps.get_model("taskguard", "Ledger")
    TaskRun = apps.get_model("taskguard", "TaskRun")
    db = schema_editor.connection.alias
    last = TaskRun.objects.using(db).aggregate(last=models.Max("fence"))["last"] or 0
    Ledger.objects.using(db).get_or_create(id=1, defaults={"identity": uuid.uuid4(), "fence": last})


class Migration(migrations.Migration):
    dependencies = [("taskguard", "0004_taskrun_state_slot")]

    operations = [
        migrations.CreateModel(
            name="Ledger",
            fields=[
                (
                    "id",
                    models.PositiveSmallIntegerField(default=1, primary_key=True, serialize=False),
                ),
                (
                    "identity",
                    models.UUIDField(default=uuid.uuid4, editable=False, verbose_name="identity"),
                ),
                ("fence", models.BigIntegerField(default=0, verbose_name="last fence")),
            ],
            options={
                "verbose_name": "ledger",
                "verbose_name_plural": "ledger",
                "constraints": [
                    django_taskguard._compat.check_constraint(
                        models.Q(("id", 1)), "taskguard_ledger_single_row"
                    )
                ],
            },
        ),
        migrations.RunPython(create_row, migrations.RunPython.noop, elidable=False),
    ]
