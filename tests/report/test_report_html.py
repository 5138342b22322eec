"""write_report and `anatomist report`: the page holds the input's numbers, works offline, bad input exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from anatomist.anatomy import MemoryCategory
from anatomist.cli import main
from anatomist.errors import InputError
from anatomist.report import write_report

from .tables import read_tables

MEMORY_KEYS = [c.value for c in MemoryCategory] + ["peak_allocated", "peak_reserved", "device_total"]


def test_estimate_dict_tables_hold_the_exact_bytes(tmp_path: Path, estimate_json: dict) -> None:
    out = write_report(estimate_json, tmp_path / "r.html")
    html = out.read_text()
    (row,) = read_tables(html).tables["table-memory"]
    for key in MEMORY_KEYS:
        assert int(row[key]) == estimate_json["memory"][key], key
    assert int(row["gpu_memory_bytes"]) == estimate_json["gpu"]["memory_bytes"]
    # only the estimate's charts: no parity or op-class section without bench/profile input
    assert 'id="chart-memory"' in html and "section-parity" not in html and "section-classes" not in html


def test_page_is_self_contained(tmp_path: Path, fixtures: Path) -> None:
    out = write_report([fixtures / "estimate_bert-large-uncased.json", fixtures / "bench_schema_example.jsonl",
                        fixtures / "profile_schema_example.json"], tmp_path / "r.html")
    html = out.read_text()
    for external in ("<script", "<link", 'src="http', "href=\"http", "url(http", "@import"):
        assert external not in html
    images = read_tables(html).images
    assert [i["data-chart"] for i in images] == ["memory", "throughput", "parity", "classes"]
    assert all(i["src"].startswith("data:image/png;base64,") for i in images)


def test_bench_tables_match_the_results_file(tmp_path: Path, fixtures: Path) -> None:
    path = fixtures / "bench_schema_example.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    tables = read_tables(write_report(path, tmp_path / "r.html").read_text()).tables
    ok = [r for r in rows if r["status"] == "ok"]
    assert [t["label"] for t in tables["table-memory"]] == [r["name"] for r in ok]
    for t, r in zip(tables["table-parity"], ok, strict=True):
        assert int(t["measured_device_total"]) == r["measured"]["memory"]["device_total"]
        assert int(t["predicted_device_total"]) == r["predicted"]["memory"]["device_total"]
        assert float(t["measured_samples_per_second"]) == r["measured"]["samples_per_second"]
    assert [t["label"] for t in tables["table-failed"]] == ["fp32 bs32"]


def test_png_dir(tmp_path: Path, fixtures: Path) -> None:
    write_report(fixtures / "bench_schema_example.jsonl", tmp_path / "r.html", png_dir=tmp_path / "png")
    names = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert names == ["memory.png", "parity.png", "throughput.png"]
    assert (tmp_path / "png" / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_only_failed_rows_write_a_report_that_says_so(tmp_path: Path, fixtures: Path) -> None:
    html = write_report(fixtures / "bench_only_failed.jsonl", tmp_path / "r.html").read_text()
    assert html.index('id="notices"') < html.index("<section")  # said at the top
    assert "Every run in" in html and "<img" not in html
    assert "CUDA out of memory" in html and "NCCL timeout" in html  # the reasons are shown


def test_bad_input_keeps_an_existing_report(tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    out.write_text("previous report")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(InputError, match="is empty"):
        write_report(tmp_path / "empty.jsonl", out)
    assert out.read_text() == "previous report"


@pytest.mark.parametrize("content", ["", '{"hello": "world"}', "{broken", "\x00\x01binary"])
def test_cli_bad_input_exits_2_with_one_line(tmp_path: Path, content: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "results.jsonl"
    path.write_text(content)
    assert main(["report", str(path), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("anatomist: error:")
    assert not (tmp_path / "r.html").exists()


def test_cli_writes_report_and_pngs(tmp_path: Path, fixtures: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["report", str(fixtures / "plan_schema_example.json"), "-o", str(tmp_path / "plan.html"),
               "--png", str(tmp_path / "png")])
    assert rc == 0 and (tmp_path / "plan.html").is_file()
    assert "report written to" in capsys.readouterr().out
    assert (tmp_path / "png" / "memory.png").is_file() and (tmp_path / "png" / "throughput.png").is_file()


@pytest.mark.slow  # over 15 s on 2 cores
def test_estimate_report_shortcut(cli, tmp_path: Path) -> None:
    """`anatomist estimate MODEL --report PATH` on a tiny config: the report holds that estimate."""
    model = tmp_path / "tiny-bert"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "bert", "architectures": ["BertForSequenceClassification"], "hidden_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 128,
        "max_position_embeddings": 64,
    }))
    out = tmp_path / "estimate.html"
    proc = cli("estimate", str(model), "--seq-len", "32", "--fp16", "--json", "--report", str(out))
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)  # --json stays clean: nothing else on stdout
    (row,) = read_tables(out.read_text()).tables["table-memory"]
    assert int(row["device_total"]) == printed["memory"]["device_total"]
    assert row["label"] == "bs8, fp16"  # the Trainer's default batch of 8
