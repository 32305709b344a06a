"""Fixtures of the browser tests: Playwright's Chromium (Debian's /usr/bin/chromium; Playwright's
own browser download is not used), skipped with the reason when either is missing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is missing: pip install 'flywheel[browser]'")
    if not CHROMIUM.exists() and shutil.which("chromium") is None:
        pytest.skip("no Chromium at /usr/bin/chromium: apt-get install chromium (make test-all installs it)")
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM if CHROMIUM.exists() else shutil.which("chromium")),
                                      args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """Where the tests' screenshots go (under pytest's tmp dir)."""
    return tmp_path_factory.mktemp("screenshots")
