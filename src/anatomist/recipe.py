"""Recipe: the training knobs of the seeds' methods table, named as in TrainingArguments.

The defaults are today's: every field that TrainingArguments has takes the installed
transformers' own default (`trainer_defaults`: read from the dataclass once per transformers
version, not copied: e.g. `optim` is `adamw_torch_fused` with torch >= 2.8), and `dtype` is
`from_pretrained`'s default, "auto" (the checkpoint's dtype).

Two steps turn what a user gives into what the estimator reads, both at the entry points (the
CLI, a recipe file, `estimate()`, `plan()`), never below them:
- `Recipe.with_presets(**given)` (and `from_dict`): the presets the given values imply, filled in
  where the user is silent (`peft="qlora"`: QLORA_PRESET). `Recipe(...)` itself never rewrites a value.
- `recipe.resolved(workload)`: a `ResolvedRecipe`, its load dtype made concrete for the model
  ("auto" -> the config's). Everything below the entry points takes a ResolvedRecipe.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, fields
from functools import cache
from typing import TYPE_CHECKING, Any, Literal, Self, get_args, get_origin, get_type_hints

from anatomist.axes.liger import check_liger
from anatomist.axes.optimizers import OPTIMIZERS, optimizer, runs_with
from anatomist.axes.precisions import HALF_DTYPES
from anatomist.axes.shardings import DEEPSPEED_SETTINGS, FSDP_STAGES, deepspeed_values, trainer_fsdp_arguments
from anatomist.deepspeed_bounds import deepspeed_bounds
from anatomist.errors import InputError
from anatomist.trainer_defaults import trainer_defaults

if TYPE_CHECKING:
    from anatomist.workload import Workload

AttnImplementation = Literal["eager", "sdpa", "flash_attention_2"]
ExpertsImplementation = Literal["grouped_mm", "batched_mm", "eager"]
Offload = Literal["none", "cpu", "nvme"]
Fsdp = Literal["none", "full_shard", "shard_grad_op"]
LoadDtype = Literal["auto", "float32", "bfloat16", "float16"]
Peft = Literal["none", "lora", "qlora"]
QuantType = Literal["nf4", "fp4"]
Trainer = Literal["trainer", "sft", "dpo"]

ATTN_IMPLEMENTATIONS: tuple[str, ...] = get_args(AttnImplementation)
EXPERTS_IMPLEMENTATIONS: tuple[str, ...] = get_args(ExpertsImplementation)
OFFLOADS: tuple[str, ...] = get_args(Offload)
FSDP_MODES: tuple[str, ...] = get_args(Fsdp)
LOAD_DTYPES: tuple[str, ...] = get_args(LoadDtype)
PEFT_METHODS: tuple[str, ...] = get_args(Peft)
QUANT_TYPES: tuple[str, ...] = get_args(QuantType)
TRAINERS: tuple[str, ...] = get_args(Trainer)
DPO_BETA = 0.1
"""DPOConfig.beta as anatomist's DPO step computes it (trl 1.16's default); it scales the loss, not its memory."""
DPO_LOSS_TYPE = "sigmoid"
"""DPOConfig.loss_type as anatomist's DPO step computes it (trl 1.16's default: -logsigmoid(beta x the margin))."""


QLORA_PRESET: dict[str, Any] = {"load_in_4bit": True, "bnb_4bit_use_double_quant": True,
                                "bnb_4bit_compute_dtype": "bfloat16", "gradient_checkpointing": True}
"""What `peft="qlora"` means in practice (Dettmers et al. 2023, "QLoRA", sec. 3: NF4 with double
quantization, bf16 compute; PEFT's prepare_model_for_kbit_training turns on gradient checkpointing):
filled in by `Recipe.with_presets` where the user is silent."""
LORA_FALLBACK_TARGETS = "all-linear"
"""The LoRA targets of a recipe that names none, for a model PEFT has no default for (its
TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING lacks the model type, or transformers 5's fused experts leave
its default nothing to match): PEFT's own shorthand for every linear layer but the output head, what the QLoRA
paper trains (Dettmers et al. 2023, sec. 4: "LoRA on all linear transformer block layers") and what axolotl's
lora_target_linear and LLaMA-Factory's lora_target: all set."""
CLASSIFIER_HEADS = "classifier,score"
"""What a quantized sequence classifier keeps unquantized where the recipe does not say (llm_int8_skip_modules): the
heads PEFT trains in full (PeftModelForSequenceClassification's modules_to_save). transformers' bitsandbytes skips
only the module of the model's last parameter, which for an encoder is `classifier.bias`: its classifier is quantized,
and PEFT's requires_grad on the 4-bit weight then fails ("only Tensors of floating point dtype can require
gradients"); QLoRA users of classifiers pass this skip list."""
CCE_NEEDS_HALF_WEIGHTS = ("cut_cross_entropy needs the weights in bfloat16 or float16 (--dtype bfloat16): Cut "
                          "Cross-Entropy's backward takes half-precision hidden states and head weights")
"""Why Cut Cross-Entropy refuses float32 weights (cce_backward_kernel asserts bf16/fp16 hidden states and head)."""


def _trainer_default(name: str, help: str, *, when_none: Any = None, **metadata: Any) -> Any:
    """A field whose default is TrainingArguments' own (`when_none` where that is None)."""

    def default() -> Any:
        value = trainer_defaults()[name]
        return when_none if value is None else value

    return dataclasses.field(default_factory=default, metadata={"help": help, **metadata})


def _field(default: Any, help: str, **metadata: Any) -> Any:
    """A field with a fixed default; `help` is what `--help` and the docs show for it."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


@dataclass(kw_only=True, slots=True, frozen=True)
class Recipe:
    """One combination of the efficiency methods; field names follow TrainingArguments.

    Each field's description is its `metadata["help"]`, as in TrainingArguments: the one text a
    reader of this class and `anatomist estimate --help` both see (the flags are generated from
    these fields: cli/recipe_flags.py). A docstring under a field cannot be read at run time.

    Example:
        >>> Recipe(per_device_train_batch_size=1, gradient_accumulation_steps=4, fp16=True)
    """

    per_device_train_batch_size: int = _trainer_default(
        "per_device_train_batch_size", "Samples per forward/backward pass on each device.", aliases=("--batch-size",))
    gradient_accumulation_steps: int = _trainer_default(
        "gradient_accumulation_steps", "Micro-batches whose gradients are summed before one optimizer step.")
    gradient_checkpointing: bool = _trainer_default(
        "gradient_checkpointing", "Recompute each layer's activations in backward instead of keeping them.",
        when_none=False)
    checkpoint_every: int = _field(
        1, "With gradient checkpointing, checkpoint every N-th repeated layer only (transformers' "
        "activation_checkpointing_kwargs every_n_layers): layers 0, N, 2N, ... recompute, the others keep their "
        "activations; 1: every layer. Above 1 it turns gradient_checkpointing on.", metavar="N")
    checkpoint_offload: bool = _field(
        False, "With gradient checkpointing, hold what the checkpointed layers save (their inputs) in pinned host "
        "memory (transformers' activation_checkpointing_kwargs offload; axolotl's activation_offloading: hidden_states, "
        "LLaMA-Factory's use_unsloth_gc): frees about layers x tokens x hidden x dtype bytes, and copies them to the "
        "host in forward and back in backward, on the compute stream. It turns gradient_checkpointing on.")
    activation_offloading: bool = _field(
        False, "TRL's activation offloading (SFTConfig/DPOConfig.activation_offloading; axolotl's activation_offloading: "
        "true): every tensor autograd saves of 1 KiB or more, but the parameters' and the output head's, is copied to "
        "pinned host memory in forward and back in backward, on a side stream (trl/models/activation_offloading.py); "
        "with gradient checkpointing that is each checkpointed layer's input.")
    dtype: LoadDtype = _field(
        "auto", "The dtype the weights are loaded in, as from_pretrained(dtype=...): auto is the config's dtype "
        "(float32 where it names none). Half-precision weights train in pure half precision: gradients and "
        "optimizer states in that dtype, no fp32 master weights.")
    fp16: bool = _trainer_default(
        "fp16", "fp16 autocast + GradScaler (mixed precision: fp32 master weights when loaded in float32).")
    bf16: bool = _trainer_default(
        "bf16", "bf16 autocast (mixed precision: fp32 master weights when loaded in float32); Ampere or newer.")
    tf32: bool = _trainer_default(
        "tf32", "Allow TF32 tensor cores for fp32 matrix products; Ampere or newer.", when_none=False)
    optim: str = _trainer_default("optim", "Optimizer, as TrainingArguments.optim names it (axes/optimizers.py).",
                                  choices=tuple(OPTIMIZERS))
    attn_implementation: AttnImplementation | None = _field(
        None, "Attention kernel: eager keeps the [b, heads, s, s] probabilities, sdpa and flash_attention_2 do not; "
        "unset: transformers' own choice for the model, sdpa where it supports it, else eager.")
    experts_implementation: ExpertsImplementation = _field(
        "grouped_mm", "Mixture-of-Experts kernel, as from_pretrained(experts_implementation=...); no effect on dense "
        "models. grouped_mm (transformers' default) runs a layer's routed tokens as grouped matrix products; "
        "batched_mm copies each routed token's expert weights (meant for decoding); eager loops over the experts "
        "the router picked, whose sizes follow the data: it cannot be estimated (refused).")
    torch_compile: bool = _trainer_default("torch_compile", "Compile the model with torch.compile (inductor).")
    dataloader_num_workers: int = _trainer_default(
        "dataloader_num_workers", "DataLoader worker processes feeding the GPU.")
    dataloader_pin_memory: bool = _trainer_default(
        "dataloader_pin_memory", "Stage batches in page-locked host memory for faster host-to-device copies.")
    zero_stage: Literal[0, 1, 2, 3] = _field(
        0, "DeepSpeed ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also weights.")
    offload: Offload = _field(
        "none", "Where DeepSpeed ZeRO offloads optimizer states (and, at stage 3, parameters); with FSDP, cpu is "
        "its CPUOffloadPolicy (sharded parameters, gradients, optimizer states and step on the host).")
    max_grad_norm: float = _trainer_default(
        "max_grad_norm", "Gradient clipping, as the Trainer does by default (0 turns it off).")
    peft: Peft = _field(
        "none", "Parameter-efficient fine-tuning with the peft library: lora trains low-rank adapters on a frozen "
        "base; qlora is the QLoRA recipe as people run it: a 4-bit NF4 base with double quantization and bf16 "
        "compute, LoRA adapters, prepare_model_for_kbit_training (fp32 copies of the non-quantized parameters, "
        "input gradients, gradient checkpointing).")
    lora_r: int = _field(
        16, "LoRA rank: each adapted d_out x d_in layer gains r x (d_in + d_out) trainable parameters.")
    lora_alpha: int = _field(32, "LoRA scaling numerator (no memory effect; written to the emitted LoraConfig).")
    lora_dropout: float = _field(
        0.0, "Dropout on each adapter's input (PEFT's default 0): above 0 it keeps a mask and a copy.")
    lora_target_modules: str | None = _field(
        None, "Comma-separated module names, or all-linear; unset: PEFT's default for the architecture, or all-linear "
        "where PEFT has none (said in the notes).", metavar="A,B|all-linear")
    lora_target_parameters: str | None = _field(
        None, "Comma-separated parameter names that LoRA adapts directly (PEFT's target_parameters): the fused 3D "
        "expert weights of a Mixture of Experts, which are not nn.Linear modules, e.g. "
        "mlp.experts.gate_up_proj,mlp.experts.down_proj. Each forward adds the adapters' product to the whole weight "
        "(a temporary the size of the experts of one layer).", metavar="A,B")
    load_in_4bit: bool = _field(
        False, "BitsAndBytesConfig(load_in_4bit=True): the base's linear weights as packed 4-bit codes.")
    load_in_8bit: bool = _field(
        False, "BitsAndBytesConfig(load_in_8bit=True): the base's linear weights as int8 with row scales.")
    llm_int8_skip_modules: str | None = _field(
        None, "Comma-separated modules bitsandbytes leaves unquantized, 4-bit or 8-bit alike (BitsAndBytesConfig's "
        "llm_int8_skip_modules: they replace transformers' own, the output head); unset: transformers' own, and for "
        "a sequence classifier its head too (classifier,score), which PEFT trains in full and a 4-bit weight could "
        "not.", metavar="A,B")
    bnb_4bit_quant_type: QuantType = _field(
        "nf4", "4-bit data type: nf4 (QLoRA's NormalFloat) or fp4; the same memory.")
    bnb_4bit_use_double_quant: bool = _field(
        False, "Quantize the per-block fp32 scales again (QLoRA's double quantization): ~0.37 fewer bits/param.")
    bnb_4bit_compute_dtype: Literal["float32", "bfloat16", "float16"] = _field(
        "float32", "The dtype 4-bit weights are dequantized to for each matrix product "
        "(BitsAndBytesConfig's default float32).")
    fsdp: Fsdp = _trainer_default(
        "fsdp", "PyTorch FSDP sharding across data-parallel devices (TrainingArguments.fsdp): full_shard shards "
        "weights, gradients and optimizer states (like ZeRO-3); shard_grad_op shards gradients and optimizer "
        "states (like ZeRO-2). Exclusive with DeepSpeed ZeRO.", when_none="none")

    # -- LLM fine-tuning as TRL and the Trainer run it -----------------------------------------
    use_liger_kernel: bool = _trainer_default(
        "use_liger_kernel", "Liger Kernel's Triton kernels (TrainingArguments.use_liger_kernel): fused linear + "
        "cross-entropy that never holds the logits, RMSNorm, SwiGLU and RoPE; causal LMs Liger supports "
        "(axes/liger.py). Predicted without liger-kernel installed. Under TRL's trainers only the layer kernels "
        "apply (TRL's own fused LM head computes the loss).")
    cut_cross_entropy: bool = _field(
        False, "Cut Cross-Entropy (cut_cross_entropy's cce_patch, axolotl's CutCrossEntropyPlugin): the causal LM's "
        "loss from its last hidden states and head weight, block by block, without the logits; under the Trainer, "
        "with weights in bfloat16 or float16, on Ampere or newer (trace/standins/cce.py).")
    trainer: Trainer = _field(
        "trainer", "Which trainer runs the step: transformers' Trainer (the model's own head and loss: the logits "
        "exist), TRL's SFTTrainer (sft) or DPOTrainer (dpo), whose fused LM head never holds the logits; dpo runs "
        "chosen and rejected sequences as one batch of twice the pairs and a reference model (trace/step/trainers.py).")
    padding_free: bool = _field(
        False, "Flatten each micro-batch into one row without padding (SFTConfig.padding_free, transformers' "
        "DataCollatorWithFlattening): position_ids restart per sequence, flash_attention_2's varlen kernel; a "
        "micro-batch is then batch x the data's mean length in tokens (--avg-seq-len or --lengths).")
    packing: bool = _field(
        False, "Pack sequences into rows of max_length (--seq-len) tokens (SFTConfig.packing, best-fit decreasing, "
        "which is padding-free): every row full, several sequences in each.")
    precompute_ref_log_probs: bool = _field(
        False, "DPO: the reference model's log-probabilities are computed before training (DPOConfig), so no "
        "reference model is held nor run during it.")

    # -- DeepSpeed's buffer sizes (zero_optimization; axes/shardings.py DEEPSPEED_SETTINGS) --
    reduce_bucket_size: int | None = _field(
        None, "DeepSpeed zero_optimization.reduce_bucket_size: elements per gradient-reduction bucket (ZeRO >= 1); "
        "unset: the Trainer's auto, hidden_size^2.", metavar="N")
    allgather_bucket_size: int | None = _field(
        None, "DeepSpeed zero_optimization.allgather_bucket_size (ZeRO-1/2); unset: DeepSpeed's 5e8.", metavar="N")
    stage3_prefetch_bucket_size: int | None = _field(
        None, "DeepSpeed ZeRO-3: parameter elements fetched ahead; unset: the Trainer's auto, 0.9 x hidden_size^2.",
        metavar="N")
    stage3_max_live_parameters: int | None = _field(
        None, "DeepSpeed ZeRO-3: gathered parameter elements kept on a device before releasing; unset: "
        "DeepSpeed's 1e9.", metavar="N")
    stage3_max_reuse_distance: int | None = _field(
        None, "DeepSpeed ZeRO-3: a gathered parameter used again within this many parameter elements is kept "
        "gathered; unset: DeepSpeed's 1e9.", metavar="N")
    stage3_param_persistence_threshold: int | None = _field(
        None, "DeepSpeed ZeRO-3: parameters of at most this many elements stay whole on every device; unset: the "
        "Trainer's auto, 10 x hidden_size.", metavar="N")
    bf16_master_weights_and_grads: bool = _field(
        False, "DeepSpeed bf16.bf16_master_weights_and_grads: ZeRO keeps its master weights and gradient partitions "
        "in bf16, not fp32 (2 B/param less per partition); DeepSpeed needs --offload cpu for it unless the optimizer "
        "states are bf16 too (--bf16-optimizer-states).")
    bf16_optimizer_states: bool = _field(
        False, "DeepSpeed bf16.bf16_optimizer_states: the optimizer's states on ZeRO's partitions in bf16, not fp32 "
        "(AdamW: 4 B/param less per partition); needs --bf16-master-weights-and-grads.")

    def __post_init__(self) -> None:
        if self.per_device_train_batch_size <= 0:
            raise InputError(
                f"per_device_train_batch_size must be greater than 0, got {self.per_device_train_batch_size}"
            )
        if self.gradient_accumulation_steps <= 0:
            raise InputError(
                f"gradient_accumulation_steps must be greater than 0, got {self.gradient_accumulation_steps}"
            )
        if self.fp16 and self.bf16:
            raise InputError("fp16 and bf16 are mutually exclusive: choose one mixed precision")
        if self.dtype not in LOAD_DTYPES:
            raise InputError(f"unknown dtype {self.dtype!r}; known: {', '.join(LOAD_DTYPES)}")
        if self.dtype == "float16" and self.fp16 and self.peft == "none":  # PEFT's adapters are fp32
            raise InputError(
                "fp16 (GradScaler) cannot train float16-loaded weights: PyTorch refuses to unscale fp16 "
                "gradients; load in float32 for fp16 mixed precision (--dtype float32 --fp16), or use "
                "--dtype bfloat16 [--bf16]"
            )
        if self.checkpoint_every < 1:
            raise InputError(f"checkpoint_every must be at least 1, got {self.checkpoint_every}")
        if (self.checkpoint_every > 1 or self.checkpoint_offload) and not self.gradient_checkpointing:
            what = f"checkpoint_every={self.checkpoint_every}" if self.checkpoint_every > 1 else "checkpoint_offload"
            raise InputError(f"{what} is a setting of gradient checkpointing: it needs gradient_checkpointing=True")
        if self.activation_offloading and self.fsdp != "none":
            raise InputError("activation_offloading under FSDP is not modelled yet (TRL offloads each rank's saved "
                             "activations, DTensor shards aside): use DeepSpeed ZeRO (zero_stage), or leave it off")
        if self.activation_offloading and self.torch_compile:
            raise InputError("activation_offloading with torch_compile is not modelled yet (the compiled blocks' "
                             "backward reads saved tensors in the layout they had, which TRL's copies do not keep)")
        if self.use_liger_kernel and self.torch_compile and not self.gradient_checkpointing:
            raise InputError("use_liger_kernel with torch_compile is not modelled yet (Liger's kernels stand in as "
                             "custom ops, which the compiled blocks' trace cannot run): leave one off, or turn "
                             "gradient_checkpointing on (its blocks are predicted as eager code)")
        optimizer(self.optim)  # raises for one anatomist does not model
        if self.attn_implementation is not None and self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise InputError(
                f"unknown attn_implementation {self.attn_implementation!r}; "
                f"known: {', '.join(ATTN_IMPLEMENTATIONS)}"
            )
        if self.experts_implementation not in EXPERTS_IMPLEMENTATIONS:
            raise InputError(
                f"unknown experts_implementation {self.experts_implementation!r}; "
                f"known: {', '.join(EXPERTS_IMPLEMENTATIONS)}"
            )
        if self.dataloader_num_workers < 0:
            raise InputError(f"dataloader_num_workers must be >= 0, got {self.dataloader_num_workers}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise InputError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.offload not in OFFLOADS:
            raise InputError(f"unknown offload {self.offload!r}; known: {', '.join(OFFLOADS)}")
        if self.offload != "none" and self.zero_stage == 0 and self.fsdp == "none":
            raise InputError(f"offload={self.offload} needs DeepSpeed ZeRO (zero_stage 1, 2 or 3) or FSDP (fsdp)")
        if self.offload == "nvme" and self.zero_stage != 3:
            raise InputError("offload=nvme needs zero_stage=3")
        if self.fsdp not in FSDP_MODES:
            raise InputError(f"unknown fsdp {self.fsdp!r}; known: {', '.join(FSDP_MODES)}")
        if self.fsdp != "none" and self.zero_stage != 0:
            raise InputError("fsdp and DeepSpeed ZeRO (zero_stage) are exclusive: choose one sharding engine")
        if not runs_with(self.optim, self.fsdp):
            raise InputError(f"optim={self.optim} does not run under FSDP2 (its state is plain tensors beside the "
                             "sharded DTensor gradients, which PyTorch refuses to mix): choose another optimizer, or "
                             "DeepSpeed ZeRO (zero_stage)")
        if self.peft not in PEFT_METHODS:
            raise InputError(f"unknown peft {self.peft!r}; known: {', '.join(PEFT_METHODS)}")
        if self.peft == "qlora" and not self.load_in_4bit:
            raise InputError("peft=qlora is LoRA on a 4-bit base: set load_in_4bit=True, or make the recipe with "
                             "Recipe.with_presets(peft='qlora', ...) for QLoRA's usual settings")
        if self.lora_r <= 0:
            raise InputError(f"lora_r must be greater than 0, got {self.lora_r}")
        if not 0 <= self.lora_dropout < 1:
            raise InputError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.load_in_4bit and self.load_in_8bit:
            raise InputError("load_in_4bit and load_in_8bit are exclusive: choose one quantization")
        if (self.load_in_4bit or self.load_in_8bit) and self.peft == "none":
            raise InputError("a quantized base cannot be trained itself: add adapters with --peft lora (or use --peft qlora)")
        if self.bnb_4bit_quant_type not in QUANT_TYPES:
            raise InputError(f"unknown bnb_4bit_quant_type {self.bnb_4bit_quant_type!r}; known: {', '.join(QUANT_TYPES)}")
        if self.max_grad_norm < 0:
            raise InputError(f"max_grad_norm must be >= 0, got {self.max_grad_norm}")
        for name in DEEPSPEED_SETTINGS:  # within DeepSpeed's own bounds (deepspeed_bounds.py): what it refuses
            value = getattr(self, name)
            refusal = None if value is None else deepspeed_bounds().refusal("zero_optimization", name, value)
            if refusal:
                raise InputError(f"{name} {refusal}")
        self._check_llm_fields()
        self._check_deepspeed_precision()

    def _check_deepspeed_precision(self) -> None:
        """DeepSpeed's bf16 master weights and optimizer states, where DeepSpeed 0.19 takes them (`runtime/config.py`
        `_do_error_check`, `runtime/base_optimizer.py` `_configure_master_weights`)."""
        for name in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
            if getattr(self, name) and not (self.zero_stage and self.bf16):
                raise InputError(f"{name} is a setting of DeepSpeed ZeRO's bf16 mode: it needs zero_stage 1, 2 or 3 and "
                                 "bf16=True (DeepSpeed's bf16.enabled)")
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise InputError("bf16_optimizer_states needs bf16_master_weights_and_grads=True too (DeepSpeed refuses "
                             "bf16 optimizer states over fp32 master weights)")
        if self.bf16_master_weights_and_grads and not self.bf16_optimizer_states and self.offload == "none":
            raise InputError("bf16_master_weights_and_grads with fp32 optimizer states runs only with ZeRO-Offload "
                             "(DeepSpeed: offload cpu): add --offload cpu, or --bf16-optimizer-states")

    def _check_llm_fields(self) -> None:
        """The trainer, padding-free and packing fields: combinations the tools themselves refuse."""
        if self.trainer not in TRAINERS:
            raise InputError(f"unknown trainer {self.trainer!r}; known: {', '.join(TRAINERS)}")
        if self.packing and not self.padding_free:
            raise InputError("packing=True packs rows with TRL's best-fit decreasing strategy, which is padding-free: "
                             "set padding_free=True too, or make the recipe with Recipe.with_presets(packing=True)")
        if (self.padding_free or self.packing) and self.attn_implementation != "flash_attention_2":
            what = "packing" if self.packing else "padding_free"
            raise InputError(f"{what}: sequences flattened into one row need an attention that takes packed "
                             f"position_ids (TRL: FlashAttention 2 or 3): use --attn-implementation flash_attention_2, "
                             f"not {self.attn_implementation or 'the model default (sdpa or eager)'}")
        if self.trainer == "dpo" and self.padding_free:
            raise InputError("DPOTrainer (trl 1.16) has no padding-free training: its padding_free falls back to "
                             "padding; leave padding_free and packing off with --trainer dpo")
        if self.cut_cross_entropy and self.use_liger_kernel:
            raise InputError("cut_cross_entropy and use_liger_kernel both replace the LM head's loss (Liger's with its "
                             "fused linear cross-entropy): choose one")
        if self.cut_cross_entropy and self.dtype == "float32":
            raise InputError(CCE_NEEDS_HALF_WEIGHTS)
        if self.cut_cross_entropy and self.trainer != "trainer":
            raise InputError(f"cut_cross_entropy is modelled under transformers' Trainer, whose loss is the model's "
                             f"patched forward; TRL's {self.trainer.upper()}Trainer scores with its own fused LM head")
        if self.precompute_ref_log_probs and self.trainer != "dpo":
            raise InputError("precompute_ref_log_probs is DPO's reference model: it needs --trainer dpo")

    @property
    def sharding_stage(self) -> int:
        """The ZeRO-equivalent sharding stage: DeepSpeed's own, or FSDP's (full_shard = 3, shard_grad_op = 2)."""
        return FSDP_STAGES.get(self.fsdp, self.zero_stage)

    @property
    def checkpointing(self) -> str:
        """How the layers checkpoint, as the tables say it: off, on (every layer) or "1 in N", "+offload" (the
        checkpoints on the host), "+TRL offload" (`activation_offloading`)."""
        trl = "+TRL offload" if self.activation_offloading else ""
        if not self.gradient_checkpointing:
            return "off" + trl
        layers = "on" if self.checkpoint_every == 1 else f"1 in {self.checkpoint_every}"
        return layers + ("+offload" if self.checkpoint_offload else "") + trl

    def checkpointed(self, layer: int) -> bool:
        """Whether gradient checkpointing recomputes repeated layer `layer` (its index among the model's repeated
        layers, in the model's order: transformers counts them so, `_set_gradient_checkpointing`)."""
        return self.gradient_checkpointing and layer % self.checkpoint_every == 0

    @property
    def mixed_precision(self) -> Literal["no", "fp16", "bf16"]:
        """The autocast the Trainer runs (`--fp16`/`--bf16`), whatever the weights' dtype."""
        return "fp16" if self.fp16 else "bf16" if self.bf16 else "no"

    def lora_config_kwargs(self, task_type: str | None) -> dict[str, Any]:
        """peft.LoraConfig keyword arguments of the adapters (`task_type`: peft's TaskType name)."""
        kwargs: dict[str, Any] = {"r": self.lora_r, "lora_alpha": self.lora_alpha, "lora_dropout": self.lora_dropout,
                                  "bias": "none", "task_type": task_type}
        names = [n.strip() for n in (self.lora_target_modules or "").split(",") if n.strip()]
        if names:  # none: PEFT's default targets for the architecture
            kwargs["target_modules"] = "all-linear" if names == ["all-linear"] else names
        parameters = [n.strip() for n in (self.lora_target_parameters or "").split(",") if n.strip()]
        if parameters:
            kwargs["target_parameters"] = parameters
        return kwargs

    @property
    def quantized(self) -> bool:
        """True when the base's linear weights are loaded by bitsandbytes (4- or 8-bit)."""
        return self.load_in_4bit or self.load_in_8bit

    @property
    def half_weights(self) -> bool:
        """True when the weights are loaded in bf16 or fp16 ("auto" must be resolved first)."""
        return self.dtype in HALF_DTYPES

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes` (of this class: a ResolvedRecipe stays one); no preset is applied."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def with_presets(cls, **given: Any) -> Recipe:
        """The recipe `given` sets, with the presets its values imply where `given` is silent:
        `peft="qlora"` is QLoRA as people run it (QLORA_PRESET).

        Example:
            >>> Recipe.with_presets(peft="qlora").load_in_4bit
            True
        """
        preset = dict(QLORA_PRESET) if given.get("peft") == "qlora" else {}
        if given.get("packing"):
            preset["padding_free"] = True
        if given.get("checkpoint_every", 1) > 1 or given.get("checkpoint_offload"):
            preset["gradient_checkpointing"] = True  # TRL: padding_free = padding_free or (packing and strategy "bfd")
        return cls(**{**preset, **given})

    def resolved(self, workload: Workload) -> ResolvedRecipe:
        """This recipe settled for `workload`: its load dtype concrete ("auto" -> the checkpoint's), its attention
        (unset -> transformers' choice for the model), its LoRA targets where PEFT has no default for the model
        (unset -> LORA_FALLBACK_TARGETS), a quantized classifier's head (unset -> CLASSIFIER_HEADS) and, under
        DeepSpeed, its buffer sizes (unset -> "auto" as the Trainer fills it, or DeepSpeed's default).

        Raises:
            InputError: a dtype the model's code rejects, or one that with the recipe's precision
                flags makes a combination PyTorch refuses; Liger Kernel for a model it does not patch.
        """
        if self.use_liger_kernel:
            check_liger(workload.model_type, workload.task, workload.name)
        if self.cut_cross_entropy and workload.task != "causal-lm":
            raise InputError(f"{workload.name}: Cut Cross-Entropy replaces a causal LM's loss; this is a "
                             f"{workload.task} model")
        if self.trainer != "trainer" and workload.task != "causal-lm":
            raise InputError(f"{workload.name}: TRL's {self.trainer.upper()}Trainer trains causal language models; this "
                             f"is a {workload.task} model (--task causal-lm, or --trainer trainer)")
        if self.cut_cross_entropy and workload.weights_dtype(self.dtype) == "float32":
            raise InputError(f"{workload.name} loads in float32 by default: {CCE_NEEDS_HALF_WEIGHTS}")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.zero_stage:  # DeepSpeed's buffer sizes, "auto" filled as the Trainer fills it
            values |= deepspeed_values(workload.hidden_size(), {n: values[n] for n in DEEPSPEED_SETTINGS})
        values["attn_implementation"] = self.attn_implementation or workload.default_attention()
        if self.peft != "none" and self.lora_target_modules is None and self.lora_target_parameters is None \
                and workload.lora_default_targets() is None:
            values["lora_target_modules"] = LORA_FALLBACK_TARGETS
        if self.quantized and self.llm_int8_skip_modules is None and workload.task == "sequence-classification":
            values["llm_int8_skip_modules"] = CLASSIFIER_HEADS
        return ResolvedRecipe(**{**values, "dtype": workload.weights_dtype(self.dtype)})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "recipe") -> Recipe:
        """Build a Recipe from its own field names, with the presets they imply (`with_presets`); unknown
        keys and values of the wrong type are an error.

        Files in other tools' formats (TrainingArguments, TRL, accelerate, DeepSpeed): recipe_files.py.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"{source}: unknown recipe field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        kinds = field_kinds()
        for name, value in data.items():
            if not kinds[name].accepts(value):
                raise InputError(f"{source}: field {name} must be {kinds[name].describe()}, got {value!r}")
        return cls.with_presets(**data)

    def missing_packages(self) -> list[str]:
        """Optional packages this recipe needs at run time that are not importable here."""
        package = optimizer(self.optim).package
        needed = [package] if package else []
        if self.attn_implementation == "flash_attention_2":
            needed.append("flash_attn")
        if self.zero_stage:
            needed.append("deepspeed")
        if self.load_in_4bit or self.load_in_8bit:
            needed.append("bitsandbytes")
        if self.use_liger_kernel:
            needed.append("liger_kernel")
        if self.cut_cross_entropy:
            needed.append("cut_cross_entropy")
        return [name for name in dict.fromkeys(needed) if importlib.util.find_spec(name) is None]

    def to_training_arguments_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for transformers.TrainingArguments (DeepSpeed config excluded)."""
        kwargs: dict[str, Any] = {
            "per_device_train_batch_size": self.per_device_train_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "gradient_checkpointing": self.gradient_checkpointing,
            "fp16": self.fp16,
            "bf16": self.bf16,
            "optim": self.optim,
            "torch_compile": self.torch_compile,
            "dataloader_num_workers": self.dataloader_num_workers,
            "dataloader_pin_memory": self.dataloader_pin_memory,
            "max_grad_norm": self.max_grad_norm,
        }
        checkpointing = {"every_n_layers": self.checkpoint_every} if self.checkpoint_every > 1 else {}
        if self.checkpoint_offload:
            checkpointing["offload"] = True
        if self.gradient_checkpointing and checkpointing:  # activation_checkpointing_kwargs' alias (transformers 5.23)
            kwargs["gradient_checkpointing_kwargs"] = checkpointing
        if self.tf32:
            kwargs["tf32"] = True
        if self.fsdp != "none":
            kwargs |= trainer_fsdp_arguments(self.fsdp, offload=self.offload == "cpu", adapters=self.peft != "none")
        if self.use_liger_kernel:
            kwargs["use_liger_kernel"] = True
        return kwargs | dict(optimizer(self.optim).trainer_kwargs)

    def to_training_arguments(self, output_dir: str, **extra: Any) -> Any:
        """A real transformers.TrainingArguments for this recipe."""
        from transformers import TrainingArguments

        return TrainingArguments(output_dir=output_dir, **self.to_training_arguments_kwargs(), **extra)


@dataclass(kw_only=True, slots=True, frozen=True)
class ResolvedRecipe(Recipe):
    """A Recipe settled for one model (`Recipe.resolved`): its `dtype` is float32, bfloat16 or float16,
    never "auto", and its `attn_implementation` is set. The estimator, the tracer and the time model take only this."""

    attn_implementation: AttnImplementation = None  # type: ignore[assignment]  # Recipe's None resolved: set

    def __post_init__(self) -> None:
        if self.dtype == "auto" or self.attn_implementation is None:
            raise TypeError("a ResolvedRecipe has a concrete dtype and attention: make it with recipe.resolved(workload)")
        Recipe.__post_init__(self)


@dataclass(frozen=True, slots=True)
class FieldKind:
    """What values a Recipe field takes, read from its annotation: one scalar type, maybe choices, maybe None."""

    type: type
    """bool, int, float or str."""
    choices: tuple[Any, ...] | None
    """The Literal's values; None for a free value."""
    optional: bool
    """None is a value (`str | None`)."""

    def accepts(self, value: Any) -> bool:
        """The type check of a value read from a file (its choices are checked by Recipe itself)."""
        if value is None:
            return self.optional
        if self.type is float:
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        if self.type is int:
            return isinstance(value, int) and not isinstance(value, bool)
        return isinstance(value, self.type)

    def describe(self) -> str:
        return self.type.__name__ + (" or null" if self.optional else "")


@cache
def field_kinds() -> dict[str, FieldKind]:
    """Each Recipe field's FieldKind, by name (the annotations here are strings: resolved once)."""
    kinds = {}
    listed = {f.name: f.metadata["choices"] for f in fields(Recipe) if "choices" in f.metadata}
    for name, hint in get_type_hints(Recipe).items():
        args = get_args(hint)
        optional = type(None) in args and get_origin(hint) is not Literal
        if optional:
            (hint,) = [a for a in args if a is not type(None)]
        if get_origin(hint) is Literal:
            choices = get_args(hint)
            kinds[name] = FieldKind(type=type(choices[0]), choices=choices, optional=optional)
        else:  # a registry's names (optimizers) are choices too
            kinds[name] = FieldKind(type=hint, choices=listed.get(name), optional=optional)
    return kinds
