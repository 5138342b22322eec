"""Reading a model config's fields the same way from a transformers config and from its config.json.

`anatomist models` reads the shipped config.json files without transformers; the estimator reads
the transformers config. Both go through a `ConfigField` getter, so a field means one thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ConfigField = Callable[[str], Any]
"""A config's field by name, None where it has none: getattr on a transformers config, or `dict.get`
on its JSON."""

LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
"""The names a config.json gives its (encoder's) block count: GPT-2's and T5's are aliases in
transformers' `attribute_map`."""

ESTIMATOR_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
"""The sizes the estimator builds from: each must be a positive integer where the config has it
(canonical transformers names; a config class may store them under its own, GPT-2's n_layer)."""

POSITIONS_AFTER_PADDING = ("roberta", "xlm-roberta", "camembert", "roberta-prelayernorm", "data2vec-text", "xmod")
"""Models whose position ids start after the padding index (RobertaEmbeddings'
create_position_ids_from_input_ids), so max_position_embeddings - pad_token_id - 1 tokens fit."""


def experts_of(field: ConfigField) -> tuple[int, int] | None:
    """(experts per token, routed experts) of a text config's fields, else None.

    The expert count goes by num_local_experts (Mixtral, gpt-oss), num_experts (Qwen-MoE) or
    n_routed_experts (DeepSeek); shared experts are not counted.
    """
    experts = field("num_local_experts") or field("num_experts") or field("n_routed_experts")
    per_token = field("num_experts_per_tok")
    if experts and per_token:
        return int(per_token), int(experts)
    return None


def context_length(field: ConfigField, model_type: str) -> int | None:
    """Longest sequence a text config's position embeddings allow, None where nothing limits it."""
    for name in ("max_position_embeddings", "n_positions"):
        value = field(name)
        if isinstance(value, int) and value > 0:
            pad = field("pad_token_id")
            if model_type in POSITIONS_AFTER_PADDING and isinstance(pad, int) and 0 <= pad < value - 1:
                return value - pad - 1  # RoBERTa: 514 embeddings, padding_idx 1 -> 512 tokens
            return value
    return None
