"""The custom permission that gates the admin's cleanup and release actions."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("taskguard", "0002_fence_sequence")]

    operations = [
        migrations.AlterModelOptions(
            name="taskrun",
            options={
                "ordering": ["-slot", "-id"],
                "permissions": [("cleanup_taskrun", "Can clean up stale locks and release locks")],
                "verbose_name": "task run",
                "verbose_name_plural": "task runs",
            },
        ),
    ]
