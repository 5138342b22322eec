"""Every catalog model, fully fine-tuned, with LoRA and with QLoRA, answers with no flag but the model, the GPU and a
length it holds: the load dtype is the checkpoint's, the attention transformers' own pick, the LoRA targets PEFT's
or all-linear where it has none, a quantized classifier's head unquantized.

The fast test settles every recipe (what used to refuse in one line); the slow one estimates all of them (what
used to end in a traceback, too).
"""

from __future__ import annotations

import json

import pytest

from anatomist.model_catalog import catalog_entries
from anatomist.recipe import Recipe
from anatomist.workload_loader import load_workload

METHODS = {"full": (), "lora": ("--peft", "lora"), "qlora": ("--peft", "qlora")}


@pytest.mark.parametrize("name", sorted(catalog_entries()))
def test_every_catalog_model_settles_for_every_method(name):
    workload = load_workload(name, seq_len=512)
    for flags in METHODS.values():
        given = {"peft": flags[1]} if flags else {}
        recipe = Recipe.with_presets(per_device_train_batch_size=1, **given).resolved(workload)
        assert recipe.attn_implementation == workload.default_attention()
        if workload.is_moe:
            assert recipe.dtype == "bfloat16"  # the checkpoints', where the config names none (DeepSeek, gpt-oss)
        if recipe.peft != "none" and workload.lora_default_targets() is None:
            assert recipe.lora_target_modules == "all-linear"
        if recipe.quantized and workload.task == "sequence-classification":
            assert recipe.llm_int8_skip_modules == "classifier,score"  # the head PEFT trains in full stays unquantized


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("name", sorted(catalog_entries()))
def test_every_catalog_model_answers_for_every_method(cli, name, method):
    """One H100, 512 tokens (each model's limit where it is shorter), batch 1: an estimate, fitting or not."""
    seq = min(512, load_workload(name).max_positions or 512)
    result = cli("estimate", name, "--gpu", "H100", "--seq-len", str(seq), "--batch-size", "1", *METHODS[method],
                 "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["memory"]["device_total"] > 0 and data["trainable_parameters"] > 0
