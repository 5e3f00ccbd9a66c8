import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models

from django_taskguard._compat import check_constraint


class Migration(migrations.Migration):

    initial = True

    dependencies = [
    ]

    operations = [
        migrations.CreateModel(
            name='TaskRun',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('task_name', models.CharField(max_length=255, verbose_name='task')),
                ('slot', models.DateTimeField(help_text='The schedule fire time, in UTC.', verbose_name='slot')),
                ('state', models.CharField(choices=[('pending', 'pending'), ('running', 'running'), ('retrying', 'retrying'), ('succeeded', 'succeeded'), ('failed', 'failed'), ('skipped', 'skipped'), ('abandoned', 'abandoned')], default='pending', max_length=16, verbose_name='state')),
                ('attempt', models.PositiveIntegerField(default=0, verbose_name='attempt')),
                ('fence', models.BigIntegerField(blank=True, help_text="Grows with every attempt; a stale owner's writes are refused by it.", null=True, verbose_name='fence')),
                ('owner', models.CharField(blank=True, default='', max_length=255, verbose_name='owner')),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now, verbose_name='created at')),
                ('started_at', models.DateTimeField(blank=True, null=True, verbose_name='started at')),
                ('lease_until', models.DateTimeField(blank=True, null=True, verbose_name='lease until')),
                ('finished_at', models.DateTimeField(blank=True, null=True, verbose_name='finished at')),
                ('error', models.TextField(blank=True, default='', verbose_name='error')),
                ('duplicates', models.PositiveIntegerField(default=0, help_text='Attempts that found the slot taken.', verbose_name='duplicates')),
            ],
            options={
                'verbose_name': 'task run',
                'verbose_name_plural': 'task runs',
                'ordering': ['-slot', '-id'],
                'indexes': [models.Index(fields=['state', 'lease_until'], name='taskguard_run_state_lease'), models.Index(fields=['fence'], name='taskguard_run_fence'), models.Index(fields=['-slot', '-id'], name='taskguard_run_slot_desc')],
                'constraints': [models.UniqueConstraint(fields=('task_name', 'slot'), name='taskguard_run_task_slot'), check_constraint(models.Q(('state__in', ['pending', 'running', 'retrying', 'succeeded', 'failed', 'skipped', 'abandoned'])), 'taskguard_run_state_valid')],
            },
        ),
        migrations.CreateModel(
            name='TaskRunTransition',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('from_state', models.CharField(choices=[('pending', 'pending'), ('running', 'running'), ('retrying', 'retrying'), ('succeeded', 'succeeded'), ('failed', 'failed'), ('skipped', 'skipped'), ('abandoned', 'abandoned')], max_length=16, verbose_name='from')),
                ('to_state', models.CharField(choices=[('pending', 'pending'), ('running', 'running'), ('retrying', 'retrying'), ('succeeded', 'succeeded'), ('failed', 'failed'), ('skipped', 'skipped'), ('abandoned', 'abandoned')], max_length=16, verbose_name='to')),
                ('at', models.DateTimeField(default=django.utils.timezone.now, verbose_name='at')),
                ('reason', models.TextField(blank=True, default='', verbose_name='reason')),
                ('owner', models.CharField(blank=True, default='', max_length=255, verbose_name='owner')),
                ('run', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='transitions', to='taskguard.taskrun', verbose_name='run')),
            ],
            options={
                'verbose_name': 'transition',
                'verbose_name_plural': 'transitions',
                'ordering': ['at', 'id'],
            },
        ),
    ]
