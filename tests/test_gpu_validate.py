"""The GPU validation script's CPU dry run, so that it cannot rot between GPU runs.

`benchmarks/gpu/validate.sh --dry-run` runs every part (a runtime overhead, b pytest -m gpu,
c anatomist bench, d forward+backward grid, e anatomist calibrate) on this CPU with tiny models
built from configs: no CUDA, no network, no weights. These tests run it as a user would (bash,
a fresh interpreter), then check what it wrote: rows that parse and say "dry-run", a markdown
table with the expected columns, a GPU-catalog snippet that is valid TOML, and that a second run
skips the units already done while `--redo` runs a part again.

What only a GPU produces (numbers) is checked on made-up inputs instead: a bench row's figures
becoming compared quantities, part a's figures becoming a gpus.toml snippet and table lines, and
the pytest plugin catching the prediction and the measurement of a GPU test case.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu" / "validate.sh"
COLUMNS = "| part | case | quantity | predicted | measured | error % | status | note |"


def run_validate(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO / "src")}
    env.pop("OUT", None)  # a lent GPU's output folder: the dry run must not copy there
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(out), *args], env=env,
                          capture_output=True, text=True, timeout=600)


def lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def rows_of(out: Path, part: str) -> dict[str, dict]:
    return {r["name"]: r for r in lines(out) if "record" not in r and r["part"] == part}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("validate") / "cpu"
    proc = run_validate(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_every_part_records_dry_run_rows(dry_run: Path) -> None:
    rows = [r for r in lines(dry_run) if "record" not in r]
    assert {r["part"] for r in rows} == {"a", "b", "c", "d", "e"}
    assert {r["mode"] for r in rows} == {"dry-run"}
    markers = [r for r in lines(dry_run) if r.get("record") == "unit-done"]
    assert [m for m in markers if m["status"] == "error"] == []
    # a: the allocator model's answer beside the (absent) CUDA one: 513 B -> two 512 B blocks,
    # in a new 2 MiB small-pool segment; 10 MiB is its own segment from kMinLargeAlloc on.
    a = rows_of(dry_run, "a")
    assert a["allocator-request-513"]["quantities"]["block_bytes"] == {"predicted": 1024, "measured": None,
                                                                       "error_pct": None}
    assert a["allocator-request-513"]["quantities"]["new_segment_bytes"]["predicted"] == 2 * 2**20
    assert a["allocator-request-10485760"]["quantities"]["new_segment_bytes"]["predicted"] == 10 * 2**20
    assert a["after-training-step"]["quantities"]["outside_allocator_bytes"]["predicted"] > 0
    # b: tests/test_gpu.py's 3 models x 5 recipes, skipped without CUDA
    b = rows_of(dry_run, "b")
    assert len(b) == 15 and {r["status"] for r in b.values()} == {"skipped"}
    # c: the seeds' row through `anatomist bench --json`, and the suites other issues will add
    c = rows_of(dry_run, "c")
    assert c["seeds/fp16"]["status"] == "skipped" and "CUDA" in c["seeds/fp16"]["reason"]
    assert "exists; its rows run on a GPU only" in c["lora"]["reason"]  # the shipped lora suite
    assert "does not exist" in c["long-context"]["reason"]
    # d: 2 weights modes x 2 kernels; the comparable cell has anatomist's forward/backward peaks
    d = rows_of(dry_run, "d")
    assert set(d) == {f"{w}/{a}/s16/b2" for w in ("bf16", "fp32-autocast") for a in ("eager", "sdpa")}
    predicted = d["fp32-autocast/sdpa/s16/b2"]["quantities"]
    assert predicted["backward_peak_bytes"]["predicted"] >= predicted["forward_peak_bytes"]["predicted"] > 0
    assert d["bf16/sdpa/s16/b2"]["quantities"]["forward_s"]["measured"] > 0
    # e: CPU rows cannot calibrate a GPU: the CLI says so, and the row keeps its words
    assert "no finished GPU row" in rows_of(dry_run, "e")["calibrate"]["reason"]


@pytest.mark.slow
def test_table_and_catalog_snippet(dry_run: Path) -> None:
    table = (dry_run / "table.md").read_text()
    assert "DRY RUN" in table and COLUMNS in table
    body = [line for line in table.splitlines() if line.startswith("| ") and line != COLUMNS]
    assert all(line.count(" | ") == COLUMNS.count(" | ") for line in body)
    assert any(line.startswith("| d | fp32-autocast/sdpa/s16/b2 | forward_peak_bytes |") for line in body)
    snippet = tomllib.loads((dry_run / "gpus-snippet.toml").read_text())
    assert "cuda_context_bytes" not in next(iter(snippet["gpus"].values()))  # nothing measured on a CPU
    assert "NOT MEASURED" in (dry_run / "gpus-snippet.toml").read_text()


@pytest.mark.slow
def test_second_run_skips_done_units_and_redo_runs_again(dry_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "again"
    shutil.copytree(dry_run, out)
    before = [r for r in lines(out) if r.get("record") == "unit-done"]
    with (out / "results.jsonl").open("a") as fh:
        fh.write('{"part": "d", "torn')  # a write cut short by a kill: dropped, not fatal
    proc = run_validate(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dropping an unfinished last line" in proc.stderr
    assert proc.stderr.count("done already") == len(before)
    assert [r for r in lines(out) if r.get("record") == "unit-done"] == before

    proc = run_validate(out, "--part", "c", "--redo", "c")
    assert proc.returncode == 0, proc.stderr[-3000:]
    redone = [r for r in lines(out) if r.get("record") == "unit-done"][len(before):]
    assert sorted(r["unit"] for r in redone) == sorted(r["unit"] for r in before if r["part"] == "c")
    assert list(out.glob("bench.*.jsonl")), "--redo c keeps the old bench results aside"


SCRIPT_MODULES = ("parts", "results", "runner", "report")


@pytest.fixture
def scripts(monkeypatch: pytest.MonkeyPatch):
    """The scripts' modules (plain names: parts, results, ...) importable for one test, then gone."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    for name in SCRIPT_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield importlib.import_module
    for name in SCRIPT_MODULES:
        sys.modules.pop(name, None)


