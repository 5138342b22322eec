"""Which modules PEFT's LoraConfig targets in a model when none are named: asked of PEFT itself.

PEFT keeps default LoRA targets per model type (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING). A type it lacks
(phi3, smollm3, modernbert, qwen3_moe, deepseek_v2, gpt_oss), or whose transformers 5 layout its v4-to-v5 conversion
of the config empties (mixtral, whose experts are fused), has none: `get_peft_model` raises. Rather than read the
table (and miss the conversion), `default_targets` runs `get_peft_model` on the model cut to one block, built on the
meta device. `Workload.lora_default_targets` keeps the answer in the trace cache, so a repeated estimate asks nothing.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from anatomist.trace.depth.configs import traced_config

if TYPE_CHECKING:
    from anatomist.workload import Workload


def default_targets(workload: Workload, task_type: str | None) -> tuple[str, ...] | None:
    """The modules PEFT targets in `workload`'s model (as a `task_type` adapter: peft's TaskType name) when
    `target_modules` is unset, as `peft.get_peft_model` picks them; None where it finds none."""
    import peft

    with torch.device("meta"), contextlib.redirect_stderr(None):
        model = workload.build_model(workload.default_attention(), "float32", config=traced_config(workload, 1))
        try:
            wrapped = peft.get_peft_model(model, peft.LoraConfig(task_type=task_type))
        except ValueError:
            return None
    targets = getattr(wrapped.peft_config["default"], "target_modules", None)
    return (targets,) if isinstance(targets, str) else tuple(sorted(targets or ()))
