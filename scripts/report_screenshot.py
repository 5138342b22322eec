"""Regenerate docs/report-screenshot.png: a report of real estimates and a real plan (docs/report-example/, what
`anatomist estimate|plan ... --json` printed; the commands are in docs/report.md), in headless Chromium.

Usage: python scripts/report_screenshot.py [OUT.png]   (needs chromium, chromium-driver, selenium)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from anatomist.report import write_report

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "report-example"
INPUTS = [EXAMPLE / "estimate_Llama-3.2-1B_liger.json", EXAMPLE / "estimate_Llama-3.2-1B.json",
          EXAMPLE / "plan_Llama-3.2-1B.json"]


def main(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        report = write_report(INPUTS, Path(tmp) / "report.html")
        options = webdriver.ChromeOptions()
        for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    "--window-size=1150,3500", f"--user-data-dir={tmp}/profile"):
            options.add_argument(arg)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        try:
            driver.get(report.as_uri())
            shot = Path(tmp) / "shot.png"
            driver.save_screenshot(str(shot))
        finally:
            driver.quit()
        # 256-colour palette: the charts use a handful of flat colours, so this keeps it sharp and small
        Image.open(shot).convert("RGB").quantize(colors=256).save(out, optimize=True)
    print(f"{out}: {out.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "report-screenshot.png")
