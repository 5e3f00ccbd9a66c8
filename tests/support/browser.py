"""The headless Chromium the admin's browser tests drive (the fixtures ``chromium`` and
``browser`` in tests/conftest.py). Needs Debian's ``chromium`` and ``chromium-driver``
packages; a missing binary fails the test with the command that installs them (it is never
skipped)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1600,900",
]
# How long a lookup waits for an element to appear. The admin's pages are rendered by the
# server and a navigation waits for its page to load; the wait is for the few parts a script
# adds. A test that asserts an element is absent uses :func:`at_once` (each absent element would
# otherwise cost the whole wait: 50 s of one test's 80, 2026-12-07).
IMPLICIT_WAIT = 10


def chromium() -> Iterator[object]:
    """One headless Chromium for the session (each start took seconds); each test gets it
    through :func:`browser`, signed out and at its first size."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not Path(path).exists()]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not found: the browser test needs Debian's Chromium "
            "(apt-get install -y chromium chromium-driver)",
            pytrace=False,
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="taskguard-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(IMPLICIT_WAIT)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def browser(chromium: Any) -> Iterator[object]:
    """The session's Chromium, as a new one would be: no cookies of the live server (a test
    signs in), and the window at its first size (tests resize it)."""
    chromium.set_window_size(1600, 900)
    try:
        yield chromium
    finally:
        chromium.delete_all_cookies()  # the live server's: the one site the tests visit


def at_once(scope: Any, selector: str) -> list[Any]:
    """The elements in ``scope`` (the driver or an element) that match the CSS ``selector``
    at once, with no implicit wait: what a test that asserts absence reads."""
    from selenium.webdriver.common.by import By

    driver = getattr(scope, "parent", scope)  # an element's parent is its driver
    driver.implicitly_wait(0)
    try:
        return list(scope.find_elements(By.CSS_SELECTOR, selector))
    finally:
        driver.implicitly_wait(IMPLICIT_WAIT)
