"""Shared fixtures: tiny model configs written to disk, so tests never touch the network."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The trace cache of a test run lives in a folder of its own, never in the user's cache.
os.environ.setdefault("ANATOMIST_CACHE_DIR", tempfile.mkdtemp(prefix="anatomist-test-cache-"))

TINY_CONFIGS: dict[str, dict] = {
    "bert": {
        "model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 128,
        "type_vocab_size": 2, "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "pad_token_id": 0,
    },
    "gpt2": {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 4, "n_head": 4,
        "n_positions": 128, "vocab_size": 1000,
    },
    "llama": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000,
        "max_position_embeddings": 128, "tie_word_embeddings": False,
    },
}


def write_config(folder: Path, name: str, **overrides: object) -> Path:
    """Write a tiny config.json for `name` (a key of TINY_CONFIGS) and return its folder."""
    target = folder / name
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps({**TINY_CONFIGS[name], **overrides}))
    return target


@pytest.fixture
def tiny_model(tmp_path: Path):
    """Factory: tiny_model("bert", num_hidden_layers=2) -> path of a config folder."""

    def make(name: str, **overrides: object) -> Path:
        return write_config(tmp_path, name, **overrides)

    return make
