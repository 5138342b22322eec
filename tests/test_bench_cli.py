"""`anatomist bench` end to end on CPU: real Trainer rows, bad input (SIGKILL durability: test_process.py)."""

from __future__ import annotations

import json

import pytest
from bench_tiny import write_tiny_suite

from anatomist.cli import main


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()[1:]]


def test_unknown_suite_row_model_exit_2(tmp_path, capsys):
    results = tmp_path / "r.jsonl"
    assert main(["bench", "--suite", "nope", "--results", str(results)]) == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err
    assert main(["bench", "--rows", "vanilla,bogus", "--results", str(results)]) == 2
    assert "unknown row(s) bogus" in capsys.readouterr().err
    assert main(["bench", "--model", "no-such-model", "--results", str(results)]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert main(["bench", "--num-processes", "0", "--results", str(results)]) == 2
    assert not results.exists()


def test_corrupt_results_file_exit_2_and_untouched(tmp_path, capsys):
    results = tmp_path / "r.jsonl"
    results.write_text('{"anatomist_results": 1}\n{"broken"\n')
    before = results.read_bytes()
    assert main(["bench", "--suite", str(write_tiny_suite(tmp_path)), "--results", str(results)]) == 2
    assert "line 2 is corrupt" in capsys.readouterr().err
    assert results.read_bytes() == before


@pytest.mark.slow  # real training steps in subprocesses: minutes on 2 cores
def test_tiny_suite_runs_through_trainer_and_json(tmp_path, capsys):
    results = tmp_path / "r.jsonl"
    suite = write_tiny_suite(tmp_path)
    with suite.open("a") as f:  # the seeds' "Using Accelerate" loop, on the tiny model
        f.write("  - name: accelerate\n    loop: accelerate\n    recipe: {per_device_train_batch_size: 2, gradient_accumulation_steps: 2}\n")
    code = main(["bench", "--suite", str(suite), "--rows", "first,needs-gpu,accelerate", "--results", str(results),
                 "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    stored = _rows(results)
    assert [r["name"] for r in printed["rows"]] == [r["name"] for r in stored] == ["first", "needs-gpu", "accelerate"]
    first, skipped, accelerate = stored
    # the Accelerate loop (Accelerator, accumulate, track()) runs and is measured too
    assert accelerate["status"] == "ok", accelerate["reason"]
    assert accelerate["measured"]["samples_per_second"] > 0 and accelerate["measured"]["memory"]["weights"] > 0
    assert first["status"] == "ok", first["reason"]
    assert first["device"]["kind"] == "cpu"
    memory = first["measured"]["memory"]
    assert memory["peak_allocated"] > 0 and memory["weights"] > 0 and memory["optimizer_states"] > 0
    assert first["measured"]["samples_per_second"] > 0
    # MFU and HFU sit side by side in the row; on CPU (no GPU peak) both are null
    assert first["measured"]["time"]["mfu"] is None and first["measured"]["time"]["hfu"] is None
    assert set(first["predicted"]["memory"]) == set(memory)
    assert first["error_pct"]["peak_allocated"] is not None
    assert skipped["status"] == "skipped" and "CUDA" in skipped["reason"]


@pytest.mark.slow  # real training steps in subprocesses: minutes on 2 cores
def test_lora_suite_runs_adapters_for_real_and_skips_qlora_without_cuda(tmp_path, capsys):
    """The shipped lora suite on CPU: LoRA rows train a real PEFT model through the Trainer and an
    Accelerate loop, within 5% of the prediction; QLoRA rows say why they did not run."""
    results = tmp_path / "lora.jsonl"
    code = main(["bench", "--suite", "lora", "--rows", "lora+checkpointing,lora-accelerate,qlora",
                 "--results", str(results)])
    assert code == 0, capsys.readouterr().err
    rows = {r["name"]: r for r in _rows(results)}
    for name in ("lora+checkpointing", "lora-accelerate"):
        row = rows[name]
        assert row["status"] == "ok", row["reason"]
        assert row["workload"]["task"] == "causal-lm" and row["recipe"]["peft"] == "lora"
        measured, predicted = row["measured"]["memory"], row["predicted"]["memory"]
        assert measured["gradients"] == predicted["gradients"] == 0  # freed by the step's end; adapters only
        assert measured["optimizer_states"] == predicted["optimizer_states"] > 0
        assert abs(row["error_pct"]["peak_allocated"]) < 5
    assert rows["qlora"]["status"] == "skipped" and "CUDA" in rows["qlora"]["reason"]


@pytest.mark.parametrize(("recipe", "loop", "message"), [
    ("{per_device_train_batch_size: 2, trainer: sft}", "trainer", "row 'row' sets trainer sft, which TRL's trainers run"),
    ("{per_device_train_batch_size: 2, activation_offloading: true}", "trainer", "sets activation_offloading, which TRL's trainers run"),
    ("{per_device_train_batch_size: 2, use_liger_kernel: true}", "accelerate",
     "the Accelerate loop does not apply Liger Kernel"),
])
def test_a_row_the_bench_does_not_run_is_refused(tmp_path, capsys, recipe, loop, message):
    """Before, such a row ran transformers' plain Trainer step (or the loop without Liger) and was recorded as the
    recipe's measurement."""
    suite = tmp_path / "s.yaml"
    suite.write_text(f"""
name: refused
model: llama-tiny
task: causal-lm
seq_len: 32
cpu:
  model_config: {{model_type: llama, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
                 num_key_value_heads: 2, intermediate_size: 128, vocab_size: 1000, max_position_embeddings: 128}}
  seq_len: 32
rows:
  - name: row
    recipe: {recipe}
    loop: {loop}
""")
    results = tmp_path / "r.jsonl"
    assert main(["bench", "--suite", str(suite), "--results", str(results)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not results.exists()
