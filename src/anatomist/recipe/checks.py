"""Every check of a recipe: against itself, against the model, against the GPU.

The library and the CLI call the same functions, so a recipe is refused with the same words wherever it enters:
- `check_fields`: the values alone and their combinations (`Recipe.__post_init__`: no Recipe exists that fails it);
- `check_model`: what the model cannot take (`Recipe.resolved`);
- `check_gpu`: what the GPU cannot run (`estimate()` and `anatomist estimate`; `check_cce_gpu` for `plan`'s fixed
  values), and `emulated_bf16_note`, bfloat16 weights on a GPU without bf16: they run, slowly, and are said
  (the CLI refuses a --dtype bfloat16 given there, the library predicts it).

Each refusal is an InputError naming the field and the value, and what to do instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from anatomist.axes.kernels import ATTN_IMPLEMENTATIONS, EXPERTS_IMPLEMENTATIONS
from anatomist.axes.liger import check_liger
from anatomist.axes.methods import PEFT_METHODS, TRAINERS
from anatomist.axes.optimizers import optimizer, runs_with
from anatomist.axes.precisions import FP8_RECIPES, LOAD_DTYPES
from anatomist.axes.quantization import QUANT_TYPES
from anatomist.axes.shardings import DEEPSPEED_SETTINGS, FSDP_MODES, OFFLOADS
from anatomist.deepspeed_bounds import deepspeed_bounds
from anatomist.errors import InputError
from anatomist.recipe.parallel_checks import (
    check_context_parallel,
    check_context_parallel_model,
    check_expert_parallel,
    check_expert_parallel_model,
    check_hybrid_shard,
    check_sequence_parallel,
    check_sequence_parallel_model,
    check_tensor_parallel,
    check_tensor_parallel_model,
)

if TYPE_CHECKING:
    from anatomist.hardware import GPU
    from anatomist.recipe.fields import RecipeFields
    from anatomist.workload import Workload

CCE_NEEDS_HALF_WEIGHTS = ("cut_cross_entropy needs the weights in bfloat16 or float16 (--dtype bfloat16): Cut "
                          "Cross-Entropy's backward takes half-precision hidden states and head weights")
"""Why Cut Cross-Entropy refuses float32 weights (cce_backward_kernel asserts bf16/fp16 hidden states and head)."""


def check_fields(r: RecipeFields) -> None:
    """Refuse a value out of its range or vocabulary, or a combination the libraries refuse or anatomist does not
    model; the first found is said.

    Raises:
        InputError: naming the field(s) and the value.
    """
    check_batch_and_precision(r)
    check_checkpointing(r)
    check_optimizer_and_kernels(r)
    check_data_loading(r)
    check_sharding(r)
    check_tensor_parallel(r)
    check_expert_parallel(r)
    check_context_parallel(r)
    check_sequence_parallel(r)
    check_hybrid_shard(r)
    check_adapters(r)
    check_clipping(r)
    check_deepspeed_buffers(r)
    check_llm_fields(r)
    check_deepspeed_precision(r)


def check_batch_and_precision(r: RecipeFields) -> None:
    """The batch sizes, and the weights' dtype with the autocast."""
    if r.per_device_train_batch_size <= 0:
        raise InputError(f"per_device_train_batch_size must be greater than 0, got {r.per_device_train_batch_size}")
    if r.gradient_accumulation_steps <= 0:
        raise InputError(f"gradient_accumulation_steps must be greater than 0, got {r.gradient_accumulation_steps}")
    if r.fp16 and r.bf16:
        raise InputError("fp16 and bf16 are mutually exclusive: choose one mixed precision")
    if r.dtype not in LOAD_DTYPES:
        raise InputError(f"unknown dtype {r.dtype!r}; known: {', '.join(LOAD_DTYPES)}")
    check_fp8(r)
    check_fp8_all_gather(r)
    if r.dtype == "float16" and r.fp16 and r.peft == "none":  # PEFT's adapters are fp32
        raise InputError(
            "fp16 (GradScaler) cannot train float16-loaded weights: PyTorch refuses to unscale fp16 "
            "gradients; load in float32 for fp16 mixed precision (--dtype float32 --fp16), or use "
            "--dtype bfloat16 [--bf16]"
        )


