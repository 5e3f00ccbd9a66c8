"""Two beats and Celery retries: only the retry of the attempt that asked for it starts the
next attempt; another copy of the slot's message is a counted duplicate (issue 19, item 5).

Real workers and beats on a private Redis broker (see tests/test_celery_e2e.py), the
database lock backend. Every body execution appends a line to an unfenced log.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta

import pytest

from django_taskguard.models import RunState, TaskRun

from .support.children import executions
from .support.slots import BASE_SLOT
from .support.waiting import wait_for
from .test_celery_e2e import (  # noqa: F401 (fixtures)
    PERSISTENT,
    backend,
    cluster,
    drain,
    published,
)

pytestmark = [pytest.mark.processes, pytest.mark.once]

FLAKY = "tests.support.celery_tasks.ha_flaky"
HOPELESS = "tests.support.celery_tasks.ha_hopeless"


@pytest.mark.parametrize("backend", ["database", "redis"])
def test_retry__a_second_copy_that_meets_the_retrying_row_is_a_duplicate(
    cluster,  # noqa: F811
    scratch,
    backend,  # noqa: F811
):
    """The issue's reproduction: one slot's message twice, the second while the row is
    ``retrying`` (the task always raises, each retry 3 s later). Before: the copy became
    attempt 2 and then retried on its own, 5 executions where max_retries=2 allows 3.
    With the Redis lock backend too: a retrying slot holds no lock key, so the copy
    reaches the row and is counted there."""
    from tests.support import celery_tasks

    log = scratch / "executions.log"
    name = f"{celery_tasks.always_fails.name}[twice]"
    cluster.env["TASKGUARD_TEST_VISIBILITY"] = "60"  # no redeliveries of held retries
    cluster.worker("w1")
    cluster.worker("w2")
    slot = BASE_SLOT + timedelta(hours=14)
    first = cluster.publish(celery_tasks.always_fails, slot, "twice", log=str(log))
    wait_for(
        lambda: TaskRun.objects.filter(task_name=name, state=RunState.RETRYING).exists(),
        60,
        "attempt 1 to end retrying",
        describe=cluster.describe,
    )
    second = cluster.publish(celery_tasks.always_fails, slot, "twice", log=str(log))
    assert second != first
    wait_for(
        lambda: TaskRun.objects.filter(task_name=name, duplicates=1).exists(),
        30,
        "the second copy to be counted",
        describe=cluster.describe,
    )
    wait_for(
        lambda: TaskRun.objects.filter(task_name=name, state=RunState.FAILED).exists(),
        60,
        "the retries to run out",
        describe=cluster.describe,
    )
    run = TaskRun.objects.get(task_name=name)
    attempts = [line[3] for line in executions(log) if line[1] == name]
    assert attempts == ["1", "2", "3"], cluster.describe()
    assert (run.state, run.attempt, run.duplicates) == (RunState.FAILED, 3, 1)
    counted = run.transitions.filter(to_state=RunState.RUNNING).count()
    assert counted == 3


def test_retry__a_stale_copy_of_the_message_that_asked_for_the_retry_is_a_duplicate(
    cluster,  # noqa: F811
    scratch,
):
    """Review of issue 19: a copy of the first message (same task id, retry count 0: a
    put-back of the original, a redelivery after the visibility timeout) that meets the
    row ``retrying`` for that message's retry. Before, ``retry_by`` was the task id alone:
    the stale copy started attempt 2 early and began a second retry chain (more than 3
    executions where max_retries=2 allows 3)."""
    from tests.support import celery_tasks

    log = scratch / "executions.log"
    name = f"{celery_tasks.always_fails.name}[stale]"
    cluster.env["TASKGUARD_TEST_VISIBILITY"] = "60"
    cluster.worker("w1")
    cluster.worker("w2")
    slot = BASE_SLOT + timedelta(hours=15)
    first = cluster.publish(celery_tasks.always_fails, slot, "stale", log=str(log))
    wait_for(
        lambda: TaskRun.objects.filter(task_name=name, state=RunState.RETRYING).exists(),
        60,
        "attempt 1 to end retrying",
        describe=cluster.describe,
    )
    stale = cluster.publish(celery_tasks.always_fails, slot, "stale", first, log=str(log))
    assert stale == first
    wait_for(
        lambda: TaskRun.objects.filter(task_name=name, state=RunState.FAILED).exists(),
        60,
        "the retries to run out",
        describe=cluster.describe,
    )
    wait_for(
        lambda: TaskRun.objects.filter(task_name=name, duplicates=1).exists(),
        30,
        "the stale copy to be counted",
        describe=cluster.describe,
    )
    run = TaskRun.objects.get(task_name=name)
    attempts = [line[3] for line in executions(log) if line[1] == name]
    assert attempts == ["1", "2", "3"], cluster.describe()
    assert (run.state, run.attempt, run.duplicates) == (RunState.FAILED, 3, 1)


def test_retry__two_beats_two_workers_at_most_max_retries_plus_one_per_slot(cluster, scratch):  # noqa: F811
    """The documented HA setup with retries: two TaskguardScheduler beats, two workers,
    autoretry_for with max_retries=2 and retry_backoff (1 s, 2 s). A task that fails twice
    then succeeds runs 3 times per slot and succeeds at attempt 3; one that always fails
    runs 3 times and ends failed; every other copy is a counted duplicate."""
    log = scratch / "executions.log"
    cluster.env["TASKGUARD_TEST_VISIBILITY"] = "60"
    kwargs = {"log": str(log)}
    schedule = {
        "ha-flaky": {"task": FLAKY, "every": 4, "kwargs": kwargs},
        "ha-hopeless": {"task": HOPELESS, "every": 4, "kwargs": kwargs},
    }
    # One process each: of the four messages a slot brings (two tasks, two beats), two
    # wait for a free process and so often meet the first copy's row retrying.
    cluster.worker("w1")
    cluster.worker("w2")
    cluster.beat("beat1", PERSISTENT, schedule)
    cluster.beat("beat2", PERSISTENT, schedule)

    def both_sent(times: int) -> bool:
        sent = Counter((entry, role) for entry, _, role in published(cluster))
        return all(sent[(e, r)] >= times for e in schedule for r in ("beat1", "beat2"))

    wait_for(
        lambda: both_sent(4),
        120,
        "both beats to send four slots of each",
        describe=cluster.describe,
    )
    cluster.stop("beat1")
    cluster.stop("beat2")
    names = [f"{FLAKY}[ha-flaky]", f"{HOPELESS}[ha-hopeless]"]
    drain(names, timeout=120)
    sends = Counter((entry, slot) for entry, slot, _ in published(cluster))

    def counted() -> bool:  # the last copies may still be on their way to a worker
        found = {(r.task_name, r.slot): r.duplicates for r in TaskRun.objects.all()}
        return all(
            found.get((f"{task}[{entry}]", slot), -1) >= sent - 1
            for (entry, slot), sent in sends.items()
            for task in (FLAKY if entry == "ha-flaky" else HOPELESS,)
        )

    wait_for(counted, 60, "every copy the beats sent to be counted", describe=cluster.describe)
    executed = Counter(
        (name, datetime.fromisoformat(slot)) for _, name, slot, *_ in executions(log)
    )
    runs = {(r.task_name, r.slot): r for r in TaskRun.objects.filter(task_name__in=names)}
    assert len(runs) >= 8 and len(sends) == len(runs)
    assert sum(n == 2 for n in sends.values()) >= 6, f"few slots had two copies: {sends}"
    for key, run in runs.items():
        assert executed[key] == 3, (key, executed[key], cluster.describe())
        final = RunState.SUCCEEDED if key[0] == names[0] else RunState.FAILED
        assert (run.state, run.attempt) == (final, 3), key
        attempts = [int(line[3]) for line in executions(log) if (line[1], line[2]) == (
            key[0], key[1].isoformat())]  # fmt: skip
        assert attempts == [1, 2, 3], key
        entry = "ha-flaky" if key[0] == names[0] else "ha-hopeless"
        assert run.duplicates == sends[(entry, key[1])] - 1, key
