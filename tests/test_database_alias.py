"""The ledger on a second, real database (``DATABASE_ALIAS = "ledger"``), with and without a router.

Every test plants the same kind of rows in both databases: taskguard must act on
the ledger's database only, whatever Django's routing would pick for TaskRun.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

from django_taskguard import once_per_schedule
from django_taskguard.checks import check_settings
from django_taskguard.cleanup import startup_cleanup
from django_taskguard.locks import get_backend
from django_taskguard.locks.redis import RedisLock
from django_taskguard.models import RunState, TaskRun
from django_taskguard.owner import Owner, host, pid_space

from .support.redis_support import redis_caches
from .support.runs import make_run

pytestmark = [
    pytest.mark.dialect,
    pytest.mark.django_db(transaction=True, databases=["default", "ledger"]),
]

ROUTED = ["tests.support.routers.LedgerRouter", "tests.support.routers.MigrateDefaultOnly"]
UNROUTED = ["tests.support.routers.MigrateDefaultOnly"]


@pytest.fixture(params=["no-router", "router"])
def on_ledger(request: pytest.FixtureRequest) -> Iterator[str]:
    routers = ROUTED if request.param == "router" else UNROUTED
    taskguard = {"BACKEND": "database", "DATABASE_ALIAS": "ledger"}
    with override_settings(DATABASE_ROUTERS=routers, TASKGUARD=taskguard):
        yield request.param


def states(using: str) -> dict[int, str]:
    return dict(TaskRun.objects.using(using).values_list("pk", "state"))


def test_guarded_call__writes_the_ledger_database_only(on_ledger):
    job = once_per_schedule(name="tests.alias.job", every=timedelta(minutes=1))(lambda: "ran")
    slot = timezone.now() - timedelta(minutes=5)
    assert job.run_for_slot(slot) == "ran"
    assert job.run_for_slot(slot) is None
    (run,) = TaskRun.objects.using("ledger").all()
    assert (run.state, run.duplicates) == (RunState.SUCCEEDED, 1)
    assert run.transitions.using("ledger").count() == 2
    assert not TaskRun.objects.using("default").exists()


def test_cleanup_locks__abandons_the_ledgers_stale_runs_only(on_ledger):
    ours = make_run("tests.alias.stale", 0, using="ledger")
    decoy = make_run("tests.alias.stale", 0, using="default")
    out = StringIO()
    call_command("cleanup_locks", "--json", stdout=out)
    assert '"stale_runs": 1' in out.getvalue()
    assert states("ledger") == {ours.pk: RunState.ABANDONED}
    assert states("default") == {decoy.pk: RunState.RUNNING}


@pytest.mark.file_and_server
@pytest.mark.processes
def test_startup_cleanup__abandons_the_ledgers_runs_only(on_ledger):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    owner = Owner(host(), int(gone.stdout), pid_space(), "aa").format()
    ours = make_run("tests.alias.dead", 0, owner=owner, lease=3600, using="ledger")
    decoy = make_run("tests.alias.dead", 0, owner=owner, lease=3600, using="default")
    assert startup_cleanup() == 1
    assert states("ledger") == {ours.pk: RunState.ABANDONED}
    assert states("default") == {decoy.pk: RunState.RUNNING}


def test_prune_runs__deletes_from_the_ledger_database_only(on_ledger):
    # Ids collide across the two databases: ids picked in one and deleted in
    # the other would delete the ledger's recent run.
    old = timezone.now() - timedelta(days=90)
    recent = timezone.now() - timedelta(hours=1)
    kept = make_run("tests.alias.recent", slot=recent, state=RunState.SUCCEEDED, using="ledger")
    gone = make_run("tests.alias.old", slot=old, state=RunState.SUCCEEDED, using="ledger")
    decoy = make_run(
        "tests.alias.old", slot=old, state=RunState.SUCCEEDED, using="default", pk=kept.pk
    )
    out = StringIO()
    call_command("prune_runs", "--older-than", "30", stdout=out)
    assert "Deleted 1 finished run" in out.getvalue()
    assert set(states("ledger")) == {kept.pk}
    assert gone.pk not in states("ledger")
    assert set(states("default")) == {decoy.pk}


def test_admin__lists_and_shows_the_ledgers_runs(on_ledger):
    ours = make_run("tests.alias.in-ledger", 0, using="ledger")
    make_run("tests.alias.in-default", 1, using="default")
    client = Client()
    client.force_login(User.objects.create_superuser("admin", password="pw"))
    page = client.get(reverse("admin:taskguard_taskrun_changelist")).content.decode()
    assert "tests.alias.in-ledger" in page
    assert "tests.alias.in-default" not in page
    detail = client.get(reverse("admin:taskguard_taskrun_change", args=[ours.pk]))
    assert detail.status_code == 200
    assert "claimed 0" in detail.content.decode(), "the transition inline reads the ledger too"


def test_check__a_router_sending_taskrun_elsewhere_is_reported():
    taskguard = {"BACKEND": "database", "DATABASE_ALIAS": "default"}
    with override_settings(DATABASE_ROUTERS=ROUTED, TASKGUARD=taskguard):
        ids = [message.id for message in check_settings()]
    assert "taskguard.W013" in ids
    assert "taskguard.E011" in ids, "the router forbids taskguard's migrations on 'default'"
    with override_settings(
        DATABASE_ROUTERS=ROUTED, TASKGUARD={**taskguard, "DATABASE_ALIAS": "ledger"}
    ):
        ids = [message.id for message in check_settings()]
    assert "taskguard.W013" not in ids and "taskguard.E011" not in ids


@pytest.mark.file_and_server
@pytest.mark.processes
def test_child_process__sees_the_ledger_database(on_ledger, child_env):
    # The same settings in a real process (what a worker is): its claim lands in
    # the ledger database this test created.
    code = (
        "import django; django.setup(); from datetime import datetime, timezone; "
        "from django.test import override_settings\n"
        "from django_taskguard import once_per_schedule\n"
        "with override_settings(TASKGUARD={'BACKEND': 'database', 'DATABASE_ALIAS': 'ledger'}):\n"
        "    print(once_per_schedule(name='tests.alias.child')(lambda: 'ran')"
        ".run_for_slot(datetime.now(timezone.utc)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=child_env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ran"
    assert TaskRun.objects.using("ledger").filter(task_name="tests.alias.child").exists()
    assert not TaskRun.objects.using("default").exists()


def test_two_ledgers_on_one_redis__each_runs_every_slot_once(redis_server):
    # Staging and production (or two sites) on one Redis with the same KEY_PREFIX.
    # Before: whichever project held the key made the other return None, with nothing
    # in its ledger, and its count went to the wrong row.
    calls: list[str] = []
    job = once_per_schedule(name="tests.alias.shared")(lambda: calls.append("ran"))
    slot = timezone.now() - timedelta(minutes=5)
    caches = redis_caches(redis_server)
    outcome = {}
    for alias in ("default", "ledger", "default", "ledger"):
        settings = {"BACKEND": "redis", "REDIS_ALIAS": "redis", "DATABASE_ALIAS": alias}
        with override_settings(CACHES=caches, TASKGUARD=settings):
            outcome.setdefault(alias, []).append(job.run_for_slot(slot))
            prefix = get_backend().key("x", slot).split(":run:")[0]
            outcome.setdefault(f"{alias}-prefix", []).append(prefix)
    RedisLock.close_all()
    assert calls == ["ran", "ran"], "each ledger ran its slot once"
    assert outcome["default"] == [None, None] and outcome["ledger"] == [None, None]
    assert outcome["default-prefix"][0] != outcome["ledger-prefix"][0]
    for alias in ("default", "ledger"):
        (run,) = TaskRun.objects.using(alias).all()
        assert (run.state, run.duplicates) == (RunState.SUCCEEDED, 0)
    # Each ledger's late duplicate is counted in its own Redis keys, folded into its row.
    for alias in ("default", "ledger"):
        settings = {"BACKEND": "redis", "REDIS_ALIAS": "redis", "DATABASE_ALIAS": alias}
        with override_settings(CACHES=caches, TASKGUARD=settings):
            call_command("cleanup_locks", stdout=StringIO())
        RedisLock.close_all()
        assert TaskRun.objects.using(alias).get().duplicates == 1
