"""Django's TIME_ZONE of the copy that saved a schedule, so that a copy with another one is
noticed (check taskguard.W020) and the sweep reads a cron in the zone it was saved with
(issue 20)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("taskguard", "0011_taskschedule_resumed_at"),
    ]

    operations = [
        migrations.AddField(
            model_name="taskschedule",
            name="default_zone",
            field=models.CharField(
                blank=True,
                default="",
                help_text=(
                    "Django's TIME_ZONE in the copy that last saved it: a cron without its own "
                    "time zone runs in it."
                ),
                max_length=64,
                verbose_name="default time zone",
            ),
        ),
    ]
