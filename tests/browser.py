"""Headless Chromium for the browser tests: Debian's ``chromium`` and ``chromedriver`` (installed
by ``.ci/run`` with apt-get, never a downloaded browser build), driven by selenium."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("SPECBATCH_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("SPECBATCH_CHROMEDRIVER", "/usr/bin/chromedriver")


def artifacts_dir() -> Path:
    """Where browser tests leave their screenshots (``SPECBATCH_TEST_ARTIFACTS`` or ./test-artifacts)."""
    path = Path(os.environ.get("SPECBATCH_TEST_ARTIFACTS", ROOT / "test-artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def chromium() -> webdriver.Chrome:
    """A headless Chromium that records the page's console (``driver.get_log("browser")``)."""
    for binary in (CHROMIUM, CHROMEDRIVER):
        if not (Path(binary).exists() or shutil.which(binary)):
            raise RuntimeError(f"{binary} is missing: install Debian's chromium and chromium-driver "
                               "(apt-get install chromium chromium-driver), as .ci/run does")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    return driver


def console_errors(driver: webdriver.Chrome) -> list[str]:
    """The page's console messages at level SEVERE (errors, failed loads)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry.get("level") == "SEVERE"]
