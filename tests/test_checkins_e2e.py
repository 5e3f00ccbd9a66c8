"""Check-ins from real processes: exactly one start and one end per slot, at every service.

The receivers (tests/support/checkin_holding.py, over tests/support/checkin_receivers.py) run
in this process on one port: Sentry's envelope endpoint, Healthchecks' and Cronitor's ping
APIs, and a webhook. The children are ``run_schedules`` copies (tests/support/
scheduler_child.py, with the one-second schedule of tests/support/checkin_jobs.py) and Celery
beats and workers (tests/support/celery_app.py); tests/settings.py gives each child
``TASKGUARD["CHECKINS"]`` (``TASKGUARD_TEST_CHECKINS``) and a real ``sentry_sdk`` client
(``TASKGUARD_TEST_SENTRY_DSN``). Executions are counted outside the ledger (an O_APPEND log);
the webhook's records say which slot and run each check-in id stands for, and every other
service must have got the same check-ins (tests/support/checkin_records.py).

``TASKGUARD_SCHEDULER_TEST_SECONDS`` (default 30) is how long the three copies and the two
beats fire.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from django_taskguard.models import RunState, TaskRun

from .support.checkin_holding import HoldingReceiver
from .support.checkin_records import (
    OTHERS,
    Hook,
    by_slot,
    delivered,
    expected,
    hooks,
    kinds,
    monitor_of,
    tally,
)
from .support.children import executions, python
from .support.slots import BASE_SLOT
from .support.waiting import wait_for
from .test_celery_e2e import PERSISTENT, Cluster, drain, published
from .test_run_schedules import Copy, schedule_env, slots_between

pytestmark = pytest.mark.dialect

JOBS = "tests.support.checkin_jobs"
SECONDS = float(os.environ.get("TASKGUARD_SCHEDULER_TEST_SECONDS", "30"))
SECOND = timedelta(seconds=1)


@pytest.fixture
def receiver() -> Iterator[HoldingReceiver]:
    running = HoldingReceiver()
    running.start()
    try:
        yield running
    finally:
        running.stop()


def checkin_env(
    env: dict[str, str], receiver: HoldingReceiver, timeout: float = 5, attempts: int = 3
) -> dict[str, str]:
    """``env`` with check-ins to every service of ``receiver``, and a Sentry DSN there."""
    checkins = {
        "sentry": {},
        "healthchecks": {"ping_url": f"{receiver.url}/hc/ping-key"},
        "cronitor": {"api_key": "cronitor-key", "url": receiver.url},
        "webhook": {"url": f"{receiver.url}/webhook"},
        "timeout": timeout,
        "attempts": attempts,
    }
    return {
        **env,
        "TASKGUARD_TEST_CHECKINS": json.dumps(checkins),
        "TASKGUARD_TEST_SENTRY_DSN": f"http://public@127.0.0.1:{receiver.port}/1",
    }


def copies_env(env: dict[str, str], log: Path, prefix: str, **extra: str) -> dict[str, str]:
    return schedule_env(env, log, prefix, TASKGUARD_TEST_SCHEDULE_MODULES=JOBS, **extra)


def executed(log: Path) -> Counter[datetime]:
    """How many times each slot's body ran (tests/support/checkin_jobs.py's log)."""
    return Counter(
        datetime.fromisoformat(words[1]) for words in executions(log) if words[0] != "blocked"
    )


def settled(receiver: HoldingReceiver, ends: int, task: str | None = None) -> None:
    """Wait until the webhook got ``ends`` ends (of ``task``) and every other service as
    many check-ins as the webhook."""

    def done() -> bool:
        if sum(hook.event == "end" for hook in hooks(receiver, task)) < ends:
            return False
        want = sum(expected(receiver).values())
        return all(len(delivered(receiver, service)) >= want for service in OTHERS)

    wait_for(done, 60, "every check-in to arrive", describe=lambda: str(tally(receiver)))


def assert_one_checkin_per_run(receiver: HoldingReceiver, ran: Counter[datetime], task: str):
    """Every executed slot: one start and one end, under one id; any other slot: one
    ``missed`` only; every service got what the webhook got, each exactly once."""
    found = hooks(receiver, task)
    slots = by_slot(found)
    assert max(ran.values()) == 1, f"a slot ran twice: {ran.most_common(3)}"
    counts = {slot: (slots.get(slot, Counter())["start"], slots.get(slot, Counter())["end"])
              for slot in ran}  # fmt: skip
    assert set(counts.values()) == {(1, 1)}, {s: c for s, c in counts.items() if c != (1, 1)}
    others = {slot: events for slot, events in slots.items() if slot not in ran}
    assert all(events == Counter(missed=1) for events in others.values()), others
    ids = {hook.slot: set() for hook in found}
    for hook in found:
        if hook.event != "missed":
            ids[hook.slot].add(hook.checkin_id)
    assert all(len(found_ids) <= 1 for found_ids in ids.values()), "a slot had two ids"
    for service in OTHERS:
        got = kinds(receiver, service)
        assert got == expected(receiver), (service, got - expected(receiver))
        assert max(got.values()) == 1, f"{service}: a check-in arrived twice"
        assert len({monitor_of(r) for r in delivered(receiver, service)}) == 1, service


def report(name: str, receiver: HoldingReceiver, **numbers: object) -> None:
    """One line of figures (shown with ``pytest -s``)."""
    print(f"\n[{name}] {numbers} check-ins: {tally(receiver)}")


@pytest.mark.file_and_server
@pytest.mark.processes
def test_checkins_e2e__three_copies__one_start_and_one_end_per_slot_at_every_service(
    child_env, scratch, receiver
):
    log = scratch / "executions.log"
    task = "tests.checkins-three.0"
    env = checkin_env(copies_env(child_env, log, "tests.checkins-three"), receiver)
    copies = [Copy(env, scratch / f"{name}.out") for name in "abc"]
    wait_for(lambda: len(executed(log)) >= SECONDS, SECONDS + 60, "slots")
    assert [copy.stop() for copy in copies] == [0, 0, 0]
    ran = executed(log)
    settled(receiver, len(ran), task)

    assert_one_checkin_per_run(receiver, ran, task)
    ends = {hook.slot: hook for hook in hooks(receiver, task) if hook.event == "end"}
    runs = {run.slot: run for run in TaskRun.objects.filter(task_name=task, slot__in=list(ran))}
    assert {slot: (end.run_id, end.state) for slot, end in ends.items()} == {
        slot: (run.id, RunState.SUCCEEDED) for slot, run in runs.items()
    }
    slots = sorted(ran)
    assert slots == slots_between(slots[0], slots[-1]), "a slot was not run"
    missed = TaskRun.objects.filter(task_name=task, state=RunState.MISSED).count()
    duplicates = sum(TaskRun.objects.filter(task_name=task).values_list("duplicates", flat=True))
    assert duplicates > 0, "the copies did not all fire"
    report("three copies", receiver, slots=len(ran), missed=missed, duplicates=duplicates)


RETRIED = "tests.support.celery_checkin_tasks.checkin_tick"


@pytest.mark.processes
@pytest.mark.once
def test_checkins_e2e__two_beats_two_workers__a_retried_slot_is_one_checkin(
    child_env, scratch, redis_server, receiver
):
    """Every fifth slot's first attempt asks for a Celery retry: one start (attempt 1) and
    one end (ok, attempt 2) for it, like every other slot."""
    log = scratch / "executions.log"
    task = f"{RETRIED}[checkin-tick]"
    cluster = Cluster(checkin_env(child_env, receiver), scratch, redis_server.url)
    try:
        schedule = {"checkin-tick": {"task": RETRIED, "every": 1, "kwargs": {"log": str(log)}}}
        cluster.worker("w1")
        cluster.worker("w2")
        for name in ("beat1", "beat2"):
            cluster.beat(name, PERSISTENT, schedule)
        roles = {"beat1", "beat2"}
        wait_for(
            lambda: {role for *_, role in published(cluster)} >= roles,
            60,
            "both beats to publish",
            describe=cluster.describe,
        )
        first = len({slot for _, slot, _ in published(cluster)})
        wait_for(
            lambda: len({slot for _, slot, _ in published(cluster)}) >= first + SECONDS,
            SECONDS + 60,
            "slots published",
            describe=cluster.describe,
        )
        for name in roles:
            cluster.stop(name)
        drain([task])
        runs = {run.slot: run for run in TaskRun.objects.filter(task_name=task)}
        settled(receiver, len(runs), task)
    finally:
        cluster.kill_all()

    ran, retried = assert_retries_are_one_checkin(receiver, log, runs, task)
    report("two beats, two workers", receiver, slots=len(ran), retried=len(retried),
           duplicates=sum(run.duplicates for run in runs.values()))  # fmt: skip


class SlowReceiver(HoldingReceiver):
    """Every service answers after ``LATENCY`` seconds, like a distant one: a check-in is
    still in flight, and the next one queued behind it, when the task that sent them ends."""

    LATENCY = 2.0

    def answer(self, request: BaseHTTPRequestHandler) -> None:
        time.sleep(self.LATENCY)  # the service's latency (no test waits on it)
        super().answer(request)


@pytest.mark.processes
@pytest.mark.once
def test_checkins_e2e__prefork_child_recycled__flushes_its_checkins_before_it_exits(
    child_env, scratch, redis_server
):
    """A prefork worker whose pool child is replaced after each task
    (``--max-tasks-per-child 1``) runs two guarded tasks. A pool child leaves through
    ``os._exit`` (no ``atexit``) right after its task; every service answers after 2 s, so
    each child's end check-ins are still queued when it exits: only the flush on
    ``worker_process_shutdown`` gets them, and its start check-ins, to every service."""
    from tests.support import celery_tasks

    log = scratch / "executions.log"
    task = f"{celery_tasks.tick.name}[prefork]"
    slots = [BASE_SLOT + timedelta(hours=13), BASE_SLOT + timedelta(hours=14)]
    receiver = SlowReceiver()
    receiver.start()
    cluster = Cluster(checkin_env(child_env, receiver, timeout=15), scratch, redis_server.url)
    try:
        cluster.worker("w1", concurrency=1, max_tasks_per_child=1)
        for slot in slots:
            cluster.publish(celery_tasks.tick, slot, "prefork", log=str(log), seconds=0)
        drain([task], timeout=90)
        wait_for(
            lambda: (
                sum(hook.event == "end" for hook in hooks(receiver, task)) >= 2
                and all(kinds(receiver, service) == expected(receiver) for service in OTHERS)
            ),
            90,
            "both tasks' check-ins at every service",
            describe=lambda: f"{tally(receiver)}\n{cluster.describe()}",
        )
    finally:
        cluster.kill_all()
        receiver.stop()

    pids = {int(words[4]) for words in executions(log)}
    assert len(pids) == 2, f"the two tasks ran in one pool child: {pids}"
    runs = TaskRun.objects.filter(task_name=task)
    assert {(run.slot, run.state) for run in runs} == {(s, RunState.SUCCEEDED) for s in slots}
    found = hooks(receiver, task)
    assert by_slot(found) == {slot: Counter(start=1, end=1) for slot in slots}
    assert {(hook.slot, hook.run_id) for hook in found} == {(run.slot, run.id) for run in runs}
    for service in OTHERS:
        assert kinds(receiver, service) == expected(receiver), service
        assert sorted(kind for _, kind in kinds(receiver, service)) == [
            "ok",
            "ok",
            "start",
            "start",
        ]


def assert_retries_are_one_checkin(
    receiver: HoldingReceiver, log: Path, runs: dict[datetime, TaskRun], task: str
) -> tuple[Counter[datetime], set[datetime]]:
    """Each slot's attempt ran once, every fifth slot twice (its retry), each run succeeded,
    each slot one start and one end: a retried slot's start from attempt 1, its end from
    attempt 2. Returns the slots run, and those retried."""
    attempts = Counter((datetime.fromisoformat(slot), int(attempt))
                       for _, _, slot, attempt, *_ in executions(log))  # fmt: skip
    assert max(attempts.values()) == 1, f"an attempt ran twice: {attempts.most_common(3)}"
    ran = Counter(slot for slot, attempt in attempts if attempt == 1)
    retried = {slot for slot in ran if int(slot.timestamp()) % 5 == 0}
    assert {slot for slot, attempt in attempts if attempt == 2} == retried
    assert len(retried) >= SECONDS // 5 - 1
    assert set(runs) == set(ran)
    assert {(run.state, run.attempt) for slot, run in runs.items() if slot in retried} == {
        (RunState.SUCCEEDED, 2)
    }
    assert {(run.state, run.attempt) for slot, run in runs.items() if slot not in retried} == {
        (RunState.SUCCEEDED, 1)
    }
    assert_one_checkin_per_run(receiver, ran, task)
    found = hooks(receiver, task)
    assert {(h.event, h.attempt, h.state) for h in found if h.slot in retried} == {
        ("start", 1, "running"),
        ("end", 2, "succeeded"),
    }
    return ran, retried


def cleanup(env: dict[str, str], out: Path) -> subprocess.Popen[bytes]:
    """``manage.py cleanup_locks --json`` in a child (check-ins configured there too)."""
    with out.open("ab") as sink:
        return subprocess.Popen(
            [python(), "-m", "django", "cleanup_locks", "--json"],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )


def blocked(log: Path) -> datetime | None:
    """The slot whose body blocks (tests/support/checkin_jobs.py), once it has started."""
    lines = [words for words in executions(log) if words[0] == "blocked"]
    return datetime.fromisoformat(lines[0][1]) if lines else None


def started_everywhere(receiver: HoldingReceiver, task: str, slot: datetime) -> Hook:
    """The webhook's start of ``slot``, once every service got that start."""
    start = wait_for(
        lambda: [h for h in hooks(receiver, task) if h.slot == slot and h.event == "start"],
        30,
        "the blocked run's start",
    )[0]
    wait_for(
        lambda: all(kinds(receiver, s)[(start.checkin_id, "start")] for s in OTHERS),
        30,
        "the blocked run's start at every service",
    )
    return start


