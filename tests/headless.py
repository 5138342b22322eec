"""Headless Chromium through Selenium, for the browser tests of the report and of `anatomist serve`."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def start_chromium(profile: Path, *, window: str, downloads: Path | None = None) -> Any:
    """A headless Chromium driven by the system's chromedriver (the Debian packages), with its own profile
    folder; downloads go to `downloads` without asking. Skips the test where either is not installed."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed (pip install -e '.[dev]')")
    if not CHROMIUM or not CHROMEDRIVER.exists():
        pytest.skip("chromium / chromedriver not installed: run scripts/install_browser.sh (needs apt and root)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", f"--window-size={window}", f"--user-data-dir={profile}"):
        options.add_argument(arg)
    if downloads is not None:
        options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                                  "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    if downloads is not None:
        driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    return driver
