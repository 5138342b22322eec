"""The config of a model cut to a few of its blocks: what a trace at a depth builds.

Config surgery only (no model is built here): every stack cut to N blocks (a uniform stack), or
to the layers a `Cut` names, each still the kind it was (`cut_config` rewrites the fields that
say what each layer is: per-layer lists, index lists, `first_k_dense_replace`,
`decoder_sparse_step`). `layout.cut_matches` builds the result and checks the kinds.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from anatomist.config_fields import LAYER_FIELDS
from anatomist.trace.depth.cuts import Cut, Depth

if TYPE_CHECKING:
    from anatomist.workload import Workload

LAYER_COUNT_FIELDS = (*LAYER_FIELDS, "num_decoder_layers", "encoder_layers", "decoder_layers")
"""Config fields that hold the depth of a stack (as the config classes store or alias them)."""
INDEX_LIST_FIELDS = ("mlp_only_layers", "moe_layers", "full_attn_idxs")
"""Config fields that list layer indices (Qwen-MoE's dense layers, Llama 4's MoE layers, LFM2's attention)."""

Scalar = bool | int | float | str | None


def is_scalar(value: Any) -> bool:
    """A setting a block's kind may be told by: None, bool, int, float, str, or a tuple of them."""
    if isinstance(value, tuple):
        return all(is_scalar(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def depth_fields(config: Any) -> dict[str, int]:
    """The config's layer counts by the name they are stored under (T5's num_hidden_layers is num_layers)."""
    aliases = getattr(config, "attribute_map", {}) or {}
    out: dict[str, int] = {}
    for name in LAYER_COUNT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            out[aliases.get(name, name)] = value
    return out


def per_layer_fields(config: Any, depth: int) -> dict[str, list[Any]]:
    """Config fields that say something of each of `depth` layers: lists of that length whose name says
    layer (`layer_types`, `mlp_layer_types`, `no_rope_layers`)."""
    out = {}
    for name, value in vars(config).items():
        if ("layer" in name and isinstance(value, list) and len(value) == depth and depth > 0
                and all(is_scalar(v) for v in value)):
            out[name] = value
    return out


def at_depth(config: Any, num_layers: int) -> Any:
    """A copy of `config` with `num_layers` repeated blocks in every stack (the per-layer lists repeated,
    the index lists cut): right for stacks of blocks all alike."""
    config = copy.deepcopy(config)
    for name in LAYER_COUNT_FIELDS:
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, num_layers)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list) and layer_types:
        config.layer_types = (layer_types * num_layers)[:num_layers]
    mlp_only = getattr(config, "mlp_only_layers", None)
    if isinstance(mlp_only, list):
        config.mlp_only_layers = [i for i in mlp_only if i < num_layers]
    return config


def cut_config(config: Any, cut: Cut) -> Any:
    """A copy of `config` whose stacks keep the layers `cut` names, each still the kind it was."""
    config = copy.deepcopy(config)
    for stack in cut.stacks:
        kept = list(stack.kept)
        rank = {i: r for r, i in enumerate(kept)}
        step = getattr(config, "decoder_sparse_step", None)
        if isinstance(step, int) and step > 1 and isinstance(getattr(config, "mlp_only_layers", None), list):
            # Qwen-MoE: layer i is sparse iff (i + 1) % step == 0 and i is not in mlp_only_layers. Kept
            # layers are renumbered, so the rule is written out as the list of dense layers.
            config.mlp_only_layers = sorted(set(config.mlp_only_layers) | {i for i in range(stack.depth)
                                                                           if (i + 1) % step})
            config.decoder_sparse_step = 1
        for name, values in per_layer_fields(config, stack.depth).items():
            setattr(config, name, [values[i] for i in kept])
        for name in INDEX_LIST_FIELDS:
            listed = getattr(config, name, None)
            if isinstance(listed, list):
                setattr(config, name, [rank[i] for i in sorted(listed) if i in rank])
        first_dense = getattr(config, "first_k_dense_replace", None)
        if isinstance(first_dense, int) and not isinstance(first_dense, bool):
            config.first_k_dense_replace = sum(1 for i in kept if i < first_dense)
        for name in stack.fields:
            setattr(config, name, len(kept))
    return config


def traced_config(workload: Workload, depth: Depth) -> Any:
    """The config a trace of `workload` at `depth` builds (a copy: building writes into it)."""
    if depth is None:
        config = copy.deepcopy(workload.config)
    else:
        config = at_depth(workload.config, depth) if isinstance(depth, int) else cut_config(workload.config, depth)
    if workload.task == "sequence-classification" and getattr(config, "problem_type", None) is None:
        # The loss the Trainer's integer labels get. Left unset, DeBERTa picks the labelled rows
        # with nonzero(), whose size depends on the labels' values: a trace without data cannot
        # follow it. The memory differs by a few bytes per sample.
        config.problem_type = "single_label_classification" if workload.num_labels > 1 else "regression"
    return config
