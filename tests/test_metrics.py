"""The metrics/ URL: prometheus_client's exposition of the ledger, and who may scrape it."""

from __future__ import annotations

import sys
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client, override_settings
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

import django_taskguard
from django_taskguard.models import RunState

from .support.monitoring import due_slot, finished, schedule
from .support.runs import make_run

pytestmark = [pytest.mark.dialect, pytest.mark.django_db(transaction=True)]
METRICS = reverse("taskguard:metrics")
TOKEN = "scrape-token-0123456789"


def scrape(client: Client, **headers: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get(METRICS, headers=headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


@pytest.fixture
def staff() -> Client:
    client = Client()
    user = User.objects.create_user("ops", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_taskrun"))
    client.force_login(user)
    return client


def test_metrics_view__per_task_figures_from_the_ledger(staff):
    slot = due_slot(timedelta(minutes=1))
    schedule("tests.sync", every=timedelta(minutes=1))
    done = finished("tests.sync", slot, seconds=0.3, duplicates=7)
    finished("tests.sync", slot - timedelta(minutes=1), RunState.FAILED, seconds=42)
    finished("tests.sync", slot - timedelta(minutes=2), RunState.MISSED, attempt=0)
    finished("tests.sync", slot - timedelta(minutes=3), RunState.ABANDONED, duplicates=1)
    finished("tests.sync", slot - timedelta(days=3), RunState.SUCCEEDED)  # outside the window
    make_run("tests.other", 0, state=RunState.SUCCEEDED)
    samples = scrape(staff)
    task = (("task", "tests.sync"),)
    assert samples[("taskguard_last_success_timestamp_seconds", task)] == pytest.approx(
        done.finished_at.timestamp()
    )
    assert samples[("taskguard_runs", (("state", "succeeded"), *task))] == 1
    assert samples[("taskguard_runs", (("state", "failed"), *task))] == 1
    assert samples[("taskguard_duplicates_suppressed", task)] == 8
    assert samples[("taskguard_missed_slots", task)] == 1
    assert samples[("taskguard_lease_losses", task)] == 1
    # Its latest slot succeeded: the earlier missed, failed and abandoned slots are counted
    # above, not judged (a later success clears them).
    assert samples[("taskguard_task_healthy", task)] == 1
    assert samples[("taskguard_task_paused", task)] == 0
    assert samples[("taskguard_window_seconds", ())] == 24 * 3600
    # The histogram: the succeeded run took 0.3 s, the failed one 42 s.
    assert samples[("taskguard_run_duration_seconds_bucket", (("le", "0.5"), *task))] == 1
    assert samples[("taskguard_run_duration_seconds_bucket", (("le", "30"), *task))] == 1
    assert samples[("taskguard_run_duration_seconds_bucket", (("le", "60"), *task))] == 2
    assert samples[("taskguard_run_duration_seconds_bucket", (("le", "+Inf"), *task))] == 2
    assert samples[("taskguard_run_duration_seconds_gsum", task)] == pytest.approx(
        42.3, abs=0.01
    )  # SQLite: julianday()


def test_metrics_view__openmetrics_when_asked(staff):
    finished("tests.sync", due_slot())
    response = staff.get(METRICS, headers={"accept": "application/openmetrics-text"})
    assert response["Content-Type"].startswith("application/openmetrics-text")
    body = response.content.decode()
    assert "# TYPE taskguard_run_duration_seconds gaugehistogram" in body
    assert body.endswith("# EOF\n")


def test_metrics_view__staff_only_without_a_token():
    assert Client().get(METRICS).status_code == 403
    user = Client()
    user.force_login(User.objects.create_user("someone", password="pw"))
    assert user.get(METRICS).status_code == 403
    # Staff the admin refuses (no view_taskrun) are refused here too.
    refused = Client()
    refused.force_login(User.objects.create_user("clerk", password="pw", is_staff=True))
    assert refused.get(METRICS).status_code == 403


def test_metrics_view__a_bearer_token_when_set(staff):
    with override_settings(TASKGUARD={"BACKEND": "database", "METRICS_TOKEN": TOKEN}):
        assert ("taskguard_window_seconds", ()) in scrape(Client(), authorization=f"Bearer {TOKEN}")
        assert Client().get(METRICS, headers={"authorization": "Bearer nope"}).status_code == 401
        assert staff.get(METRICS).status_code == 200
        # The health token does not open the metrics.
    with override_settings(TASKGUARD={"BACKEND": "database", "HEALTH_TOKEN": TOKEN}):
        assert (
            Client().get(METRICS, headers={"authorization": f"Bearer {TOKEN}"}).status_code == 403
        )


def test_metrics_view__without_prometheus_client_says_how_to_install(staff, monkeypatch):
    for name in [n for n in sys.modules if n.split(".")[0] == "prometheus_client"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.delitem(sys.modules, "django_taskguard.metrics", raising=False)
    monkeypatch.delattr(django_taskguard, "metrics", raising=False)
    response = staff.get(METRICS)
    assert response.status_code == 404
    assert b"pip install 'django-taskguard[prometheus]'" in response.content


def test_metrics_view__query_count_does_not_grow_with_runs_or_tasks(
    staff, django_assert_max_num_queries
):
    schedule("tests.sync", every=timedelta(minutes=1))
    slot = due_slot(timedelta(minutes=1))
    finished("tests.sync", slot)
    staff.get(METRICS)
    with django_assert_max_num_queries(13) as few:
        staff.get(METRICS)
    for minute in range(1, 60):
        finished("tests.sync", slot - timedelta(minutes=minute))
    for n in range(30):  # more tasks do not mean more queries either
        schedule(f"tests.more{n}", every=timedelta(minutes=1))
        finished(f"tests.more{n}", slot)
    with django_assert_max_num_queries(len(few.captured_queries)):
        staff.get(METRICS)
