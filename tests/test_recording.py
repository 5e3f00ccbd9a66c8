"""What the ledger records when things end badly: text it cannot store, retries that
never come, a user's exception whatever the recording meets."""

from __future__ import annotations

import json
import tracemalloc
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command

from django_taskguard import guard, ledger
from django_taskguard.endings import Ending
from django_taskguard.guard import Policy
from django_taskguard.models import DatabaseNow, RunState, TaskRun

from .support.runs import counted_duplicates
from .support.slots import BASE_SLOT

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]


class Boom(Exception):
    pass


@pytest.mark.parametrize(
    ("message", "stored"),
    [
        pytest.param("a\x00b", "a\\x00b", id="nul"),
        pytest.param("lone \udc80 surrogate", "lone \\udc80 surrogate", id="lone-surrogate"),
        pytest.param("ok ünïcode ✓", "ok ünïcode ✓", id="unicode-kept"),
    ],
)
def test_failed_run__error_text_the_database_refuses_is_stored_escaped(message, stored):
    # Before: PostgreSQL refused NUL, both databases lone surrogates; the caller got a
    # DataError/UnicodeEncodeError instead of its own exception, the row stayed running.
    def body() -> None:
        raise Boom(message)

    with pytest.raises(Boom) as info:
        guard.execute("tests.recording.text", BASE_SLOT, Policy(), body, (), {})
    assert info.value.args == (message,), "the function's own exception reaches the caller"
    run = TaskRun.objects.get()
    assert run.state == RunState.FAILED
    assert run.error == f"Boom: {stored}"
    assert run.transitions.last().reason == f"Boom: {stored}"


def test_failed_run__huge_error_text_is_bounded():
    def body() -> None:
        raise Boom("x" * 100_000)

    with pytest.raises(Boom):
        guard.execute("tests.recording.huge", BASE_SLOT, Policy(), body, (), {})
    run = TaskRun.objects.get()
    assert len(run.error) == ledger.ERROR_MAX_LENGTH and run.error.endswith("…")
    assert len(run.transitions.last().reason) == ledger.REASON_MAX_LENGTH


def test_failed_run__huge_non_ascii_error_is_cut_before_it_is_escaped():
    # Before: clip() escaped the whole message, then cut it: a 100M-character non-ASCII
    # exception cost ~700 MB to record. Recording must cost about the stored text, not
    # the message (measured with tracemalloc, not time).
    message = "é\x00" * 2_000_000  # 4M characters, non-ASCII, with NULs to escape
    tracemalloc.start()
    try:
        clipped = ledger.clip(message, ledger.ERROR_MAX_LENGTH)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"recording a 4M-character message allocated {peak} bytes"
    assert clipped == ("é\\x00" * 2_000)[: ledger.ERROR_MAX_LENGTH - 1] + "…"


@pytest.mark.parametrize("limit", [1, 2, 3, 5, 6, 7, 8, 20])
@pytest.mark.parametrize(
    "text", ["abcdefgh", "a\x00bc\x00", "ab\udcffcd", "x\ud83d\ude00y", "é😀\x00\udc80é"]
)
def test_clip__cutting_first_stores_what_escaping_first_stored(text, limit):
    # Cut before escaping: the same text as escaping the whole message then cutting it,
    # at every cut, a surrogate pair or an escape at the boundary included.
    escaped = text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode()
    expected = escaped if len(escaped) <= limit else escaped[: limit - 1] + "…"
    assert ledger.clip(text, limit) == expected


def test_retrying_run__a_retry_that_never_comes_is_abandoned_by_cleanup():
    # Before: a retrying row whose retry never came (worker killed before Celery
    # published it) stayed retrying forever: cleanup looked at running rows only.
    def classify(exc: BaseException) -> Ending:
        return Ending(RunState.RETRYING, "retry requested", retry_within=30)

    with pytest.raises(Boom):
        guard.execute(
            "tests.recording.retry",
            BASE_SLOT,
            Policy(),
            lambda: (_ for _ in ()).throw(Boom("transient")),
            (),
            {},
            classify_raise=classify,
        )
    run = TaskRun.objects.get()
    assert run.state == RunState.RETRYING
    # The deadline: the retry's wait plus RETRY_GRACE_SECONDS (default 7200).
    left = (run.lease_until - run.started_at).total_seconds()
    assert 7200 + 30 - 5 <= left <= 7200 + 30 + 5
    assert call_command_json("cleanup_locks")["stale_runs"] == 0, "not due yet"

    TaskRun.objects.filter(pk=run.pk).update(lease_until=DatabaseNow() - timedelta(seconds=1))
    assert call_command_json("cleanup_locks")["stale_runs"] == 1
    run.refresh_from_db()
    assert run.state == RunState.ABANDONED
    assert run.transitions.last().reason.startswith("retry never came: attempt 1")


def test_retrying_run__the_retry_that_comes_in_time_runs():
    ran: list[int] = []

    def classify(exc: BaseException) -> Ending | None:
        return Ending(RunState.RETRYING, "retry requested") if ran == [1] else None

    def body() -> str:
        if not ran:
            ran.append(1)
            raise Boom("first")
        ran.append(2)
        return "second"

    with pytest.raises(Boom):
        guard.execute(
            "tests.recording.retry2", BASE_SLOT, Policy(), body, (), {}, classify_raise=classify
        )
    assert guard.execute("tests.recording.retry2", BASE_SLOT, Policy(), body, (), {}) == "second"
    run = TaskRun.objects.get()
    assert (run.state, run.attempt) == (RunState.SUCCEEDED, 2)


