"""Write a recipe as the real libraries take it: TrainingArguments, accelerate config, DeepSpeed,
TRL, and for LoRA/QLoRA PEFT's LoraConfig and transformers' BitsAndBytesConfig (the keyword arguments
of TrainingArguments, TRL, PEFT and bitsandbytes are spelled in `recipe/spellings.py`; this module
adds the accelerate and DeepSpeed configs, the snippets, the launch commands and the files).

Each output is loaded by the library itself in the tests: `TrainingArguments(**kwargs)` (`SFTConfig` /
`DPOConfig` for a recipe of TRL's trainers), accelerate's `load_config_from_file`,
`deepspeed.runtime.config.DeepSpeedConfig`, `LoraConfig(**kwargs)`, `BitsAndBytesConfig(**kwargs)`, and the YAML
`trl sft --config` (`trl dpo --config`) reads with TRL's own parser; and each is read back by `--recipe` as the
recipe it was written from (tests/test_emit_round_trip.py).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Literal

import yaml

from anatomist.axes.shardings import DEEPSPEED_SETTINGS
from anatomist.errors import InputError
from anatomist.estimate.sharding import overlap_comm
from anatomist.recipe import Recipe
from anatomist.recipe.spellings import bnb_config, distributed_config_kwargs, lora_config, trainer_kwargs, trl_config

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
        "bf16": {"enabled": recipe.bf16, **{name: True for name in ("bf16_master_weights_and_grads",
                                                                     "bf16_optimizer_states") if getattr(recipe, name)}},
    }
    return config


def trl_script(recipe: Recipe) -> str:
    """The `trl` command that runs the recipe: dpo for DPOTrainer, else sft (SFTTrainer)."""
    return "dpo" if recipe.trainer == "dpo" else "sft"


def reference_model(recipe: Recipe) -> str:
    """How DPOTrainer holds the reference model of a DPO recipe, in words (trace/step/trainers.py)."""
    if recipe.precompute_ref_log_probs:
        return "none during training: its log-probabilities are computed before it (precompute_ref_log_probs)"
    if recipe.peft != "none":
        return "the base with the adapters disabled (no second copy)"
    return "a frozen second copy of the weights, which DPOTrainer loads from model_name_or_path"


def trl_header(recipe: Recipe, name: str = "FILE", prompt_len: int = 0) -> str:
    """The comment lines atop the TRL YAML: the command that runs it and, for DPO, what no DPOConfig field says."""
    lines = [f"# trl {trl_script(recipe)} --config {name}  (written by anatomist plan)"]
    if recipe.trainer == "dpo":
        lines.append(f"# the reference model: {reference_model(recipe)}")
        if prompt_len:  # trl 1.0 removed max_prompt_length: max_length truncates prompt and completion together
            lines.append(f"# prompts of {prompt_len} tokens, not scored (no DPOConfig field says it): anatomist "
                         f"estimate --recipe {name} --prompt-len {prompt_len}")
    return "\n".join(lines) + "\n"


AUTO_CLASSES = {
    "sequence-classification": "AutoModelForSequenceClassification", "causal-lm": "AutoModelForCausalLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM", "masked-lm": "AutoModelForMaskedLM",
}


def trainer_snippet(recipe: Recipe, num_gpus: int = 1, *, model: str = "MODEL",
                    task: str = "sequence-classification", seq_len: int = 1024, deepspeed: str | None = None) -> str:
    """Python for the model and TrainingArguments: the load dtype and the attention kernel are
    `from_pretrained` arguments, the rest TrainingArguments'; for TRL's trainers, `trl_snippet`. `deepspeed`: the
    ds_config written beside it (None: the name `plan --emit deepspeed` is told to write)."""
    if recipe.trainer != "trainer":
        return trl_snippet(recipe, model=model, task=task, seq_len=seq_len, deepspeed=deepspeed)
    kwargs = trainer_kwargs(recipe)
    auto = AUTO_CLASSES[task]
    bnb, lora = bnb_config(recipe), lora_config(recipe, task)
    imports = ([auto, "TrainingArguments"] + (["BitsAndBytesConfig"] if bnb else [])
               + (["DistributedConfig"] if recipe.split_by_transformers else []))
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
    if recipe.split_by_transformers:  # split (and under FSDP sharded) by transformers as it loads: the Trainer keeps it so
        lines.append(f"distributed_config = DistributedConfig({_call_args(distributed_config_kwargs(recipe, num_gpus))})")
        load += ", distributed_config=distributed_config"
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
    args += _deepspeed_argument(recipe, deepspeed)
    if recipe.uses_parallelism_config:
        lines.insert(0, "from accelerate import ParallelismConfig")
        config = _call_args(parallelism_sizes(recipe, num_gpus))
        if recipe.sp_size > 1:
            lines.insert(1, "from accelerate.utils import DeepSpeedSequenceParallelConfig")
            config += f", sp_handler=DeepSpeedSequenceParallelConfig({_call_args(SP_HANDLER)})"
        args += f",\n    parallelism_config=ParallelismConfig({config})"
    lines.append(f'args = TrainingArguments(\n    output_dir="out",\n{args},\n)')
    return "\n".join(lines) + "\n"


def trl_snippet(recipe: Recipe, *, model: str = "MODEL", task: str = "causal-lm", seq_len: int = 1024,
                deepspeed: str | None = None) -> str:
    """Python that runs a recipe of TRL's trainers as trl/scripts/sft.py (dpo.py) does: the trainer loads the
    model by name with SFTConfig's (DPOConfig's) model_init_kwargs, quantizes it (quantization_config) and adds the
    adapters (peft_config); DPOTrainer makes the reference model itself (`reference_model`)."""
    name = trl_script(recipe).upper()
    bnb, lora = bnb_config(recipe), lora_config(recipe, task)
    lines = ["from datasets import load_dataset"]
    if lora:
        lines.append("from peft import LoraConfig")
    if bnb:
        lines.append("from transformers import BitsAndBytesConfig")
    lines += [f"from trl import {name}Config, {name}Trainer", ""]
    args = ",\n".join(f"    {k}={v!r}" for k, v in trainer_kwargs(recipe, seq_len).items())
    args += _deepspeed_argument(recipe, deepspeed)
    lines.append(f'args = {name}Config(\n    output_dir="out",\n{args},\n)')
    if recipe.trainer == "dpo":
        lines.append(f"# the reference model: {reference_model(recipe)}")
    trainer = [f"model={model!r}", "args=args", 'train_dataset=load_dataset("DATASET", split="train")']
    if bnb:
        trainer.append(f"quantization_config=BitsAndBytesConfig({_call_args(bnb)})")
    if lora:
        trainer.append(f"peft_config=LoraConfig({_call_args(lora)})")
    lines += [f"trainer = {name}Trainer(\n    " + ",\n    ".join(trainer) + ",\n)", "trainer.train()"]
    return "\n".join(lines) + "\n"


def _deepspeed_argument(recipe: Recipe, deepspeed: str | None) -> str:
    """The snippet's `deepspeed=` line under ZeRO: the ds_config written beside it, else the one to write."""
    if not recipe.zero_stage:
        return ""
    if deepspeed is None:
        return ',\n    deepspeed="ds_config.json",  # anatomist plan --emit deepspeed -o ds_config.json'
    return f",\n    deepspeed={deepspeed!r}"


