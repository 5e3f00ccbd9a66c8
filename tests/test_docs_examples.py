"""The docs' examples, run as written, so that they cannot rot.

A fenced ``python`` block right after a ``<!-- docs-test: KIND -->`` line is run:

- ``pytest``, ``unittest``: the block is a test module of a user's project, collected by
  pytest (pytest-django, the ``taskguard`` plugin);
- ``run``: the page's ``run`` blocks are executed in order, in one namespace (as a reader
  follows the page), inside a transactional test; names that stand for the user's own code
  come from the page's prelude below.

Each page runs in a pytest session of its own (a child process, tests/support/inner_session.py),
on the database backend and on a private Redis: a user's project, with ``myapp.jobs`` as
the docs describe it and ``TIME_ZONE = "Asia/Shanghai"``.
"""

from __future__ import annotations

import re
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from .support import ROOT
from .support.inner_session import run_session

DEPLOYMENTS = [
    "docs/deployments/apscheduler.md",
    "docs/deployments/celery-beat.md",
    "docs/deployments/run-schedules.md",
    "docs/deployments/django-tasks.md",
]
MIGRATING = "docs/migrating-from-django-celery-beat.md"
DJANGO_Q2 = "docs/django-q2.md"
PAGES = [
    "docs/getting-started.md",
    "docs/testing.md",
    "docs/decorators.md",
    "docs/schedules.md",
    "README.md",
    "docs/dramatiq.md",
    *DEPLOYMENTS,
    MIGRATING,
    DJANGO_Q2,
]
# Pages whose examples create django-celery-beat rows: skipped where it cannot be installed.
NEEDS_CELERY_BEAT = {"docs/deployments/celery-beat.md", MIGRATING}
# Each page in a pytest session of its own (a child process), on SQLite: what a reader trying
# the page has first (the README's demo is SQLite), and the examples show the API, whose
# outcome the database does not change (the dialect tests prove the ledger's SQL).
pytestmark = [pytest.mark.pure, pytest.mark.processes]
BLOCK = re.compile(r"^<!-- docs-test: (\w+) -->\n```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)

MYAPP_JOBS = """
from datetime import timedelta

from django_taskguard import once_per_key, once_per_schedule


@once_per_schedule(cron="0 21 * * *")
def nightly_report():
    return "report sent"


@once_per_key(key="order:{order_id}", keep=timedelta(days=7))
def charge(order_id):
    return f"charged {order_id}"


@once_per_schedule()  # no schedule of its own: data schedules give it slots
def send_report(tenant_id, fmt="pdf"):
    return f"report {tenant_id} {fmt}"
"""

SETTINGS = """
from tests.settings import *  # noqa: F403

TIME_ZONE = "Asia/Shanghai"  # the docs' site
INSTALLED_APPS = [*INSTALLED_APPS, "myapp"]  # noqa: F405  (its jobs module: the site's schedules)
"""

# What a page's ``run`` blocks take from its other blocks, or from the user's own code.
PRELUDES = {
    "docs/testing.md": (
        "from datetime import datetime, timedelta\n"
        "from zoneinfo import ZoneInfo\n"
        "from django_taskguard.testing import freeze_now\n"
        "from myapp.jobs import nightly_report\n"
        'SHANGHAI = ZoneInfo("Asia/Shanghai")\n'
    ),
    "docs/decorators.md": (
        "def chunks():\n    return [b'one', b'two']\n\n"
        "def write(chunk, fence):\n    assert fence > 0\n"
    ),
    "docs/schedules.md": "",
    "README.md": "",
    "docs/dramatiq.md": "",
    "docs/getting-started.md": "",
    **dict.fromkeys([*DEPLOYMENTS, MIGRATING, DJANGO_Q2], ""),
}

RUN_TEST = """
import pytest

PAGE = {page!r}
BLOCKS = {blocks!r}


@pytest.mark.django_db(transaction=True)
def test_run_blocks_in_order():
    namespace = {{"__name__": {module!r}}}
    for line, source in BLOCKS:
        exec(compile(source, f"{{PAGE}}, block at line {{line}}", "exec"), namespace)
"""


def blocks(page: str) -> list[tuple[str, int, str]]:
    """``(kind, line, source)`` of each marked block of ``page``."""
    text = (ROOT / page).read_text()
    return [
        (match[1], text.count("\n", 0, match.start()) + 3, match[2])
        for match in BLOCK.finditer(text)
    ]


def session_files(page: str) -> dict[str, str]:
    stem = Path(page).stem.lower().replace("-", "_")
    files = {"myapp/__init__.py": "", "myapp/jobs.py": MYAPP_JOBS, "docs_settings.py": SETTINGS}
    runs: list[tuple[int, str]] = []
    for kind, line, source in blocks(page):
        if kind in ("pytest", "unittest"):
            files[f"test_{stem}_line{line}.py"] = source
        elif kind == "run":
            runs.append((line, source))
        else:
            raise AssertionError(f"{page}:{line}: unknown docs-test kind {kind!r}")
    if runs:
        runs[0] = (runs[0][0], PRELUDES[page] + runs[0][1])
        module = f"docs_{stem}"
        files[f"test_{stem}_run.py"] = RUN_TEST.format(page=page, blocks=runs, module=module)
    return files


def marked(page: str) -> Any:
    """``page``, marked ``celery_beat`` when its examples need django-celery-beat."""
    if page in NEEDS_CELERY_BEAT:
        return pytest.param(page, marks=pytest.mark.celery_beat)
    if page == DJANGO_Q2:
        missing = find_spec("django_q") is None
        return pytest.param(page, marks=pytest.mark.skipif(missing, reason="needs django-q2"))
    if page == "docs/dramatiq.md" and not find_spec("dramatiq"):
        return pytest.param(page, marks=pytest.mark.skip(reason="needs dramatiq"))
    return page


def test_docs__every_page_marks_its_runnable_examples():
    for page in PAGES:
        kinds = [kind for kind, _, _ in blocks(page)]
        assert kinds, f"{page}: no block is marked <!-- docs-test: ... -->"
    assert [kind for kind, _, _ in blocks("docs/testing.md")][:2] == ["pytest", "unittest"]


@pytest.mark.parametrize("backend", ["database", "redis"])
@pytest.mark.parametrize("page", [marked(page) for page in PAGES])
def test_docs__examples_run_as_written(page, backend, tmp_path, redis_server):
    redis = redis_server if backend == "redis" else None
    done = run_session(
        tmp_path / "project", session_files(page), redis=redis, settings="docs_settings"
    )
    assert done.returncode == 0, f"{page} on {backend}:\n{done.stdout[-6000:]}{done.stderr[-3000:]}"
    assert " failed" not in done.stdout and " passed" in done.stdout
