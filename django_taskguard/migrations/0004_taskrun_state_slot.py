"""An index for the admin's state filter and for prune_runs: state, newest slot first.

The task filter is served by the (task_name, slot) unique constraint's index.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("taskguard", "0003_taskrun_permissions")]

    operations = [
        migrations.AddIndex(
            model_name="taskrun",
            index=models.Index(fields=["state", "-slot", "-id"], name="taskguard_run_state_slot"),
        ),
    ]
