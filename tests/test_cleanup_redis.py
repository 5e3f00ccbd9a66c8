"""cleanup_locks against a real private Redis: token-checked release, SCAN for orphans."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from django_taskguard import cleanup
from django_taskguard.cleanup import cleanup_locks
from django_taskguard.locks.base import run_key
from django_taskguard.models import RunState, TaskRun

from .runs import make_run

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def redis_settings(redis_server):  # type: ignore[no-untyped-def]
    caches = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "redis": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": redis_server.url},
    }
    config = {"BACKEND": "redis", "REDIS_ALIAS": "redis", "KEY_PREFIX": "tg"}
    with override_settings(CACHES=caches, TASKGUARD=config):
        yield redis_server


def key(run: TaskRun) -> str:
    return run_key("tg", run.task_name, run.slot)


def test_cleanup_locks_redis__releases_only_keys_holding_the_runs_token(redis_settings):
    client = redis_settings.client()
    mine = make_run("tests.r", 0, owner="h:1:tokmine")
    taken = make_run("tests.r", 1, owner="h:1:tokold")
    client.set(key(mine), "tokmine", px=600_000)
    client.set(key(taken), "toknew", px=600_000)  # a newer attempt holds it now
    # Only the release step here: the orphan sweep (its own test below) would, rightly,
    # remove a token that no row names once its grace period is over.
    result = cleanup_locks(scan_orphans=False)
    assert (result.stale_runs, result.released_locks) == (2, 1)
    assert client.get(key(mine)) is None
    assert client.get(key(taken)) == b"toknew"


def test_cleanup_locks_redis__orphans_removed_live_keys_kept(redis_settings, monkeypatch):
    monkeypatch.setattr(cleanup, "ORPHAN_GRACE_SECONDS", 0.5)
    client = redis_settings.client()
    live = make_run("tests.live", 0, owner="h:1:toklive", lease=3600)
    done = make_run("tests.done", 0, owner="h:1:tokdone", state=RunState.SUCCEEDED)
    client.set(key(live), "toklive", px=600_000)
    client.set(key(done), "tokdone", px=600_000)
    client.set(run_key("tg", "tests.nobody", done.slot), "tokghost", px=600_000)
    dry = cleanup_locks(dry_run=True)
    assert dry.orphan_keys == 2
    assert client.get(key(done)) == b"tokdone"
    assert cleanup_locks().orphan_keys == 2
    assert client.get(key(live)) == b"toklive"
    assert client.get(key(done)) is None
    assert client.get(run_key("tg", "tests.nobody", done.slot)) is None
    assert TaskRun.objects.get(pk=live.pk).state == RunState.RUNNING


def test_cleanup_locks_redis__redis_down_is_a_clear_error(redis_settings):
    make_run("tests.r", 0, owner="h:1:tok")
    redis_settings.stop()
    with pytest.raises(CommandError, match="unreachable"):
        call_command("cleanup_locks", stdout=StringIO())


def test_cleanup_locks_redis__json(redis_settings):
    out = StringIO()
    call_command("cleanup_locks", "--json", stdout=out)
    assert json.loads(out.getvalue()) == {
        "stale_runs": 0,
        "released_locks": 0,
        "orphan_keys": 0,
        "dry_run": False,
    }
