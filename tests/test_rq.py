"""RQ composition in this process: ``@enqueue_on`` over ``@once_per_schedule``, the job a
slot makes (its id derived from the task and the slot, the slot in its ``meta``), a second
enqueue of a slot refused by RQ, ``run_schedules --enqueue``'s hand-off, and jobs run by a
real RQ ``SimpleWorker`` (in this process) on a private Redis: the slot read from the meta,
RQ's retry as the next attempt of the same row, the same job run again as a duplicate.
Real worker processes: tests/test_rq_e2e.py."""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from io import StringIO
from pathlib import Path
from types import ModuleType
from zoneinfo import ZoneInfo

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.test import override_settings

from django_taskguard import once_per_schedule, registry, upkeep
from django_taskguard.exceptions import TaskGuardError
from django_taskguard.handoff import hand_off
from django_taskguard.models import RunState, TaskRun

rq = pytest.importorskip("rq")

from redis import Redis  # noqa: E402
from rq import Queue, SimpleWorker  # noqa: E402
from rq.job import Job, JobStatus  # noqa: E402

from django_taskguard.contrib.rq import (  # noqa: E402
    RETRY_MAX_META,
    SLOT_META,
    enqueue_for_slot,
    enqueue_on,
    job_id_for,
)
from django_taskguard.contrib.rq.enqueue import Target  # noqa: E402
from django_taskguard.contrib.rq.worker import flush_checkins  # noqa: E402

from .support import ROOT  # noqa: E402
from .support.redis_server import RedisServer  # noqa: E402

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]
SLOT = datetime(2026, 11, 27, 6, 0, 1, tzinfo=timezone.utc)
JOBS = {"TASKGUARD": {"BACKEND": "database", "SCHEDULE_MODULES": ["tests.support.rq_jobs"]}}


