"""The fine-tuning methods: which adapters train (PEFT), and which trainer runs the step (transformers' or TRL's)."""

from __future__ import annotations

from typing import Literal, get_args

Peft = Literal["none", "lora", "qlora"]
"""Full fine-tuning, LoRA adapters, or LoRA on a 4-bit base (QLoRA)."""
PEFT_METHODS: tuple[str, ...] = get_args(Peft)
Trainer = Literal["trainer", "sft", "dpo"]
"""transformers' Trainer, TRL's SFTTrainer or DPOTrainer."""
TRAINERS: tuple[str, ...] = get_args(Trainer)
DPO_BETA = 0.1
"""DPOConfig.beta as anatomist's DPO step computes it (trl 1.16's default); it scales the loss, not its memory."""
DPO_LOSS_TYPE = "sigmoid"
"""DPOConfig.loss_type as anatomist's DPO step computes it (trl 1.16's default: -logsigmoid(beta x the margin))."""
