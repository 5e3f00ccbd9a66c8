"""The Huey instance of the Huey tests, on the private Redis named by
``TASKGUARD_TEST_HUEY_URL`` (children of tests/test_huey_e2e.py, where tests/settings.py
makes it ``settings.HUEY`` for huey.contrib.djhuey). Without it the instance points at a
port nothing listens on until a test calls :func:`connect` (redis-py connects lazily).

No taskguard import here: tests/settings.py imports this module.
"""

from __future__ import annotations

import os

from huey import RedisHuey

NOWHERE = "redis://127.0.0.1:9/0"

huey = RedisHuey("taskguard-tests", url=os.environ.get("TASKGUARD_TEST_HUEY_URL") or NOWHERE)


def connect(url: str) -> None:
    """Point :data:`huey` at the Redis at ``url`` (a test's private server)."""
    huey.storage_kwargs["url"] = url
    huey.storage = huey.create_storage()
