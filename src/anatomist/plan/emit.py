"""Write a recipe as the real libraries take it: TrainingArguments, accelerate config, DeepSpeed,
TRL, and for LoRA/QLoRA PEFT's LoraConfig and transformers' BitsAndBytesConfig.

Each output is loaded by the library itself in the tests: `TrainingArguments(**kwargs)`,
accelerate's `load_config_from_file`, `deepspeed.runtime.config.DeepSpeedConfig`,
`LoraConfig(**kwargs)`, `BitsAndBytesConfig(**kwargs)`, and the YAML `trl sft --config` reads
with TRL's own parser.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml

from anatomist.axes.shardings import DEEPSPEED_SETTINGS, FSDP2_ACCELERATE, installed, release
from anatomist.errors import InputError
from anatomist.estimate.sharding import overlap_comm
from anatomist.recipe import Recipe
from anatomist.workload import PEFT_TASK_TYPES

Target = Literal["trainer", "accelerate", "deepspeed", "trl"]
TARGETS: tuple[str, ...] = ("trainer", "accelerate", "deepspeed", "trl")


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
        zero.update({"overlap_comm": overlap_comm(recipe), "contiguous_gradients": True})
    names = [n for n in DEEPSPEED_SETTINGS if recipe.zero_stage == 3 or not n.startswith("stage3_")]
    for name in names if recipe.zero_stage else ():  # what the estimate sized DeepSpeed's buffers with
        value = getattr(recipe, name)
        if value is not None:
            zero[name] = value
        else:  # what Recipe.resolved assumes of an unset value: the Trainer's "auto", else DeepSpeed's default
            zero[name] = "auto" if DEEPSPEED_SETTINGS[name].auto else DEEPSPEED_SETTINGS[name].default
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


def lora_config(recipe: Recipe, task: str = "causal-lm") -> dict[str, Any] | None:
    """peft.LoraConfig keyword arguments of a LoRA/QLoRA recipe (None for full fine-tuning)."""
    return recipe.lora_config_kwargs(PEFT_TASK_TYPES.get(task)) if recipe.peft != "none" else None


def bnb_config(recipe: Recipe) -> dict[str, Any] | None:
    """transformers.BitsAndBytesConfig keyword arguments of a quantized base (None otherwise)."""
    skipped = [n.strip() for n in (recipe.llm_int8_skip_modules or "").split(",") if n.strip()]
    skip = {"llm_int8_skip_modules": skipped} if skipped else {}
    if recipe.load_in_8bit:
        return {"load_in_8bit": True, **skip}
    if not recipe.load_in_4bit:
        return None
    kwargs: dict[str, Any] = {"load_in_4bit": True, "bnb_4bit_quant_type": recipe.bnb_4bit_quant_type,
                              "bnb_4bit_use_double_quant": recipe.bnb_4bit_use_double_quant,
                              "bnb_4bit_compute_dtype": recipe.bnb_4bit_compute_dtype, **skip}
    if recipe.fsdp != "none" or recipe.zero_stage == 3:  # the codes sharded with the rest: stored in the same float
        kwargs["bnb_4bit_quant_storage"] = recipe.bnb_4bit_compute_dtype  # dtype (bitsandbytes' FSDP-QLoRA guide)
    return kwargs


def trl_config(recipe: Recipe, *, model: str = "MODEL", seq_len: int = 1024) -> dict[str, Any]:
    """The YAML `trl sft --config` reads (`trl dpo --config` for a DPO recipe): SFTConfig (DPOConfig) and
    ModelConfig fields (TRL's field names).

    TRL dequantizes 4-bit weights to its `dtype` (get_quantization_config), so a 4-bit base is
    loaded in its compute dtype; `prepare_model_for_kbit_training` casts the rest to fp32 anyway.
    """
    dtype = recipe.bnb_4bit_compute_dtype if recipe.load_in_4bit else recipe.dtype
    config: dict[str, Any] = {
        "model_name_or_path": model,
        "dtype": dtype,
        **({"attn_implementation": recipe.attn_implementation} if recipe.attn_implementation else {}),
        "dataset_name": "DATASET",
        "output_dir": "out",
        # padding-free without packing: TRL refuses a max_length (it would not be enforced)
        "max_length": None if recipe.padding_free and not recipe.packing else seq_len,
        **trainer_kwargs(recipe),
    }
    if recipe.zero_stage:
        config["deepspeed"] = "ds_config.json"
    if recipe.peft != "none":
        config.update({"use_peft": True, "lora_r": recipe.lora_r, "lora_alpha": recipe.lora_alpha,
                       "lora_dropout": recipe.lora_dropout})
        lora = recipe.lora_config_kwargs(None)
        targets = lora.get("target_modules")
        if targets is not None:
            config["lora_target_modules"] = [targets] if isinstance(targets, str) else targets
        if lora.get("target_parameters"):
            config["lora_target_parameters"] = lora["target_parameters"]
    if recipe.load_in_8bit:
        config["load_in_8bit"] = True
    if recipe.load_in_4bit:
        config.update({"load_in_4bit": True, "bnb_4bit_quant_type": recipe.bnb_4bit_quant_type,
                       "use_bnb_nested_quant": recipe.bnb_4bit_use_double_quant})
    config.update(_trl_trainer_fields(recipe))
    return config


def _trl_trainer_fields(recipe: Recipe) -> dict[str, Any]:
    """SFTConfig's padding_free/packing or DPOConfig's precompute_ref_log_probs, and either's activation_offloading,
    where set (issue 23); a DPO recipe's YAML is the one `trl dpo --config` reads, an SFT one `trl sft --config`'s."""
    fields: dict[str, Any] = {"activation_offloading": True} if recipe.activation_offloading else {}
    if recipe.trainer == "dpo":
        if recipe.precompute_ref_log_probs:
            fields["precompute_ref_log_probs"] = True
        return fields
    if recipe.padding_free:
        fields["padding_free"] = True
    if recipe.packing:
        fields["packing"] = True
    return fields


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
    bnb, lora = bnb_config(recipe), lora_config(recipe, task)
    imports = [auto, "TrainingArguments"] + (["BitsAndBytesConfig"] if bnb else [])
    lines = []
    if lora:
        helpers = ["LoraConfig", "get_peft_model"] + (["prepare_model_for_kbit_training"] if bnb else [])
        lines.append(f"from peft import {', '.join(helpers)}")
    if recipe.cut_cross_entropy:
        lines.append("from cut_cross_entropy.transformers import cce_patch")
        if bnb:
            lines.insert(0, "import torch")
    lines += [f"from transformers import {', '.join(imports)}", ""]
    load = f'dtype="{recipe.dtype}"' + (f', attn_implementation="{recipe.attn_implementation}"'
                                        if recipe.attn_implementation else "")
    if recipe.experts_implementation != "grouped_mm":  # transformers' default, and no argument for a dense model
        load += f', experts_implementation="{recipe.experts_implementation}"'
    if bnb:
        lines.append(f"quantization_config = BitsAndBytesConfig({_call_args(bnb)})")
        load += ", quantization_config=quantization_config"
    lines.append(f"model = {auto}.from_pretrained({model!r}, {load})")
    if recipe.cut_cross_entropy:
        lines.append("model = cce_patch(model)  # Cut Cross-Entropy: the loss without the logits")
    if bnb:
        lines.append(f"model = prepare_model_for_kbit_training(model, use_gradient_checkpointing={recipe.gradient_checkpointing})")
    if bnb and recipe.cut_cross_entropy:  # CCE's backward takes a half-precision head: as axolotl's loader turns it
        lines += ["for name, module in model.named_modules():",
                  '    embedding = any(m in name for m in ("embed_tokens", "lm_head")) and hasattr(module, "weight")',
                  '    if "norm" in name or embedding:',
                  f"        module.to(torch.{recipe.dtype})"]
    if lora:
        lines.append(f"model = get_peft_model(model, LoraConfig({_call_args(lora)}))")
    args = ",\n".join(f"    {k}={v!r}" for k, v in kwargs.items())
    if recipe.zero_stage:
        args += ',\n    deepspeed="ds_config.json",  # anatomist plan --emit deepspeed -o ds_config.json'
    lines.append(f'args = TrainingArguments(\n    output_dir="out",\n{args},\n)')
    return "\n".join(lines) + "\n"


def _call_args(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


MAIN_NODE = "MAIN_NODE_IP"
"""Where a multi-node config and launch command name the first node: the user puts its address there."""
MAIN_PORT = 29500
"""torch.distributed's default rendezvous port (torchrun's --master-port)."""


def launch_warnings(recipe: Recipe, target: str) -> list[str]:
    """What would make the emitted config run otherwise than anatomist predicts it: activation offloading, which
    only TRL's configs can say; with this machine's libraries, FSDP under an accelerate without FSDP2 (the Trainer
    and `accelerate launch` both build accelerate's plugin)."""
    warnings = []
    if recipe.activation_offloading and target != "trl":
        warnings.append("activation_offloading is TRL's (SFTConfig / DPOConfig), no TrainingArguments field: "
                        "--emit trl writes it, or run each training step under "
                        "trl.models.get_act_offloading_ctx_manager(model) as TRL's trainers do")
    if recipe.cut_cross_entropy and target != "trainer":
        warnings.append("cut_cross_entropy patches the model (cut_cross_entropy.transformers.cce_patch), no config "
                        "field: --emit trainer writes it, or call cce_patch(model) before training")
    version = installed("accelerate")
    if recipe.fsdp == "none" or target not in ("accelerate", "trainer", "trl") or release(version) >= FSDP2_ACCELERATE:
        return warnings
    return [*warnings, f"accelerate {version} here has no FSDP2 (it came in 1.6): it would run this FSDP config as "
            "FSDP1, which anatomist does not predict; train with accelerate 1.6 or later"]


def accelerate_config(recipe: Recipe, num_gpus: int = 1, *, use_cpu: bool = False, nodes: int = 1) -> dict[str, Any]:
    """An accelerate config as `accelerate config` writes it (ClusterConfig keys); `num_gpus` counts
    every node's devices (accelerate's num_processes), each node launches with its own --machine_rank."""
    # MULTI_GPU selects accelerate's torchrun launcher; with use_cpu the processes then run on
    # CPU with gloo (accelerate's MULTI_CPU is the mpirun multi-node path, one process here).
    distributed = "DEEPSPEED" if recipe.zero_stage else "FSDP" if recipe.fsdp != "none" else (
        "MULTI_GPU" if num_gpus > 1 else "NO"
    )
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed,
        "mixed_precision": recipe.mixed_precision,
        "num_machines": nodes,
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
    if nodes > 1:
        config.update(main_process_ip=MAIN_NODE, main_process_port=MAIN_PORT)
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
        # FSDP2, what anatomist traces (trace/sharded.py) and the Trainer's default; accelerate's own default is
        # still FSDP1, so the version is written. FSDP1's sharding_strategy, backward_prefetch, use_orig_params and
        # sync_module_states are obsolete there (accelerate warns): reshard_after_forward says full_shard (True)
        # or shard_grad_op (False).
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": recipe.fsdp == "full_shard",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_offload_params": recipe.offload == "cpu",
            # adapters: the base loaded on rank 0 only and broadcast (PEFT's FSDP-QLoRA config)
            "fsdp_cpu_ram_efficient_loading": recipe.peft != "none",
            # FSDP's own checkpointing is every layer's, on the device; partial or offloaded: TrainingArguments'
            "fsdp_activation_checkpointing": recipe.checkpointing == "on",
        }
    if recipe.torch_compile:
        config["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
    return config


def launch_commands(target: str, path: str | Path, num_gpus: int, nodes: int) -> list[str]:
    """The command each node runs to start the training script (train.py) with what `target` wrote to
    `path`: `accelerate launch` for an accelerate config, else torchrun; none on one node."""
    if nodes <= 1:
        return []
    per_node = num_gpus // nodes
    if target == "accelerate":
        return [f"accelerate launch --config_file {path} --machine_rank {rank} --main_process_ip {MAIN_NODE} train.py"
                for rank in range(nodes)]
    return [f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --node-rank {rank} --master-addr {MAIN_NODE} "
            f"--master-port {MAIN_PORT} train.py" for rank in range(nodes)]


def render(recipe: Recipe, target: str, num_gpus: int = 1, *, model: str = "MODEL", seq_len: int = 1024,
           nodes: int = 1) -> str:
    """The text of `target` for `recipe`."""
    if target == "trl":
        return yaml.safe_dump(trl_config(recipe, model=model, seq_len=seq_len), sort_keys=False)
    if target == "trainer":
        return json.dumps(trainer_kwargs(recipe), indent=2) + "\n"
    if target == "accelerate":
        return yaml.safe_dump(accelerate_config(recipe, num_gpus, nodes=nodes), sort_keys=True)
    if target == "deepspeed":
        return json.dumps(deepspeed_config(recipe, num_gpus), indent=2) + "\n"
    raise InputError(f"unknown --emit target {target!r}; known: {', '.join(TARGETS)}")


def write(recipe: Recipe, target: str, path: str | Path, num_gpus: int = 1, *, model: str = "MODEL",
          task: str = "sequence-classification", seq_len: int = 1024, nodes: int = 1) -> list[Path]:
    """Write `target` to `path`; for trainer, also the Python snippet next to it (.py) and, for
    LoRA/QLoRA, the LoraConfig (.lora.json) and BitsAndBytesConfig (.bnb.json) keyword arguments."""
    p = Path(path)
    if p.parent and not p.parent.exists():
        raise InputError(f"-o {str(p)!r}: folder {str(p.parent)!r} does not exist")
    p.write_text(render(recipe, target, num_gpus, model=model, seq_len=seq_len, nodes=nodes))
    written = [p]
    if target == "trainer":
        snippet = p.with_suffix(".py")
        snippet.write_text(trainer_snippet(recipe, num_gpus, model=model, task=task))
        written.append(snippet)
        for suffix, kwargs in ((".lora.json", lora_config(recipe, task)), (".bnb.json", bnb_config(recipe))):
            if kwargs is not None:
                written.append(p.with_suffix(suffix))
                written[-1].write_text(json.dumps(kwargs, indent=2) + "\n")
    return written
