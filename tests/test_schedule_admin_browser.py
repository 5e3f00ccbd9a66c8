"""A real headless Chromium pauses, resumes, acknowledges and retires schedules through the
admin of a live test server, and reads their history (the browser set-up is
test_admin_browser.py's)."""

from __future__ import annotations

import zoneinfo
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from django_taskguard import pauses
from django_taskguard.models import (
    ScheduleEvent,
    ScheduleEventOrigin,
    ScheduleSource,
    TaskRun,
    TaskSchedule,
)
from tests.support import data_targets  # noqa: F401  (registers the schedules' targets)

from .support.browser import at_once
from .support.monitoring import due_slot, finished, schedule
from .test_admin_browser import (
    CLIPPED_HEADERS,
    fits_laptops,
    fits_width,
    keep_screenshot,
    shots_dir,
)

pytestmark = [pytest.mark.browser, pytest.mark.once, pytest.mark.django_db(transaction=True)]
MINUTE = timedelta(minutes=1)
# Where each name cell's text wraps to a new line in the middle of a word: the characters
# either side of every break that does not follow a dot, underscore, hyphen or bracket.
MID_WORD_BREAKS = """
const breaks = [];
for (const cell of document.querySelectorAll(arguments[0])) {
  let previous = null;
  const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    for (let i = 0; i < node.length; i++) {
      const range = document.createRange();
      range.setStart(node, i);
      range.setEnd(node, i + 1);
      const rect = range.getBoundingClientRect();
      if (rect.width === 0) continue;
      const char = node.data[i];
      if (previous && rect.top > previous.top + 2 && !/[._\\-\\[ ]/.test(previous.char)
          && char !== "[") {
        breaks.push(`${cell.textContent}: ${previous.char}|${char}`);
      }
      previous = {top: rect.top, char: char};
    }
  }
}
return breaks;
"""
SCHEDULE_WIDTHS = (1400, 1920)


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


def test_schedule_admin_browser__data_schedule_created_run_backfilled_and_viewed(
    browser, live_server, tmp_path, monkeypatch
):
    """Create a data schedule with arguments and a time zone, see its next slot, run it now,
    backfill a range after its preview, read its history; a view-only user sees it all and
    has nothing to change it with."""
    from django.contrib.auth.models import Permission
    from selenium.webdriver.common.by import By

    from django_taskguard import data_schedules, ledger
    from django_taskguard.schedules import CronSchedule

    handed: list[tuple[str, object, str]] = []

    def runner(row, slot, who):  # type: ignore[no-untyped-def]
        handed.append((row.task_name, slot, who))
        ledger.insert_pending(row.task_name, slot)
        return f"handed out {slot.isoformat()}"

    monkeypatch.setitem(data_schedules.RUNNERS, "function", runner)
    driver = browser
    shots = shots_dir(tmp_path)
    User.objects.create_superuser("admin", "admin@example.com", "secret-pw")
    viewer = User.objects.create_user("viewer", password="viewer-pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_taskschedule"))
    changelist = f"{live_server.url}/admin/taskguard/taskschedule/"
    login(driver, live_server.url, "admin", "secret-pw")

    # Create: a tenant's report at 09:00 in New York, with its arguments.
    driver.get(f"{changelist}add/")
    fill = {
        "id_entry": "tenant-42",
        "id_function": "tests.support.data_targets.send_report",
        "id_cron": "0 9 * * *",
        "id_time_zone": "America/New_York",
        "id_args": "[42]",
        "id_kwargs": '{"fmt": "csv"}',
        "id_reason": "tenant 42 signed up",
    }
    for field, value in fill.items():
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    driver.save_screenshot(str(shots / "data-schedule-add.png"))
    navigate(driver, driver.find_element(By.NAME, "_continue"))
    assert "was added successfully" in message(driver)
    row = TaskSchedule.objects.get(entry="tenant-42")
    assert (row.args, row.kwargs, row.time_zone) == ([42], {"fmt": "csv"}, "America/New_York")
    page = f"{changelist}{row.pk}/change/"

    # Its next slots: 09:00 in New York, 14:00 UTC.
    first = driver.find_element(By.CSS_SELECTOR, "ol.taskguard-next-slots li")
    assert "09:00:00 EST" in first.text and "14:00:00 UTC" in first.text

    # Run now: asked first, then handed to the runner (not run in the request).
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "button[value=run_now_schedules]"))
    assert "not in this web request" in driver.find_element(By.ID, "content").text
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "input[type=submit]"))
    assert "handed out" in message(driver)
    assert [(task, who) for task, _slot, who in handed] == [(row.task_name, "admin")]

    # Backfill the last three days: the preview first, then the slots handed out.
    zone = zoneinfo.ZoneInfo("America/New_York")
    now = timezone.now().astimezone(zone)
    start = (now - timedelta(days=3)).replace(hour=0, minute=0, second=0, microsecond=0)
    end = (now - timedelta(days=1)).replace(hour=23, minute=0, second=0, microsecond=0)
    expected = CronSchedule("0 9 * * *", "America/New_York").slots_between(
        start - timedelta(microseconds=1), end, 10
    )
    assert len(expected) == 3
    driver.get(page)
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "button[value=backfill_schedules]"))
    assert "America/New_York" in driver.find_element(By.CSS_SELECTOR, "label[for=id_from]").text
    driver.find_element(By.ID, "id_from").send_keys(f"{start:%Y-%m-%d %H:%M}")
    driver.find_element(By.ID, "id_to").send_keys(f"{end:%Y-%m-%d %H:%M}")
    navigate(driver, driver.find_element(By.NAME, "preview"))
    count = driver.find_element(By.CSS_SELECTOR, ".taskguard-backfill-count").text
    assert count.startswith("3 slots would be handed out"), count
    listed = driver.find_elements(By.CSS_SELECTOR, "ul.taskguard-backfill-slots li")
    assert [item.text.split(" (")[0] for item in listed] == [
        f"{slot.astimezone(zone):%Y-%m-%d %H:%M:%S %Z}" for slot in expected
    ]
    assert len(handed) == 1  # nothing handed out by the preview
    driver.save_screenshot(str(shots / "data-schedule-backfill-preview.png"))
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "input[type=submit][value^=Yes]"))
    assert f"Backfill of {row.task_name}: 3 slots handed out." in message(driver)
    assert [slot for _task, slot, _who in handed[1:]] == expected

    # The history: newest first, who, from where, what changed, the version.
    driver.get(page)
    history = driver.find_elements(By.CSS_SELECTOR, "tr.taskguard-event")
    assert [event.get_attribute("data-kind") for event in history] == [
        "backfill",
        "run_now",
        "created",
    ]
    created = history[2].text
    assert "admin" in created and "tenant 42 signed up" in created
    assert "positional arguments: [42]" in created and "time zone: America/New_York" in created
    assert "3 slots handed out" in history[0].text
    keep_screenshot(driver, tmp_path, "data-schedule-screenshot.png")

    # A view-only user sees the page, its next slots and history; nothing to change it with.
    driver.delete_all_cookies()
    login(driver, live_server.url, "viewer", "viewer-pw")
    driver.get(page)
    assert len(driver.find_elements(By.CSS_SELECTOR, "ol.taskguard-next-slots li")) == 5
    assert len(driver.find_elements(By.CSS_SELECTOR, "tr.taskguard-event")) == 3
    for control in (
        "input[name=_save]",
        "input[name=cron]",
        "a.deletelink",
        "button[value=run_now_schedules]",
        "button[value=backfill_schedules]",
    ):
        assert at_once(driver, control) == [], control
    driver.save_screenshot(str(shots / "data-schedule-view-only.png"))
    driver.get(changelist)
    assert at_once(driver, "a.addlink") == []
    actions = driver.find_elements(By.CSS_SELECTOR, "select[name=action] option")
    assert not {"run_now_schedules", "backfill_schedules"} & {
        option.get_attribute("value") for option in actions
    }
    assert TaskSchedule.objects.get(pk=row.pk).version == 1


