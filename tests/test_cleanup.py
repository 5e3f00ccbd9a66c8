"""cleanup_locks and startup cleanup against real rows, real processes and real signals."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from django_taskguard.cleanup import cleanup_locks, startup_cleanup
from django_taskguard.models import RunState, TaskRun, TaskRunTransition
from django_taskguard.owner import Owner, pid_space
from django_taskguard.signals import run_abandoned

from .support.children import hold, python
from .support.redis_server import free_port
from .support.runs import make_run
from .support.waiting import wait_for

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]
HOST = socket.gethostname()


def command(*args: str) -> str:
    out = StringIO()
    call_command("cleanup_locks", *args, stdout=out)
    return out.getvalue().strip()


def abandon_transitions(run: TaskRun) -> list[TaskRunTransition]:
    return list(run.transitions.filter(to_state=RunState.ABANDONED))


def test_cleanup_locks__dry_run_changes_nothing():
    stale = [make_run(minute=i) for i in range(3)]
    lines = command("--dry-run").splitlines()
    assert lines[0] == (
        "Would abandon 3 stale runs, would release 0 locks, would remove 0 orphan keys."
    )
    assert lines[1].startswith(
        f"  would abandon: tests.job slot {stale[0].slot.isoformat()} owner otherhost:1:deadbeef: "
        "lease of otherhost:1:deadbeef expired at "
    )
    assert len([line for line in lines if "would abandon:" in line]) == 3
    assert set(TaskRun.objects.values_list("state", flat=True)) == {RunState.RUNNING}
    assert TaskRunTransition.objects.count() == len(stale)


def test_cleanup_locks__abandons_stale_runs_with_a_reason():
    stale = make_run(minute=0, owner="otherhost:42:cafe")
    lines = command().splitlines()
    assert lines[0] == "Abandoned 1 stale run, released 0 locks, removed 0 orphan keys."
    assert lines[1].startswith(f"  abandoned: tests.job slot {stale.slot.isoformat()} owner ")
    assert lines[2] == (
        "  No lock to release: each key had already expired with its lease (a Redis lock "
        "lives exactly as long as the lease), or the backend is the database."
    )
    stale.refresh_from_db()
    assert stale.state == RunState.ABANDONED
    (transition,) = abandon_transitions(stale)
    assert transition.from_state == RunState.RUNNING
    assert "lease of otherhost:42:cafe expired" in transition.reason
    assert transition.owner.startswith(f"cleanup@{HOST}:")


def test_cleanup_locks__never_touches_a_live_lease():
    live = make_run(minute=0, lease=3600)
    finished = make_run(minute=1, state=RunState.SUCCEEDED)
    result = json.loads(command("--json"))
    (flight,) = result.pop("in_flight")
    assert result == {
        "stale_runs": 0,
        "released_locks": 0,
        "orphan_keys": 0,
        "unrecorded_slots": 0,
        "dry_run": False,
        "runs": [],
        "missed_slots": 0,
    }
    # The live run is named, with when it would become stale.
    assert (flight["task"], flight["owner"]) == ("tests.job", live.owner)
    assert 3590 <= flight["seconds_left"] <= 3600
    text = command("--dry-run").splitlines()
    assert text[1].startswith(f"  in flight: tests.job slot {live.slot.isoformat()} owner ")
    assert "if its owner is dead, it is stale then" in text[1]
    live.refresh_from_db()
    finished.refresh_from_db()
    assert (live.state, finished.state) == (RunState.RUNNING, RunState.SUCCEEDED)


def test_cleanup_locks__is_idempotent_and_sends_run_abandoned():
    make_run(minute=0)
    make_run(minute=1)
    received = []

    def receiver(sender, run_id, slot, reason, **kwargs):  # type: ignore[no-untyped-def]
        received.append((sender, run_id))

    run_abandoned.connect(receiver)
    try:
        first = json.loads(command("--json"))
        second = json.loads(command("--json"))
    finally:
        run_abandoned.disconnect(receiver)
    assert first["stale_runs"] == 2
    assert second["stale_runs"] == 0
    assert sorted(received) == sorted((r.task_name, r.id) for r in TaskRun.objects.all())


def test_cleanup_locks__task_filter():
    make_run("tests.a", 0)
    make_run("tests.b", 0)
    assert json.loads(command("--task", "tests.a", "--json"))["stale_runs"] == 1
    assert TaskRun.objects.get(task_name="tests.b").state == RunState.RUNNING


def test_cleanup_locks__task_filter_matches_the_per_schedule_names():
    # A Celery task backing beat entries is guarded as "task[entry]": its base name
    # matches them (before: silently nothing), and not another task with that prefix.
    make_run("example.tasks.slow[slow-1m]", 0)
    make_run("example.tasks.slow", 1)
    make_run("example.tasks.slower", 2)
    result = json.loads(command("--task", "example.tasks.slow", "--json"))
    assert result["stale_runs"] == 2
    assert {run["task"] for run in result["runs"]} == {
        "example.tasks.slow[slow-1m]",
        "example.tasks.slow",
    }


def test_cleanup_locks__unknown_task_is_an_error_naming_close_ones():
    make_run("example.tasks.slow[slow-1m]", 0)
    with pytest.raises(CommandError) as info:
        command("--task", "example.tasks.slwo")
    assert str(info.value) == (
        "no run of a task named 'example.tasks.slwo' is in the ledger. "
        "Did you mean: example.tasks.slow, example.tasks.slow[slow-1m]?"
    )
    with pytest.raises(CommandError, match=r"no run of a task named 'does\.not\.exist'"):
        command("--task", "does.not.exist")


def test_cleanup_locks__batches_cover_every_row():
    for minute in range(7):
        make_run(minute=minute)
    assert cleanup_locks(batch_size=2).stale_runs == 7
    assert TaskRun.objects.filter(state=RunState.ABANDONED).count() == 7


def test_cleanup_locks__bad_arguments_are_refused():
    with pytest.raises(CommandError):
        call_command("cleanup_locks", "--batch-size", "0", stdout=StringIO())
    with pytest.raises(CommandError):
        call_command("cleanup_locks", "--task", " ", stdout=StringIO())


@pytest.mark.processes
def test_cleanup_locks__sigkilled_owner_is_abandoned_and_next_slot_runs(child_env, scratch):
    log = scratch / "exec.log"
    victim = hold(child_env, log, "tests.killed", slot=0, seconds=120, lease=2)
    run_id = victim.started()["started"]
    victim.killed()
    wait_for(lambda: TaskRun.objects.stale().filter(pk=run_id).exists(), 30, "lease expiry")

    assert json.loads(command("--json"))["stale_runs"] == 1
    run = TaskRun.objects.get(pk=run_id)
    assert run.state == RunState.ABANDONED
    (transition,) = abandon_transitions(run)
    assert "expired" in transition.reason

    nxt = hold(child_env, log, "tests.killed", slot=1, seconds=0.2, lease=2)
    next_id = nxt.started()["started"]
    assert nxt.outcome(timeout=60) == {"result": "done"}
    assert TaskRun.objects.get(pk=next_id).state == RunState.SUCCEEDED
    assert TaskRun.objects.get(pk=run_id).state == RunState.ABANDONED


@pytest.mark.file_and_server
@pytest.mark.processes
def test_cleanup_locks__live_child_holding_its_lease_is_untouched(child_env, scratch):
    log = scratch / "exec.log"
    # A 4 s lease renewed every 1.3 s: a renewal may come 2.6 s late on a loaded machine.
    owner = hold(child_env, log, "tests.alive", slot=0, seconds=10, lease=4)
    run_id = owner.started()["started"]
    try:
        # Two lease lengths pass: the heartbeat keeps renewing, cleanup finds nothing.
        deadline = time.monotonic() + 8.5
        while time.monotonic() < deadline:
            assert json.loads(command("--json"))["stale_runs"] == 0
            time.sleep(0.5)
        assert TaskRun.objects.get(pk=run_id).state == RunState.RUNNING
        assert owner.outcome(timeout=60) == {"result": "done"}
    finally:
        if owner.process.poll() is None:
            owner.killed()
    assert TaskRun.objects.get(pk=run_id).state == RunState.SUCCEEDED
    assert not abandon_transitions(TaskRun.objects.get(pk=run_id))


def manage(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [python(), "-m", "django", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.processes
def test_cleanup_locks__concurrent_commands_abandon_each_run_once(child_env):
    runs = [make_run(f"tests.c{i % 5}", i) for i in range(60)]
    commands = [manage(child_env, "cleanup_locks", "--json", "--batch-size", "7") for _ in range(4)]
    totals = []
    for proc in commands:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        totals.append(json.loads(out)["stale_runs"])
    assert sum(totals) == len(runs)
    assert set(TaskRun.objects.values_list("state", flat=True)) == {RunState.ABANDONED}
    for run in runs:
        assert len(abandon_transitions(run)) == 1


@pytest.mark.file_and_server
@pytest.mark.processes
def test_cleanup_locks__database_unreachable_is_a_clear_error(child_env):
    env = dict(child_env, TASKGUARD_TEST_DB="postgres", TASKGUARD_PG_PORT=str(free_port()))
    proc = manage(env, "cleanup_locks")
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "cleanup_locks failed: the taskguard database is unreachable" in err
    assert "Traceback" not in err


def dead_pid() -> int:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(gone.stdout)


def owner(pid: int, token: str, space: str | None = None) -> str:
    return Owner(HOST, pid, pid_space() if space is None else space, token).format()


@pytest.mark.file_and_server
@pytest.mark.processes
def test_startup_cleanup__only_dead_pids_of_this_pid_space():
    pid = dead_pid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = make_run(minute=0, owner=owner(pid, "aa"), lease=3600)
        live = make_run(minute=1, owner=owner(sleeper.pid, "bb"), lease=3600)
        mine = make_run(minute=2, owner=owner(os.getpid(), "cc"), lease=-3600)
        # A container of the same pod: same host name, its own pid namespace.
        sibling = make_run(minute=3, owner=owner(pid, "dd", "0123456789ab.4026530001"), lease=3600)
        # Written before pid spaces were recorded: nobody can judge its pid.
        legacy = make_run(minute=4, owner=f"{HOST}:{pid}:ee", lease=3600)
        assert startup_cleanup() == 1
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
    states = {r.pk: r.state for r in TaskRun.objects.all()}
    assert states[dead.pk] == RunState.ABANDONED
    for untouched in (live, mine, sibling, legacy):
        assert states[untouched.pk] == RunState.RUNNING
    (transition,) = abandon_transitions(dead)
    assert f"{HOST}:{pid} is gone" in transition.reason


@pytest.mark.file_and_server
@pytest.mark.processes
def test_startup_cleanup__a_run_from_another_pid_namespace_is_never_judged(child_env):
    # A real process in a new pid namespace (what a second container of a pod
    # is): its pids mean nothing here, even where the same pid is dead here.
    unshare = shutil.which("unshare")
    assert unshare is not None, "util-linux's unshare is needed for this test"
    code = (
        "import django; django.setup(); from django_taskguard.owner import new_owner, "
        "pid_space; print(new_owner(), pid_space())"
    )
    child = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
        env=child_env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    their_owner, their_space = child.stdout.split()
    parsed = Owner.parse(their_owner)
    assert parsed is not None and parsed.host == HOST
    assert parsed.space == their_space != pid_space()
    # Their run, with a pid that is dead in this namespace (host + pid alone would
    # call it dead and abandon it), and a run of ours with the same dead pid.
    pid = dead_pid()
    theirs = make_run(minute=0, owner=owner(pid, "aa", their_space), lease=3600)
    ours = make_run(minute=1, owner=owner(pid, "bb"), lease=3600)
    assert startup_cleanup() == 1
    assert TaskRun.objects.get(pk=theirs.pk).state == RunState.RUNNING
    assert TaskRun.objects.get(pk=ours.pk).state == RunState.ABANDONED


@pytest.mark.file_and_server
@pytest.mark.processes
def test_startup_cleanup__celery_worker_ready_honours_the_setting():
    from celery.signals import worker_ready

    run = make_run(minute=0, owner=owner(dead_pid(), "aa"), lease=3600)
    worker_ready.send(sender=None)
    assert TaskRun.objects.get(pk=run.pk).state == RunState.RUNNING
    with override_settings(TASKGUARD={"BACKEND": "database", "STARTUP_CLEANUP": True}):
        worker_ready.send(sender=None)
    assert TaskRun.objects.get(pk=run.pk).state == RunState.ABANDONED
