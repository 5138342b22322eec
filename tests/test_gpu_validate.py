"""The GPU validation script's CPU dry run, so that it cannot rot between GPU runs.

`benchmarks/gpu/validate.sh --dry-run` runs every part (a runtime overhead, b pytest -m gpu,
c anatomist bench, d forward+backward grid, e anatomist calibrate) on this CPU with tiny models
built from configs: no CUDA, no network, no weights. These tests run it as a user would (bash,
a fresh interpreter), then check what it wrote: rows that parse and say "dry-run", a markdown
table with the expected columns, a GPU-catalog snippet that is valid TOML, and that a second run
skips the units already done while `--redo` runs a part again.

The dry run runs as on a lent GPU's image, where platformdirs, bitsandbytes, deepspeed, trl and
liger-kernel are not installed (IMAGE_LACKS; datasets travels as a wheel, README.md).

What only a GPU produces (numbers) is checked on made-up inputs instead: a bench row's figures
becoming compared quantities, part a's figures becoming a gpus.toml snippet and table lines, the
pytest plugin catching the prediction and the measurement of a GPU test case, and the plan
(plan.py: priority order, packing into the calls, resuming, measured seconds replacing expected ones)
on made-up units and logs.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu" / "validate.sh"
COLUMNS = "| part | case | quantity | predicted | measured | error % | status | note |"
IMAGE_LACKS = ("platformdirs", "bitsandbytes", "deepspeed", "trl", "liger_kernel", "torchao")
"""Packages the lent GPU's image does not have (benchmarks/gpu/README.md) and no wheel carries by default
but bitsandbytes'."""


HIDE_PACKAGES = """
import sys


class Hidden:
    # Wraps an import finder: finds nothing of the hidden packages (find_spec None, import fails), the rest as before.
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [Hidden(finder) for finder in sys.meta_path]
"""