def login(driver, url: str, username: str, password: str) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    driver.get(f"{url}/admin/login/?next=/admin/taskguard/taskschedule/")
    driver.find_element(By.NAME, "username").send_keys(username)
    driver.find_element(By.NAME, "password").send_keys(password)
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "input[type=submit]"))


def test_schedule_admin_browser__the_list_fits_and_names_break_only_between_words(
    browser, live_server, tmp_path
):
    """At 1400 and 1920 px, with the names, sources and reasons of a real project: every
    column (Health too) is on screen without scrolling, and a task name wraps only after a
    dot, an underscore or a hyphen, never inside a word (``every_min|ute``)."""
    driver = browser
    User.objects.create_superuser("admin", "admin@example.com", "secret-pw")
    for name in (
        "myapp.jobs.every_minute",
        "myapp.reports.tasks.send_weekly_digest_to_subscribers",
        "myapp.housekeeping.purge_expired_sessions_and_tokens",
    ):
        schedule(name, every=MINUTE)
        finished(name, due_slot(MINUTE))
    beat = schedule("myapp.rates.tasks.refresh_exchange_rates[refresh-rates-every-10-minutes]")
    TaskSchedule.objects.filter(pk=beat.pk).update(
        source=ScheduleSource.CELERY,
        entry="refresh-rates-every-10-minutes",
        declared_in="CELERY_BEAT_SCHEDULE",
    )
    data = schedule("myapp.billing.tasks.generate_invoice[tenant-4242-monthly]", cron="0 9 1 * *")
    TaskSchedule.objects.filter(pk=data.pk).update(
        source=ScheduleSource.DATA,
        entry="tenant-4242-monthly",
        function="myapp.billing.tasks.generate_invoice",
        time_zone="America/New_York",
    )
    schedule("myapp.mail.tasks.send_newsletter_batches", every=MINUTE)
    pauses.pause(
        "myapp.mail.tasks.send_newsletter_batches",
        "the mail provider throttles us until the 3rd",
        by="alice",
        origin=ScheduleEventOrigin.ADMIN,
    )
    login(driver, live_server.url, "admin", "secret-pw")
    shots = shots_dir(tmp_path)
    for width in SCHEDULE_WIDTHS:
        driver.set_window_size(width, 900)
        fits_width(driver)
        driver.save_screenshot(str(shots / f"schedule-list-{width}.png"))
        cut = driver.execute_script(CLIPPED_HEADERS, "#result_list thead th")
        assert cut == [], f"schedule list at {width} px: columns cut off: {cut}"
        broken = driver.execute_script(MID_WORD_BREAKS, ".field-task_display a > span")
        assert broken == [], f"schedule list at {width} px: names broken mid-word: {broken}"