def check_fp8(r: RecipeFields) -> None:
    """FP8 training as accelerate runs it with torchao: under bf16 autocast, on linear layers that are nn.Linear."""
    if r.fp8 not in FP8_RECIPES:
        raise InputError(f"unknown fp8 recipe {r.fp8!r}; known: {', '.join(FP8_RECIPES)}")
    if r.fp8 == "none":
        return
    if not r.bf16:
        raise InputError(f"fp8={r.fp8} runs under bf16 autocast (accelerate's mixed_precision='fp8' autocasts to "
                         "bfloat16): add --bf16" + (" and drop --fp16" if r.fp16 else ""))
    if r.quantized:
        raise InputError("fp8 with a 4-bit or 8-bit base is not modelled: bitsandbytes' layers are not nn.Linear, "
                         "so torchao converts only the adapters")
    if r.zero_stage:
        raise InputError("fp8 with DeepSpeed ZeRO is not modelled (accelerate runs torchao's float8 under DDP and "
                         "FSDP): use --fsdp, or drop --fp8")


def check_fp8_all_gather(r: RecipeFields) -> None:
    """torchao gathers float8 weights under tensorwise scaling only (Float8LinearConfig refuses it otherwise)."""
    if r.fp8_all_gather and r.fp8 != "tensorwise":
        raise InputError(f"fp8_all_gather needs --fp8 tensorwise (torchao all-gathers float8 weights only with "
                         f"tensorwise scales); fp8 is {r.fp8}")


def check_checkpointing(r: RecipeFields) -> None:
    """Gradient checkpointing's settings, and the offloading and compilation modelled with it."""
    if r.checkpoint_every < 1:
        raise InputError(f"checkpoint_every must be at least 1, got {r.checkpoint_every}")
    if (r.checkpoint_every > 1 or r.checkpoint_offload) and not r.gradient_checkpointing:
        what = f"checkpoint_every={r.checkpoint_every}" if r.checkpoint_every > 1 else "checkpoint_offload"
        raise InputError(f"{what} is a setting of gradient checkpointing: it needs gradient_checkpointing=True")
    if r.activation_offloading and r.fsdp != "none":
        raise InputError("activation_offloading under FSDP is not modelled yet (TRL offloads each rank's saved "
                         "activations, DTensor shards aside): use DeepSpeed ZeRO (zero_stage), or leave it off")
    if r.activation_offloading and r.torch_compile:
        raise InputError("activation_offloading with torch_compile is not modelled yet (the compiled blocks' "
                         "backward reads saved tensors in the layout they had, which TRL's copies do not keep)")
    if r.use_liger_kernel and r.torch_compile and not r.gradient_checkpointing:
        raise InputError("use_liger_kernel with torch_compile is not modelled yet (Liger's kernels stand in as "
                         "custom ops, which the compiled blocks' trace cannot run): leave one off, or turn "
                         "gradient_checkpointing on (its blocks are predicted as eager code)")


def check_optimizer_and_kernels(r: RecipeFields) -> None:
    """The optimizer, attention and experts kernels: names anatomist models."""
    optimizer(r.optim)  # raises for one anatomist does not model
    if r.attn_implementation is not None and r.attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise InputError(f"unknown attn_implementation {r.attn_implementation!r}; "
                         f"known: {', '.join(ATTN_IMPLEMENTATIONS)}")
    if r.experts_implementation not in EXPERTS_IMPLEMENTATIONS:
        raise InputError(f"unknown experts_implementation {r.experts_implementation!r}; "
                         f"known: {', '.join(EXPERTS_IMPLEMENTATIONS)}")


def check_data_loading(r: RecipeFields) -> None:
    if r.dataloader_num_workers < 0:
        raise InputError(f"dataloader_num_workers must be >= 0, got {r.dataloader_num_workers}")


def check_sharding(r: RecipeFields) -> None:
    """DeepSpeed ZeRO or FSDP (one of them), where it offloads, and an optimizer that runs under it."""
    if r.zero_stage not in (0, 1, 2, 3):
        raise InputError(f"zero_stage must be 0, 1, 2 or 3, got {r.zero_stage}")
    if r.offload not in OFFLOADS:
        raise InputError(f"unknown offload {r.offload!r}; known: {', '.join(OFFLOADS)}")
    if r.offload != "none" and r.zero_stage == 0 and r.fsdp == "none":
        raise InputError(f"offload={r.offload} needs DeepSpeed ZeRO (zero_stage 1, 2 or 3) or FSDP (fsdp)")
    if r.offload == "nvme" and r.zero_stage != 3:
        raise InputError("offload=nvme needs zero_stage=3")
    if r.fsdp not in FSDP_MODES:
        raise InputError(f"unknown fsdp {r.fsdp!r}; known: {', '.join(FSDP_MODES)}")
    if r.fsdp != "none" and r.zero_stage != 0:
        raise InputError("fsdp and DeepSpeed ZeRO (zero_stage) are exclusive: choose one sharding engine")
    if not runs_with(r.optim, r.fsdp):
        raise InputError(f"optim={r.optim} does not run under FSDP2 (its state is plain tensors beside the "
                         "sharded DTensor gradients, which PyTorch refuses to mix): choose another optimizer, or "
                         "DeepSpeed ZeRO (zero_stage)")


