"""Acknowledging a schedule's problems gets its own permission (it shared the pause one)."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("taskguard", "0017_taskschedule_owed")]

    operations = [
        migrations.AlterModelOptions(
            name="taskschedule",
            options={
                "ordering": ["task_name"],
                "permissions": [
                    ("pause_taskschedule", "Can pause and resume scheduled tasks"),
                    ("run_taskschedule", "Can run a schedule now"),
                    ("backfill_taskschedule", "Can backfill a schedule's slots"),
                    ("acknowledge_taskschedule", "Can acknowledge a schedule's problems"),
                ],
                "verbose_name": "task schedule",
                "verbose_name_plural": "task schedules",
            },
        ),
    ]