def test_bench_rows_become_compared_quantities(scripts) -> None:
    row = {"measured": {"samples_per_second": 10.0, "memory": {"peak_allocated": 1000, "peak_reserved": 1200}},
           "predicted": {"memory": {"peak_allocated": 1100, "peak_reserved": 1200, "device_total": 2000},
                         "time": {"samples_per_second": 8.0}}}
    q = scripts("parts").bench_row_to_quantities(row)
    assert q["peak_allocated_bytes"] == {"predicted": 1100, "measured": 1000, "error_pct": 10.0}  # (1100-1000)/1000
    assert q["peak_reserved_bytes"]["error_pct"] == 0.0
    assert q["device_total_bytes"] == {"predicted": 2000, "measured": None, "error_pct": None}
    assert q["samples_per_second"]["error_pct"] == -20.0  # (8-10)/10


def test_gpu_figures_make_a_catalog_snippet_and_table_lines(scripts, tmp_path: Path) -> None:
    results, report = scripts("results"), scripts("report")
    log = results.ResultsLog(path=tmp_path / "results.jsonl")
    log.append({"record": "env", "mode": "gpu", "versions": {"cuda": "13.0", "torch": "2.11.0"},
                "device": {"name": "NVIDIA H100 80GB HBM3", "slug": "H100-80GB-HBM3", "driver": "580.1",
                           "catalog_name": "H100-SXM", "memory_bytes": 85520809984}})
    context_bytes = 600 * 2**20 + 4096
    log.row(part="a", unit="overhead", attempt="1", name="after-training-step", status="ok", mode="gpu",
            quantities={"outside_allocator_bytes": results.quantity(500 * 2**20, context_bytes)},
            details={"model": "bert-base-uncased"})
    snippet = tomllib.loads(report.write_snippet(log, tmp_path).read_text())
    entry = snippet["gpus"]["H100-SXM"]
    assert entry["cuda_context_bytes"] == context_bytes
    assert "driver 580.1" in entry["cuda_context_source"] and "torch 2.11.0" in entry["cuda_context_source"]
    table = report.write_table(log, tmp_path, {"a": "done"}).read_text()
    # 500 MiB predicted, 600.0039 MiB measured: -16.67 %
    assert "| a | after-training-step | outside_allocator_bytes | 500.00 MiB | 600.00 MiB | -16.67 | ok |" in table


FAKE_GPU_TEST = """
import subprocess, sys
from types import SimpleNamespace

def estimate_memory():
    return SimpleNamespace(anatomy=SimpleNamespace(peak_allocated=110, peak_reserved=150))

def test_case():
    predicted = estimate_memory().anatomy
    out = subprocess.run([sys.executable, "-c", "print('{\\"allocated\\": 100, \\"reserved\\": 120}')"],
                         capture_output=True, text=True, check=True).stdout
    assert predicted.peak_allocated < 0, out
"""


def test_pytest_plugin_catches_the_numbers_a_gpu_test_compares(tmp_path: Path) -> None:
    (tmp_path / "test_fake_gpu.py").write_text(FAKE_GPU_TEST)
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent), "VALIDATE_RESULTS": str(tmp_path / "r.jsonl"),
           "VALIDATE_ATTEMPT": "1", "VALIDATE_MODE": "gpu"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "pytest_rows", "-p", "no:cacheprovider",
                           str(tmp_path / "test_fake_gpu.py")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:]  # the fake case fails on purpose
    (row,) = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert row["status"] == "failed" and row["reason"].startswith("AssertionError")
    assert row["quantities"]["peak_allocated_bytes"] == {"predicted": 110, "measured": 100, "error_pct": 10.0}
    assert row["quantities"]["peak_reserved_bytes"]["error_pct"] == 25.0  # (150 - 120) / 120