def assert_pushed_once(
    receiver: HoldingReceiver,
    task: str,
    missed: set[datetime],
    abandoned: dict[int, datetime],
    start: Hook,
) -> None:
    """Each missed slot pushed once under its own id, each abandoned run once (the blocked
    one under its start's id, closing the start the services hold), at every service."""
    found = hooks(receiver, task)
    assert Counter(h.slot for h in found if h.event == "missed") == Counter(missed)
    assert Counter(h.run_id for h in found if h.event == "abandoned") == Counter(list(abandoned))
    [pushed] = [h for h in found if h.event == "abandoned" and h.slot == start.slot]
    assert pushed.checkin_id == start.checkin_id
    assert max(Counter((h.checkin_id, h.event) for h in found).values()) == 1
    missed_ids = {h.checkin_id for h in found if h.event == "missed"}
    for service in OTHERS:
        got = kinds(receiver, service)
        assert max(got.values()) == 1, f"{service}: a check-in arrived twice"
        assert got[(start.checkin_id, "start")] == got[(start.checkin_id, "error")] == 1
        assert {i for i, kind in got if i in missed_ids} == missed_ids
        assert all(kind == "error" for i, kind in got if i in missed_ids), service


@pytest.mark.file_and_server
@pytest.mark.processes
def test_checkins_e2e__copies_killed__the_gap_missed_and_the_blocked_run_abandoned_once(
    child_env, scratch, receiver
):
    """Two copies fire a one-second schedule; one body blocks; both copies are SIGKILLed.
    Then two ``cleanup_locks`` at once: the blocked run (its 3 s lease lapsed) is pushed as
    ``abandoned`` under its start's id, each slot nobody fired as ``missed`` under its own,
    each once at every service."""
    log = scratch / "executions.log"
    gate = scratch / "gate"
    task = "tests.checkins-killed.0"
    env = checkin_env(
        copies_env(child_env, log, "tests.checkins-killed", TASKGUARD_TEST_LEASE="3",
                   TASKGUARD_TEST_BLOCK_GATE=str(gate)),
        receiver,
    )  # fmt: skip
    copies = [Copy(env, scratch / f"{name}.out") for name in "ab"]
    wait_for(lambda: len(executed(log)) >= 3, 60, "the first slots")
    gate.touch()
    slot = wait_for(lambda: blocked(log), 30, "a body to block")
    start = started_everywhere(receiver, task, slot)
    for copy in copies:
        copy.kill()
    last = max(executed(log))
    # Nothing fires for a few slots; the blocked run's 3 s lease lapses (3 s of margin).
    time.sleep(6)
    cleaners = [cleanup(env, scratch / f"cleanup-{n}.out") for n in (1, 2)]
    assert [cleaner.wait(timeout=120) for cleaner in cleaners] == [0, 0]

    rows = TaskRun.objects.filter(task_name=task)
    missed = set(rows.filter(state=RunState.MISSED).values_list("slot", flat=True))
    abandoned = dict(rows.filter(state=RunState.ABANDONED).values_list("id", "slot"))
    assert slot in abandoned.values()
    assert {s for s in missed if s > last} >= set(slots_between(last + SECOND, last + 3 * SECOND))
    assert not missed & set(executed(log)), "a missed slot ran"
    wait_for(
        lambda: (
            len([h for h in hooks(receiver, task) if h.event in ("missed", "abandoned")])
            >= len(missed) + len(abandoned)
        ),
        60,
        "the missed and abandoned check-ins",
        describe=lambda: str(tally(receiver)),
    )
    settled(receiver, 0)
    assert_pushed_once(receiver, task, missed, abandoned, start)
    report("killed copies", receiver, missed=len(missed), abandoned=len(abandoned))


