"""A real headless browser (Debian's chromium, driven by Playwright) against a viewer on 127.0.0.1.

Playwright's own browser download is never used: `make test` installs Debian's chromium (see the
Makefile's `browser` target) and the tests launch it by path. Without chromium or Playwright the
tests are skipped, and pytest's summary says why. Screenshots go to ``artifacts/browser/``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from attnlab.viewer.serve import listen, make_server, url_of

CHROMIUM = Path(os.environ.get("ATTNLAB_CHROMIUM", "/usr/bin/chromium"))
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
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "browser"
SERVER_LIFETIME_S = 180.0
"""A test server stops itself after this long, even if a test never stops it."""


@pytest.fixture(scope="session")
def browser():  # noqa: ANN201
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="Playwright for Python is not installed (pip install -e '.[dev]')"
    )
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no chromium at {CHROMIUM}: `make browser` installs it with apt-get (as root)")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=60_000)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture()
def page(browser):  # noqa: ANN001, ANN201
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(20_000)
    page.errors = []  # uncaught script errors and dialogs (alert) seen by the page
    page.on("pageerror", lambda error: page.errors.append(f"pageerror: {error}"))
    page.on("dialog", lambda dialog: (page.errors.append(f"dialog: {dialog.message}"), dialog.dismiss()))
    yield page
    context.close()


@contextmanager
def serving(app) -> Iterator[str]:  # noqa: ANN001
    """Serve ``app`` with uvicorn on 127.0.0.1 (a free port) in a background thread; yields its URL."""
    sock = listen("127.0.0.1", 0)
    server = make_server(app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    stopper = threading.Timer(SERVER_LIFETIME_S, lambda: setattr(server, "should_exit", True))
    stopper.daemon = True
    thread.start()
    stopper.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the viewer did not start")
            time.sleep(0.05)
        yield url_of(sock)
    finally:
        server.should_exit = True
        stopper.cancel()
        thread.join(timeout=10)
        sock.close()


def screenshot(page, name: str) -> Path:  # noqa: ANN001
    """Save a full-page screenshot under ``artifacts/browser/`` (git-ignored)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
