"""The admin's panel for one run: a summary for every state, the right lock, no doubled words."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest

from django_taskguard import once_per_key, once_per_schedule, registry
from django_taskguard.models import RunState, TaskRunTransition
from django_taskguard.owner import token_of
from django_taskguard.panel import why_not_running

from .support.redis_server import RedisServer
from .support.redis_support import redis_backend
from .support.runs import make_run

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]
MISSED_REASON = "missed: no instance claimed it within its grace (60s)"


@pytest.fixture
def clean_registry() -> Iterator[None]:
    before = set(registry.entries())
    yield
    for name in set(registry.entries()) - before:
        registry.unregister(name)


def test_why__every_state_has_its_own_summary_and_title():
    summaries = {}
    for state in RunState:
        why = why_not_running(make_run(f"tests.panel.{state}", 0, state=state))
        summaries[state] = why.summary
        running = state == RunState.RUNNING  # its lease expired an hour ago: presumed dead
        finished = state == RunState.SUCCEEDED
        assert (why.title == "Why is this not running?") is (running or not finished), state
    assert len(set(summaries.values())) == len(RunState), summaries
    assert summaries[RunState.MISSED].startswith("Missed: ")
    assert "manage.py backfill runs it" in summaries[RunState.MISSED]
    assert summaries[RunState.SUCCEEDED].startswith("Finished:")
    live = why_not_running(make_run("tests.panel.live", 0, lease=3600))
    assert live.title == "Running now"


def test_why__missed_reason_said_once():
    run = make_run("tests.panel.missed", 0, state=RunState.MISSED, transitions=0)
    TaskRunTransition.objects.create(
        run_id=run.pk,
        from_state=RunState.PENDING,
        to_state=RunState.MISSED,
        reason=MISSED_REASON,
        owner="",
    )
    why = why_not_running(run)
    said = " ".join([why.summary, *(value for _label, value in why.facts)])
    assert "missed: missed:" not in said.lower(), said
    assert why.summary.startswith("Missed: no instance claimed it within its grace (60s).")


@pytest.mark.usefixtures("clean_registry")
def test_why__abandoned_names_the_tasks_on_stale():
    for on_stale in ("abandon", "retry"):
        once_per_schedule(every=timedelta(minutes=1), name=f"tests.panel.{on_stale}",
                          on_stale=on_stale)(lambda: None)  # fmt: skip
    retry = why_not_running(make_run("tests.panel.retry", 0, state=RunState.ABANDONED))
    assert 'This task has on_stale="retry"' in retry.summary
    assert "the next call for this slot takes it over" in retry.summary
    abandon = why_not_running(make_run("tests.panel.abandon", 0, state=RunState.ABANDONED))
    assert 'This task has on_stale="abandon"' in abandon.summary
    assert "not run again" in abandon.summary
    unknown = why_not_running(make_run("tests.panel.elsewhere", 0, state=RunState.ABANDONED))
    assert "With on_stale" not in unknown.summary
    assert "not known to this process" in unknown.summary


def test_why__abandoned_names_on_stale_of_tasks_without_a_schedule():
    """Keyed tasks and beat-stamped ones (no cron=/every=) never register a schedule; their
    on_stale is known all the same."""
    once_per_key(key="order:{n}", name="tests.panel.keyed_retry", on_stale="retry")(lambda n: n)
    once_per_schedule(name="tests.panel.stamped_retry", on_stale="retry")(lambda: None)
    once_per_key(key="order:{n}", name="tests.panel.keyed_abandon")(lambda n: n)
    for name in ("tests.panel.keyed_retry", "tests.panel.stamped_retry"):
        why = why_not_running(make_run(name, 0, state=RunState.ABANDONED))
        assert 'This task has on_stale="retry"' in why.summary, (name, why.summary)
    why = why_not_running(make_run("tests.panel.keyed_abandon", 0, state=RunState.ABANDONED))
    assert 'This task has on_stale="abandon"' in why.summary, why.summary


def test_why__keyed_run_reads_the_keys_lock(redis_server: RedisServer):
    owner = "otherhost:1:deadbeef"
    run = make_run("tests.panel.keyed", 0, lease=3600, owner=owner)
    run.key = "order:42"
    run.save(update_fields=["key"])
    with redis_backend(redis_server) as lock:
        key = lock.keyed(run.task_name, "order:42")
        lock.client.set(key, token_of(owner), px=60_000)
        facts = dict(why_not_running(run).facts)
    assert facts["Redis key holder"] == f"this run's owner ({key})"
