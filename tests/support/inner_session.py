"""A pytest session in a child process, as a user's project runs its own tests.

The test kit's promises (the ``taskguard`` pytest plugin, what happens between two
tests, the docs' examples) are about whole sessions: one test's leftovers meeting the
next. The child runs pytest with pytest-django on ``tests.settings`` (or a settings
module written next to the tests), its own test database, and, when given a Redis
server, the Redis backend on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from . import ROOT
from .redis_server import RedisServer

INI = """[pytest]
DJANGO_SETTINGS_MODULE = {settings}
addopts = -p no:cacheprovider --strict-markers
filterwarnings = error
"""


def run_session(
    directory: Path,
    files: dict[str, str],
    *,
    redis: RedisServer | None = None,
    settings: str = "tests.settings",
) -> subprocess.CompletedProcess[str]:
    """Write ``files`` (path relative to ``directory``: text) and run pytest on them."""
    for name, text in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (directory / "pytest.ini").write_text(INI.format(settings=settings))
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("TASKGUARD_TEST_DB_NAME", "TASKGUARD_TEST_LEDGER_DB_NAME"))
        and not key.startswith("PYTEST_")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(directory), str(ROOT)])
    env["TASKGUARD_SCRATCH"] = str(directory)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    if env.get("TASKGUARD_TEST_DB") == "mariadb":
        # The session's MariaDB names its test databases the same in every process: the
        # child's get names of their own (test_<name>), or it would drop the parent's.
        name = f"taskguard_inner_{os.getpid()}_{directory.name}"[:50].replace("-", "_")
        env["TASKGUARD_TEST_DB_NAME"] = name
        env["TASKGUARD_TEST_LEDGER_DB_NAME"] = f"{name}_ledger"
    if redis is not None:
        env["TASKGUARD_TEST_REDIS_URL"] = redis.url
        env["TASKGUARD_TEST_BACKEND"] = "redis"
    else:
        env.pop("TASKGUARD_TEST_REDIS_URL", None)
        env["TASKGUARD_TEST_BACKEND"] = "database"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", str(directory)],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
