"""How the libraries spell a recipe: the keyword arguments of transformers' TrainingArguments, TRL's SFTConfig and
DPOConfig (and the YAML `trl sft|dpo --config` reads), PEFT's LoraConfig and transformers' BitsAndBytesConfig.

Pure functions of a recipe that return what the library takes; the tracer builds its adapters from
`lora_config_kwargs`, `plan --emit` writes these dicts (`plan/emit.py`, which adds the accelerate and DeepSpeed
configs, the snippets and the launch commands), and the tests load each with the library itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from anatomist.axes.methods import DPO_BETA, DPO_LOSS_TYPE
from anatomist.axes.optimizers import optimizer
from anatomist.axes.shardings import trainer_fsdp_arguments
from anatomist.workload import PEFT_TASK_TYPES

if TYPE_CHECKING:
    from anatomist.recipe.fields import RecipeFields


def training_arguments_kwargs(recipe: RecipeFields) -> dict[str, Any]:
    """Keyword arguments for transformers.TrainingArguments (DeepSpeed config excluded)."""
    kwargs: dict[str, Any] = {
        "per_device_train_batch_size": recipe.per_device_train_batch_size,
        "gradient_accumulation_steps": recipe.gradient_accumulation_steps,
        "gradient_checkpointing": recipe.gradient_checkpointing,
        "fp16": recipe.fp16,
        # FP8 is accelerate's mixed precision, which the Trainer reads from the launch (ACCELERATE_MIXED_PRECISION)
        # only where neither fp16 nor bf16 is set: bf16=True would replace it (TrainingArguments.__post_init__)
        "bf16": recipe.bf16 and recipe.fp8 == "none",
        "optim": recipe.optim,
        "torch_compile": recipe.torch_compile,
        "dataloader_num_workers": recipe.dataloader_num_workers,
        "dataloader_pin_memory": recipe.dataloader_pin_memory,
        "max_grad_norm": recipe.max_grad_norm,
    }
    checkpointing = {"every_n_layers": recipe.checkpoint_every} if recipe.checkpoint_every > 1 else {}
    if recipe.checkpoint_offload:
        checkpointing["offload"] = True
    if recipe.gradient_checkpointing and checkpointing:  # activation_checkpointing_kwargs' alias (transformers 5.23)
        kwargs["gradient_checkpointing_kwargs"] = checkpointing
    if recipe.tf32:
        kwargs["tf32"] = True
    if recipe.fsdp != "none" and not recipe.split_by_transformers:  # else transformers' own FSDP at load time
        kwargs |= trainer_fsdp_arguments(recipe.fsdp, offload=recipe.offload == "cpu", adapters=recipe.peft != "none")
    if recipe.use_liger_kernel:
        kwargs["use_liger_kernel"] = True
    return kwargs | dict(optimizer(recipe.optim).trainer_kwargs)


def distributed_config_kwargs(recipe: RecipeFields, num_gpus: int) -> dict[str, Any]:
    """transformers' DistributedConfig keyword arguments of a tensor parallel recipe on `num_gpus` GPUs, as a user gives
    them to `from_pretrained(..., distributed_config=...)`: `tp_size` ranks to a group, under FSDP the groups sharded
    over the other ranks, bf16 autocast as FSDP's mixed precision (weights gathered in bf16, gradients reduced in
    fp32). transformers applies both at load time; the Trainer then trains the model as it is."""
    fsdp = num_gpus // recipe.tp_size if recipe.fsdp != "none" else max(1, recipe.ep_size // recipe.tp_size)
    experts = {"ep_size": recipe.ep_size} if recipe.ep_size > 1 else {}
    return {"tp_size": recipe.tp_size, "fsdp_size": fsdp, "fsdp_mixed_precision": recipe.bf16, **experts}


def training_arguments(recipe: RecipeFields, output_dir: str, **extra: Any) -> Any:
    """A real transformers.TrainingArguments for `recipe` (`extra`: its fields a recipe does not hold)."""
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=output_dir, **training_arguments_kwargs(recipe), **extra)


def lora_config_kwargs(recipe: RecipeFields, task_type: str | None) -> dict[str, Any]:
    """peft.LoraConfig keyword arguments of `recipe`'s adapters (`task_type`: peft's TaskType name), whatever its
    `peft` (`lora_config`: None without adapters)."""
    kwargs: dict[str, Any] = {"r": recipe.lora_r, "lora_alpha": recipe.lora_alpha, "lora_dropout": recipe.lora_dropout,
                              "bias": "none", "task_type": task_type}
    names = [n.strip() for n in (recipe.lora_target_modules or "").split(",") if n.strip()]
    if names:  # none: PEFT's default targets for the architecture
        kwargs["target_modules"] = "all-linear" if names == ["all-linear"] else names
    parameters = [n.strip() for n in (recipe.lora_target_parameters or "").split(",") if n.strip()]
    if parameters:
        kwargs["target_parameters"] = parameters
    return kwargs


def trainer_kwargs(recipe: RecipeFields, seq_len: int = 1024) -> dict[str, Any]:
    """TrainingArguments keyword arguments (everything but output_dir). For a recipe of TRL's trainers, SFTConfig's
    (DPOConfig's), a TrainingArguments with the trainer's own fields (`trl_args`), and the model's load arguments in
    its model_init_kwargs: the trainer loads the model it is given by name (trl/scripts/dpo.py does so)."""
    if recipe.trainer == "trainer":
        return training_arguments_kwargs(recipe)
    return trl_args(recipe, seq_len) | {"model_init_kwargs": model_init_kwargs(recipe)}


def trl_args(recipe: RecipeFields, seq_len: int) -> dict[str, Any]:
    """SFTConfig (DPOConfig) keyword arguments: TrainingArguments', the longest sequence kept, and the trainer's own
    fields (`_trl_trainer_fields`)."""
    # padding-free without packing: TRL refuses a max_length (it would not be enforced)
    max_length = None if recipe.padding_free and not recipe.packing else seq_len
    return {"max_length": max_length, **training_arguments_kwargs(recipe), **_trl_trainer_fields(recipe)}


def model_init_kwargs(recipe: RecipeFields) -> dict[str, Any]:
    """What TRL's trainers pass to from_pretrained (SFTConfig/DPOConfig.model_init_kwargs): the load dtype, the
    attention kernel where the recipe names one, and, where not transformers' default, the experts' kernel. TRL
    dequantizes 4-bit weights to its `dtype` (get_quantization_config), so a 4-bit base is loaded in its compute dtype;
    `prepare_model_for_kbit_training` casts the rest to fp32 anyway."""
    kwargs: dict[str, Any] = {"dtype": recipe.bnb_4bit_compute_dtype if recipe.load_in_4bit else recipe.dtype}
    if recipe.attn_implementation:  # unset: transformers' own pick for the model
        kwargs["attn_implementation"] = recipe.attn_implementation
    if recipe.experts_implementation != "grouped_mm":  # transformers' default, and no argument for a dense model
        kwargs["experts_implementation"] = recipe.experts_implementation
    return kwargs


def lora_config(recipe: RecipeFields, task: str = "causal-lm") -> dict[str, Any] | None:
    """peft.LoraConfig keyword arguments of a LoRA/QLoRA recipe (None for full fine-tuning)."""
    return lora_config_kwargs(recipe, PEFT_TASK_TYPES.get(task)) if recipe.peft != "none" else None


def bnb_config(recipe: RecipeFields) -> dict[str, Any] | None:
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


def trl_config(recipe: RecipeFields, *, model: str = "MODEL", seq_len: int = 1024,
               deepspeed: str = "ds_config.json") -> dict[str, Any]:
    """The YAML `trl sft --config` reads (`trl dpo --config` for a DPO recipe): SFTConfig (DPOConfig), ModelConfig
    and ScriptArguments fields (TRL's field names); under ZeRO its `deepspeed` names the ds_config `deepspeed`."""
    load = model_init_kwargs(recipe)
    config: dict[str, Any] = {
        "model_name_or_path": model,
        "dtype": load.pop("dtype"),
        **({"attn_implementation": attention} if (attention := load.pop("attn_implementation", None)) else {}),
        "dataset_name": "DATASET",
        "output_dir": "out",
        **trl_args(recipe, seq_len),
    }
    if load:  # the experts' kernel: no ModelConfig field
        config["model_init_kwargs"] = load
    if recipe.zero_stage:
        config["deepspeed"] = deepspeed
    if recipe.peft != "none":
        config.update({"use_peft": True, "lora_r": recipe.lora_r, "lora_alpha": recipe.lora_alpha,
                       "lora_dropout": recipe.lora_dropout})
        lora = lora_config_kwargs(recipe, None)
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
    return config


def _trl_trainer_fields(recipe: RecipeFields) -> dict[str, Any]:
    """SFTConfig's padding_free/packing where set; DPOConfig's loss as anatomist computes it (beta, loss_type) and
    how the reference model is held (precompute_ref_log_probs), always written: a field only DPOConfig has is what
    tells `--recipe` that a file is `trl dpo`'s; either's activation_offloading where set."""
    fields: dict[str, Any] = {"activation_offloading": True} if recipe.activation_offloading else {}
    if recipe.trainer == "dpo":
        return fields | {"beta": DPO_BETA, "loss_type": [DPO_LOSS_TYPE],
                         "precompute_ref_log_probs": recipe.precompute_ref_log_probs}
    if recipe.padding_free:
        fields["padding_free"] = True
    if recipe.packing:
        fields["packing"] = True
    return fields