@pytest.fixture(scope="module")
def gpu_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder whose sitecustomize hides IMAGE_LACKS from imports (in this process and every child it starts)."""
    folder = tmp_path_factory.mktemp("gpu-image")
    (folder / "sitecustomize.py").write_text(f"HIDDEN = {set(IMAGE_LACKS)!r}\n" + HIDE_PACKAGES)
    return folder


def run_validate(out: Path, *args: str, image: Path | None = None, dry_run: bool = True
                 ) -> subprocess.CompletedProcess[str]:
    paths = ([str(image)] if image else []) + [str(REPO / "src")]
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": os.pathsep.join(paths)}
    env.pop("OUT", None)  # a lent GPU's output folder: the dry run must not copy there
    # validate.py keeps anatomist's cache in the temporary folder (the image has no platformdirs to find one)
    env.pop("ANATOMIST_CACHE_DIR", None)
    env["TMPDIR"] = str(out.parent / "tmp")
    (out.parent / "tmp").mkdir(parents=True, exist_ok=True)
    return subprocess.run(["bash", str(SCRIPT), *(["--dry-run"] if dry_run else []), "--out", str(out), *args],
                          env=env, capture_output=True, text=True, timeout=600)


def lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def rows_of(out: Path, part: str) -> dict[str, dict]:
    return {r["name"]: r for r in lines(out) if "record" not in r and r["part"] == part}


@pytest.fixture(scope="module")
def dry_run_proc(tmp_path_factory: pytest.TempPathFactory, gpu_image: Path
                 ) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("validate") / "cpu"
    proc = run_validate(out, image=gpu_image)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


@pytest.fixture(scope="module")
def dry_run(dry_run_proc: tuple[Path, subprocess.CompletedProcess[str]]) -> Path:
    return dry_run_proc[0]


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
    # a: host-overlap's settings, checkpointing off and on; the host's times measured, the GPU's null off a GPU
    for name in ("plain/b2", "checkpointing/b2"):
        q = a[name]["quantities"]
        assert q["wall_s"]["measured"] >= q["host_forward_s"]["measured"] > 0 and q["gpu_forward_s"]["measured"] is None
    # b: tests/test_gpu.py's 3 models x 5 recipes, skipped without CUDA
    b = rows_of(dry_run, "b")
    assert len(b) == 15 and {r["status"] for r in b.values()} == {"skipped"}
    # c: the seeds' row through `anatomist bench --json`, and the suites other issues will add
    c = rows_of(dry_run, "c")
    assert c["seeds/fp16"]["status"] == "skipped" and "CUDA" in c["seeds/fp16"]["reason"]
    assert "exists; its rows run on a GPU only" in c["lora"]["reason"]  # the shipped lora suite
    assert c["llama-1b/full-bf16"]["status"] == "skipped"  # the suite file of today's LLM recipes, through the CLI
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
def test_dry_run_prints_a_lent_gpus_plan_then_runs_by_priority(dry_run_proc) -> None:
    out, proc = dry_run_proc
    assert "what a lent GPU would run (--budget-s 540,180)" in proc.stderr
    # the GPU's units, not the dry run's one, each with its call and its seconds: an estimate's until a GPU ran it
    # (the GPU folders committed under benchmarks/gpu/ hold what is measured and what is done)
    # (a unit a call's end cut is priced at what it had run)
    assert re.search(r"call 1 +1 first +c/(llama-1b|seeds)/\S+ +(\d+ s expected \(an estimate\)|[\d.]+ s measured on |"
                     r">= [\d.]+ s \(cut there)", proc.stderr)
    markers = [r for r in lines(out) if r.get("record") == "unit-done"]
    order = [f"{m['part']}/{m['unit']}" for m in markers]
    # priority 1 (the host's overlap, today's LLM recipes, the guide's rows), 2 (part a's overhead), then the rest
    assert order[:4] == ["a/host-overlap", "c/llama-1b/full-bf16", "c/seeds/fp16", "a/overhead"]
    assert order[4] == "b/pytest-gpu" and order[-1] == "e/calibrate"
    assert {m["mode"] for m in markers} == {"dry-run"} and all(m["elapsed_s"] >= 0 for m in markers)
    env = next(r for r in lines(out) if r.get("record") == "env")
    assert env["budget_s"] == 540 and env["startup_s"] >= 0
    assert env["versions"]["anatomist"]  # run from the tree through PYTHONPATH, still named


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
    assert proc.stderr.count(": done already (") == len(before)
    assert [r for r in lines(out) if r.get("record") == "unit-done"] == before

    proc = run_validate(out, "--part", "c", "--redo", "c")
    assert proc.returncode == 0, proc.stderr[-3000:]
    redone = [r for r in lines(out) if r.get("record") == "unit-done"][len(before):]
    assert sorted(r["unit"] for r in redone) == sorted(r["unit"] for r in before if r["part"] == "c")
    assert list(out.glob("bench.*.jsonl")), "--redo c keeps the old bench results aside"


SCRIPT_MODULES = ("parts", "results", "runner", "report", "plan", "environment", "validate")


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


# -- the plan (plan.py) and the loop that follows it (validate.run_units) ----------------------------


def fake_unit(runner, part: str, name: str, priority: int, expected_s: float, *, after: tuple[str, ...] = (),
              ran: list[str] | None = None, status: str = "ok"):
    def run(ctx, unit, attempt, timeout_s):
        if ran is not None:
            ran.append(f"{part}/{name}")
        return runner.Outcome(status=status)

    return runner.Unit(part=part, name=name, expected_s=expected_s, cap_s=60, run=run, priority=priority,
                       after=after)


def gpu_log(results, path: Path, *lines: dict):
    log = results.ResultsLog(path=path / "results.jsonl")
    for line in lines:
        log.append(line)
    return log


def test_plan_runs_by_priority_and_packs_the_calls_first_fit(scripts) -> None:
    runner, plan = scripts("runner"), scripts("plan")
    units = [fake_unit(runner, "a", "probe", 2, 50), fake_unit(runner, "b", "small", 3, 10),
             fake_unit(runner, "c", "x", 1, 30), fake_unit(runner, "c", "big", 1, 100),
             fake_unit(runner, "d", "huge", 3, 500)]
    none = plan.read_measured({})
    # calls of 140 s and 60 s, each less 20 s of start (expected): 120 s, then 40 s
    p = plan.make_plan(units, set(), none, device=None, calls_s=(140, 60))
    assert p.start_s == 20 and not p.start_measured
    # call 1: c/x (30, priority 1), c/big (100) does not fit the 90 s left, a/probe (50) does, b/small (10) too;
    # call 2 (40 s): c/big still does not fit; nothing else is left
    assert [plan.unit_key(e.unit) for e in p.in_call(1)] == ["c/x", "a/probe", "b/small"]
    assert p.in_call(2) == []
    why = {plan.unit_key(e.unit): e.why for e in p.left_over()}
    assert why == {"c/big": "no room left in these calls", "d/huge": "longer than a call (120 s after its start)"}
    # the same units with one call of no limit: every one, priority first
    p = plan.make_plan(units, set(), none, device=None, calls_s=(0,))
    assert [plan.unit_key(e.unit) for e in p.in_call(1)] == ["c/x", "c/big", "a/probe", "b/small", "d/huge"]


def test_plan_skips_done_units_and_waits_for_a_part(scripts) -> None:
    runner, plan = scripts("runner"), scripts("plan")
    units = [fake_unit(runner, "c", "row1", 1, 30), fake_unit(runner, "c", "row2", 3, 300),
             fake_unit(runner, "e", "calibrate", 3, 10, after=("c",))]
    p = plan.make_plan(units, {"c/row1"}, plan.read_measured({}), device=None, calls_s=(140,))
    (done,) = [e for e in p.entries if e.done]
    assert plan.unit_key(done.unit) == "c/row1" and done.call is None
    # c/row2 fits no call, so c is never finished: the calibration waits for it instead of fitting half of c
    why = {plan.unit_key(e.unit): e.why for e in p.left_over()}
    assert why == {"c/row2": "longer than a call (120 s after its start)", "e/calibrate": "waits for part c to finish"}
    p = plan.make_plan(units, {"c/row1", "c/row2"}, plan.read_measured({}), device=None, calls_s=(140,))
    assert [plan.unit_key(e.unit) for e in p.in_call(1)] == ["e/calibrate"]


def test_measured_seconds_replace_the_expectations(scripts, tmp_path: Path) -> None:
    runner, plan, results = scripts("runner"), scripts("plan"), scripts("results")
    units = [fake_unit(runner, "c", name, 1, 40) for name in ("mine", "theirs", "skipped", "cut", "dry", "short-cut")]
    marker = {"record": "unit-done", "part": "c", "status": "ok", "mode": "gpu"}
    h100 = gpu_log(results, tmp_path / "H100", {"record": "env", "mode": "gpu", "startup_s": 12.5},
                   {**marker, "unit": "mine", "elapsed_s": 31.0},
                   {**marker, "unit": "skipped", "status": "skipped", "elapsed_s": 4.0},  # not run: says nothing
                   {**marker, "unit": "dry", "mode": "dry-run", "elapsed_s": 2.0},  # a CPU's seconds: not a GPU's
                   {"record": "unit-cut", "part": "c", "unit": "cut", "mode": "gpu", "elapsed_s": 75.0},
                   {"record": "unit-cut", "part": "c", "unit": "short-cut", "mode": "gpu", "elapsed_s": 20.0})
    h200 = gpu_log(results, tmp_path / "H200", {**marker, "unit": "mine", "elapsed_s": 25.0},
                   {**marker, "unit": "theirs", "elapsed_s": 55.0})
    measured = plan.read_measured({"H100": h100, "H200": h200})
    got = {u.name: plan.seconds_of(u, measured, "H100") for u in units}
    assert got["mine"] == plan.Seconds(value_s=31.0, source="measured", device="H100")  # this device's own first
    assert got["theirs"] == plan.Seconds(value_s=55.0, source="measured", device="H200")  # else another GPU's
    assert got["cut"] == plan.Seconds(value_s=75.0, source="at least", device="H100")  # longer than expected
    for name in ("skipped", "dry", "short-cut"):
        assert got[name] == plan.Seconds(value_s=40.0, source="expected")
    assert plan.call_start_s(measured, "H100") == (12.5, True)
    p = plan.make_plan(units, set(), measured, device="H100", calls_s=(100,))
    # 100 - 12.5 s of start: mine (31) + theirs (55) = 86 s, nothing else fits the 1.5 s left
    assert [e.unit.name for e in p.in_call(1)] == ["mine", "theirs"]
    text = plan.render(p)
    assert "31.0 s measured on H100" in text and "55.0 s measured on H200" in text
    assert ">= 75 s (cut there by a call's end on H100)" in text and "40 s expected (an estimate)" in text


def test_plan_text_says_each_unit_its_priority_seconds_and_call(scripts) -> None:
    runner, plan = scripts("runner"), scripts("plan")
    units = [fake_unit(runner, "c", "seeds/vanilla", 1, 40), fake_unit(runner, "a", "overhead", 2, 60),
             fake_unit(runner, "d", "grid", 3, 130)]
    text = plan.render(plan.make_plan(units, set(), plan.read_measured({}), device="H100-80GB-HBM3",
                                      calls_s=(80, 80)))
    lines = text.splitlines()
    assert lines[0].startswith("plan for H100-80GB-HBM3: calls of 80 s then 80 s (--budget-s), each less 20 s")
    assert re.fullmatch(r" +call 1 +1 first +c/seeds/vanilla +40 s expected \(an estimate\)", lines[1])
    assert re.fullmatch(r" +call 2 +2 then +a/overhead +60 s expected \(an estimate\)", lines[2])
    assert re.fullmatch(r" +no call +3 rest +d/grid +130 s expected \(an estimate\): longer than a call "
                        r"\(60 s after its start\)", lines[3])
    assert lines[4:] == ["call 1: 1 unit(s), 40 s of 60 s", "call 2: 1 unit(s), 60 s of 60 s",
                         "done already: 0 unit(s); in no call: 1 unit(s), 130 s (a later call or session goes on "
                         "with them)"]


def test_run_follows_the_plan_records_seconds_and_copies_after_each_unit(scripts, tmp_path: Path, monkeypatch) -> None:
    runner, results, validate, parts = scripts("runner"), scripts("results"), scripts("validate"), scripts("parts")
    ran: list[str] = []
    copies: list[list[str]] = []
    units = {"a": [fake_unit(runner, "a", "probe", 2, 5, ran=ran)],
             "c": [fake_unit(runner, "c", "row", 1, 5, ran=ran), fake_unit(runner, "c", "long", 1, 1000, ran=ran),
                   fake_unit(runner, "c", "cut", 3, 5, ran=ran, status="incomplete")],
             "e": [fake_unit(runner, "e", "calibrate", 3, 1, ran=ran, after=("c",))]}
    monkeypatch.setattr(validate, "PARTS", {k: parts.Part(name=k, title=k, units=lambda ctx, k=k: units[k])
                                            for k in units})
    real_copy = validate.copy_out

    def copy(out_dir: Path, dest: Path, **kwargs) -> None:
        real_copy(out_dir, dest, **kwargs)
        copies.append([json.loads(line).get("unit") for line in (dest / "results.jsonl").read_text().splitlines()])

    monkeypatch.setattr(validate, "copy_out", copy)
    log = results.ResultsLog(path=tmp_path / "H100" / "results.jsonl")
    log.append({"record": "unit-done", "part": "c", "unit": "row", "status": "ok", "mode": "gpu", "elapsed_s": 3.0})
    ctx = runner.Context(repo=tmp_path, here=tmp_path, out_dir=tmp_path / "H100", log=log, dry_run=False,
                         python=sys.executable, budget=runner.Budget(total_s=60))
    stopped = validate.run_units(ctx, ["a", "c", "e"], "H100", tmp_path / "OUT")
    # c/row is done already; c/long never fits 60 s; a/probe (priority 2) runs first, then c/cut (3), which the
    # budget cuts; e/calibrate waits for c/long and never starts
    assert ran == ["a/probe", "c/cut"]
    assert stopped is not None and "c/cut" in stopped
    new = [line for line in log.lines()][1:]
    assert [(n["record"], n["unit"], n["mode"]) for n in new] == [("unit-done", "probe", "gpu"),
                                                                  ("unit-cut", "cut", "gpu")]
    assert all(n["elapsed_s"] >= 0 for n in new)
    assert copies == [["row", "probe"]]  # copied once a unit is done (the cut one has no marker)


@pytest.mark.slow  # runs validate.sh end to end (25 s)
def test_plan_flag_resumes_from_the_devices_results_and_runs_nothing(tmp_path: Path) -> None:
    out = tmp_path / "H100-80GB-HBM3"
    out.mkdir()
    marker = {"validate": 1, "record": "unit-done", "part": "c", "status": "ok", "mode": "gpu"}
    (out / "results.jsonl").write_text(
        json.dumps({"validate": 1, "record": "env", "mode": "gpu", "time": "2026-11-27T10:00:00+00:00",
                    "startup_s": 9.0}) + "\n"
        + json.dumps({**marker, "unit": "seeds/vanilla", "elapsed_s": 33.3}) + "\n"
        + json.dumps({**marker, "unit": "seeds/fp16", "elapsed_s": 21.0}) + "\n")
    before = (out / "results.jsonl").read_text()
    proc = run_validate(out, "--plan", "--budget-s", "540,180", dry_run=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert text.startswith("plan for H100-80GB-HBM3: calls of 540 s then 180 s (--budget-s), each less 9 s of its "
                           "own start (measured)")
    assert not re.search(r"c/seeds/(vanilla|fp16) ", text)  # done: not planned again
    # not done on this device: planned, with what another GPU measured (benchmarks/gpu/H200 ran it) or an estimate
    assert re.search(r"call 1 +1 first +c/llama-1b/full-bf16 +(\d+ s expected \(an estimate\)|[\d.]+ s measured on )", text)
    assert re.search(r"c/seeds/grad-accum +(\d+ s expected \(an estimate\)|[\d.]+ s measured on )", text)
    assert "done already: 2 unit(s)" in text
    assert (out / "results.jsonl").read_text() == before and sorted(p.name for p in out.iterdir()) == ["results.jsonl"]


@pytest.mark.parametrize("args, message", [
    (("--plan", "--budget-s", "nine"), "--budget-s takes seconds >= 0"),
    (("--plan", "--device", "../elsewhere"), "--device takes a folder name under benchmarks/gpu/"),
    (("--plan", "--part", "z"), "unknown part(s) z"),
    (("--plan",), "line 1 is corrupt"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    out = tmp_path / "x"
    if args == ("--plan",):  # a device folder whose log a person edited badly
        out.mkdir()
        (out / "results.jsonl").write_text('{"record": "env"\n')
    proc = run_validate(out, *args, dry_run=False)
    assert proc.returncode == 2
    (line,) = [line for line in proc.stderr.splitlines() if re.match(r"validate(\.sh)?: error", line)]
    assert message in line and "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if not line.startswith("validate.sh: installing")] == [line]
