"""Discovery of the apps' ``tasks``/``jobs`` modules when one cannot be imported: it is named
with its error; the commands go on where that is safe, and stop with a clear message where not."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import modify_settings
from django.utils import timezone

from django_taskguard import once_per_schedule, registry
from django_taskguard.ledger import schedules as store
from django_taskguard.models import ScheduleSource, TaskRun, TaskSchedule
from django_taskguard.pauses import forget

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]
SECOND = timedelta(seconds=1)
NEEDS_EXTRA = modify_settings(INSTALLED_APPS={"append": "tests.support.apps.needs_extra"})
BROKEN = modify_settings(INSTALLED_APPS={"append": "tests.support.apps.broken"})
MISSING = (
    "tests.support.apps.needs_extra.tasks could not be imported "
    "(ModuleNotFoundError: No module named"
)


@pytest.fixture(autouse=True)
def job() -> Iterator[None]:
    forget()

    @once_per_schedule(every=SECOND, name="tests.discovery.job")
    def job() -> str:
        return "ran"

    yield
    for name in ("tests.discovery.job", "tests.typo.first", "tests.typo.second"):
        registry.unregister(name)
    forget()


def run(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


@NEEDS_EXTRA
def test_discover__app_module_missing_dependency_named_and_skipped():
    found = registry.discover()
    assert "tests.discovery.job" in found
    [skipped] = registry.unimported()
    assert skipped.module == "tests.support.apps.needs_extra.tasks"
    assert str(skipped).startswith(MISSING), str(skipped)


@NEEDS_EXTRA
def test_commands__app_module_missing_dependency_warned_and_go_on():
    end = timezone.now().replace(microsecond=0) - 10 * SECOND
    commands = [
        ("pause_task", "tests.discovery.job"),
        ("resume_task", "tests.discovery.job"),
        ("cleanup_locks",),
        ("backfill", "tests.discovery.job", "--from", (end - 2 * SECOND).isoformat(),
         "--to", end.isoformat()),
        ("run_schedules", "--once", "--task", "tests.discovery.job"),
    ]  # fmt: skip
    for command in commands:
        _out, err = run(*command)
        assert MISSING in err, (command, err)


@NEEDS_EXTRA
def test_commands__unknown_task_names_the_module_that_was_not_imported():
    for command in ("pause_task", "backfill"):
        args = ["--from", "2026-01-01T00:00Z", "--to", "2026-01-01T00:01Z"]
        with pytest.raises(CommandError, match=r"needs_extra\.tasks could not be imported"):
            call_command(command, "tests.nowhere.job", *(args if command == "backfill" else []))


@BROKEN
def test_commands__app_module_that_raises_stops_the_scheduler_not_the_operator():
    for command in (("run_schedules", "--once"), ("backfill", "tests.discovery.job", "--from",
                    "2026-01-01T00:00Z", "--to", "2026-01-01T00:01Z")):  # fmt: skip
        with pytest.raises(CommandError, match=r"tests\.support\.apps\.broken\.jobs raised "
                           "RuntimeError: this jobs module is broken"):  # fmt: skip
            run(*command)
    _out, err = run("pause_task", "tests.discovery.job")
    assert "tests.support.apps.broken.jobs raised RuntimeError: this jobs module is broken" in err


TYPO = modify_settings(INSTALLED_APPS={"append": "tests.support.apps.typo"})
TYPO_SAID = (
    r"tests\.support\.apps\.typo\.jobs could not be imported \(ImportError: cannot import name"
)
RUNNERS = [
    ("run_schedules", "--once"),
    ("backfill", "tests.discovery.job", "--from", "2026-01-01T00:00Z", "--to", "2026-01-01T00:01Z"),
]


def store_schedule(task_name: str, function: str) -> None:
    """What an earlier deploy saved: a schedule of the module that now fails to import."""
    store.save([store.Record(
        task_name=task_name, source=ScheduleSource.FUNCTION, function=function, cron="",
        cron_day_or=True, every=SECOND, time_zone="", default_zone="UTC", catchup="latest",
        grace=timedelta(minutes=1), max_catchup=1, pause_after_failures=None,
    )])  # fmt: skip


@TYPO
@pytest.mark.parametrize("command", RUNNERS, ids=["run_schedules", "backfill"])
def test_runners__own_module_import_error_stops_and_forgets_what_it_half_registered(
    command: tuple[str, ...],
):
    # The reviewer's reproduction: `first` registers, the import fails, `second` was saved.
    store_schedule("tests.typo.second", "tests.support.apps.typo.jobs.second")
    with pytest.raises(
        CommandError, match=TYPO_SAID + r".*tests\.typo\.first, tests\.typo\.second"
    ):
        run(*command)
    assert "tests.typo.first" not in registry.entries()
    assert not TaskRun.objects.filter(task_name__startswith="tests.typo.").exists()
    assert not TaskSchedule.objects.filter(task_name="tests.typo.first").exists()


@TYPO
def test_runners__a_half_import_alone_says_the_module_declares_schedules():
    with pytest.raises(CommandError, match=TYPO_SAID + r".*the schedules tests\.typo\.first,"):
        run("run_schedules", "--once")
    assert "tests.typo.first" not in registry.entries()


@NEEDS_EXTRA
@pytest.mark.parametrize("command", RUNNERS, ids=["run_schedules", "backfill"])
def test_runners__import_error_in_a_module_with_a_saved_schedule_stops(command: tuple[str, ...]):
    store_schedule("tests.extra.job", "tests.support.apps.needs_extra.tasks.job")
    with pytest.raises(CommandError, match=r"needs_extra\.tasks could not be imported .*"
                       r"the schedules tests\.extra\.job,"):  # fmt: skip
        run(*command)


@TYPO
def test_operators__own_module_import_error_said_and_half_registered_entry_dropped():
    store_schedule("tests.typo.second", "tests.support.apps.typo.jobs.second")
    _out, err = run("pause_task", "tests.typo.second")
    assert (
        "tests.support.apps.typo.jobs could not be imported (ImportError: cannot import name" in err
    )
    assert "tests.typo.first" not in registry.entries()
    assert TaskSchedule.objects.get(task_name="tests.typo.second").paused
