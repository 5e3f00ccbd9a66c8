"""The project's own jobs module after a broken deploy: it registers one schedule, then an
import fails (a renamed helper), so the schedule after that line is never registered."""

from datetime import timedelta

from django_taskguard import once_per_schedule


@once_per_schedule(every=timedelta(seconds=1), name="tests.typo.first")
def first() -> str:
    return "ran"


from django_taskguard.schedules import renamed_helper  # type: ignore[attr-defined]  # noqa: E402, F401


@once_per_schedule(every=timedelta(seconds=1), name="tests.typo.second")
def second() -> str:
    return "ran"
