"""System checks: each misconfiguration has its id; a clean configuration has none."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.test import override_settings

from django_taskguard import once_per_schedule
from django_taskguard.checks import check_settings
from django_taskguard.models import TaskRun

from .support import ROOT
from .support.slots import BASE_SLOT

pytestmark = pytest.mark.dialect

DJANGO_REDIS = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://127.0.0.1:1/0"}
LOCMEM = {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}


def ids(**overrides: object) -> list[str]:
    with override_settings(**overrides):
        return [message.id for message in check_settings()]


@pytest.mark.parametrize(
    ("taskguard", "expected"),
    [
        pytest.param({"BACKEND": "memcached"}, ["taskguard.E001"], id="E001-unknown-backend"),
        pytest.param({"BACKEND": "Redis"}, ["taskguard.E001"], id="E001-case-matters"),
        pytest.param(
            {"BACKEND": "redis", "REDIS_ALIAS": "default"},
            ["taskguard.E002"],
            id="E002-locmem-alias",
        ),
        pytest.param(
            {"BACKEND": "redis", "REDIS_ALIAS": "missing"},
            ["taskguard.E014"],
            id="E014-missing-alias",
        ),
        pytest.param({"LEASE_SECONDS": 0}, ["taskguard.E004"], id="E004-zero"),
        pytest.param({"LEASE_SECONDS": -5}, ["taskguard.E004"], id="E004-negative"),
        pytest.param({"LEASE_SECONDS": "30"}, ["taskguard.E004"], id="E004-string"),
        pytest.param({"LEASE_SECONDS": None}, ["taskguard.E004"], id="E004-none"),
        pytest.param({"LEASE_SECONDS": True}, ["taskguard.E004"], id="E004-bool"),
        pytest.param({"LEASE_SECONDS": float("nan")}, ["taskguard.E004"], id="E004-nan"),
        pytest.param({"LEASE_SECONDS": float("inf")}, ["taskguard.E004"], id="E004-inf"),
        pytest.param({"LEASE_SECONDS": 1e15}, ["taskguard.E004"], id="E004-huge"),
        pytest.param({"LEASE_SECONDS": 0.0005}, ["taskguard.E004"], id="E004-sub-millisecond"),
        pytest.param({"REDIS_SOCKET_TIMEOUT": 0}, ["taskguard.E009"], id="E009-socket-zero"),
        pytest.param({"SLOT_TOLERANCE_SECONDS": -1}, ["taskguard.E009"], id="E009-tolerance"),
        pytest.param({"PRUNE_AFTER_DAYS": 0}, ["taskguard.E009"], id="E009-prune-zero"),
        pytest.param({"PRUNE_AFTER_DAYS": 1.5}, ["taskguard.E009"], id="E009-prune-fraction"),
        pytest.param({"RETRY_GRACE_SECONDS": 1}, ["taskguard.E009"], id="E009-retry-grace"),
        pytest.param({"ON_REDIS_ERROR": "ignore"}, ["taskguard.E005"], id="E005"),
        pytest.param({"DATABASE_ALIAS": "nope"}, ["taskguard.E006"], id="E006"),
        pytest.param({"DATABASE_ALIAS": "unsupported"}, ["taskguard.E007"], id="E007"),
        pytest.param({"FINISHED_MARKER_SECONDS": -1}, ["taskguard.E012"], id="E012-negative"),
        pytest.param({"FINISHED_MARKER_SECONDS": 604801}, ["taskguard.E012"], id="E012-too-long"),
        pytest.param({"FINISHED_MARKER_SECONDS": "60"}, ["taskguard.E012"], id="E012-string"),
        pytest.param({"FINISHED_MARKER_SECONDS": True}, ["taskguard.E012"], id="E012-bool"),
        pytest.param({"HEALTH_FAILURES": 0}, ["taskguard.E009"], id="E009-health-failures"),
        pytest.param({"MONITOR_WINDOW_HOURS": 721}, ["taskguard.E009"], id="E009-window"),
        pytest.param({"HEALTH_TOKEN": "short"}, ["taskguard.E021"], id="E021-short-token"),
        pytest.param({"METRICS_TOKEN": 1234}, ["taskguard.E021"], id="E021-not-a-string"),
        pytest.param({"LEASE_SECOND": 30}, ["taskguard.W001"], id="W001-typo"),
        pytest.param(
            {"BACKEND": "x", "LEASE_SECONDS": 0, "ON_REDIS_ERROR": "x", "COLOUR": 1},
            ["taskguard.E001", "taskguard.E004", "taskguard.E005", "taskguard.W001"],
            id="several-at-once",
        ),
    ],
)
def test_check_settings__each_misconfiguration_has_its_id(taskguard, expected):
    assert ids(TASKGUARD=taskguard, CACHES={"default": LOCMEM}) == expected


def test_check_settings__w001_names_the_key_meant_and_lists_them_all_only_when_none_is_close():
    def w001(taskguard: dict[str, object]) -> tuple[str, str]:
        with override_settings(TASKGUARD=taskguard, CACHES={"default": LOCMEM}):
            (found,) = [m for m in check_settings() if m.id == "taskguard.W001"]
        return found.msg, found.hint or ""

    assert w001({"LEASE_SECOND": 30}) == (
        "Unknown TASKGUARD key: LEASE_SECOND.",
        "LEASE_SECOND: did you mean LEASE_SECONDS?",
    )
    assert w001({"on_redis_error": "fail"})[1] == "on_redis_error: did you mean ON_REDIS_ERROR?"
    message, hint = w001({"COLOUR": 1, "KEY_PREFIXES": "a"})
    assert message == "Unknown TASKGUARD keys: COLOUR, KEY_PREFIXES."
    assert hint.startswith(
        "KEY_PREFIXES: did you mean KEY_PREFIX? No known key is close to COLOUR; the known "
        "keys: BACKEND, "
    )


def test_check_settings__use_tz_false_is_e003():
    assert ids(USE_TZ=False, TASKGUARD={}) == ["taskguard.E003"]


def test_check_settings__taskguard_not_a_dict_is_e008():
    assert ids(TASKGUARD=[("BACKEND", "redis")]) == ["taskguard.E008"]


@pytest.mark.parametrize(
    "taskguard",
    [
        pytest.param({}, id="empty"),
        pytest.param({"BACKEND": "database", "REDIS_ALIAS": "nowhere"}, id="database"),
        pytest.param({"BACKEND": "auto"}, id="auto-without-redis"),
        pytest.param({"BACKEND": "redis", "REDIS_ALIAS": "redis"}, id="redis"),
        pytest.param(
            {
                "BACKEND": "auto",
                "REDIS_ALIAS": "redis",
                "KEY_PREFIX": "site1",
                "LEASE_SECONDS": 2.5,
                "ON_REDIS_ERROR": "fail",
                "DATABASE_ALIAS": "default",
                "FINISHED_MARKER_SECONDS": 0,
            },
            id="every-key",
        ),
    ],
)
def test_check_settings__clean_configuration_has_no_messages(taskguard):
    assert ids(TASKGUARD=taskguard, CACHES={"default": LOCMEM, "redis": DJANGO_REDIS}) == []


def test_check_settings__messages_carry_hints():
    with override_settings(TASKGUARD={"BACKEND": "memcached", "LEASE_SECONDS": 0}):
        messages = check_settings()
    assert all(m.hint for m in messages)
    assert "'memcached'" in messages[0].msg


def test_manage_py_check__is_clean():
    out = io.StringIO()
    call_command("check", stdout=out, fail_level="WARNING")
    assert "no issues" in out.getvalue()


@pytest.mark.file_and_server
@pytest.mark.processes
def test_manage_py_check__as_a_real_command_is_clean():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "django",
            "check",
            "--settings=tests.settings",
            "--fail-level=WARNING",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "no issues" in done.stdout


@pytest.mark.smoke  # the version matrix's smoke set (scripts/matrix.sh)
@pytest.mark.django_db(databases=["default", "ledger"])
def test_makemigrations__check_reports_no_changes():
    out = io.StringIO()
    call_command("makemigrations", "taskguard", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("LEASE_SECONDS", 0),
        ("LEASE_SECONDS", float("inf")),
        ("SLOT_TOLERANCE_SECONDS", -1),
        ("PRUNE_AFTER_DAYS", 0),
    ],
)
def test_settings__checked_where_they_are_read(name, value):
    # manage.py shell, gunicorn and Celery workers run no system checks: a guarded
    # call with a bad setting refuses to run and records nothing.
    calls: list[int] = []
    job = once_per_schedule(name="tests.checks.bad_setting")(lambda: calls.append(1))
    with (
        override_settings(TASKGUARD={"BACKEND": "database", name: value}),
        pytest.raises(ImproperlyConfigured, match=rf"TASKGUARD\['{name}'\] is"),
    ):
        job.run_for_slot(BASE_SLOT)
    assert calls == []
    assert not TaskRun.objects.exists()


@pytest.mark.parametrize(
    ("version", "refused"),
    [("6.2.14", True), ("5.0.7", True), ("7.0.15", False), ("7.2.4", False), ("8.0.0", False)],
)
def test_redis_version_problem__before_7_0_is_refused(version, refused):
    from django_taskguard.checks import redis_version_problem

    problem = redis_version_problem(version)
    assert (problem is not None) is refused
    if refused:
        assert f"is Redis {version}; taskguard's lock needs 7.0 or newer" in problem


@pytest.mark.django_db(transaction=True)
def test_check_schedule_zones__a_row_no_copy_registers_is_not_a_conflict(caplog):
    """After a fleet-wide TIME_ZONE change, the row of a schedule removed from the code
    keeps the old zone: no copy fires it, so neither W020 nor sync speaks of it."""
    from django.core.checks import run_checks
    from django.utils import timezone

    from django_taskguard import registry
    from django_taskguard.models import TaskSchedule

    TaskSchedule.objects.create(
        task_name="tests.zones.removed",
        function="tests.zones.removed",
        cron="30 9 * * *",
        default_zone="Asia/Kolkata",
        grace=timedelta(minutes=1),
        max_catchup=1,
        first_seen=timezone.now(),
    )
    with override_settings(TIME_ZONE="UTC"):
        found = run_checks(databases=["default"])
        registry.sync(mark_removed=True)
    assert not [m for m in found if m.id == "taskguard.W020" and "tests.zones.removed" in m.msg]
    said = [r.getMessage() for r in caplog.records if "tests.zones.removed" in r.getMessage()]
    assert not [message for message in said if "TIME_ZONE" in message]
    assert said == [  # sync says the code no longer declares it, only that
        "taskguard: schedule tests.zones.removed is no longer declared by the code: marked "
        "removed (not swept nor judged); retire it in the admin to delete its row, its runs stay"
    ]


@pytest.mark.django_db(transaction=True)
def test_check_schedule_zones__copies_with_another_time_zone_are_noticed(caplog):
    """A cron without its own zone runs in Django's TIME_ZONE: a copy whose TIME_ZONE
    differs from the one that saved the schedule fires other slots. The zone is recorded
    with the schedule, and a copy with another one is told (W020, and sync logs it)."""
    from django.core.checks import CheckMessage, run_checks

    from django_taskguard import registry
    from django_taskguard.models import TaskSchedule

    @once_per_schedule(cron="30 9 * * *", name="tests.zones.report")
    def report() -> None: ...

    def zone_warnings() -> list[CheckMessage]:
        found = run_checks(databases=["default"])
        return [m for m in found if m.id == "taskguard.W020" and "tests.zones.report" in m.msg]

    try:
        with override_settings(TIME_ZONE="Asia/Kolkata"):
            registry.sync()
        assert TaskSchedule.objects.get(task_name="tests.zones.report").default_zone == (
            "Asia/Kolkata"
        )
        with override_settings(TIME_ZONE="Asia/Kolkata"):
            assert not zone_warnings()
        with override_settings(TIME_ZONE="UTC"):
            found = zone_warnings()
            assert len(found) == 1 and "Asia/Kolkata" in found[0].msg
            registry.sync()
        assert "saved by a copy whose TIME_ZONE is 'Asia/Kolkata'" in caplog.text
    finally:
        registry.unregister("tests.zones.report")


# -- modules of schedules (E026, E027) -------------------------------------------------


def schedule_module_ids(modules: list[str]) -> list[str]:
    from django.core.checks import run_checks

    with override_settings(TASKGUARD={"BACKEND": "database", "SCHEDULE_MODULES": modules}):
        return [m.id for m in run_checks() if m.id in ("taskguard.E026", "taskguard.E027")]


def test_check_schedule_modules__a_typo_in_schedule_modules_is_e026():
    assert schedule_module_ids(["tests.support.schedule_jobz"]) == ["taskguard.E026"]


def test_check_schedule_modules__a_decorator_refusing_its_cron_is_e027():
    from django.core.checks import run_checks

    from django_taskguard import registry

    assert schedule_module_ids(["tests.support.bad_cron_jobs"]) == ["taskguard.E027"]
    with override_settings(
        TASKGUARD={"BACKEND": "database", "SCHEDULE_MODULES": ["tests.support.bad_cron_jobs"]}
    ):
        (message,) = [m for m in run_checks() if m.id == "taskguard.E027"]
    assert "tests.support.bad_cron_jobs" in message.msg and "61 * * * *" in message.msg
    assert "tests.bad_cron.report" not in registry.entries()


def test_check_schedule_modules__modules_that_import_are_clean():
    assert schedule_module_ids(["tests.support.schedule_jobs"]) == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("module", "said"),
    [
        pytest.param("tests.support.schedule_jobz", "cannot be imported", id="typo"),
        pytest.param("tests.support.bad_cron_jobs", "61 * * * *", id="bad-cron"),
    ],
)
def test_run_schedules__a_broken_schedule_module_is_a_command_error(module, said):
    from django.core.management.base import CommandError

    with (
        override_settings(TASKGUARD={"BACKEND": "database", "SCHEDULE_MODULES": [module]}),
        pytest.raises(CommandError, match=f"{module}.*{re.escape(said)}"),
    ):
        call_command("run_schedules", "--once", stdout=io.StringIO(), stderr=io.StringIO())


@pytest.mark.parametrize(
    ("checkins", "secret"),
    [
        ({"healthchecks": {"ping_url": "hc-ping.com/5f1e-secret-ping-key"}}, "5f1e-secret"),
        ({"webhook": {"url": "ftp://ops.example.com/hook?token=s3cr3t-tok"}}, "s3cr3t-tok"),
        ({"cronitor": {"api_key": "k", "url": "cronitor.link/p/0a9b-api-key"}}, "0a9b-api-key"),
    ],
    ids=["ping-key-in-path", "token-in-query", "key-in-path"],
)
def test_check_settings__a_bad_checkin_url_is_said_without_its_secret(checkins, secret):
    with override_settings(TASKGUARD={"CHECKINS": checkins}):
        (message,) = check_settings()
    assert message.id == "taskguard.E024"
    assert "http:// or https://" in message.msg and secret not in message.msg, message.msg
