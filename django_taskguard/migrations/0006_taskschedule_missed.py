"""The schedule registry (``TaskSchedule``) and the ``missed`` run state (issue 11)."""

import django.utils.timezone
from django.db import migrations, models

from django_taskguard._compat import check_constraint


class Migration(migrations.Migration):
    dependencies = [
        ("taskguard", "0005_ledger"),
    ]

    operations = [
        migrations.CreateModel(
            name="TaskSchedule",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("task_name", models.CharField(max_length=255, unique=True, verbose_name="task")),
                (
                    "source",
                    models.CharField(
                        choices=[
                            ("function", "a decorated function (run_schedules fires it)"),
                            ("celery", "a Celery task or beat entry (a beat fires it)"),
                        ],
                        default="function",
                        max_length=16,
                        verbose_name="source",
                    ),
                ),
                (
                    "function",
                    models.CharField(
                        blank=True,
                        default="",
                        help_text="Its dotted path.",
                        max_length=500,
                        verbose_name="function",
                    ),
                ),
                (
                    "cron",
                    models.CharField(blank=True, default="", max_length=255, verbose_name="cron"),
                ),
                (
                    "cron_day_or",
                    models.BooleanField(
                        default=True,
                        help_text="Cron's rule (day of month OR day of week); False for celery crontabs.",
                        verbose_name="cron day rule: or",
                    ),
                ),
                ("every", models.DurationField(blank=True, null=True, verbose_name="every")),
                (
                    "time_zone",
                    models.CharField(
                        blank=True,
                        default="",
                        help_text="Empty: Django's TIME_ZONE.",
                        max_length=64,
                        verbose_name="time zone",
                    ),
                ),
                (
                    "catchup",
                    models.CharField(
                        choices=[
                            ("latest", "latest: run the latest slot only"),
                            (
                                "none",
                                "none: a slot later than its grace is recorded missed, not run",
                            ),
                            ("all", "all: run every missed slot in order, at most max_catchup"),
                        ],
                        default="latest",
                        max_length=8,
                        verbose_name="catch-up",
                    ),
                ),
                ("grace", models.DurationField(verbose_name="grace")),
                ("max_catchup", models.PositiveIntegerField(verbose_name="max catch-up")),
                (
                    "pause_after_failures",
                    models.PositiveIntegerField(
                        blank=True, null=True, verbose_name="pause after failures"
                    ),
                ),
                ("paused", models.BooleanField(default=False, verbose_name="paused")),
                (
                    "paused_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="paused at"),
                ),
                (
                    "paused_reason",
                    models.TextField(blank=True, default="", verbose_name="paused reason"),
                ),
                (
                    "first_seen",
                    models.DateTimeField(
                        default=django.utils.timezone.now, verbose_name="first seen"
                    ),
                ),
                (
                    "last_seen",
                    models.DateTimeField(
                        default=django.utils.timezone.now, verbose_name="last seen"
                    ),
                ),
                (
                    "swept_until",
                    models.DateTimeField(
                        blank=True,
                        help_text="Slots at or before this were checked by the missed-slot sweep.",
                        null=True,
                        verbose_name="swept until",
                    ),
                ),
            ],
            options={
                "verbose_name": "task schedule",
                "verbose_name_plural": "task schedules",
                "ordering": ["task_name"],
                "permissions": [("pause_taskschedule", "Can pause and resume scheduled tasks")],
            },
        ),
        migrations.RemoveConstraint(
            model_name="taskrun",
            name="taskguard_run_state_valid",
        ),
        migrations.AlterField(
            model_name="taskrun",
            name="state",
            field=models.CharField(
                choices=[
                    ("pending", "pending"),
                    ("running", "running"),
                    ("retrying", "retrying"),
                    ("succeeded", "succeeded"),
                    ("failed", "failed"),
                    ("skipped", "skipped"),
                    ("abandoned", "abandoned"),
                    ("missed", "missed"),
                ],
                default="pending",
                max_length=16,
                verbose_name="state",
            ),
        ),
        migrations.AlterField(
            model_name="taskruntransition",
            name="from_state",
            field=models.CharField(
                choices=[
                    ("pending", "pending"),
                    ("running", "running"),
                    ("retrying", "retrying"),
                    ("succeeded", "succeeded"),
                    ("failed", "failed"),
                    ("skipped", "skipped"),
                    ("abandoned", "abandoned"),
                    ("missed", "missed"),
                ],
                max_length=16,
                verbose_name="from",
            ),
        ),
        migrations.AlterField(
            model_name="taskruntransition",
            name="to_state",
            field=models.CharField(
                choices=[
                    ("pending", "pending"),
                    ("running", "running"),
                    ("retrying", "retrying"),
                    ("succeeded", "succeeded"),
                    ("failed", "failed"),
                    ("skipped", "skipped"),
                    ("abandoned", "abandoned"),
                    ("missed", "missed"),
                ],
                max_length=16,
                verbose_name="to",
            ),
        ),
        migrations.AddConstraint(
            model_name="taskrun",
            constraint=check_constraint(
                models.Q(
                    (
                        "state__in",
                        [
                            "pending",
                            "running",
                            "retrying",
                            "succeeded",
                            "failed",
                            "skipped",
                            "abandoned",
                            "missed",
                        ],
                    )
                ),
                "taskguard_run_state_valid",
            ),
        ),
        migrations.AddConstraint(
            model_name="taskschedule",
            constraint=check_constraint(
                models.Q(
                    models.Q(("cron", ""), ("every__isnull", False)),
                    models.Q(models.Q(("cron", ""), _negated=True), ("every", None)),
                    _connector="OR",
                ),
                "taskguard_schedule_cron_or_every",
            ),
        ),
        migrations.AddConstraint(
            model_name="taskschedule",
            constraint=check_constraint(
                models.Q(("catchup__in", ["latest", "none", "all"])), "taskguard_schedule_catchup"
            ),
        ),
    ]
