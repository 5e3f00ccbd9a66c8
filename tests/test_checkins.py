"""Check-ins: one start and one end per slot at every service, from the winning attempt only;
failures, hangs and a full queue never reach the task (docs/monitoring.md)."""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sentry_sdk
from django.db import connections
from prometheus_client import REGISTRY

from django_taskguard import checkins as checkins_api
from django_taskguard import current_run, ledger, once_per_key, once_per_schedule, pauses, registry
from django_taskguard.checkins import events, sending
from django_taskguard.models import RunState, TaskRun
from django_taskguard.signals import checkin_failed, run_skipped

from .support.checkin_receivers import SERVICES, Receiver
from .support.checkin_setup import CheckIns, running_checkins

pytestmark = pytest.mark.dialect

HOUR = timedelta(hours=1)
SLOT = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - 24 * HOUR


@pytest.fixture
def checkins(transactional_db: None) -> Iterator[CheckIns]:
    with running_checkins() as kit:
        yield kit


def seen(receiver: Receiver) -> list[tuple[str, str, str, str]]:
    """Every check-in the receiver got, as (service, start|ok|error, check-in id, slug)."""
    found = []
    for record in receiver.records:
        service, query = record["service"], record["query"]
        if service == "sentry":
            item = record["item"]
            kind = {"in_progress": "start"}.get(item["status"], item["status"])
            found.append((service, kind, str(uuid.UUID(item["check_in_id"])), item["monitor_slug"]))
        elif service == "healthchecks":
            parts = record["path"].split("/")  # /hc/<key>/<slug>[/start|/fail]
            kind = {"start": "start", "fail": "error"}.get(parts[-1], "ok")
            found.append((service, kind, query["rid"], parts[3]))
        elif service == "cronitor":
            kind = {"run": "start", "complete": "ok", "fail": "error"}[query["state"]]
            found.append((service, kind, query["series"], record["path"].split("/")[3]))
        else:
            body = record["json"]
            kind = "start" if body["event"] == "start" else "ok" if body["state"] in (
                "succeeded", "skipped") else "error"  # fmt: skip
            found.append((service, kind, body["checkin_id"], body["monitor"]))
    return sorted(found)


def expected_id(task: str, slot: datetime, missed: bool = False) -> str:
    name = f"{ledger.identity()}\n{task}\n{slot.isoformat()}" + ("\nmissed" if missed else "")
    return str(uuid.uuid5(events.NAMESPACE, name))


def every_service(kinds: list[str], ident: str, slug: str) -> list[tuple[str, str, str, str]]:
    services = ("cronitor", "healthchecks", "sentry", "webhook")
    return sorted((s, k, ident, slug) for s in services for k in kinds)


def test_checkins__one_start_and_one_end_per_slot_from_the_winner(checkins: CheckIns) -> None:
    calls = []

    @once_per_schedule(every=HOUR, name="tests.checkins.hourly")
    def hourly() -> None:
        calls.append(1)

    registry.sync()
    hourly.run_for_slot(SLOT)
    hourly.run_for_slot(SLOT)  # a duplicate: no check-in
    hourly.run_for_slot(SLOT + HOUR)
    checkins.settle()
    assert len(calls) == 2
    slug = "tests-checkins-hourly"
    assert seen(checkins.receiver) == sorted(
        every_service(["start", "ok"], expected_id("tests.checkins.hourly", SLOT), slug)
        + every_service(["start", "ok"], expected_id("tests.checkins.hourly", SLOT + HOUR), slug)
    )
    (webhook_end, *_) = [
        r["json"] for r in checkins.receiver.of("webhook") if r["json"]["event"] == "end"
    ]
    run = TaskRun.objects.get(task_name="tests.checkins.hourly", slot=webhook_end["slot"])
    assert webhook_end["run_id"] == run.id and webhook_end["attempt"] == 1
    assert webhook_end["state"] == RunState.SUCCEEDED and webhook_end["duration"] >= 0
    assert checkins.receiver.of("webhook")[0]["headers"]["authorization"] == "Bearer webhook-token"
    assert {r["query"].get("env") for r in checkins.receiver.of("cronitor")} == {"test"}
    assert checkins_api.failures() == {}


