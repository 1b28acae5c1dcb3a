"""The system Chromium the browser tests drive through playwright (no browser is downloaded): the dashboard's own
tests and the cluster's, which import it from here whichever of them runs alone."""

from __future__ import annotations

import os
import shutil

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def why_no_browser() -> str | None:
    """Why the browser tests cannot run here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]')"
    if not os.path.exists(CHROMIUM):
        return "no Chromium at /usr/bin/chromium (Debian: apt-get install chromium; .ci/run does)"
    return None
