"""Several processes on this CPU machine: DDP through `accelerate launch`, FSDP2 through `torchrun` (gloo),
measured per rank, stored as bench rows and resumed; and what cannot run, refused in one line."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from anatomist.bench.distributed import CATEGORIES, run_distributed
from anatomist.cli import main
from anatomist.errors import InputError
from anatomist.recipe import Recipe
from tests.conftest import TINY_CONFIGS

TINY_BERT = {
    "model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 128,
    "type_vocab_size": 2, "pad_token_id": 0,
}

SUITE = f"""
name: dist-tiny
model: llama-tiny
task: causal-lm
seq_len: 32
num_processes: 2
cpu:
  model_config: {json.dumps(TINY_CONFIGS["llama"])}
  seq_len: 32
rows:
  - name: ddp
    recipe: {{per_device_train_batch_size: 2, optim: adamw_torch}}
  - name: fsdp
    recipe: {{per_device_train_batch_size: 2, optim: adamw_torch, fsdp: full_shard}}
  - name: zero2
    recipe: {{per_device_train_batch_size: 2, optim: adamw_torch, zero_stage: 2}}
  - name: hsdp
    recipe: {{per_device_train_batch_size: 2, optim: adamw_torch, fsdp: full_shard, dp_replicate_size: 2}}
  - name: cp
    recipe: {{per_device_train_batch_size: 2, optim: adamw_torch, fsdp: full_shard, cp_size: 2}}
"""


def _suite(folder: Path) -> Path:
    path = folder / "dist.yaml"
    path.write_text(SUITE)
    return path


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[1:]]


@pytest.mark.slow  # real training steps in subprocesses: minutes on 2 cores
def test_two_process_ddp_matches_prediction(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_BERT))
    recipe = Recipe(per_device_train_batch_size=2, optim="adamw_torch")
    start = time.perf_counter()
    result = run_distributed(str(tmp_path), recipe, 2, seq_len=32, steps=2)
    assert time.perf_counter() - start < 300
    assert [r["rank"] for r in result["measured"]] == [0, 1]
    assert all(r["num_processes"] == 2 and "MULTI_CPU" in r["distributed_type"] for r in result["measured"])
    predicted = result["predicted"]["memory"]
    for rank in result["measured"]:
        for category in CATEGORIES:
            # DDP keeps a full replica of each on every process. The prediction rounds every CUDA
            # block up to 512 bytes (the caching allocator's granularity) and CPU tensors are
            # exact, so the two may differ by at most 512 B per tensor (e.g. 80 AdamW moments of
            # ~40 parameters of a few hundred bytes: < 40 KiB of a 1.1 MiB total).
            bound = 512 * rank["tensor_counts"][category]
            assert abs(rank["memory"][category] - predicted[category]) <= bound, category
            assert rank["memory"][category] <= predicted[category] * 1.001, category


@pytest.mark.slow  # one launch of two processes: about 20 s on 2 cores
def test_a_ddp_rank_holds_ddps_gradient_buckets_beside_its_gradients(tmp_path: Path, capsys) -> None:
    """The per-process prediction of plain data parallelism against a real DDP step (accelerate launch, gloo):
    PyTorch's MemTracker over accelerate wrapping the model in DDP (its gradient buckets are made then) and a
    steady-state step; DDP's own report of its buckets. Without the buckets (a second copy of the gradients) the
    prediction would be 16% low here."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the suite would run its full-size model")
    results = tmp_path / "r.jsonl"
    assert main(["bench", "--suite", str(_suite(tmp_path)), "--rows", "ddp", "--results", str(results)]) == 0, \
        capsys.readouterr().err
    (row,) = _rows(results)
    assert row["status"] == "ok", row["reason"]
    config = AutoConfig.for_model(**TINY_CONFIGS["llama"])
    full = sum(p.numel() * p.element_size() for p in AutoModelForCausalLM.from_config(config).parameters())
    predicted = row["predicted"]["memory"]
    for rank in row["measured"]["ranks"]:
        assert sum(rank["ddp_buckets"]) == pytest.approx(full, abs=512 * len(rank["ddp_buckets"]))
        assert predicted["functionality"] == pytest.approx(sum(rank["ddp_buckets"]), abs=512 * len(rank["ddp_buckets"]))
        assert abs(rank["error_pct"]["peak_allocated"]) < 3
        assert predicted["peak_allocated"] - predicted["functionality"] < 0.97 * rank["memory"]["peak_allocated"]


