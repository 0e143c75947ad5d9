"""The chat playground in a real headless browser (Debian's chromium driven by Playwright): the browser (one per
test module, tests/conftest.py) and the page's steps the playground tests share."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextmanager
def chromium() -> Iterator:
    if not os.access(CHROMIUM, os.X_OK):
        raise AssertionError(f"{CHROMIUM} is missing: `bash scripts/test.sh` installs Debian's chromium package")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def open_playground(context, url: str, token: str | None = None):
    """The page loaded with its token entered by keyboard alone; returns the page once the model is listed."""
    page = context.new_page()
    page.goto(url + "/")
    assert page.locator("#token-dialog").is_visible()
    if token is not None:
        assert page.evaluate("document.activeElement.id") == "token-input"
        page.keyboard.type(token)
        page.keyboard.press("Enter")
        page.wait_for_function("() => document.querySelector('#model').options.length > 0")
        assert not page.locator("#token-dialog").is_visible()
    return page


def set_params(page, **values: str) -> None:
    if page.locator("#settings").get_attribute("open") is None:
        page.locator("#settings summary").click()
    for field, value in values.items():
        page.locator(f"#{field}").fill(value)


def send(page, text: str) -> None:
    page.locator("#prompt").fill(text)
    page.locator("#prompt").press("Enter")


def wait_answer_done(page, count: int = 1):
    """The count-th answer's closing note (finish reason and token counts, or why it stopped)."""
    note = page.locator("#messages .assistant").nth(count - 1).locator(".stats")
    note.wait_for()
    return note