@pytest.mark.file_and_server
@pytest.mark.processes
def test_checkins_e2e__a_hanging_and_a_failing_receiver_hold_up_no_slot(
    child_env, scratch, receiver
):
    """The webhook never answers (each try times out after 1 s, two tries), Healthchecks
    answers 500. Runs are recorded succeeded while their own start check-in still waits at
    the webhook (the ledger is read first, then what the webhook holds: a run that waited
    on its send could not be finished before the send gave up); every slot runs once, in
    turn; the failures are counted (``checkin_failed``) and logged in the children's output."""
    receiver.set_mode("webhook", "hang")
    receiver.set_mode("healthchecks", "500")
    log = scratch / "executions.log"
    failures = scratch / "failures.log"
    task = "tests.checkins-hang.0"
    env = checkin_env(
        copies_env(child_env, log, "tests.checkins-hang",
                   TASKGUARD_TEST_CHECKIN_FAILURES=str(failures)),
        receiver, timeout=1, attempts=2,
    )  # fmt: skip
    copies = [Copy(env, scratch / f"{name}.out") for name in "ab"]
    shown: set[datetime] = set()

    def finished_while_waiting() -> bool:
        done = TaskRun.objects.filter(task_name=task, state=RunState.SUCCEEDED)
        finished = set(done.values_list("slot", flat=True))
        held = [h.json for h in receiver.in_flight("webhook") if h.json["event"] == "start"]
        shown.update(finished & {datetime.fromisoformat(body["slot"]) for body in held})
        failed = {words[0] for words in executions(failures)}
        return (
            len(shown) >= 3 and len(executed(log)) >= 10 and failed >= {"webhook", "healthchecks"}
        )

    try:
        wait_for(finished_while_waiting, 90, "runs finished while their check-in hangs",
                 describe=lambda: f"shown {sorted(shown)}, held {len(receiver.held)}")  # fmt: skip
    finally:
        codes = [copy.stop() for copy in copies]
    assert codes == [0, 0]

    ran = executed(log)
    assert max(ran.values()) == 1
    slots = sorted(ran)
    assert slots == slots_between(slots[0], slots[-1]), "a slot was not run"
    rows = TaskRun.objects.filter(task_name=task)
    assert set(rows.values_list("state", flat=True)) == {RunState.SUCCEEDED}
    failed = Counter(words[0] for words in executions(failures))
    output = "".join((scratch / f"{name}.out").read_text() for name in "ab")
    assert "check-in to webhook failed after 2 tries (status None)" in output
    assert "check-in to healthchecks failed after 2 tries (status 500)" in output
    answered_500 = len([r for r in receiver.of("healthchecks") if r["status"] == 500])
    report("hang and 500", receiver, slots=len(ran), finished_while_held=len(shown),
           held=len(receiver.held), answered_500=answered_500, failures=dict(failed))  # fmt: skip