@pytest.mark.slow  # two launches of two processes each: about a minute on 2 cores
def test_fsdp_row_runs_on_two_cpu_processes_is_stored_and_resumed(tmp_path: Path, capsys) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the suite would run its full-size model")
    results = tmp_path / "r.jsonl"
    argv = ["bench", "--suite", str(_suite(tmp_path)), "--rows", "fsdp", "--results", str(results)]
    assert main(argv) == 0, capsys.readouterr().err
    (row,) = _rows(results)
    assert row["status"] == "ok", row["reason"]
    assert row["num_processes"] == 2 and row["measured"]["launcher"] == "torchrun"
    ranks = row["measured"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    # Independent truth: the model's own parameters, built from the same config by transformers.
    # Llama hidden 64, 4 layers, vocabulary 1,000, untied: 276,032 fp32 parameters, 1,104,128 B.
    config = AutoConfig.for_model(**TINY_CONFIGS["llama"])
    full = sum(p.numel() * p.element_size() for p in AutoModelForCausalLM.from_config(config).parameters())
    for rank in ranks:
        assert rank["backend"] == "gloo" and rank["wrapped_by"].startswith("accelerate.utils.fsdp2_prepare_model")
        shards = rank["local_shards"]
        # each rank holds half of every parameter (plus the rotary buffer's 64 B, not sharded)
        assert shards["weights"] == pytest.approx(full / 2, rel=0.01)
        assert shards["gradients"] == pytest.approx(full / 2, rel=0.01)
        assert shards["optimizer_states"] == pytest.approx(full, rel=0.01)  # AdamW: two moments of the shard
        # FSDPMemTracker's peak, by PyTorch's categories, beside the per-process prediction
        tracker = rank["fsdp_mem_tracker_peak"]
        assert tracker["Total"] == rank["memory"]["peak_allocated"] > 0
        assert tracker["SHARDED_PARAM"] >= shards["weights"] - 64 and tracker["OPT"] >= shards["optimizer_states"]
        assert abs(rank["error_pct"]["peak_allocated"]) < 3
    assert row["predicted"]["memory"]["peak_allocated"] > 0
    assert row["measured"]["memory"]["peak_allocated"] == max(r["memory"]["peak_allocated"] for r in ranks)

    # --resume: the stored row is reused, nothing launched, nothing appended
    before = results.read_bytes()
    capsys.readouterr()  # the first run's table, on stdout
    assert main([*argv, "--resume", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == [row]
    assert results.read_bytes() == before  # a launched row is appended, whatever its status


def test_resume_key_includes_the_number_of_processes(tmp_path: Path, capsys) -> None:
    """A stored 2-process row is reused for 2 processes, and does not stand for a 1-process run."""
    from anatomist.bench.store import open_results, row_key

    results = tmp_path / "r.jsonl"
    store = open_results(results)
    stored = {"suite": "dist-tiny", "name": "ddp", "num_processes": 2, "model": "m", "recipe": {}, "device": {},
              "versions": {}, "status": "error", "reason": "stored", "measured": {}, "predicted": {}, "error_pct": {}}
    store.append(stored)
    assert row_key(stored) == ("dist-tiny", "ddp", 2)
    assert row_key({"name": "ddp", "suite": "dist-tiny"}) == ("dist-tiny", "ddp", 1)  # rows written before
    argv = ["bench", "--suite", str(_suite(tmp_path)), "--rows", "ddp", "--results", str(results), "--resume",
            "--json"]
    assert main(argv) == 0  # the suite's num_processes: 2
    assert json.loads(capsys.readouterr().out)["rows"] == [stored]
    assert len(_rows(results)) == 1


def test_bad_distributed_input_exits_2_with_one_line(tmp_path: Path, capsys) -> None:
    results = tmp_path / "r.jsonl"
    suite = str(_suite(tmp_path))
    cases = [
        (["--rows", "fsdp", "--num-processes", "1"], "row 'fsdp' shards the model with FSDP (full_shard), which on one "
                                                     "process shards nothing: run it with --num-processes 2 or more"),
        (["--rows", "zero2"], "needs Intel's oneCCL"),
        (["--rows", "hsdp", "--num-processes", "4"], "replicates FSDP's shards (HSDP, dp_replicate_size=2), which "
                                                     "the bench does not launch yet"),
        (["--rows", "cp", "--num-processes", "2"], "runs context parallel (cp_size=2), which the bench does not "
                                                   "launch yet"),
        (["--rows", "ddp", "--num-processes", "0"], "--num-processes must be at least 1, got 0"),
    ]
    import torch

    if torch.cuda.is_available():
        cases = [c for c in cases if "zero2" not in c[0]]
    for extra, message in cases:
        assert main(["bench", "--suite", suite, "--results", str(results), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err
    assert not results.exists()  # refused before anything ran or was written


def test_suite_num_processes_must_be_positive(tmp_path: Path) -> None:
    from anatomist.bench.suites import load_suite

    path = tmp_path / "s.yaml"
    path.write_text("model: bert-base-uncased\nnum_processes: 0\nrows:\n  - name: a\n")
    with pytest.raises(InputError, match="num_processes must be a positive integer, got 0"):
        load_suite(str(path))


def test_needs_two_processes() -> None:
    with pytest.raises(InputError, match="at least 2"):
        run_distributed("bert-base-uncased", Recipe(), 1)


def test_zero_launch_needs_cuda_here_and_says_why() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the launch would run")
    with pytest.raises(InputError, match="oneCCL"):
        run_distributed("bert-base-uncased", Recipe(zero_stage=2), 2)


def test_collectives_hold_nothing_hides_what_gloo_makes_within_a_collective(monkeypatch) -> None:
    """gloo's reduce-scatter works on a copy of its input (FSDPMemTracker saw it made at gloo's aten.split), which
    NCCL does not make: within `collectives_hold_nothing` the trackers do not see it (fails without
    `_CollectiveOnly`: the copy's 2 KiB is the peak)."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from anatomist.bench.trackers import collectives_hold_nothing

    def reduce_scatter(output: torch.Tensor, input: torch.Tensor, **_: object) -> None:
        copy = input.clone()  # as gloo's copy of the input
        output.copy_(copy[: output.numel()])

    monkeypatch.setattr(dist, "reduce_scatter_single", reduce_scatter)
    output, input = torch.empty(256), torch.ones(512)
    tracker = MemTracker()
    with tracker, collectives_hold_nothing():
        dist.reduce_scatter_single(output, input)
    peak = sum(categories["Total"] for categories in tracker.get_tracker_snapshot("peak").values())
    assert peak == 0
    assert torch.equal(output, torch.ones(256))
    assert dist.reduce_scatter_single is reduce_scatter  # restored