def test_checkins__a_raising_task_ends_in_error_with_its_reason(checkins: CheckIns) -> None:
    @once_per_schedule(every=HOUR, name="tests.checkins.broken")
    def broken() -> None:
        raise ValueError("the disk is full")

    with pytest.raises(ValueError, match="the disk is full"):
        broken.run_for_slot(SLOT)
    checkins.settle()
    ident = expected_id("tests.checkins.broken", SLOT)
    assert seen(checkins.receiver) == every_service(
        ["start", "error"], ident, "tests-checkins-broken"
    )
    (fail,) = [r for r in checkins.receiver.of("healthchecks") if r["path"].endswith("/fail")]
    assert "ValueError: the disk is full" in fail["body"]
    (end,) = [r["json"] for r in checkins.receiver.of("webhook") if r["json"]["event"] == "end"]
    assert end["state"] == RunState.FAILED and "the disk is full" in end["reason"]


def test_checkins__a_paused_schedule_checks_in_ok(checkins: CheckIns) -> None:
    """A deliberate skip (here, a paused schedule) is ``ok``: a pause must not page."""

    @once_per_schedule(every=HOUR, name="tests.checkins.paused")
    def paused() -> None:
        raise AssertionError("a paused task ran")

    registry.sync()
    assert pauses.pause("tests.checkins.paused", "maintenance")
    paused.run_for_slot(SLOT)
    checkins.settle()
    ident = expected_id("tests.checkins.paused", SLOT)
    assert seen(checkins.receiver) == every_service(["ok"], ident, "tests-checkins-paused")
    (end,) = [r["json"] for r in checkins.receiver.of("webhook")]
    assert end["state"] == RunState.SKIPPED and "maintenance" in end["reason"]


def test_checkins__keyed_runs_and_opted_out_tasks_send_none(checkins: CheckIns) -> None:
    @once_per_key(key=lambda order: f"order-{order}")
    def ship(order: int) -> None:
        pass

    @once_per_schedule(every=HOUR, name="tests.checkins.quiet")
    def quiet() -> None:
        pass

    with checkins.configure(monitors={"tests.checkins.quiet": False}):
        ship(1)
        quiet.run_for_slot(SLOT)
        checkins.settle()
    assert TaskRun.objects.count() == 2
    assert checkins.receiver.records == []


def test_checkins__monitor_slugs_per_task_and_service(checkins: CheckIns) -> None:
    @once_per_schedule(every=HOUR, name="tests.checkins.named")
    def named() -> None:
        pass

    @once_per_schedule(every=HOUR, name="tests.checkins.split")
    def split() -> None:
        pass

    monitors_setting = {
        "tests.checkins.named": "nightly-report",
        "tests.checkins.split": {"sentry": "from-sentry", "cronitor": False},
    }
    with checkins.configure(monitors=monitors_setting):
        named.run_for_slot(SLOT)
        split.run_for_slot(SLOT)
        checkins.settle()
    slugs = {(service, slug) for service, _, _, slug in seen(checkins.receiver)}
    assert slugs == {
        *((s, "nightly-report") for s in ("sentry", "healthchecks", "cronitor", "webhook")),
        ("sentry", "from-sentry"),
        ("healthchecks", "tests-checkins-split"),
        ("webhook", "tests-checkins-split"),
    }


