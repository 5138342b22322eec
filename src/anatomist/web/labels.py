"""What the page calls each field and each choice: words a newcomer reads, beside the TrainingArguments name.

The names stay the CLI's and the URL's (a link reads like the command); only what the page shows is here.
A field not in FIELD_LABELS is shown as its name in words ("stage3 max live parameters"), so a field added to
Recipe is on the page with no edit here.
"""

from __future__ import annotations

FIELD_LABELS = {
    "model": "Model",
    "config": "or upload its config.json",
    "gpu": "GPU",
    "seq_len": "Sequence length",
    "gpus": "GPUs per node",
    "nodes": "Nodes",
    "network": "Network between nodes",
    "max_nodes": "Choose the cluster: up to this many nodes",
    "task": "Task",
    "mode": "Training step or inference",
    "memory_margin": "Memory kept free",
    "recipe": "Your recipe file",
    "avg_seq_len": "Average tokens per example",
    "lengths": "Token count of every example",
    "prompt_len": "DPO prompt tokens",
    "global_batch_size": "Global batch",
    "objective": "Top pick",
    "optims": "Optimizers",
    "precisions": "Precisions",
    "shardings": "Sharding options",
    "no_compile": "Leave out torch.compile",
    "no_liger_kernel": "Leave out Liger Kernel",
    "no_tensor_parallel": "Leave out tensor and expert parallel",
    "per_device_train_batch_size": "Batch per GPU",
    "gradient_accumulation_steps": "Gradient accumulation steps",
    "gradient_checkpointing": "Gradient checkpointing",
    "checkpoint_every": "Checkpoint every N-th layer",
    "checkpoint_offload": "Checkpoints in host memory",
    "activation_offloading": "TRL activation offloading",
    "max_grad_norm": "Gradient clipping norm",
    "dtype": "Weights loaded in",
    "fp16": "fp16 mixed precision",
    "bf16": "bf16 mixed precision",
    "tf32": "TF32 matrix products",
    "optim": "Optimizer",
    "attn_implementation": "Attention kernel",
    "experts_implementation": "MoE experts kernel",
    "torch_compile": "torch.compile",
    "use_liger_kernel": "Liger Kernel",
    "cut_cross_entropy": "Cut Cross-Entropy",
    "trainer": "Trainer",
    "padding_free": "Padding-free batches",
    "packing": "Packing",
    "precompute_ref_log_probs": "DPO reference log-probs beforehand",
    "peft": "Method",
    "lora_r": "LoRA rank",
    "lora_alpha": "LoRA alpha",
    "lora_dropout": "LoRA dropout",
    "lora_target_modules": "LoRA target modules",
    "load_in_4bit": "Load the base in 4 bits",
    "load_in_8bit": "Load the base in 8 bits",
    "bnb_4bit_quant_type": "4-bit data type",
    "bnb_4bit_use_double_quant": "Double quantization",
    "bnb_4bit_compute_dtype": "4-bit compute dtype",
    "zero_stage": "DeepSpeed ZeRO stage",
    "offload": "ZeRO / FSDP offload",
    "fsdp": "FSDP",
    "tp_size": "Tensor parallel GPUs per group",
    "ep_size": "Expert parallel GPUs per group",
    "ep_routing": "Expert routing assumed",
    "cp_size": "Context parallel GPUs per sequence",
    "sp_size": "Sequence parallel GPUs per sequence (DeepSpeed Ulysses)",
    "dp_replicate_size": "HSDP replicas",
    "dataloader_num_workers": "DataLoader workers",
    "dataloader_pin_memory": "Pinned host memory for batches",
}
CHOICE_LABELS: dict[str, dict[str, str]] = {
    "peft": {"none": "full fine-tuning", "lora": "LoRA", "qlora": "QLoRA (4-bit base)"},
    "trainer": {"trainer": "plain Trainer", "sft": "SFT (TRL)", "dpo": "DPO (TRL)"},
    "mode": {"train": "training step", "inference": "inference (forward only)"},
    "objective": {"throughput": "the fastest that fits", "memory": "the smallest"},
}
"""A choice a name does not say to a newcomer; the others are shown as their names (sdpa, bf16, zero3)."""


def field_label(name: str) -> str:
    """The page's label for field `name`."""
    return FIELD_LABELS.get(name) or name.replace("_", " ").capitalize()


def choice_labels(name: str, choices: tuple[object, ...] | None) -> tuple[str, ...] | None:
    """The page's text for each of `choices` of field `name` (None: no choices)."""
    if choices is None:
        return None
    said = CHOICE_LABELS.get(name, {})
    return tuple(said.get(str(c), str(c)) for c in choices)
