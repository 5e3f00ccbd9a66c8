"""The end of a schedule's latest pause, kept so that the missed-slot sweep labels each slot
by the pause state at its own time (issue 20)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("taskguard", "0010_taskrun_retry_by"),
    ]

    operations = [
        migrations.AlterField(
            model_name="taskschedule",
            name="paused_at",
            field=models.DateTimeField(
                blank=True,
                help_text="When the latest pause began (kept after a resume: the sweep labels by it).",
                null=True,
                verbose_name="paused at",
            ),
        ),
        migrations.AddField(
            model_name="taskschedule",
            name="resumed_at",
            field=models.DateTimeField(
                blank=True,
                help_text="When the latest pause ended (empty while paused or never paused).",
                null=True,
                verbose_name="resumed at",
            ),
        ),
    ]
