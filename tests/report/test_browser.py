"""End to end: open a report in headless Chromium, check every chart rendered and the tables hold the input's numbers.

Needs the Debian packages chromium and chromium-driver (scripts/install_browser.sh installs them)
and selenium (the `dev` extra). Without them the test skips and says why. Selenium Manager is
never asked to download a driver: the Service gets /usr/bin/chromedriver explicitly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from anatomist.anatomy import MemoryCategory
from anatomist.report import write_report
from tests.headless import start_chromium

pytestmark = pytest.mark.browser



@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    driver = start_chromium(tmp_path_factory.mktemp("chromium-profile"), window="1200,900")
    yield driver
    driver.quit()


def _table(driver, table_id: str) -> list[dict[str, str]]:  # type: ignore[no-untyped-def]
    """Rows of a table as the browser sees them: data attributes and the visible text of each cell."""
    return driver.execute_script(
        """
        return Array.from(document.querySelectorAll('#' + arguments[0] + ' tbody tr')).map(tr => {
          const row = {label: tr.dataset.label};
          tr.querySelectorAll('td[data-key]').forEach(td => {
            row[td.dataset.key] = td.dataset.value; row[td.dataset.key + ':text'] = td.innerText.trim(); });
          return row; });
        """,
        table_id,
    )


def _assert_charts_rendered(driver, expected: list[str]) -> None:  # type: ignore[no-untyped-def]
    images = driver.execute_script(
        "return Array.from(document.images).map(i => [i.dataset.chart, i.complete, i.naturalWidth, i.naturalHeight,"
        " i.getBoundingClientRect().width]);"
    )
    assert [i[0] for i in images] == expected
    for chart, complete, natural_w, natural_h, shown_w in images:
        assert complete and natural_w > 0 and natural_h > 0 and shown_w > 0, chart


def test_report_renders_in_chromium(browser, tmp_path: Path, fixtures: Path) -> None:  # type: ignore[no-untyped-def]
    estimate = fixtures / "estimate_bert-large-uncased.json"
    bench = fixtures / "bench_schema_example.jsonl"
    profile = fixtures / "profile_schema_example.json"
    out = write_report([estimate, bench, profile], tmp_path / "report.html")
    browser.get(out.as_uri())
    assert browser.title == "anatomist report"
    _assert_charts_rendered(browser, ["memory", "throughput", "parity", "classes"])

    est = json.loads(estimate.read_text())
    rows = [json.loads(line) for line in bench.read_text().splitlines()[1:]]
    ok = [r for r in rows if r["status"] == "ok"]
    memory = _table(browser, "table-memory")
    # the fixture ran adamw_torch (today's default is fused); the bench rows ran on another GPU at another length
    assert [r["label"] for r in memory] == ["bs4, adamw_torch (V100-16GB, seq 512)",
                                            *[f"{r['name']} (schema example, not measured)" for r in ok]]
    for shown, source in zip(memory, [est["memory"], *[r["measured"]["memory"] for r in ok]], strict=True):
        for key in [c.value for c in MemoryCategory] + ["device_total"]:
            assert int(shown[key]) == source[key], (shown["label"], key)
            assert shown[f"{key}:text"] == f"{source[key] / 2**30:.2f}"  # the GiB a reader sees
    classes = {r["label"]: r for r in _table(browser, "table-classes")}
    expected = json.loads(profile.read_text())["classes"]
    for name, shares in expected.items():
        assert float(classes[name]["flops_pct"]) == shares["flops_pct"]
        assert classes[name]["time_pct:text"] == f"{shares['time_pct']:.1f}"
    failed = browser.execute_script("return Array.from(document.querySelectorAll('#table-failed tbody tr'))"
                                    ".map(tr => tr.dataset.label);")
    assert failed == ["fp32 bs32"]
    shot = tmp_path / "report.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


def test_only_failed_report_shows_the_notice(browser, tmp_path: Path, fixtures: Path) -> None:  # type: ignore[no-untyped-def]
    out = write_report(fixtures / "bench_only_failed.jsonl", tmp_path / "failed.html")
    browser.get(out.as_uri())
    notice = browser.execute_script("return document.getElementById('notices').innerText;")
    assert notice.startswith("Every run in") and "1 error, 1 oom" in notice
    _assert_charts_rendered(browser, [])
