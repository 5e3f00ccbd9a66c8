"""A real headless Chromium drives the admin of a live test server.

Needs Debian's ``chromium`` and ``chromium-driver`` packages; a missing binary
fails the test with the command that installs them (it is never skipped).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from django.contrib.auth.models import User

from django_taskguard.models import RunState, TaskRun

from .support import ROOT
from .support.browser import at_once
from .support.runs import make_run

# "once": scripts/test.sh runs it in the PostgreSQL pass only.
pytestmark = [pytest.mark.browser, pytest.mark.once, pytest.mark.django_db(transaction=True)]


def keep_screenshot(driver, tmp_path: Path, name: str) -> None:  # type: ignore[no-untyped-def]
    """The page at 1400 px; into docs/ with TASKGUARD_UPDATE_SCREENSHOT=1 (the docs' pictures)."""
    driver.set_window_size(1400, 900)
    fits_width(driver)
    shot = tmp_path / name
    assert driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    if os.environ.get("TASKGUARD_UPDATE_SCREENSHOT"):
        shutil.copyfile(shot, ROOT / "docs" / name)
    driver.set_window_size(1600, 900)


def shots_dir(tmp_path: Path) -> Path:
    """Where the layout screenshots go: TASKGUARD_SCREENSHOT_DIR to keep them, else tmp_path."""
    kept = os.environ.get("TASKGUARD_SCREENSHOT_DIR")
    path = Path(kept) if kept else tmp_path
    path.mkdir(parents=True, exist_ok=True)
    return path


def fits_width(driver) -> None:  # type: ignore[no-untyped-def]
    """Wait (after a resize, for the layout) until the page needs no horizontal scrollbar."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 10).until(
        lambda d: d.execute_script(
            "return document.documentElement.scrollWidth <= document.documentElement.clientWidth"
        ),
        "the page is wider than the window: a horizontal scrollbar at 1400 px",
    )


# Every column of the page's tables is on screen: not past the window, not clipped by a
# scrolling or hidden-overflow box around it (the changelist's results scroll sideways).
CLIPPED_HEADERS = """
const viewport = document.documentElement.clientWidth;
const clipped = (cell) => {
  const right = cell.getBoundingClientRect().right;
  if (right > viewport + 1) return true;
  for (let box = cell.parentElement; box; box = box.parentElement) {
    if (getComputedStyle(box).overflowX !== "visible"
        && right > box.getBoundingClientRect().right + 1) return true;
  }
  return false;
};
return Array.from(document.querySelectorAll(arguments[0]))
  .filter(clipped).map((cell) => cell.textContent.trim() || cell.className);
"""
# How many lines each cell's text takes.
LINES = """
return Array.from(document.querySelectorAll(arguments[0])).map((cell) => {
  const style = getComputedStyle(cell);
  const line = parseFloat(style.lineHeight) || parseFloat(style.fontSize) * 1.2;
  const padding = parseFloat(style.paddingTop) + parseFloat(style.paddingBottom);
  return Math.round((cell.clientHeight - padding) / line);
});
"""
LAPTOP_WIDTHS = (1280, 1400)


def fits_laptops(driver, headers: str, shots: Path, name: str) -> None:  # type: ignore[no-untyped-def]
    """At 1280 and 1400 px: no horizontal scrollbar and no column header cut off."""
    for width in LAPTOP_WIDTHS:
        driver.set_window_size(width, 900)
        fits_width(driver)
        driver.save_screenshot(str(shots / f"{name}-{width}.png"))
        cut = driver.execute_script(CLIPPED_HEADERS, headers)
        assert cut == [], f"{name} at {width} px: columns cut off: {cut}"
    driver.set_window_size(1600, 900)


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

    # Times carry their zone and seconds, UTC beside (TIME_ZONE is Europe/Paris).
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d CES?T \(", panel.text)

    driver.get(f"{live_server.url}/admin/taskguard/taskrun/")
    slots = [cell.text for cell in driver.find_elements(By.CSS_SELECTOR, "td.field-slot_display")]
    assert slots and all(re.fullmatch(r"\d{4}-\d\d-\d\d\n\d\d:\d\d:\d\d CES?T", t) for t in slots)
    owners = [cell.text for cell in driver.find_elements(By.CSS_SELECTOR, "td.field-owner_display")]
    assert "worker-3:4242" in owners  # where it ran; the token on hover
    # Every column fits a laptop screen (1280 and 1400 px), and a slot takes at most 2 lines.
    fits_laptops(driver, "#result_list thead th", shots_dir(tmp_path), "changelist")
    driver.set_window_size(1400, 900)
    lines = driver.execute_script(LINES, "td.field-slot_display")
    assert lines and max(lines) <= 2, f"slots wrap over {max(lines)} lines at 1400 px"
    driver.set_window_size(1600, 900)
    driver.find_element(By.CSS_SELECTOR, f"input.action-select[value='{stale.pk}']").click()
    Select(driver.find_element(By.NAME, "action")).select_by_value("cleanup_stale_locks")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "button[name=index]"))

    assert "1 of the selected runs is stale" in driver.find_element(By.ID, "content").text
    assert TaskRun.objects.get(pk=stale.pk).state == RunState.RUNNING
    keep_screenshot(driver, tmp_path, "confirm-screenshot.png")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "input[type=submit][value^='Yes']"))

    message = driver.find_element(By.CSS_SELECTOR, "ul.messagelist li.success")
    assert "Abandoned 1 stale run" in message.text
    assert TaskRun.objects.get(pk=stale.pk).state == RunState.ABANDONED
    badges = [badge.text for badge in driver.find_elements(By.CSS_SELECTOR, ".taskguard-state")]
    assert "abandoned" in badges

    keep_screenshot(driver, tmp_path, "admin-screenshot.png")


def seed_overview() -> dict[str, TaskRun]:
    """Four tasks an operator would meet: healthy, failing, paused, and one with gaps."""
    from datetime import timedelta

    from .support.monitoring import due_slot, finished, schedule

    minute, five = timedelta(minutes=1), timedelta(minutes=5)
    schedule("billing.sync", every=minute, first_seen=due_slot(minute) - 40 * minute)
    latest = due_slot(minute)
    runs = {}
    for back in range(34):
        slot = latest - back * minute
        if back in (6, 7):
            continue  # nobody fired these: gaps
        state = RunState.MISSED if back in (0, 12) else RunState.SUCCEEDED
        if back in (3, 19):
            state = RunState.FAILED
        runs[f"sync-{back}"] = finished(
            "billing.sync", slot, state, seconds=1 + back % 4, attempt=0 if back in (0, 12) else 1
        )
    from django.utils import timezone

    from django_taskguard.schedules import CronSchedule

    schedule("reports.nightly", cron="0 21 * * *")
    nightly = CronSchedule("0 21 * * *").latest_slot(timezone.now() - minute)
    for back in range(8):
        finished("reports.nightly", nightly - back * timedelta(days=1), seconds=95)
    schedule("mail.digest", every=five, paused=True, paused_at=due_slot(five) - 4 * five)
    for back in range(5, 25):
        finished("mail.digest", due_slot(five) - back * five, seconds=3)
    hour = timedelta(hours=1)
    schedule("search.reindex", every=hour, first_seen=due_slot(hour) - 10 * hour)
    for back in range(10):
        state = RunState.FAILED if back < 3 else RunState.SUCCEEDED
        finished("search.reindex", due_slot(timedelta(hours=1)) - back * timedelta(hours=1), state)
    return runs


def test_admin_browser__overview_strip_links_and_pause(browser, live_server, tmp_path):
    from selenium.webdriver.common.by import By

    driver = browser
    User.objects.create_superuser("admin", "admin@example.com", "secret-pw")
    runs = seed_overview()
    driver.get(f"{live_server.url}/admin/login/?next=/admin/taskguard/taskrun/")
    driver.find_element(By.NAME, "username").send_keys("admin")
    driver.find_element(By.NAME, "password").send_keys("secret-pw")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "input[type=submit]"))
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "a.taskguard-overview-link"))

    rows = driver.find_elements(By.CSS_SELECTOR, "tr.taskguard-task")
    names = [row.get_attribute("data-task") for row in rows]
    assert names[:2] == ["billing.sync", "search.reindex"]  # the unhealthy first
    status = {row.get_attribute("data-task"): row.get_attribute("data-status") for row in rows}
    assert status == {
        "billing.sync": "unhealthy",
        "search.reindex": "unhealthy",
        "mail.digest": "paused",
        "reports.nightly": "ok",
    }
    sync = rows[0]
    assert "missed" in sync.text and "every minute" in sync.text
    cells = sync.find_elements(By.CSS_SELECTOR, ".taskguard-cell")
    assert len(cells) == 30
    assert len(sync.find_elements(By.CSS_SELECTOR, ".taskguard-cell.gap")) == 2
    assert "failing: the " in rows[1].text and "(its last 3 runs failed)" in rows[1].text
    # Nothing hides behind a horizontal scrollbar, no column is cut off at 1280 and 1400 px.
    fits_laptops(driver, "#content-main table thead th", shots_dir(tmp_path), "overview")
    keep_screenshot(driver, tmp_path, "overview-screenshot.png")

    # A cell is a link to its run.
    newest = runs["sync-0"]
    link = sync.find_element(By.CSS_SELECTOR, f"a[href$='/taskrun/{newest.pk}/change/']")
    navigate(driver, link)
    assert "billing.sync" in driver.find_element(By.ID, "content").text

    # Pause from the overview: it asks first (with a reason), then the admin says so and the
    # row turns paused.
    driver.get(f"{live_server.url}/admin/taskguard/taskrun/overview/")
    row = driver.find_element(By.CSS_SELECTOR, "tr[data-task='reports.nightly']")
    navigate(driver, row.find_element(By.CSS_SELECTOR, "button[value=pause]"))
    assert "Pause reports.nightly?" in driver.find_element(By.ID, "content").text
    driver.find_element(By.ID, "id_reason").send_keys("vendor outage")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "input[type=submit]"))
    assert "Paused reports.nightly." in driver.find_element(By.CSS_SELECTOR, ".messagelist").text
    row = driver.find_element(By.CSS_SELECTOR, "tr[data-task='reports.nightly']")
    assert row.get_attribute("data-status") == "paused"
    said = row.find_element(By.CSS_SELECTOR, ".taskguard-paused").text
    assert said.startswith("Paused by admin from the admin at ") and said.endswith(
        ": vendor outage"
    )


def login(driver, url: str) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    driver.get(f"{url}/admin/login/?next=/admin/taskguard/taskrun/overview/")
    driver.find_element(By.NAME, "username").send_keys("admin")
    driver.find_element(By.NAME, "password").send_keys("secret-pw")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "input[type=submit]"))


def test_admin_browser__acknowledge_and_the_pause_history(browser, live_server):
    """An abandoned slot acknowledged from the overview (asked why first); a pause from the
    command and its resume from the admin, both on the page with who, from where, why."""
    from datetime import timedelta

    from django.core.management import call_command
    from selenium.webdriver.common.by import By

    from .support.monitoring import due_slot, finished, schedule

    driver = browser
    day = timedelta(days=1)  # no new slot comes due while the test runs
    User.objects.create_superuser("admin", "admin@example.com", "secret-pw")
    schedule("billing.sync", every=day)
    slot = due_slot(day)
    for back in range(1, 4):
        finished("billing.sync", slot - back * day)
    killed = finished("billing.sync", slot, RunState.ABANDONED)
    TaskRun.objects.filter(pk=killed.pk).update(error="owner killed mid-run")
    schedule("mail.digest", every=day)
    finished("mail.digest", slot)
    call_command("pause_task", "mail.digest", "--reason", "vendor outage")
    login(driver, live_server.url)

    row = driver.find_element(By.CSS_SELECTOR, "tr[data-task='billing.sync']")
    assert row.get_attribute("data-status") == "unhealthy"
    assert "was abandoned: owner killed mid-run" in row.text
    navigate(driver, row.find_element(By.CSS_SELECTOR, "button[value=acknowledge]"))
    assert "Acknowledge billing.sync?" in driver.find_element(By.ID, "content").text
    driver.find_element(By.ID, "id_reason").send_keys("known: the 21:00 deploy killed it")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "input[type=submit]"))
    message = driver.find_element(By.CSS_SELECTOR, ".messagelist").text
    assert "Acknowledged the problems of billing.sync." in message
    row = driver.find_element(By.CSS_SELECTOR, "tr[data-task='billing.sync']")
    assert row.get_attribute("data-status") == "ok"
    acknowledged = row.find_element(By.CSS_SELECTOR, ".taskguard-acknowledged").text
    assert "acknowledged by admin from the admin" in acknowledged
    assert "known: the 21:00 deploy killed it" in acknowledged
    assert not at_once(row, "button[value=acknowledge]")

    row = driver.find_element(By.CSS_SELECTOR, "tr[data-task='mail.digest']")
    assert row.get_attribute("data-status") == "paused"
    navigate(driver, row.find_element(By.CSS_SELECTOR, "button[value=resume]"))
    row = driver.find_element(By.CSS_SELECTOR, "tr[data-task='mail.digest']")
    assert row.get_attribute("data-status") == "ok"
    row.find_element(By.CSS_SELECTOR, "details.taskguard-history summary").click()
    events = [e.text for e in row.find_elements(By.CSS_SELECTOR, "li.taskguard-event")]
    assert len(events) == 2, events
    assert "resumed by admin from the admin" in events[0]
    assert "paused by " in events[1] and "from a management command" in events[1]
    assert events[1].endswith("vendor outage")