def check_adapters(r: RecipeFields) -> None:
    """PEFT's adapters and the bitsandbytes base they train on."""
    if r.peft not in PEFT_METHODS:
        raise InputError(f"unknown peft {r.peft!r}; known: {', '.join(PEFT_METHODS)}")
    if r.peft == "qlora" and not r.load_in_4bit:
        raise InputError("peft=qlora is LoRA on a 4-bit base: set load_in_4bit=True, or make the recipe with "
                         "Recipe.with_presets(peft='qlora', ...) for QLoRA's usual settings")
    if r.lora_r <= 0:
        raise InputError(f"lora_r must be greater than 0, got {r.lora_r}")
    if not 0 <= r.lora_dropout < 1:
        raise InputError(f"lora_dropout must be in [0, 1), got {r.lora_dropout}")
    if r.load_in_4bit and r.load_in_8bit:
        raise InputError("load_in_4bit and load_in_8bit are exclusive: choose one quantization")
    if (r.load_in_4bit or r.load_in_8bit) and r.peft == "none":
        raise InputError("a quantized base cannot be trained itself: add adapters with --peft lora (or use --peft qlora)")
    if r.bnb_4bit_quant_type not in QUANT_TYPES:
        raise InputError(f"unknown bnb_4bit_quant_type {r.bnb_4bit_quant_type!r}; known: {', '.join(QUANT_TYPES)}")


def check_clipping(r: RecipeFields) -> None:
    if r.max_grad_norm < 0:
        raise InputError(f"max_grad_norm must be >= 0, got {r.max_grad_norm}")


def check_deepspeed_buffers(r: RecipeFields) -> None:
    """DeepSpeed's buffer sizes within DeepSpeed's own bounds (deepspeed_bounds.py): what it refuses."""
    for name in DEEPSPEED_SETTINGS:
        value = getattr(r, name)
        refusal = None if value is None else deepspeed_bounds().refusal("zero_optimization", name, value)
        if refusal:
            raise InputError(f"{name} {refusal}")


def check_llm_fields(r: RecipeFields) -> None:
    """The trainer, padding-free and packing fields: combinations the tools themselves refuse."""
    if r.trainer not in TRAINERS:
        raise InputError(f"unknown trainer {r.trainer!r}; known: {', '.join(TRAINERS)}")
    if r.packing and not r.padding_free:
        raise InputError("packing=True packs rows with TRL's best-fit decreasing strategy, which is padding-free: "
                         "set padding_free=True too, or make the recipe with Recipe.with_presets(packing=True)")
    if (r.padding_free or r.packing) and r.attn_implementation != "flash_attention_2":
        what = "packing" if r.packing else "padding_free"
        raise InputError(f"{what}: sequences flattened into one row need an attention that takes packed "
                         f"position_ids (TRL: FlashAttention 2 or 3): use --attn-implementation flash_attention_2, "
                         f"not {r.attn_implementation or 'the model default (sdpa or eager)'}")
    if r.trainer == "dpo" and r.padding_free:
        raise InputError("DPOTrainer (trl 1.16) has no padding-free training: its padding_free falls back to "
                         "padding; leave padding_free and packing off with --trainer dpo")
    if r.cut_cross_entropy and r.use_liger_kernel:
        raise InputError("cut_cross_entropy and use_liger_kernel both replace the LM head's loss (Liger's with its "
                         "fused linear cross-entropy): choose one")
    if r.cut_cross_entropy and r.dtype == "float32":
        raise InputError(CCE_NEEDS_HALF_WEIGHTS)
    if r.cut_cross_entropy and r.trainer != "trainer":
        raise InputError(f"cut_cross_entropy is modelled under transformers' Trainer, whose loss is the model's "
                         f"patched forward; TRL's {r.trainer.upper()}Trainer scores with its own fused LM head")
    if r.precompute_ref_log_probs and r.trainer != "dpo":
        raise InputError("precompute_ref_log_probs is DPO's reference model: it needs --trainer dpo")