def test_checkins__a_500_receiver_is_counted_logged_and_signalled(
    checkins: CheckIns, caplog: pytest.LogCaptureFixture
) -> None:
    for service in ("healthchecks", "cronitor", "webhook"):
        checkins.receiver.set_mode(service, "500")
    failed: list[dict[str, Any]] = []

    def on_failed(sender: str, **kwargs: Any) -> None:
        failed.append(kwargs)

    checkin_failed.connect(on_failed)
    before = REGISTRY.get_sample_value(
        "taskguard_checkin_failures_total", {"service": "healthchecks"}
    )

    @once_per_schedule(every=HOUR, name="tests.checkins.refused")
    def refused() -> str:
        return "done"

    try:
        with caplog.at_level(logging.WARNING, logger="taskguard.checkins"):
            assert refused.run_for_slot(SLOT) == "done"
            checkins.settle()
    finally:
        checkin_failed.disconnect(on_failed)
    assert sending.failures() == {"healthchecks": 2, "cronitor": 2, "webhook": 2}
    after = REGISTRY.get_sample_value(
        "taskguard_checkin_failures_total", {"service": "healthchecks"}
    )
    assert after == (before or 0) + 2
    assert sorted((f["service"], f["event"], f["error"]) for f in failed) == sorted(
        (s, e, "HTTP 500")
        for s in ("healthchecks", "cronitor", "webhook")
        for e in ("start", "end")
    )
    # Two tries each (attempts=2), every try with the same id: one check-in at the service.
    rids = [r["query"]["rid"] for r in checkins.receiver.of("healthchecks")]
    assert rids == [expected_id("tests.checkins.refused", SLOT)] * 4
    warnings = [r.getMessage() for r in caplog.records if "check-in to" in r.getMessage()]
    assert len(warnings) == 6 and all("(status 500)" in w for w in warnings)
    assert TaskRun.objects.get().state == RunState.SUCCEEDED


def test_checkins__a_redirect_is_a_failure_and_is_never_followed(
    checkins: CheckIns, caplog: pytest.LogCaptureFixture
) -> None:
    """A receiver answering 302 to another host: the secret headers and the body must not
    go there, and the check-in is not reported sent (counted, logged, tried again)."""
    with Receiver() as elsewhere:
        checkins.receiver.redirect_to = elsewhere.url
        for service in ("healthchecks", "cronitor", "webhook"):
            checkins.receiver.set_mode(service, "302")

        @once_per_schedule(every=HOUR, name="tests.checkins.redirected")
        def redirected() -> str:
            return "done"

        with caplog.at_level(logging.WARNING, logger="taskguard.checkins"):
            assert redirected.run_for_slot(SLOT) == "done"
            checkins.settle()
        assert sending.failures() == {"healthchecks": 2, "cronitor": 2, "webhook": 2}
        # Two tries of a start and an end at each service, each answered 302, none followed.
        answered = [r["status"] for r in checkins.receiver.records if r["service"] != "sentry"]
        assert answered == [302] * 12
        assert elsewhere.records == []
        warnings = [r.getMessage() for r in caplog.records if "check-in to" in r.getMessage()]
        assert len(warnings) == 6 and all("(status 302)" in w for w in warnings), warnings


def test_checkins__a_hanging_receiver_does_not_hold_the_task(checkins: CheckIns) -> None:
    """The guarded call returns while the receiver still holds the start's request."""
    checkins.receiver.set_mode("healthchecks", "hang")
    finished = threading.Event()

    @once_per_schedule(every=HOUR, name="tests.checkins.hung")
    def hung() -> str:
        assert checkins.receiver.holding.wait(30), "the start was never sent"
        return "done"

    def call() -> None:
        try:
            hung.run_for_slot(SLOT)
            finished.set()
        finally:
            connections.close_all()  # this thread's own

    caller = threading.Thread(target=call)
    caller.start()
    assert finished.wait(30), "the guarded call waited on the hanging receiver"
    # Every other service has its own thread: its start and end arrive while Healthchecks
    # still holds the start's request.
    for service in ("cronitor", "webhook"):
        assert len(checkins.receiver.wait_for(2, service, timeout=30)) == 2, service
    assert checkins.receiver.holding.is_set() and checkins.receiver.of("healthchecks") == []
    caller.join(10)
    checkins.receiver.release()
    checkins.settle()
    assert [r["path"].rsplit("/", 1)[-1] for r in checkins.receiver.of("healthchecks")] == [
        "start",
        "tests-checkins-hung",
    ]


