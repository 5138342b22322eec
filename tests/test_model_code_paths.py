"""Model code the tracer must follow on fake tensors (shapes, no values): DeBERTa's loss, DeepSeek's
multi-head latent attention, and a clear error where a model's code needs values."""

from __future__ import annotations

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from anatomist.errors import InputError
from anatomist.recipe import Recipe
from anatomist.trace.step.driver import data_dependent_code_is_input_error
from anatomist.workload_loader import load_workload

DEBERTA_V2 = {
    "model_type": "deberta-v2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128, "relative_attention": True,
    "position_buckets": 16, "pos_att_type": ["p2c", "c2p"], "position_biased_input": False, "type_vocab_size": 0,
    "max_relative_positions": -1, "norm_rel_ebd": "layer_norm", "share_att_key": True,
}
# Multi-head latent attention: values (16) narrower than queries and keys (16 + 8), so CUDA's
# SDPA runs the memory-efficient kernel, not flash.
DEEPSEEK_V2 = {
    "model_type": "deepseek_v2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128,
    "first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "kv_lora_rank": 32, "q_lora_rank": None,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "dtype": "bfloat16",
}


def _folder(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.slow
def test_deberta_with_eager_attention_is_estimated(cli, tmp_path):
    # Its classification loss picks the labelled rows with nonzero() unless problem_type is set:
    # the trace sets it, as the Trainer's integer labels mean. (DeBERTa has no SDPA code.)
    out = cli("estimate", _folder(tmp_path, DEBERTA_V2), "--attn-implementation", "eager", "--seq-len", "32",
              "--batch-size", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["memory"]["activations"] > 0


def test_deepseek_latent_attention_is_estimated(cli, tmp_path):
    out = cli("estimate", _folder(tmp_path, DEEPSEEK_V2), "--seq-len", "32", "--batch-size", "2", "--json")
    assert out.returncode == 0, out.stderr
    time = json.loads(out.stdout)["time"]
    # the attention's products are counted: 2 x (b h s s (dq + dv)) forward, twice that backward
    assert time["flops_per_step"] > 0


def test_code_that_needs_values_is_one_clear_error(tiny_model):
    workload = load_workload(str(tiny_model("llama")), seq_len=8)
    with pytest.raises(InputError, match=r"llama: cannot be estimated without data: .*nonzero.*--attn-implementation sdpa"):
        with data_dependent_code_is_input_error(workload, Recipe(attn_implementation="eager")):
            with FakeTensorMode():
                torch.ones(4).nonzero()
