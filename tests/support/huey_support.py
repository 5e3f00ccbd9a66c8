"""tests/support/huey_jobs.py in the test process, freshly decorated on a private Redis
(tests/test_huey.py, tests/test_huey_e2e.py)."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from types import ModuleType

from huey.api import TaskWrapper

from django_taskguard import registry
from django_taskguard.contrib.huey import periodic_tasks

from . import huey_app

JOBS_MODULE = "tests.support.huey_jobs"


@contextlib.contextmanager
def fresh_jobs(url: str) -> Iterator[ModuleType]:
    """The jobs module, (re)imported with :data:`huey_app.huey` on the Redis at ``url``;
    its schedules and Huey tasks forgotten afterwards."""
    huey_app.connect(url)
    before = set(registry.entries())
    module = sys.modules.get(JOBS_MODULE)
    if module is None:
        module = importlib.import_module(JOBS_MODULE)
    else:
        forget_tasks(module)
        module = importlib.reload(module)
    periodic_tasks.forget()
    try:
        yield module
    finally:
        forget_tasks(module)
        for name in set(registry.entries()) - before:
            registry.unregister(name)
        huey_app.connect(huey_app.NOWHERE)


def forget_tasks(module: ModuleType) -> None:
    """Unregister the module's Huey tasks (a reload registers them again)."""
    for value in vars(module).values():
        if isinstance(value, TaskWrapper):
            value.unregister()
