"""Input detection and tolerance: every kind of file, and every kind of bad file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from anatomist.errors import InputError
from anatomist.report.load import detect_kind, load, recipe_label


def test_estimate_is_read_with_its_exact_bytes(fixtures: Path, estimate_json: dict) -> None:
    data = load(fixtures / "estimate_bert-large-uncased.json")
    assert data.kinds == ["estimate"]
    (r,) = data.results
    assert r.status == "predicted" and r.memory_source == "predicted"
    assert r.memory["weights"] == estimate_json["memory"]["weights"]
    assert r.memory["device_total"] == estimate_json["memory"]["device_total"]
    assert r.gpu_memory_bytes == estimate_json["gpu"]["memory_bytes"]
    assert r.label == "bs4, adamw_torch"  # the batch size, and what differs from today's defaults (fused AdamW)
    assert data.notices == []


def test_bench_jsonl_skips_the_header_and_keeps_failed_rows(fixtures: Path) -> None:
    data = load(fixtures / "bench_schema_example.jsonl")
    assert data.kinds == ["bench"]
    assert [r.status for r in data.results] == ["ok", "ok", "ok", "oom"]
    assert len(data.ok_results) == 3 and [r.label for r in data.failed_results] == ["fp32 bs32"]
    ok = data.results[0]
    assert ok.memory_source == "measured" and ok.measured_samples_per_second == 19.6
    assert data.failed_results[0].measured_memory is None  # failed: its prediction stays out of the charts
    assert data.notices == []


def test_bench_json_rows_object_is_accepted(fixtures: Path) -> None:
    rows = [json.loads(line) for line in (fixtures / "bench_schema_example.jsonl").read_text().splitlines()[1:]]
    data = load({"rows": rows})
    assert data.kinds == ["bench"] and len(data.results) == 4


def test_only_failed_rows_say_so(fixtures: Path) -> None:
    data = load(fixtures / "bench_only_failed.jsonl")
    assert data.ok_results == []
    assert len(data.notices) == 1
    assert "Every run" in data.notices[0] and "1 error, 1 oom" in data.notices[0]


def test_older_schema_and_missing_keys_are_said(fixtures: Path) -> None:
    data = load(fixtures / "bench_old_schema.jsonl")
    text = " ".join(data.notices)
    assert "older anatomist (results schema 0" in text
    assert "lacks functionality" in text
    assert data.results[0].memory["functionality"] == 0


def test_plan_entries_are_pareto_and_best_is_marked(fixtures: Path) -> None:
    data = load(fixtures / "plan_schema_example.json")
    assert data.kinds == ["plan"]
    assert all(r.pareto for r in data.results)
    assert sum(r.best for r in data.results) == 1


def test_profile_classes(fixtures: Path) -> None:
    data = load(fixtures / "profile_schema_example.json")
    assert data.classes["contraction"] == {"flops_pct": 99.8, "time_pct": 61.0}
    assert data.results == []


def test_several_inputs_are_combined(fixtures: Path) -> None:
    data = load([fixtures / "estimate_bert-large-uncased.json", fixtures / "profile_schema_example.json"])
    assert data.kinds == ["estimate", "profile"] and len(data.results) == 1 and data.classes


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("", "is empty"),
        ("   \n\n", "is empty"),
        ('{"foo": 1, "bar": 2}', r"not an anatomist .* \(top-level keys: bar, foo\)"),
        ("{not json\n", "line 1 is not valid JSON"),
        ('{"anatomist_results": 1}\n[1, 2]\n', "line 2 is not a JSON object"),
        ("42", "holds a JSON int"),
    ],
)
def test_bad_files_raise_one_clear_input_error(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "results.jsonl"
    path.write_text(content)
    with pytest.raises(InputError, match=match):
        load(path)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        load(tmp_path / "nope.jsonl")
    with pytest.raises(InputError, match="is a directory"):
        load(tmp_path)


def test_header_only_results_say_no_rows(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    path.write_text('{"anatomist_results": 1}\n')
    data = load(path)
    assert data.results == [] and "holds no result rows" in data.notices[0]


def test_detect_kind_by_keys() -> None:
    assert detect_kind({"memory": {}, "gpu": {}}) == "estimate"
    assert detect_kind({"candidates": 1, "pareto": [], "best": None}) == "plan"
    assert detect_kind({"classes": {}, "phases": {}}) == "profile"
    assert detect_kind({"rows": []}) == "bench"


def test_recipe_label_names_what_differs_from_the_defaults() -> None:
    recipe = {"per_device_train_batch_size": 8, "gradient_checkpointing": True, "fp16": True,
              "optim": "adafactor", "attn_implementation": "sdpa", "dataloader_pin_memory": False}
    # sdpa is the default (not named); pin memory defaults to True, so False is "no pin"
    assert recipe_label(recipe) == "bs8, ckpt, fp16, adafactor, no pin"
