"""``rq worker -c tests.support.rq_config``: RQ reads its settings from this module, which
sets Django up first (the guard needs the ledger), as a project's RQ config module would.
The Redis comes from ``TASKGUARD_TEST_RQ_URL``."""

from __future__ import annotations

import os

import django

django.setup()

REDIS_URL = os.environ["TASKGUARD_TEST_RQ_URL"]