@pytest.fixture
def jobs(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """tests/support/rq_jobs.py, freshly decorated, its queues on the private Redis; its
    schedules forgotten afterwards."""
    monkeypatch.setenv("TASKGUARD_TEST_RQ_URL", redis_server.url)
    before = set(registry.entries())
    module = importlib.reload(importlib.import_module("tests.support.rq_jobs"))
    module.executed.clear()
    yield module
    module.REDIS.close()
    for name in set(registry.entries()) - before:
        registry.unregister(name)


def recent(every: timedelta) -> datetime:
    """The latest slot of ``every`` before now, a slot back (never ahead of the clock)."""
    now = datetime.now(timezone.utc)
    epoch = datetime(1970, 1, 1, tzinfo=timezone.utc)
    return now - (now - epoch) % every - every


class BurstWorker(SimpleWorker):
    """RQ's ``SimpleWorker`` without its command channel (``rq suspend``, kill-horse): with
    redis-py 8, stopping that channel's thread at the end of a burst waited for its 60 s
    poll (``PubSubWorkerThread.stop`` joins it), a minute lost in every third test."""

    def subscribe(self) -> None:
        self.pubsub_thread = None


def work(module: ModuleType, *queues: str) -> None:
    """Run every job of ``queues`` in this process with RQ's own worker, then return."""
    worker = BurstWorker(
        [Queue(name, connection=module.REDIS) for name in queues], connection=module.REDIS
    )
    worker.work(burst=True)


def test_job_id_for__same_task_and_slot_same_id_in_rq_characters():
    first = job_id_for("app.jobs.sync", SLOT)
    assert first == job_id_for("app.jobs.sync", SLOT.astimezone(ZoneInfo("Europe/Paris")))
    assert first == job_id_for("app.jobs.sync", "2026-11-27T06:00:01Z")
    assert first.startswith("taskguard-sync-") and first.endswith("-20261127T060001Z")
    assert first != job_id_for("app.jobs.sync", SLOT + timedelta(seconds=1))
    assert first != job_id_for("other.jobs.sync", SLOT)
    assert job_id_for("a", SLOT + timedelta(microseconds=5)).endswith("T060001000005Z")
    odd = job_id_for("app.jobs.sync[tenant 42: ü]" + "x" * 300, SLOT)
    assert re.fullmatch(r"[A-Za-z0-9_-]+", odd) and len(odd) < 100


def test_job_id_for__naive_slot_refused():
    with pytest.raises(TaskGuardError, match="timezone-aware"):
        job_id_for("app.jobs.sync", datetime(2026, 11, 27, 6))


def test_enqueue_for_slot__job_id_meta_and_function(jobs: ModuleType):
    job = enqueue_for_slot(jobs.flaky, SLOT)
    assert job is not None
    assert job.id == job_id_for(jobs.FLAKY, SLOT)
    fetched = Job.fetch(job.id, connection=jobs.REDIS)
    assert fetched.meta == {SLOT_META: "2026-11-27T06:00:01+00:00", RETRY_MAX_META: 2}
    assert fetched.func_name == "tests.support.rq_jobs.flaky"
    assert fetched.retries_left == 2
    assert fetched.origin == "tg-other"
    # Run in the work horse after the job: the check-ins it queued are sent before os._exit.
    assert fetched.success_callback is fetched.failure_callback is flush_checkins
    assert fetched.stopped_callback is flush_checkins
    assert Queue("tg-other", connection=jobs.REDIS).job_ids == [job.id]


def test_enqueue_for_slot__second_enqueue_of_a_slot_makes_no_job(jobs: ModuleType):
    """rq cron's double enqueue (rq #2302): here the job id is the slot's, and RQ refuses it."""
    assert enqueue_for_slot(jobs.tick, SLOT) is not None
    assert enqueue_for_slot(jobs.tick, SLOT.astimezone(ZoneInfo("Asia/Tokyo"))) is None
    assert enqueue_for_slot(jobs.tick, SLOT + timedelta(seconds=1)) is not None
    queue = Queue("tg-tick", connection=jobs.REDIS)
    assert queue.job_ids == [
        job_id_for(jobs.TICK, SLOT),
        job_id_for(jobs.TICK, SLOT + timedelta(seconds=1)),
    ]


def test_enqueue_for_slot__refuses_a_function_without_enqueue_on(jobs: ModuleType):
    @once_per_schedule(name="tests.rq.bare")
    def bare() -> None: ...

    with pytest.raises(TaskGuardError, match="@enqueue_on"):
        enqueue_for_slot(bare, SLOT)


def test_enqueue_on__refuses_what_it_cannot_enqueue():
    def plain() -> None: ...

    with pytest.raises(TaskGuardError, match="above @once_per_schedule"):
        enqueue_on("default")(plain)
    with pytest.raises(TaskGuardError, match="defined inside a function"):
        enqueue_on("default")(once_per_schedule(name="tests.rq.local")(plain))
    with pytest.raises(TaskGuardError, match="queue name"):
        enqueue_on("  ")
    with pytest.raises(TaskGuardError, match=r"queue name or an rq\.Queue"):
        enqueue_on(42)  # type: ignore[arg-type]
    with pytest.raises(TaskGuardError, match=r"an rq\.Queue has its own"):
        enqueue_on(Queue("default", connection=Redis()), connection=Redis())
    with pytest.raises(TaskGuardError, match=r"rq\.Retry"):
        enqueue_on("default", retry=3)  # type: ignore[arg-type]


def test_target__a_bare_queue_name_is_looked_up_in_rq_queues():
    pytest.importorskip("django_rq")
    refused = pytest.raises(ImproperlyConfigured, match=r"RQ_QUEUES .* no queue named 'nightly'")
    with override_settings(RQ_QUEUES={}), refused:
        Target("nightly").resolve()


@override_settings(**JOBS)
def test_hand_off__one_job_per_slot_across_copies(jobs: ModuleType):
    """run_schedules --enqueue's path: the finder gives the schedule its RQ enqueue; the
    pending row decides which copy enqueues, and the job id would refuse a second anyway."""
    entry = registry.discover()[jobs.TICK]
    assert entry.enqueue is not None
    slot = recent(timedelta(seconds=1))
    said = [hand_off(entry, slot) for _ in range(3)]
    job_id = job_id_for(jobs.TICK, slot)
    assert said[0] == f"enqueued (RQ job {job_id} on queue 'tg-tick')"
    assert said[1:] == ["not enqueued here (it has a row: another copy enqueued it, or it ran)"] * 2
    assert Queue("tg-tick", connection=jobs.REDIS).job_ids == [job_id]
    assert TaskRun.objects.get(task_name=jobs.TICK, slot=slot).state == RunState.PENDING


@override_settings(**JOBS)
def test_worker__claims_the_slot_in_the_meta_not_the_current_one(jobs: ModuleType):
    old = recent(timedelta(seconds=1)) - timedelta(seconds=30)  # a queue that backed up
    hand_off(registry.discover()[jobs.TICK], old)
    work(jobs, "tg-tick")
    assert jobs.executed == [f"{jobs.TICK} {old.isoformat()} 1"]
    run = TaskRun.objects.get(task_name=jobs.TICK)
    assert (run.slot, run.state, run.attempt) == (old, RunState.SUCCEEDED, 1)
    job = Job.fetch(job_id_for(jobs.TICK, old), connection=jobs.REDIS)
    assert job.get_status() == JobStatus.FINISHED
    assert job.return_value() == old.isoformat()


@override_settings(**JOBS)
def test_worker__rq_retry_is_the_next_attempt_of_the_row(jobs: ModuleType):
    slot = recent(timedelta(hours=1))
    enqueue_for_slot(jobs.flaky, slot)
    work(jobs, "tg-other")
    assert jobs.executed == [
        f"{jobs.FLAKY} {slot.isoformat()} 1",
        f"{jobs.FLAKY} {slot.isoformat()} 2",
    ]
    run = TaskRun.objects.get(task_name=jobs.FLAKY)
    assert (run.slot, run.state, run.attempt, run.duplicates) == (slot, RunState.SUCCEEDED, 2, 0)
    states = list(run.transitions.order_by("id").values_list("to_state", flat=True))
    assert states == [RunState.RUNNING, RunState.RETRYING, RunState.RUNNING, RunState.SUCCEEDED]
    job = Job.fetch(job_id_for(jobs.FLAKY, slot), connection=jobs.REDIS)
    assert (job.get_status(), job.retries_left, job.return_value()) == (JobStatus.FINISHED, 1, 2)


@override_settings(**JOBS)
def test_worker__the_same_job_run_again_is_a_counted_duplicate(jobs: ModuleType):
    slot = recent(timedelta(seconds=1))
    job = enqueue_for_slot(jobs.tick, slot)
    assert job is not None
    work(jobs, "tg-tick")
    queue = Queue("tg-tick", connection=jobs.REDIS)
    queue.enqueue_job(Job.fetch(job.id, connection=jobs.REDIS))  # the same job, once more
    work(jobs, "tg-tick")
    assert jobs.executed == [f"{jobs.TICK} {slot.isoformat()} 1"]
    run = TaskRun.objects.get(task_name=jobs.TICK)
    assert (run.state, run.attempt, run.duplicates) == (RunState.SUCCEEDED, 1, 1)


@override_settings(**JOBS)
def test_worker__a_retry_that_another_copy_of_the_job_meets_is_a_duplicate(jobs: ModuleType):
    """The row waits for the retry its failed attempt named (job id, retry count 1): the
    first message run again (retry count 0) is another copy, not the retry."""
    slot = recent(timedelta(hours=1))
    job = enqueue_for_slot(jobs.flaky, slot)
    assert job is not None
    first = Job.fetch(job.id, connection=jobs.REDIS)
    worker = BurstWorker([Queue("tg-other", connection=jobs.REDIS)], connection=jobs.REDIS)
    queue = Queue("tg-other", connection=jobs.REDIS)
    # Run attempt 1 (it fails; RQ enqueues the retry), then put the retry aside and send
    # the first message again, as a copy.
    worker.work(burst=True, max_jobs=1)
    assert TaskRun.objects.get(task_name=jobs.FLAKY).state == RunState.RETRYING
    queue.remove(job.id)
    first.retries_left = 2
    first.save()
    queue.enqueue_job(first)
    work(jobs, "tg-other")
    assert jobs.executed == [f"{jobs.FLAKY} {slot.isoformat()} 1"]
    run = TaskRun.objects.get(task_name=jobs.FLAKY)
    assert (run.state, run.attempt, run.duplicates) == (RunState.RETRYING, 1, 1)


@pytest.fixture
def docs_jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """docs/rq.md's ``myapp/jobs.py`` block, as written, as the module ``rq_docs_jobs``."""
    text = (ROOT / "docs" / "rq.md").read_text()
    found = re.search(r"```python\n# myapp/jobs\.py[^\n]*\n(.*?)^```", text, re.S | re.M)
    assert found, "docs/rq.md has no myapp/jobs.py block"
    (tmp_path / "rq_docs_jobs.py").write_text(found[1])
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(registry.entries())
    yield "rq_docs_jobs"
    sys.modules.pop("rq_docs_jobs", None)
    for name in set(registry.entries()) - before:
        registry.unregister(name)


def test_docs__the_rq_page_example_runs_as_written(docs_jobs: str, redis_server: RedisServer):
    """The page's jobs, their queues named in django-rq's RQ_QUEUES: each slot handed to its
    queue, and run by RQ's worker through the guard."""
    django_rq = pytest.importorskip("django_rq")
    queues = {"default": {"URL": redis_server.url}, "reports": {"URL": redis_server.url}}
    taskguard = {"BACKEND": "database", "SCHEDULE_MODULES": [docs_jobs]}
    with override_settings(RQ_QUEUES=queues, TASKGUARD=taskguard):
        entries = registry.discover()
        sync, nightly = entries[f"{docs_jobs}.sync_prices"], entries[f"{docs_jobs}.nightly_report"]
        assert sync.enqueue is not None and nightly.enqueue is not None
        slot = recent(timedelta(minutes=5))
        said = hand_off(sync, slot)
        assert said == f"enqueued (RQ job {job_id_for(sync.task_name, slot)} on queue 'default')"
        queue = django_rq.get_queue("default")
        BurstWorker([queue], connection=queue.connection).work(burst=True)
        run = TaskRun.objects.get(task_name=sync.task_name)
        assert (run.slot, run.state) == (slot, RunState.SUCCEEDED)
        job = Job.fetch(job_id_for(sync.task_name, slot), connection=queue.connection)
        assert job.meta[RETRY_MAX_META] == 3
        queue.connection.close()


@override_settings(**JOBS)
def test_worker__a_process_running_rq_jobs_starts_no_upkeep(jobs: ModuleType):
    """RQ's work horse ends with os._exit right after its job: an upkeep thread started
    there would die holding the fleet-wide lease (tests/test_rq_e2e.py watches the lease)."""
    taskguard = {**JOBS["TASKGUARD"], "UPKEEP_INTERVAL_SECONDS": 5}
    with override_settings(TASKGUARD=taskguard):
        upkeep.forget()  # on, as in a worker outside the test environment
        try:
            enqueue_for_slot(jobs.tick, recent(timedelta(seconds=1)))
            work(jobs, "tg-tick")
            assert len(jobs.executed) == 1
            assert upkeep._gate.thread is None  # the job's guard started no upkeep thread
            assert upkeep.maybe_upkeep()  # outside a job this process may (upkeep.VETOES)
        finally:
            upkeep.join(timeout=30)
            upkeep.forget(off=True)  # as conftest leaves the test process


@override_settings(**JOBS)
def test_backfill__enqueue_hands_each_slot_to_rq_once(jobs: ModuleType):
    """``backfill --enqueue`` of an ``@enqueue_on`` schedule: a job per slot of the range,
    named by the slot; a second backfill of the same range enqueues nothing."""
    end = recent(timedelta(seconds=1))
    start = end - 2 * timedelta(seconds=1)
    for _ in range(2):
        call_command(
            "backfill", jobs.TICK, "--from", start.isoformat(), "--to", end.isoformat(),
            "--enqueue", stdout=StringIO(),
        )  # fmt: skip
    slots = [start + n * timedelta(seconds=1) for n in range(3)]
    assert Queue("tg-tick", connection=jobs.REDIS).job_ids == [
        job_id_for(jobs.TICK, slot) for slot in slots
    ]
    work(jobs, "tg-tick")
    assert sorted(jobs.executed) == [f"{jobs.TICK} {slot.isoformat()} 1" for slot in slots]


@override_settings(**JOBS)
def test_backfill_enqueue__catchup_none_runs_the_past_slots_as_backfill_here_does(
    jobs: ModuleType,
):
    """Backfill is an operator's request for past slots: the worker runs each slot it
    enqueued whatever catchup="none" says of a late call, as backfill without --enqueue
    runs them here (not one recorded missed)."""
    minute = timedelta(minutes=1)
    end = recent(minute) - 10 * minute  # long past the 5 s grace
    start = end - 2 * minute
    call_command(
        "backfill", jobs.STRICT, "--from", start.isoformat(), "--to", end.isoformat(),
        "--enqueue", stdout=StringIO(),
    )  # fmt: skip
    work(jobs, "tg-strict")
    slots = [start + n * minute for n in range(3)]
    assert sorted(jobs.executed) == [f"{jobs.STRICT} {slot.isoformat()} 1" for slot in slots]
    runs = TaskRun.objects.filter(task_name=jobs.STRICT).order_by("slot")
    assert [run.state for run in runs] == [RunState.SUCCEEDED] * 3
