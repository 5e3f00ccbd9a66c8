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
from django_taskguard.pauses import forget

pytestmark = pytest.mark.django_db(transaction=True)
SECOND = timedelta(seconds=1)
NEEDS_EXTRA = modify_settings(INSTALLED_APPS={"append": "tests.apps.needs_extra"})
BROKEN = modify_settings(INSTALLED_APPS={"append": "tests.apps.broken"})
MISSING = "tests.apps.needs_extra.tasks could not be imported (ModuleNotFoundError: No module named"


@pytest.fixture(autouse=True)
def job() -> Iterator[None]:
    forget()

    @once_per_schedule(every=SECOND, name="tests.discovery.job")
    def job() -> str:
        return "ran"

    yield
    registry.unregister("tests.discovery.job")
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
    assert skipped.module == "tests.apps.needs_extra.tasks"
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
        with pytest.raises(CommandError, match=r"tests\.apps\.broken\.jobs raised RuntimeError: "
                           "this jobs module is broken"):  # fmt: skip
            run(*command)
    _out, err = run("pause_task", "tests.discovery.job")
    assert "tests.apps.broken.jobs raised RuntimeError: this jobs module is broken" in err
