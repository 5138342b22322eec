"""The report says what it is about: model, parameters, sequence length, batch, recipe and GPU in
its header, and, on each chart comparing several results, in the title and next to each result."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from anatomist.cli import main
from anatomist.report import charts, write_report
from anatomist.report.load import load

from .tables import read_tables


def _on_gpu(estimate: dict, name: str, memory_bytes: int) -> dict:
    other = copy.deepcopy(estimate)
    other["gpu"] = {"name": name, "memory_bytes": memory_bytes}
    return other


def test_cli_report_header_names_model_parameters_seq_batch_recipe_gpu(
    tmp_path: Path, fixtures: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.html"
    assert main(["report", str(fixtures / "estimate_bert-large-uncased_fp16_gc.json"), "-o", str(out)]) == 0
    assert "report written to" in capsys.readouterr().out
    about = read_tables(out.read_text()).about
    assert about == {
        "model": "bert-large-uncased",
        "parameters": "335.1 M",  # 335,143,938 in the estimate
        "seq_len": "512",
        "batch": "4 per device x 1 accumulation step(s)",
        "recipe": "bs4, ckpt, fp16, adamw_torch",
        "gpu": "V100-16GB",
    }


def test_header_lists_what_differs_and_says_what_is_missing(tmp_path: Path, fixtures: Path, estimate_json: dict) -> None:
    a100 = _on_gpu(estimate_json, "A100-80GB", 85_899_345_920)
    a100["recipe"]["per_device_train_batch_size"] = 16
    bench = fixtures / "bench_schema_example.jsonl"  # hand-made rows: no parameter count, no seq_len
    html = write_report([estimate_json, a100, bench], tmp_path / "r.html").read_text()
    about = read_tables(html).about
    assert about["gpu"] == "V100-16GB; A100-80GB; schema example, not measured"
    assert about["batch"] == "4, 16, 8, 32 per device x 1 accumulation step(s)"
    assert about["parameters"] == "335.1 M (not in the input for 4 of 6 results)"
    # the two estimates differ in batch and GPU, the bench rows in their GPU: each named by what sets it apart
    assert about["recipe"].startswith("6 recipes: bs4 (V100-16GB, seq 512); bs16 (A100-80GB, seq 512); "
                                      "fp16+gc (schema example, not measured)")


def test_chart_title_names_model_and_gpu(estimate_json: dict) -> None:
    fig = charts.memory_anatomy(load(estimate_json).results)
    assert fig._suptitle.get_text() == "Memory anatomy per recipe"
    assert fig.axes[0].get_title(loc="left") == "bert-large-uncased (335.1 M parameters), seq 512, on V100-16GB"


def test_chart_comparing_gpus_says_which_result_ran_where(tmp_path: Path, estimate_json: dict) -> None:
    results = load([estimate_json, _on_gpu(estimate_json, "A100-80GB", 85_899_345_920)]).results
    ax = charts.memory_anatomy(results).axes[0]
    assert ax.get_title(loc="left") == "bert-large-uncased (335.1 M parameters), seq 512, on V100-16GB vs A100-80GB"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["bs4 (V100-16GB)", "bs4 (A100-80GB)"]  # first input on top
    # the page says it too: the chart's alt text and heading
    html = write_report([estimate_json, _on_gpu(estimate_json, "A100-80GB", 85_899_345_920)], tmp_path / "r.html").read_text()
    (image,) = read_tables(html).images
    assert image["alt"] == "Memory anatomy per recipe: bert-large-uncased (335.1 M parameters), seq 512, on V100-16GB vs A100-80GB"


def test_chart_comparing_models_labels_each_result(estimate_json: dict) -> None:
    gpt2 = copy.deepcopy(estimate_json)
    gpt2.update(model="gpt2-large", parameters=774_030_080, seq_len=1024)
    ax = charts.memory_anatomy(load([estimate_json, gpt2]).results).axes[0]
    assert ax.get_title(loc="left") == "bert-large-uncased vs gpt2-large, seq 512 vs 1024, on V100-16GB"
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "bs4 (bert-large-uncased, seq 512)", "bs4 (gpt2-large, seq 1024)"]


def test_bench_rows_take_seq_len_from_their_workload(tmp_path: Path, fixtures: Path) -> None:
    rows = [json.loads(line) for line in (fixtures / "bench_schema_example.jsonl").read_text().splitlines()[1:]]
    for row in rows:
        row["workload"] = {"model": "bert-large-uncased", "seq_len": 128, "task": "sequence-classification"}
    data = load({"rows": rows})
    assert {r.seq_len for r in data.results} == {128}
    fig = charts.throughput_vs_memory(data.results)
    assert fig.axes[0].get_title(loc="left") == "bert-large-uncased, seq 128, on schema example, not measured"
