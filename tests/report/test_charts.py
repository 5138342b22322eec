"""The charts draw the input's numbers: bar widths, capacity line, Pareto front."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from anatomist.anatomy import MemoryCategory
from anatomist.report import charts, write_report
from anatomist.report.load import load

GIB = 2**30


def test_pareto_front_hand_worked() -> None:
    # (2, 5) needs more memory than (1, 10) for less speed; (3, 10) is no faster than (1, 10)
    points = [(1.0, 10.0), (2.0, 5.0), (3.0, 20.0), (3.0, 10.0), (0.5, 1.0)]
    assert charts.pareto_front(points) == [4, 0, 2]
    assert charts.pareto_front([]) == []


def test_memory_bars_are_the_categories_in_gib(fixtures: Path, estimate_json: dict) -> None:
    data = load(fixtures / "estimate_bert-large-uncased.json")
    fig = charts.memory_anatomy(data.results)
    ax = fig.axes[0]
    widths = [patch.get_width() for patch in ax.patches]  # one bar per category, one recipe
    expected = [estimate_json["memory"][c.value] / GIB for c in MemoryCategory]
    assert widths == expected
    # the seven categories stack up to nvidia-smi's view: device_total
    assert abs(sum(widths) - estimate_json["memory"]["device_total"] / GIB) < 1e-9
    (capacity,) = [line.get_xdata()[0] for line in ax.get_lines()]
    assert capacity == estimate_json["gpu"]["memory_bytes"] / GIB
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "optimizer states" in labels and any("V100-16GB" in t for t in labels)


def test_a_predicted_total_carries_its_likely_range(estimate_json: dict, tmp_path: Path) -> None:
    """The estimate's memory.interval is drawn as a whisker over the total bar; the capacity line stays."""
    total = estimate_json["memory"]["device_total"]
    estimate_json["memory"]["interval"] = {"low": total / 1.15, "high": total / 0.9, "validated": True, "basis": "x"}
    path = tmp_path / "estimate.json"
    path.write_text(json.dumps(estimate_json))
    fig = charts.memory_anatomy(load(path).results)
    ax = fig.axes[0]
    whisker, capacity = ax.get_lines()
    assert list(whisker.get_xdata()) == [total / 1.15 / GIB, total / 0.9 / GIB]
    assert capacity.get_xdata()[0] == estimate_json["gpu"]["memory_bytes"] / GIB
    assert any("likely range" in t.get_text() for t in fig.legends[0].get_texts())


def test_throughput_and_parity_from_bench(fixtures: Path) -> None:
    data = load(fixtures / "bench_schema_example.jsonl")
    fig = charts.throughput_vs_memory(data.results)
    scatter = fig.axes[0].collections[0]
    assert sorted(y for _, y in scatter.get_offsets()) == [19.6, 24.9, 31.8]  # measured samples/s, ok rows only
    parity = charts.predicted_vs_measured(data.results)
    assert len(charts.plots(parity)) == 2  # memory and samples/s


def test_no_data_no_chart(fixtures: Path) -> None:
    failed = load(fixtures / "bench_only_failed.jsonl")
    assert charts.memory_anatomy(failed.results) is None
    assert charts.throughput_vs_memory(failed.results) is None
    assert charts.predicted_vs_measured(failed.results) is None
    assert charts.op_class_shares(None) is None
    estimate_only = load(fixtures / "estimate_bert-large-uncased.json")
    assert charts.throughput_vs_memory(estimate_only.results) is None  # no time prediction yet


def test_op_class_bars(fixtures: Path) -> None:
    data = load(fixtures / "profile_schema_example.json")
    fig = charts.op_class_shares(data.classes)
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert heights == [99.8, 0.17, 0.03, 0.0, 61.0, 25.5, 13.5, 0.0]  # FLOPs bars, then time bars


def test_cpu_bench_rows_chart_their_peak_allocated(fixtures: Path, tmp_path: Path) -> None:
    """A CPU run has no device total: the charts use peak allocated bytes, on both sides of the parity plot."""
    data = load(fixtures / "bench_cpu_seeds.jsonl")
    ok = [r for r in data.results if r.ok]
    assert len(ok) == 2 and all(r.measured_memory["device_total"] is None for r in ok)
    fig = charts.throughput_vs_memory(data.results)
    xs = sorted(x for x, _ in fig.axes[0].collections[0].get_offsets())
    assert xs == pytest.approx(sorted(r.measured_memory["peak_allocated"] / 2**30 for r in ok))
    parity = charts.predicted_vs_measured(data.results)
    assert parity is not None and len(charts.plots(parity)) == 1  # CPU rows carry no predicted time
    assert write_report(fixtures / "bench_cpu_seeds.jsonl", tmp_path / "cpu.html").exists()