def check_deepspeed_precision(r: RecipeFields) -> None:
    """DeepSpeed's bf16 master weights and optimizer states, where DeepSpeed 0.19 takes them (`runtime/config.py`
    `_do_error_check`, `runtime/base_optimizer.py` `_configure_master_weights`)."""
    for name in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        if getattr(r, name) and not (r.zero_stage and r.bf16):
            raise InputError(f"{name} is a setting of DeepSpeed ZeRO's bf16 mode: it needs zero_stage 1, 2 or 3 and "
                             "bf16=True (DeepSpeed's bf16.enabled)")
    if r.bf16_optimizer_states and not r.bf16_master_weights_and_grads:
        raise InputError("bf16_optimizer_states needs bf16_master_weights_and_grads=True too (DeepSpeed refuses "
                         "bf16 optimizer states over fp32 master weights)")
    if r.bf16_master_weights_and_grads and not r.bf16_optimizer_states and r.offload == "none":
        raise InputError("bf16_master_weights_and_grads with fp32 optimizer states runs only with ZeRO-Offload "
                         "(DeepSpeed: offload cpu): add --offload cpu, or --bf16-optimizer-states")


def check_model(r: RecipeFields, workload: Workload) -> None:
    """What `workload`'s model cannot take: Liger Kernel where it does not patch the model, Cut Cross-Entropy
    and TRL's trainers on anything but a causal LM, Cut Cross-Entropy on weights that load in float32.

    Raises:
        InputError: naming the model and what would work.
    """
    if r.use_liger_kernel:
        check_liger(workload.model_type, workload.task, workload.name)
    if r.cut_cross_entropy and workload.task != "causal-lm":
        raise InputError(f"{workload.name}: Cut Cross-Entropy replaces a causal LM's loss; this is a "
                         f"{workload.task} model")
    if r.trainer != "trainer" and workload.task != "causal-lm":
        raise InputError(f"{workload.name}: TRL's {r.trainer.upper()}Trainer trains causal language models; this "
                         f"is a {workload.task} model (--task causal-lm, or --trainer trainer)")
    if r.cut_cross_entropy and workload.weights_dtype(r.dtype) == "float32":
        raise InputError(f"{workload.name} loads in float32 by default: {CCE_NEEDS_HALF_WEIGHTS}")
    if r.tp_size > 1:
        check_tensor_parallel_model(r.tp_size, workload)
    if r.ep_size > 1:
        check_expert_parallel_model(r.ep_size, workload)
    if r.cp_size > 1:
        check_context_parallel_model(r.cp_size, workload)
    if r.sp_size > 1:
        check_sequence_parallel_model(r.sp_size, workload)


def check_gpu(r: RecipeFields, gpu: GPU, *, dtype_given: bool = True) -> None:
    """What `gpu` cannot run: bf16 autocast, TF32, bfloat16 weights and Cut Cross-Entropy need Ampere or newer, FP8
    Ada or newer.

    Args:
        dtype_given: whether a bfloat16 `r.dtype` is a choice the user can change (the CLI's --dtype: refused, saying
            what to use instead), rather than the weights as they are (a checkpoint's own dtype, a live run's model),
            which run emulated on an older GPU (`emulated_bf16_note`): the library's `estimate()` predicts them.

    Raises:
        InputError: naming the setting, the GPU, and what to use instead.
    """
    if r.bf16 and not gpu.bf16:
        raise InputError(f"bf16 needs an Ampere or newer GPU; {gpu.name} has none (use --fp16)")
    if r.tf32 and not gpu.tf32:
        raise InputError(f"tf32 needs an Ampere or newer GPU; {gpu.name} has none")
    if dtype_given and r.dtype == "bfloat16" and not gpu.bf16:
        raise InputError(f"--dtype bfloat16 needs an Ampere or newer GPU; {gpu.name} has none (use --dtype float16 or float32)")
    if r.fp8 != "none" and not gpu.fp8:
        raise InputError(f"fp8 needs FP8 tensor cores (Ada, Hopper or Blackwell: compute capability 8.9+); {gpu.name} "
                         f"is {gpu.compute_capability}")
    check_cce_gpu(r.cut_cross_entropy, gpu)


def check_cce_gpu(cut_cross_entropy: bool, gpu: GPU) -> None:
    """Cut Cross-Entropy refuses a GPU without bfloat16 (cce_linear_cross_entropy: torch.cuda.is_bf16_supported()).

    Raises:
        InputError: `cut_cross_entropy` on such a GPU.
    """
    if cut_cross_entropy and not gpu.bf16:
        raise InputError(f"Cut Cross-Entropy needs an Ampere or newer GPU; {gpu.name} is older")


def emulated_bf16_note(r: RecipeFields, gpu: GPU, model: str) -> str | None:
    """What to say where `model` loads in bfloat16 (its config's dtype, `r` resolved) on a GPU without bf16."""
    if r.dtype == "bfloat16" and not gpu.bf16:
        return (f"{model} loads in bfloat16 (its config's dtype) but {gpu.name} has no bf16 tensor cores: "
                "it runs emulated and slowly there; --dtype float16 or float32 is the usual choice")
    return None
