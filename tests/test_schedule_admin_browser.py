"""A real headless Chromium pauses, resumes, acknowledges and retires schedules through the
admin of a live test server, and reads their history (the browser set-up is
test_admin_browser.py's)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from django_taskguard.models import ScheduleEvent, TaskRun, TaskSchedule

from .support.monitoring import due_slot, finished, schedule
from .test_admin_browser import browser, fits_laptops, keep_screenshot, shots_dir

pytestmark = [pytest.mark.browser, pytest.mark.once, pytest.mark.django_db(transaction=True)]
__all__ = ["browser"]  # the fixture
MINUTE = timedelta(minutes=1)


def choose(driver, task: str, action: str) -> None:  # type: ignore[no-untyped-def]
    """Tick ``task``'s row on the changelist and run ``action`` on it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    row = driver.find_element(By.XPATH, f"//tr[.//a/span[normalize-space()='{task}']]")
    row.find_element(By.CSS_SELECTOR, "input.action-select").click()
    Select(driver.find_element(By.NAME, "action")).select_by_value(action)
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "button[name=index]"))


def navigate(driver, element) -> None:  # type: ignore[no-untyped-def]
    """Click ``element`` and wait until its page has been replaced (Chromium may say the
    old node "does not belong to the document" instead of that it is stale)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    def replaced(_driver) -> bool:  # type: ignore[no-untyped-def]
        try:
            element.is_enabled()
        except WebDriverException:  # stale, or detached
            return True
        return False

    element.click()
    WebDriverWait(driver, 30).until(replaced)


def message(driver) -> str:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.CSS_SELECTOR, "ul.messagelist").text)


def test_schedule_admin_browser__pause_resume_acknowledge_retire_and_history(
    browser, live_server, tmp_path
):
    from selenium.webdriver.common.by import By

    driver = browser
    User.objects.create_superuser("admin", "admin@example.com", "secret-pw")
    nightly = schedule("reports.nightly", every=MINUTE)
    finished("reports.nightly", due_slot(MINUTE))
    gone = schedule("reports.old", every=MINUTE)
    TaskSchedule.objects.filter(pk=gone.pk).update(removed_at=timezone.now())
    run = finished("reports.old", due_slot(MINUTE) - 3 * MINUTE)
    changelist = f"{live_server.url}/admin/taskguard/taskschedule/"
    driver.get(f"{live_server.url}/admin/login/?next=/admin/taskguard/taskschedule/")
    driver.find_element(By.NAME, "username").send_keys("admin")
    driver.find_element(By.NAME, "password").send_keys("secret-pw")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "input[type=submit]"))

    # Pause asks a reason first, then says what it did; the row says why, by whom, since when.
    choose(driver, "reports.nightly", "pause_schedules")
    assert not TaskSchedule.objects.get(pk=nightly.pk).paused
    driver.find_element(By.ID, "id_reason").send_keys("vendor outage")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "input[type=submit]"))
    assert "Paused reports.nightly." in message(driver)
    paused = driver.find_element(By.CSS_SELECTOR, "td.field-health_column").text
    assert "vendor outage" in paused and "by admin from the admin" in paused
    # Every column fits a laptop screen (1280 and 1400 px); the docs' picture.
    fits_laptops(driver, "#result_list thead th", shots_dir(tmp_path), "schedules")
    keep_screenshot(driver, tmp_path, "schedules-screenshot.png")

    # Resume and acknowledge from the schedule's own page, whose history grows.
    driver.get(f"{changelist}{nightly.pk}/change/")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "button[value=resume_schedules]"))
    assert "Resumed reports.nightly." in message(driver)
    driver.get(f"{changelist}{nightly.pk}/change/")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "button[value=acknowledge_schedules]"))
    driver.find_element(By.ID, "id_reason").send_keys("vendor said sorry")
    driver.find_element(By.ID, "id_until").send_keys("2026-11-20 21:00")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "input[type=submit]"))
    assert "Acknowledged reports.nightly." in message(driver)
    driver.get(f"{changelist}{nightly.pk}/change/")
    history = driver.find_elements(By.CSS_SELECTOR, "tr.taskguard-event")
    kinds = [row.get_attribute("data-kind") for row in history]
    assert kinds == ["acknowledged", "resumed", "paused"]
    driver.save_screenshot(str(shots_dir(tmp_path) / "schedule-change.png"))
    assert "vendor said sorry" in history[0].text and "2026-11-20 21:00:00 CET" in history[0].text
    assert "admin" in history[2].text and "vendor outage" in history[2].text
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "a.taskguard-runs-link"))
    assert "task_name=reports.nightly" in driver.current_url

    # Retire a removed schedule: asked first, then its row goes and its runs stay.
    driver.get(changelist)
    choose(driver, "reports.old", "retire_schedules")
    assert "Its runs and its history stay" in driver.find_element(By.ID, "content").text
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "input[type=submit]"))
    assert "Retired reports.old (their runs stay)." in message(driver)
    assert not TaskSchedule.objects.filter(pk=gone.pk).exists()
    assert TaskRun.objects.filter(pk=run.pk).exists()
    assert ScheduleEvent.objects.filter(
        task_name="reports.old", kind="retired", by="admin"
    ).exists()
