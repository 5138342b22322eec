"""Write a recipe as the real libraries take it: TrainingArguments, accelerate config, DeepSpeed.

Each output is loaded by the library itself in the tests: `TrainingArguments(**kwargs)`,
accelerate's `load_config_from_file`, `deepspeed.runtime.config.DeepSpeedConfig`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml

from anatomist.errors import InputError
from anatomist.estimate.sharding import BUCKET_ELEMENTS
from anatomist.recipe import Recipe

Target = Literal["trainer", "accelerate", "deepspeed"]
TARGETS: tuple[str, ...] = ("trainer", "accelerate", "deepspeed")


def deepspeed_config(recipe: Recipe, num_gpus: int = 1) -> dict[str, Any]:
    """A ds_config dict: batch sizes, ZeRO stage/offload, fp16/bf16, clipping.

    Known limitation: stage 0 with no offload is written as ZeRO stage 0 (plain data parallel).
    """
    micro, accum = recipe.per_device_train_batch_size, recipe.gradient_accumulation_steps
    zero: dict[str, Any] = {"stage": recipe.zero_stage}
    if recipe.offload != "none":
        zero["offload_optimizer"] = {"device": recipe.offload, "pin_memory": True}
        if recipe.zero_stage == 3:
            zero["offload_param"] = {"device": recipe.offload, "pin_memory": True}
    if recipe.zero_stage >= 2:
        zero.update({"overlap_comm": True, "contiguous_gradients": True})
    if recipe.zero_stage >= 1:
        zero.update({"reduce_bucket_size": BUCKET_ELEMENTS, "allgather_bucket_size": BUCKET_ELEMENTS})
    if recipe.zero_stage == 3:
        zero["stage3_prefetch_bucket_size"] = BUCKET_ELEMENTS
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * num_gpus,
        "gradient_clipping": recipe.max_grad_norm,
        "zero_optimization": zero,
        "fp16": {"enabled": recipe.fp16, "loss_scale": 0, "initial_scale_power": 16},
        "bf16": {"enabled": recipe.bf16},
    }
    return config


def trainer_kwargs(recipe: Recipe) -> dict[str, Any]:
    """TrainingArguments keyword arguments (everything but output_dir)."""
    return recipe.to_training_arguments_kwargs()


AUTO_CLASSES = {
    "sequence-classification": "AutoModelForSequenceClassification", "causal-lm": "AutoModelForCausalLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM", "masked-lm": "AutoModelForMaskedLM",
}


def trainer_snippet(recipe: Recipe, num_gpus: int = 1, *, model: str = "MODEL",
                    task: str = "sequence-classification") -> str:
    """Python for the model and TrainingArguments: the load dtype and the attention kernel are
    `from_pretrained` arguments, the rest TrainingArguments'."""
    kwargs = trainer_kwargs(recipe)
    auto = AUTO_CLASSES[task]
    lines = [f"from transformers import {auto}, TrainingArguments", ""]
    lines.append(f'model = {auto}.from_pretrained({model!r}, dtype="{recipe.dtype}", '
                 f'attn_implementation="{recipe.attn_implementation}")')
    args = ",\n".join(f"    {k}={v!r}" for k, v in kwargs.items())
    if recipe.zero_stage:
        args += ',\n    deepspeed="ds_config.json",  # anatomist plan --emit deepspeed -o ds_config.json'
    lines.append(f'args = TrainingArguments(\n    output_dir="out",\n{args},\n)')
    return "\n".join(lines) + "\n"


def accelerate_config(recipe: Recipe, num_gpus: int = 1, *, use_cpu: bool = False) -> dict[str, Any]:
    """An accelerate config as `accelerate config` writes it (ClusterConfig keys)."""
    # MULTI_GPU selects accelerate's torchrun launcher; with use_cpu the processes then run on
    # CPU with gloo (accelerate's MULTI_CPU is the mpirun multi-node path, one process here).
    distributed = "DEEPSPEED" if recipe.zero_stage else "FSDP" if recipe.fsdp != "none" else (
        "MULTI_GPU" if num_gpus > 1 else "NO"
    )
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed,
        "mixed_precision": recipe.mixed_precision,
        "num_machines": 1,
        "machine_rank": 0,
        "num_processes": num_gpus,
        "gpu_ids": "all",
        "use_cpu": use_cpu,
        "main_training_function": "main",
        "downcast_bf16": "no",
        "rdzv_backend": "static",
        "same_network": True,
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
        "debug": False,
    }
    if recipe.zero_stage:
        ds: dict[str, Any] = {
            "gradient_accumulation_steps": recipe.gradient_accumulation_steps,
            "gradient_clipping": recipe.max_grad_norm,
            "offload_optimizer_device": recipe.offload,
            "offload_param_device": recipe.offload if recipe.zero_stage == 3 else "none",
            "zero3_init_flag": recipe.zero_stage == 3,
            "zero_stage": recipe.zero_stage,
        }
        if recipe.zero_stage == 3:
            ds["zero3_save_16bit_model"] = True
        config["deepspeed_config"] = ds
    if recipe.fsdp != "none":
        config["fsdp_config"] = {
            "fsdp_sharding_strategy": recipe.fsdp.upper(),
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_backward_prefetch": "BACKWARD_PRE",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_offload_params": False,
            "fsdp_use_orig_params": True,
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_sync_module_states": True,
            "fsdp_activation_checkpointing": recipe.gradient_checkpointing,
        }
    if recipe.torch_compile:
        config["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
    return config


def render(recipe: Recipe, target: str, num_gpus: int = 1) -> str:
    """The text of `target` for `recipe`."""
    if target == "trainer":
        return json.dumps(trainer_kwargs(recipe), indent=2) + "\n"
    if target == "accelerate":
        return yaml.safe_dump(accelerate_config(recipe, num_gpus), sort_keys=True)
    if target == "deepspeed":
        return json.dumps(deepspeed_config(recipe, num_gpus), indent=2) + "\n"
    raise InputError(f"unknown --emit target {target!r}; known: {', '.join(TARGETS)}")


def write(recipe: Recipe, target: str, path: str | Path, num_gpus: int = 1, *, model: str = "MODEL",
          task: str = "sequence-classification") -> list[Path]:
    """Write `target` to `path` (and, for trainer, the Python snippet next to it as .py)."""
    p = Path(path)
    if p.parent and not p.parent.exists():
        raise InputError(f"-o {str(p)!r}: folder {str(p.parent)!r} does not exist")
    p.write_text(render(recipe, target, num_gpus))
    written = [p]
    if target == "trainer":
        snippet = p.with_suffix(".py")
        snippet.write_text(trainer_snippet(recipe, num_gpus, model=model, task=task))
        written.append(snippet)
    return written
