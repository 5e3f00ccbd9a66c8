"""A real headless Chromium drives the admin of a live test server.

Needs Debian's ``chromium`` and ``chromium-driver`` packages; a missing binary
fails the test with the command that installs them (it is never skipped).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.contrib.auth.models import User

from django_taskguard.models import RunState, TaskRun

from .conftest import ROOT
from .runs import make_run

# "once": scripts/test.sh runs it in the PostgreSQL pass only.
pytestmark = [pytest.mark.browser, pytest.mark.once, pytest.mark.django_db(transaction=True)]

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


@pytest.fixture
def browser() -> Iterator[object]:
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
    driver.implicitly_wait(10)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def navigate(driver, element) -> None:  # type: ignore[no-untyped-def]
    """Click ``element`` and wait until the page it was on has been replaced."""
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    element.click()
    WebDriverWait(driver, 30).until(expected_conditions.staleness_of(element))


def test_admin_browser__cleanup_action_through_the_confirmation_page(
    browser, live_server, tmp_path
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver = browser
    User.objects.create_superuser("admin", "admin@example.com", "secret-pw")
    stale = make_run("reports.nightly", 0, owner="worker-3:4242:9f1c2e", transitions=1)
    make_run("reports.nightly", -1440, state=RunState.SUCCEEDED, owner="worker-1:17:aa01")
    make_run("billing.sync", 5, lease=3600, owner="worker-2:311:b7d3")
    make_run("billing.sync", 0, state=RunState.FAILED, owner="worker-2:311:c4e2")
    make_run("mail.digest", 0, state=RunState.SKIPPED, owner="worker-1:17:d9a0")

    driver.get(f"{live_server.url}/admin/login/?next=/admin/taskguard/taskrun/{stale.pk}/change/")
    driver.find_element(By.NAME, "username").send_keys("admin")
    driver.find_element(By.NAME, "password").send_keys("secret-pw")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "input[type=submit]"))

    panel = driver.find_element(By.CSS_SELECTOR, "fieldset.taskguard-why")
    assert "presumed dead" in panel.text
    assert "worker-3:4242:9f1c2e" in panel.text
    assert "claimed 0" in driver.find_element(By.CSS_SELECTOR, ".inline-group").text

    driver.get(f"{live_server.url}/admin/taskguard/taskrun/")
    driver.find_element(By.CSS_SELECTOR, f"input.action-select[value='{stale.pk}']").click()
    Select(driver.find_element(By.NAME, "action")).select_by_value("cleanup_stale_locks")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "button[name=index]"))

    assert "1 of the selected runs is stale" in driver.find_element(By.ID, "content").text
    assert TaskRun.objects.get(pk=stale.pk).state == RunState.RUNNING
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "input[type=submit][value^='Yes']"))

    message = driver.find_element(By.CSS_SELECTOR, "ul.messagelist li.success")
    assert "Abandoned 1 stale run" in message.text
    assert TaskRun.objects.get(pk=stale.pk).state == RunState.ABANDONED
    badges = [badge.text for badge in driver.find_elements(By.CSS_SELECTOR, ".taskguard-state")]
    assert "abandoned" in badges

    shot = tmp_path / "admin-screenshot.png"
    assert driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    if os.environ.get("TASKGUARD_UPDATE_SCREENSHOT"):  # refresh the README's picture on demand
        shutil.copyfile(shot, ROOT / "docs" / "admin-screenshot.png")
