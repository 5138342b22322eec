"""Settings that change memory a lot and that anatomist does not model yet: refused, never predicted as something else.

Each reader calls `refuse_unmodelled` with the setting's name in this table and the key as the
file writes it. The table is the list for the sharding model to take over (issue 21: FSDP2 per
rank, DeepSpeed buffers): once a setting is modelled, its reader sets a Recipe field instead and
its entry goes.
"""

from __future__ import annotations

from typing import Any

from anatomist.errors import InputError
from anatomist.recipe_files.reading import is_off

UNMODELLED: dict[str, str] = {
    "fp16_master_weights_and_grads": "DeepSpeed's fp16 master weights and gradients: they would be predicted in fp32",
    "tensor_parallel": "tensor parallel: it would be predicted as plain data parallel",
    "context_parallel": "context parallel: it would be predicted as plain data parallel",
    "sequence_parallel": "sequence parallel: it would be predicted as plain data parallel",
    "pipeline_parallel": "pipeline parallel: it would be predicted as plain data parallel",
    "hybrid_shard": "hybrid sharding (replicated groups of sharded ranks): it would be predicted as one sharded group",
    "activation_offload": "activation offload to the CPU: it would be predicted with activations on the GPU",
    "selective_checkpointing": "selective activation checkpointing (the attention outputs kept): it would be "
                               "predicted as full recomputation",
    "spectrum": "Spectrum, which freezes the layers of lowest signal-to-noise ratio: they would be predicted as trained",
    "knowledge_distillation": "knowledge distillation against a teacher's logits: it would be predicted without them",
    "grokfast": "Grokfast's moving average of every gradient: it would be predicted without it",
    "expert_parallel": "expert parallel: it would be predicted as plain data parallel",
}
"""Setting -> what it changes and how a prediction that ignored it would be wrong."""


def refuse_unmodelled(setting: str, file: str, key: str, value: Any, instead: str = "") -> None:
    """InputError naming `file`'s `key` when `value` turns `setting` on (a size of 1 or an off value does not);
    `instead`: a modelled setting of the same tool that does nearly the same, offered before removing it."""
    if is_off(value) or (isinstance(value, int) and not isinstance(value, bool) and value <= 1):
        return
    raise InputError(f"{file}: {key}={value!r} is not modelled yet ({UNMODELLED[setting]}); "
                     f"{f'use {instead} or ' if instead else ''}remove it to estimate without it")