def test_retrying_run__only_the_message_that_asked_for_the_retry_starts_the_next_attempt(
    lock_backend,
):
    # Before (issue 19, item 5): any caller that found the row retrying started the next
    # attempt, so another beat's copy of the slot's message ran as an extra attempt.
    name, ran = "tests.recording.retry_by", []

    def fails() -> None:
        ran.append("m1")
        raise Boom("transient")

    def classify(exc: BaseException) -> Ending:
        return Ending(RunState.RETRYING, "retry requested", retry_within=30, retry_by="m1")

    with pytest.raises(Boom):
        guard.execute(name, BASE_SLOT, Policy(), fails, (), {}, classify_raise=classify,
                      message_id="m1")  # fmt: skip
    other = [guard.execute(name, BASE_SLOT, Policy(), ran.append, ("other",), {}, message_id=m)
             for m in ("m2", None)]  # fmt: skip
    assert other == [None, None] and ran == ["m1"], "another copy ran"
    run = TaskRun.objects.get()
    assert (run.state, run.attempt, run.duplicates, run.retry_by) == (
        RunState.RETRYING, 1, 2, "m1",
    )  # fmt: skip
    assert guard.execute(name, BASE_SLOT, Policy(), lambda: "ok", (), {}, message_id="m1") == "ok"
    run.refresh_from_db()
    assert (run.state, run.attempt, run.duplicates, run.retry_by) == (
        RunState.SUCCEEDED, 2, 2, None,
    )  # fmt: skip
    late = guard.execute(name, BASE_SLOT, Policy(), ran.append, ("late",), {}, message_id="m3")
    assert late is None and ran == ["m1"]
    assert counted_duplicates(name) == 3  # the late one may be counted in Redis


def call_command_json(name: str) -> dict[str, int]:
    out = StringIO()
    call_command(name, "--json", stdout=out)
    return dict(json.loads(out.getvalue()))


def test_owner__names_the_instance_setting_then_the_host():
    from django.test import override_settings

    from django_taskguard.owner import Owner, host

    guard.execute("tests.recording.where", BASE_SLOT, Policy(), lambda: 1, (), {})
    with override_settings(TASKGUARD={"BACKEND": "database", "INSTANCE_NAME": "web:3"}):
        guard.execute(
            "tests.recording.where", BASE_SLOT + timedelta(minutes=1), Policy(), lambda: 1, (), {}
        )
    with override_settings(TASKGUARD={"BACKEND": "database"}):
        guard.execute(
            "tests.recording.where", BASE_SLOT + timedelta(minutes=2), Policy(), lambda: 1, (), {},
            instance="w1@worker-host",
        )  # fmt: skip
    owners = [
        Owner.parse(o) for o in TaskRun.objects.order_by("slot").values_list("owner", flat=True)
    ]
    assert [o.host for o in owners if o is not None] == [host(), "web_3", "w1@worker-host"]


def retrying_for(name: str, message: str, retry_by: str) -> TaskRun:
    """Run ``name``'s slot once as message ``message``, ending ``retrying`` for ``retry_by``."""

    def classify(exc: BaseException) -> Ending:
        return Ending(RunState.RETRYING, "retry requested", retry_within=30, retry_by=retry_by)

    def fails() -> None:
        raise Boom("transient")

    with pytest.raises(Boom):
        guard.execute(name, BASE_SLOT, Policy(), fails, (), {}, classify_raise=classify,
                      message_id=message)  # fmt: skip
    return TaskRun.objects.get(task_name=name)


def test_retrying_run__a_message_identity_longer_than_the_column_still_starts_its_retry():
    # Before (review of issue 19): a Celery task id over the 255-character column broke
    # every retry on PostgreSQL (DataError, the row left running) and, truncated on
    # MariaDB in non-strict mode, refused the real retry.
    name, long_id = "tests.recording.retry_by_long", "t" * 300
    run = retrying_for(name, f"{long_id}/0", f"{long_id}/1")
    assert (run.state, run.attempt) == (RunState.RETRYING, 1)
    assert run.retry_by is not None and len(run.retry_by) <= 255
    other = guard.execute(name, BASE_SLOT, Policy(), lambda: "x", (), {}, message_id="u/1")
    assert other is None
    stale = guard.execute(name, BASE_SLOT, Policy(), lambda: "x", (), {},
                          message_id=f"{long_id}/0")  # fmt: skip
    assert stale is None
    done = guard.execute(name, BASE_SLOT, Policy(), lambda: "ok", (), {},
                         message_id=f"{long_id}/1")  # fmt: skip
    assert done == "ok"
    run.refresh_from_db()
    assert (run.state, run.attempt, run.duplicates) == (RunState.SUCCEEDED, 2, 2)


def test_retrying_run__an_overdue_retry_no_longer_holds_the_slot_for_its_message(lock_backend):
    # Before (review of issue 19): once the retry's deadline (lease_until) had passed, the
    # retry had never come (its publish failed), yet every other copy was still refused
    # and the slot stayed stranded until the sweep, whatever on_stale said.
    name, ran = "tests.recording.retry_overdue", []
    run = retrying_for(name, "m/0", "m/1")
    assert guard.execute(name, BASE_SLOT, Policy(), ran.append, ("early",), {},
                         message_id="n/0") is None  # fmt: skip
    TaskRun.objects.filter(pk=run.pk).update(lease_until=DatabaseNow() - timedelta(seconds=5))
    assert ledger.count_other_copy(run.pk, "n/0") is False
    got = guard.execute(name, BASE_SLOT, Policy(), lambda: "ran", (), {}, message_id="n/0")
    assert got == "ran" and ran == []
    run.refresh_from_db()
    assert (run.state, run.attempt, run.duplicates) == (RunState.SUCCEEDED, 2, 1)
