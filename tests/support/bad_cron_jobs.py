"""A module of schedules whose decorator refuses its cron (minute 61): check
``taskguard.E027`` names it, and ``run_schedules`` stops with a ``CommandError``."""

from __future__ import annotations

from django_taskguard import once_per_schedule


@once_per_schedule(cron="61 * * * *", name="tests.bad_cron.report")
def report() -> None: ...
