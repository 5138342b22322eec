"""A 2-process CPU run (gloo) through `accelerate launch`, measured bytes vs the per-device prediction."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from anatomist.bench.distributed import CATEGORIES, run_distributed
from anatomist.errors import InputError
from anatomist.recipe import Recipe

TINY_BERT = {
    "model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 128,
    "type_vocab_size": 2, "pad_token_id": 0,
}


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


def test_needs_two_processes() -> None:
    with pytest.raises(InputError, match="at least 2"):
        run_distributed("bert-base-uncased", Recipe(), 1)


def test_zero_launch_needs_cuda_here_and_says_why() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the launch would run")
    with pytest.raises(InputError, match="oneCCL"):
        run_distributed("bert-base-uncased", Recipe(zero_stage=2), 2)
