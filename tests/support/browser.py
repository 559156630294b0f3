"""The headless browser the web-view tests drive: Debian's chromium (``make tools`` installs it)."""

from __future__ import annotations

import shutil

#: the flags every headless run takes (no sandbox as root, no GPU, /tmp instead of a small /dev/shm)
HEADLESS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]


def chromium() -> str | None:
    """The path of a Chromium on ``PATH``, or None (the tests skip, naming it)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None