def _call_args(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


MAIN_NODE = "MAIN_NODE_IP"
"""Where a multi-node config and launch command name the first node: the user puts its address there."""
MAIN_PORT = 29500
"""torch.distributed's default rendezvous port (torchrun's --master-port)."""


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
        "mixed_precision": "fp8" if recipe.fp8 != "none" else recipe.mixed_precision,
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
    if recipe.fp8 != "none":
        config["fp8_config"] = _fp8_config(recipe)
    if recipe.zero_stage:
        config["deepspeed_config"] = _deepspeed_plugin(recipe)
    if recipe.fsdp != "none":
        # FSDP2, what anatomist traces (trace/step/fsdp.py) and the Trainer's default; accelerate's own default is
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
            "fsdp_activation_checkpointing": recipe.checkpoints_every_layer,
        }
    if recipe.uses_parallelism_config:  # HSDP, context parallel (a non-empty section turns ParallelismConfig on)
        handler = SP_HANDLER if recipe.sp_size > 1 else {}
        config["parallelism_config"] = {f"parallelism_config_{name}": value
                                        for name, value in {**parallelism_sizes(recipe, num_gpus), **handler}.items()}
    if recipe.torch_compile:
        config["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
    return config


def _deepspeed_plugin(recipe: Recipe) -> dict[str, Any]:
    """The deepspeed_config section of an accelerate config (accelerate's DeepSpeedPlugin keys)."""
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
    return ds


def parallelism_sizes(recipe: Recipe, num_gpus: int) -> dict[str, int | str]:
    """accelerate's ParallelismConfig of an HSDP or context parallel recipe: its replicas, each a shard group of
    num_gpus / replicas consecutive ranks (a node's, as the plan searches it), of which context parallel takes cp_size
    (FSDP shards over dp_shard x cp). Of DeepSpeed's sequence parallel (transformers' deepspeed_alst.md): groups of
    sp_size, the data parallel ranks as replicas (ZeRO partitions over every GPU all the same)."""
    if recipe.sp_size > 1:
        return {"dp_replicate_size": num_gpus // recipe.sp_size, "dp_shard_size": 1, "tp_size": 1,
                "sp_size": recipe.sp_size, "sp_backend": "deepspeed"}
    replicas, cp = recipe.dp_replicate_size, recipe.cp_size
    return {"dp_replicate_size": replicas, "dp_shard_size": num_gpus // replicas // cp, "tp_size": 1, "cp_size": cp}


SP_HANDLER: dict[str, Any] = {"sp_seq_length_is_variable": True, "sp_attn_implementation": "sdpa"}
"""accelerate's DeepSpeedSequenceParallelConfig of a sequence parallel recipe: any length (the Trainer's batches vary),
SDPA (what is traced; accelerate leaves it unset, and DeepSpeed then refuses to start)."""


def _fp8_config(recipe: Recipe) -> dict[str, Any]:
    """torchao's float8 layers (AORecipeKwargs' default recipe: tensorwise), and under FSDP whether it gathers their
    weights in float8 (AORecipeKwargs reads the key; its default is true)."""
    config: dict[str, Any] = {"backend": "AO"}
    if recipe.fsdp != "none" and recipe.fp8 == "tensorwise":
        config["enable_fsdp_float8_all_gather"] = recipe.fp8_all_gather is not False
    return config


def launch_commands(recipe: Recipe, target: str, path: str | Path, num_gpus: int, nodes: int) -> list[str]:
    """The command each node runs with what `target` wrote to `path`: `trl sft|dpo --config` for TRL's YAML (on
    one node too; from its folder, where its ds_config is named), `accelerate launch` for an accelerate config,
    else torchrun with the training script (train.py); none for those on one node."""
    p = Path(path)
    if target == "trl":
        folder = f"cd {shlex.quote(str(p.parent))} && " if str(p.parent) != "." else ""
        command = f"{folder}trl {trl_script(recipe)} --config {shlex.quote(p.name)}"
        if nodes <= 1:  # the rest goes to accelerate launch (trl/cli/commands/training.py)
            return [command + (f" --num_processes {num_gpus}" if num_gpus > 1 else "")]
        return [f"{command} --num_processes {num_gpus} --num_machines {nodes} --machine_rank {rank} "
                f"--main_process_ip {MAIN_NODE} --main_process_port {MAIN_PORT}" for rank in range(nodes)]
    if nodes <= 1:
        return []
    per_node = num_gpus // nodes
    if target == "accelerate":
        return [f"accelerate launch --config_file {path} --machine_rank {rank} --main_process_ip {MAIN_NODE} train.py"
                for rank in range(nodes)]
    return [f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --node-rank {rank} --master-addr {MAIN_NODE} "
            f"--master-port {MAIN_PORT} train.py" for rank in range(nodes)]


def render(recipe: Recipe, target: str, num_gpus: int = 1, *, model: str = "MODEL", seq_len: int = 1024,
           nodes: int = 1, prompt_len: int = 0, deepspeed: str = "ds_config.json", name: str = "FILE") -> str:
    """The text of `target` for `recipe`; `deepspeed`: the ds_config a ZeRO recipe's trainer or TRL file names,
    `name`: the TRL file's own name, for the command atop it; `prompt_len`: DPO's prompt tokens, said there."""
    if recipe.split_by_transformers and target != "trainer":
        split = "tensor parallel" if recipe.tp_size > 1 else "expert parallel"
        raise InputError(f"--emit {target}: {split} is set where transformers loads the model "
                         "(from_pretrained(distributed_config=...)), which only --emit trainer writes")
    if target == "trl":
        config = trl_config(recipe, model=model, seq_len=seq_len, deepspeed=deepspeed)
        return trl_header(recipe, name, prompt_len) + yaml.safe_dump(config, sort_keys=False)
    if target == "trainer":
        kwargs = trainer_kwargs(recipe, seq_len) | ({"deepspeed": deepspeed} if recipe.zero_stage else {})
        return json.dumps(kwargs, indent=2) + "\n"
    if target == "accelerate":
        return yaml.safe_dump(accelerate_config(recipe, num_gpus, nodes=nodes), sort_keys=True)
    if target == "deepspeed":
        return json.dumps(deepspeed_config(recipe, num_gpus), indent=2) + "\n"
    raise InputError(f"unknown --emit target {target!r}; known: {', '.join(TARGETS)}")


def write(recipe: Recipe, target: str, path: str | Path, num_gpus: int = 1, *, model: str = "MODEL",
          task: str = "sequence-classification", seq_len: int = 1024, nodes: int = 1, prompt_len: int = 0) -> list[Path]:
    """Write `target` to `path`; for trainer, also the Python snippet next to it (.py) and, for
    LoRA/QLoRA, the LoraConfig (.lora.json) and BitsAndBytesConfig (.bnb.json) keyword arguments; for trainer and
    trl under ZeRO, the ds_config it names (.ds_config.json), so that the files run, and read back, as they are."""
    p = Path(path)
    if p.parent and not p.parent.exists():
        raise InputError(f"-o {str(p)!r}: folder {str(p.parent)!r} does not exist")
    ds = p.with_name(f"{p.stem}.ds_config.json") if recipe.zero_stage and target in ("trainer", "trl") else None
    reference = ds.name if ds else "ds_config.json"  # beside the file: run from its folder (launch_commands)
    p.write_text(render(recipe, target, num_gpus, model=model, seq_len=seq_len, nodes=nodes, prompt_len=prompt_len,
                        deepspeed=reference, name=p.name))
    written = [p]
    if ds is not None:
        ds.write_text(render(recipe, "deepspeed", num_gpus))
        written.append(ds)
    if target == "trainer":
        snippet = p.with_suffix(".py")
        snippet.write_text(trainer_snippet(recipe, num_gpus, model=model, task=task, seq_len=seq_len,
                                           deepspeed=reference if ds else None))
        written.append(snippet)
        for suffix, kwargs in ((".lora.json", lora_config(recipe, task)), (".bnb.json", bnb_config(recipe))):
            if kwargs is not None:
                written.append(p.with_suffix(suffix))
                written[-1].write_text(json.dumps(kwargs, indent=2) + "\n")
    return written
