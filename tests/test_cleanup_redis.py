"""cleanup_locks against a real private Redis: token-checked release, orphans, claim records."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from django_taskguard import ledger
from django_taskguard.cleanup import cleanup_locks
from django_taskguard.locks import Acquired, get_backend
from django_taskguard.locks.redis import claim_key
from django_taskguard.models import RunState, TaskRun

from .support.children import python
from .support.redis_support import guard_key
from .support.runs import BASE, make_run
from .support.waiting import wait_for

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]


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
    return guard_key(run.task_name, run.slot)


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


def test_cleanup_locks_redis__orphans_removed_live_keys_kept(redis_settings):
    client = redis_settings.client()
    live = make_run("tests.live", 0, owner="h:1:toklive", lease=3600)
    done = make_run("tests.done", 0, owner="h:1:tokdone", state=RunState.SUCCEEDED)
    client.set(key(live), "toklive", px=600_000)
    client.set(key(done), "tokdone", px=600_000)
    # No row names it, but its lease runs: maybe a winner before its insert. Kept.
    unrecorded = guard_key("tests.nobody", done.slot)
    client.set(unrecorded, "tokwinner", px=600_000)
    # No row names it and it never lapses (not written by taskguard's acquire). Removed.
    immortal = guard_key("tests.immortal", done.slot)
    client.set(immortal, "tokghost")
    dry = cleanup_locks(dry_run=True)
    assert dry.orphan_keys == 2
    assert client.get(key(done)) == b"tokdone"
    assert cleanup_locks().orphan_keys == 2
    assert client.get(key(live)) == b"toklive"
    assert client.get(key(done)) is None
    assert client.get(unrecorded) == b"tokwinner"
    assert client.get(immortal) is None
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
        "unrecorded_slots": 0,
        "dry_run": False,
        "runs": [],
        "in_flight": [],
        "missed_slots": 0,
    }


# Claim records: a slot won in Redis whose lock is gone ------------------------------
# (The winner killed by a real SIGKILL before its row: tests/test_faults_redis.py.)


def claim(name: str, slot: datetime, winner: str, losers: int, lease: float = 30.0) -> str:
    """Win ``slot`` in Redis for ``winner`` and have ``losers`` calls lose to it; the key."""
    lock = get_backend()
    slot_key = guard_key(name, slot)
    assert lock.acquire(slot_key, winner, lease, name) is Acquired.WON
    for index in range(losers):
        assert lock.acquire(slot_key, f"loser{index}", lease, name) is Acquired.LOST
    return slot_key


@pytest.mark.parametrize("winner", ["lost_to_the_row", "final_release_failed"])
def test_cleanup_locks_redis__claim_of_a_recorded_slot_adds_its_count(redis_settings, winner):
    client = redis_settings.client()
    run = make_run("tests.c", 0, state=RunState.SUCCEEDED)
    TaskRun.objects.filter(pk=run.pk).update(duplicates=1)
    # A long lease, cut short by hand: a 0.3 s lease could lapse between the acquires
    # on a loaded machine, and a "loser" would win.
    slot_key = claim(run.task_name, run.slot, "tokwin", 3, lease=30.0)
    if winner == "lost_to_the_row":
        assert get_backend().release(slot_key, "tokwin")  # what a winner does on a taken row
    else:  # its release_counted never reached Redis: the lock lapses with the count on it
        lapse(client, slot_key)
    assert client.exists(claim_key(slot_key))
    assert cleanup_locks().as_dict() == counts()
    run.refresh_from_db()
    assert (run.state, run.duplicates, run.transitions.count()) == (RunState.SUCCEEDED, 4, 1)
    assert not client.exists(claim_key(slot_key))
    assert cleanup_locks().as_dict() == counts()
    assert TaskRun.objects.get(pk=run.pk).duplicates == 4


@pytest.mark.file_and_server
@pytest.mark.processes
def test_cleanup_locks_redis__row_inserted_by_a_caller_meanwhile_gets_the_count(
    redis_settings, child_env, scratch, monkeypatch
):
    client = redis_settings.client()
    name = "tests.meanwhile"
    slot_key = claim(name, BASE, "tokdead", 2, lease=30.0)
    lapse(client, slot_key)
    children = []
    insert_abandoned = ledger.insert_abandoned

    def caller_claims_first(task_name: str, slot: datetime, **kwargs: Any) -> int | None:
        # Between cleanup's UPDATE (no row yet) and its INSERT, a real caller on
        # the database path claims the slot, runs it and commits.
        if task_name == name and not children:
            argv = [python(), "-m", "tests.support.proc", "hold", "--task", name, "--log",
                    str(scratch / "x.log"), "--seconds", "0"]  # fmt: skip
            children.append(
                subprocess.run(argv, env=child_env, capture_output=True, text=True, timeout=120)
            )
        return insert_abandoned(task_name, slot, **kwargs)

    monkeypatch.setattr(ledger, "insert_abandoned", caller_claims_first)
    result = cleanup_locks()
    (child,) = children
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout.splitlines()[-1]) == {"result": "done"}
    assert result.as_dict() == counts()  # the insert lost to the caller's row: counted on it
    run = TaskRun.objects.get(task_name=name)
    assert (run.state, run.attempt, run.duplicates) == (RunState.SUCCEEDED, 1, 2)
    assert [t.to_state for t in run.transitions.order_by("id")] == ["running", "succeeded"]
    assert not client.exists(claim_key(slot_key))


def test_cleanup_locks_redis__claim_taken_again_mid_sweep_is_counted_once(
    redis_settings, monkeypatch
):
    client = redis_settings.client()
    lock = get_backend()
    name = "tests.again"
    slot_key = claim(name, BASE, "tokdead", 2, lease=30.0)
    lapse(client, slot_key)

    insert_abandoned = ledger.insert_abandoned

    def new_caller_wins_redis(task_name: str, slot: datetime, **kwargs: Any) -> int | None:
        # A new call wins the free Redis lock after cleanup read the record: the
        # record's count is now that call's to fold when it releases.
        assert lock.acquire(slot_key, "toknew", 30.0, name) is Acquired.WON
        return insert_abandoned(task_name, slot, **kwargs)

    monkeypatch.setattr(ledger, "insert_abandoned", new_caller_wins_redis)
    # The new call's key names no row, but its lease runs: it is left alone.
    assert cleanup_locks().as_dict() == counts(unrecorded_slots=1)
    monkeypatch.undo()
    run = TaskRun.objects.get(task_name=name)
    assert (run.state, run.duplicates) == (RunState.ABANDONED, 0)  # the count went back
    assert client.hget(claim_key(slot_key), "count") == b"2"
    lapse(client, slot_key)  # the new call dies too
    assert cleanup_locks().as_dict() == counts()  # the new call died too: the next run folds it
    run.refresh_from_db()
    assert (run.state, run.duplicates, run.transitions.count()) == (RunState.ABANDONED, 2, 1)
    assert not client.exists(claim_key(slot_key))
    assert cleanup_locks().as_dict() == counts()
    assert TaskRun.objects.get(pk=run.pk).duplicates == 2


def lapse(client, slot_key: str) -> None:  # type: ignore[no-untyped-def]
    """The holder of ``slot_key`` is dead: its (long) lease lapses now."""
    client.pexpire(slot_key, 1)
    wait_for(lambda: client.get(slot_key) is None, what="the lease to lapse")


def counts(**nonzero: int) -> dict[str, object]:
    return {**dict.fromkeys(["stale_runs", "released_locks", "orphan_keys"], 0),
            "unrecorded_slots": 0, "dry_run": False, "runs": [], "in_flight": [],
            "missed_slots": 0, **nonzero}  # fmt: skip