def test_checkins__an_expired_keyed_message_sends_none(checkins: CheckIns) -> None:
    """An ``apply_once`` message that expired is recorded skipped at now with its key in
    the signal: a keyed task is not a schedule, nothing is checked in."""
    run_skipped.send(sender="tests.checkins.keyed", slot=SLOT, reason="expired", key="k")
    run_skipped.send(sender="tests.checkins.slotted", slot=SLOT, reason="paused")
    checkins.settle()
    assert {r["service"] for r in checkins.receiver.records} == set(SERVICES)
    assert all("keyed" not in json.dumps(r, default=str) for r in checkins.receiver.records)


def test_checkins_config__sentry_without_sentry_sdk_is_refused(monkeypatch) -> None:
    from django_taskguard.checkins import config

    monkeypatch.setattr(config, "find_spec", lambda name: None)
    assert "pip install" in (config.problem({"sentry": {}}) or "")
    assert config.problem({"webhook": {"url": "http://127.0.0.1:1/"}}) is None


def test_checkins__a_full_queue_drops_counts_and_signals__for_that_service_only(
    checkins: CheckIns,
) -> None:
    """The webhook hangs and its queue (of 1) fills: its check-ins are dropped, counted and
    signalled. Every other service has a queue of its own (a queue of 1 too, so that a
    quick sender may drop some as well): nothing of theirs is lost uncounted."""
    checkins.receiver.set_mode("webhook", "hang")
    dropped: list[dict[str, Any]] = []

    def on_failed(sender: str, **kwargs: Any) -> None:
        dropped.append(kwargs)

    @once_per_schedule(every=HOUR, name="tests.checkins.flood")
    def flood() -> None:
        if current_run().slot == SLOT:  # the thread took the start, and hangs on the webhook
            assert checkins.receiver.holding.wait(30), "the start was never sent"

    checkin_failed.connect(on_failed)
    try:
        with checkins.configure(queue=1):
            sending.reset()  # the next check-in starts a thread with a queue of 1
            flood.run_for_slot(SLOT)  # its end takes the queue's one place
            flood.run_for_slot(SLOT + HOUR)  # dropped: its start and end, and the next slot's
            flood.run_for_slot(SLOT + 2 * HOUR)
            checkins.receiver.release()
            checkins.settle()
    finally:
        checkin_failed.disconnect(on_failed)
    webhook = [d for d in dropped if d["service"] == "webhook"]
    assert len(webhook) == 4  # the second and third slots' starts and ends
    assert {d["error"] for d in dropped} == {"dropped: the check-in queue is full"}
    failures = sending.failures()
    assert failures["webhook"] == 4
    for service in ("sentry", "healthchecks", "cronitor"):  # 3 starts, 3 ends: sent or counted
        assert len(checkins.receiver.of(service)) + failures.get(service, 0) == 6, service
    sending.reset()  # the next test's thread has the default queue
    assert TaskRun.objects.filter(state=RunState.SUCCEEDED).count() == 3


def test_checkins__no_sentry_client_is_counted_and_said_once(
    checkins: CheckIns, caplog: pytest.LogCaptureFixture
) -> None:
    sentry_sdk.get_client().close(timeout=2)
    sentry_sdk.get_global_scope().set_client(None)

    @once_per_schedule(every=HOUR, name="tests.checkins.clientless")
    def clientless() -> None:
        pass

    with caplog.at_level(logging.WARNING, logger="taskguard.checkins"):
        clientless.run_for_slot(SLOT)
        clientless.run_for_slot(SLOT + HOUR)
        checkins.settle()
    assert checkins_api.failures() == {"sentry": 4}
    said = [r for r in caplog.records if "has no client in this process" in r.getMessage()]
    assert len(said) == 1  # once per process, not once per check-in
    assert len(checkins.receiver.of("healthchecks")) == 4  # the other services are not held up
