"""Headless Chromium for the viewer's tests, benchmark and screenshots (Debian's ``chromium`` + Playwright).

Playwright's own browser download is never used: :func:`launch` starts the system browser at
``CHROMIUM_PATH`` with a fresh user-data directory and flags that keep it from calling home.
Install it with ``apt-get install -y chromium`` and ``pip install playwright``.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHROMIUM_PATH = "/usr/bin/chromium"
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
LAUNCH_TIMEOUT_MS = 60_000


def chromium_missing_reason() -> str | None:
    """Why the browser cannot be used here (None when it can)."""
    if not Path(CHROMIUM_PATH).exists():
        return f"{CHROMIUM_PATH} is missing: install Debian's browser with `apt-get install -y chromium`"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing: pip install playwright (never run `playwright install`)"
    return None


@contextlib.contextmanager
def browser_context(width: int = 1440, height: int = 900, color_scheme: str = "light") -> Iterator[Any]:
    """A Playwright ``BrowserContext`` on system Chromium with a throw-away profile; closed on exit."""
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="ng_viewer_chromium_")
    try:
        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(
                profile,
                executable_path=CHROMIUM_PATH,
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": width, "height": height},
                color_scheme=color_scheme,
                timeout=LAUNCH_TIMEOUT_MS,
            )
            try:
                yield ctx
            finally:
                ctx.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
