"""A data schedule's empty catch-up, grace, max catch-up, pause after failures and late after
follow its target's decorator (issue 33): the columns take empty values, for data schedules
only. Rows already stored keep what they hold (nothing says they were the target's)."""

from django.db import migrations, models

from django_taskguard._compat import check_constraint

FOLLOWS = "Empty (a data schedule's): its target's."


class Migration(migrations.Migration):
    dependencies = [
        ("taskguard", "0019_taskoverview"),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name="taskschedule",
            name="taskguard_schedule_catchup",
        ),
        migrations.AlterField(
            model_name="taskschedule",
            name="catchup",
            field=models.CharField(
                blank=True,
                choices=[
                    ("latest", "latest: run the latest slot only"),
                    ("none", "none: a slot later than its grace is recorded missed, not run"),
                    ("all", "all: run every missed slot in order, at most max_catchup"),
                ],
                default="latest",
                help_text=FOLLOWS,
                max_length=8,
                verbose_name="catch-up",
            ),
        ),
        migrations.AlterField(
            model_name="taskschedule",
            name="grace",
            field=models.DurationField(
                blank=True, help_text=FOLLOWS, null=True, verbose_name="grace"
            ),
        ),
        migrations.AlterField(
            model_name="taskschedule",
            name="late_after",
            field=models.DurationField(
                blank=True,
                help_text="Its last LATE_START_RUNS slots all starting later than this after "
                "their time make it unhealthy; empty: TASKGUARD['LATE_START_SECONDS'] (a data "
                "schedule's: its target's, else that setting).",
                null=True,
                verbose_name="late after",
            ),
        ),
        migrations.AlterField(
            model_name="taskschedule",
            name="max_catchup",
            field=models.PositiveIntegerField(
                blank=True, help_text=FOLLOWS, null=True, verbose_name="max catch-up"
            ),
        ),
        migrations.AlterField(
            model_name="taskschedule",
            name="pause_after_failures",
            field=models.PositiveIntegerField(
                blank=True,
                help_text="Empty: never (a data schedule's: its target's, else never).",
                null=True,
                verbose_name="pause after failures",
            ),
        ),
        migrations.AddConstraint(
            model_name="taskschedule",
            constraint=check_constraint(
                models.Q(("catchup__in", ["latest", "none", "all"]))
                | models.Q(("catchup", ""), ("source", "data")),
                "taskguard_schedule_catchup",
            ),
        ),
        migrations.AddConstraint(
            model_name="taskschedule",
            constraint=check_constraint(
                models.Q(("source", "data"))
                | models.Q(("grace__isnull", False), ("max_catchup__isnull", False)),
                "taskguard_schedule_code_policy",
            ),
        ),
    ]
