"""What the check-in tests run in: a receiver, a real sentry_sdk client pointed at it, and
``TASKGUARD["CHECKINS"]`` naming all four services there.

A test module makes its fixture of :func:`running_checkins` (under ``transactional_db``:
the sending thread reads the ledger through its own connection)::

    @pytest.fixture
    def checkins(transactional_db: None) -> Iterator[CheckIns]:
        with running_checkins() as kit:
            yield kit
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sentry_sdk
from django.conf import settings
from django.test import override_settings

from django_taskguard.checkins import monitors, sending
from tests.support.checkin_receivers import Receiver


def checkin_settings(url: str, **more: Any) -> dict[str, Any]:
    """``CHECKINS`` with every service at the receiver ``url``."""
    return {
        "sentry": {},
        "healthchecks": {"ping_url": f"{url}/hc/ping-key"},
        "cronitor": {"api_key": "cronitor-key", "url": url, "environment": "test"},
        "webhook": {"url": f"{url}/webhook", "headers": {"Authorization": "Bearer webhook-token"}},
        "timeout": 10,
        "attempts": 2,
        **more,
    }


@dataclass
class CheckIns:
    receiver: Receiver

    def configure(self, **more: Any) -> override_settings:
        """Settings naming every service at the receiver (``more``: other keys)."""
        return override_settings(
            TASKGUARD={
                **settings.TASKGUARD,
                "CHECKINS": checkin_settings(self.receiver.url, **more),
            }
        )

    def settle(self, timeout: float = 30) -> None:
        """Wait until this process sent everything it queued (Sentry's transport too)."""
        assert sending.flush(timeout), "the check-ins were not sent in time"


@contextmanager
def running_checkins() -> Iterator[CheckIns]:
    """A receiver, a real sentry_sdk client sending there, and ``CHECKINS`` set to it
    (enter ``checkins.configure()`` for more keys)."""
    receiver = Receiver().start()
    sentry_sdk.init(
        dsn=f"http://public@127.0.0.1:{receiver.port}/1",
        default_integrations=False,
        auto_enabling_integrations=False,
        environment="test",
        release="taskguard-tests",
    )
    sending.reset()
    monitors.forget_schedules()
    kit = CheckIns(receiver)
    try:
        with kit.configure():
            yield kit
            sending.flush(10)
    finally:
        receiver.release()
        sentry_sdk.get_client().close(timeout=2)
        sentry_sdk.get_global_scope().set_client(None)
        receiver.stop()
        sending.reset()
