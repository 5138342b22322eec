"""Settings that change memory a lot and that anatomist does not model yet: refused, never predicted as something else.

Each reader calls `refuse_unmodelled` with the setting's name in this table and the key as the
file writes it. The table is the list for the sharding model to take over (FSDP2 per
rank, DeepSpeed buffers): once a setting is modelled, its reader sets a Recipe field instead and
its entry goes.
"""

from __future__ import annotations

from typing import Any

from anatomist.errors import InputError
from anatomist.recipe.files.reading import is_off

TP_UNDER_ACCELERATE_FSDP = (
    "{file}: tensor parallel {tp} under accelerate's FSDP2 is not modelled: accelerate 1.15 prepares it with "
    "transformers.integrations.tensor_parallel.ReplicateParallel, which transformers 5.24 no longer has, and with an "
    "older transformers it would upcast the weights to fp32 masters, which transformers' own FSDP (what "
    "--tp-size --fsdp full_shard predicts: from_pretrained(distributed_config=...)) does not")
"""Why a file that asks accelerate (or the Trainer through it) for FSDP2 with tensor parallel is refused."""


UNMODELLED: dict[str, str] = {
    "fp16_master_weights_and_grads": "DeepSpeed's fp16 master weights and gradients: they would be predicted in fp32",
    "tensor_parallel": "tensor parallel: it would be predicted as plain data parallel",
    "context_parallel": "context parallel: it would be predicted as plain data parallel",
    "ring_flash_attention": "axolotl's context parallel, the ring-flash-attn package's ring over flash_attention_2, or "
                            "DeepSpeed's Ulysses under its ALST (accelerate's, PyTorch's ring attention over SDPA, is "
                            "what --cp-size models)",
    "sequence_parallel": "sequence parallel: it would be predicted as plain data parallel",
    "pipeline_parallel": "pipeline parallel: it would be predicted as plain data parallel",
    "hybrid_shard": "FSDP1's hybrid sharding (replicated groups of sharded ranks; FSDP2's, which anatomist models, is "
                    "parallelism_config's dp_replicate_size)",
    "activation_offload": "activation offload to the CPU: it would be predicted with activations on the GPU",
    "selective_checkpointing": "selective activation checkpointing (the attention outputs kept): it would be "
                               "predicted as full recomputation",
    "spectrum": "Spectrum, which freezes the layers of lowest signal-to-noise ratio: they would be predicted as trained",
    "knowledge_distillation": "knowledge distillation against a teacher's logits: it would be predicted without them",
    "grokfast": "Grokfast's moving average of every gradient: it would be predicted without it",
    "expert_parallel": "expert parallel: it would be predicted as plain data parallel",
    "reward_model": "reward modelling (a score head trained on pairs of sequences): it would be predicted as a language "
                    "model's fine-tuning",
    "partial_training": "training a chosen subset of the weights, the rest frozen: it would be predicted with the "
                        "recipe's trainable set (every weight, or the adapter's)",
    "modules_to_save": "whole modules trained beside the adapter (their gradients and optimizer states): they would be "
                       "predicted frozen",
    "dora": "DoRA (a magnitude vector and the norm of each adapted weight, computed every step): it would be predicted "
            "as plain LoRA",
    "optimizer": "an optimizer anatomist does not model: its states would be predicted as AdamW's",
    "fp8": "FP8 training with LLaMA-Factory's own choice of layers (torchao rowwise, every linear layer but those "
           "named embed, lm_head, output or classifier), where anatomist traces accelerate's (every linear layer "
           "but the first and last): `--bf16 --fp8 rowwise` estimates accelerate's",
    "bitnet": "BitNet's ternary linear layers (onebitllms, weights and activations quantized in each forward): they "
              "would be predicted as plain linear layers",
    "prequantized": "a base model quantized ahead of training (GPTQ): its weights would be predicted in the load dtype",
    "sparse_masks": "sparse fine-tuning (LLM Compressor's modifiers keep a mask beside each weight they target): it "
                    "would be predicted without the masks",
    "unsloth": "Unsloth's patched model (its own kernels and checkpointing): it would be predicted as transformers' model",
    "zenflow": "DeepSpeed's ZenFlow (the gradients' most important columns updated on the GPU beside the offloaded "
               "optimizer): it would be predicted as plain optimizer offload",
    "fsdp_ignored_modules": "FSDP's ignored modules (kept whole on every rank): they would be predicted sharded",
}
"""Setting -> what it changes and how a prediction that ignored it would be wrong."""


def refuse_unmodelled(setting: str, file: str, key: str, value: Any, instead: str = "", *, size: bool = True) -> None:
    """InputError naming `file`'s `key` when `value` turns `setting` on (an off value does not, nor, where `value` is
    a `size` of parallel ranks, 1); `instead`: a modelled setting of the same tool that does nearly the same, offered
    before removing it."""
    if is_off(value) or (size and isinstance(value, int) and not isinstance(value, bool) and value <= 1):
        return
    raise InputError(f"{file}: {key}={value!r} is not modelled yet ({UNMODELLED[setting]}); "
                     f"{f'use {instead} or ' if instead else ''}remove it to estimate without it")
