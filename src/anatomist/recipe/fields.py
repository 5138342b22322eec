"""The recipe's fields: the training knobs of the seeds' methods table, named as in TrainingArguments.

The defaults are today's: every field that TrainingArguments has takes the installed
transformers' own default (`trainer_defaults`: read from the dataclass once per transformers
version, not copied: e.g. `optim` is `adamw_torch_fused` with torch >= 2.8), and `dtype` is
`from_pretrained`'s default, "auto" (the checkpoint's dtype). Each field's choices are its axis'
vocabulary (`axes/`); what each field means, as `--help` says it, is in `help.py` (kept out of the
trace code digest: a help text changes no trace).

`RecipeFields` holds the values and what is read off them; `Recipe` (`recipe.py`) is the class
everyone builds: these fields, checked (`checks.py`), with their presets and resolution. Two classes,
because the checks read the fields and the Recipe runs the checks: in one class, the fields and their
checks would import each other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from anatomist.axes.kernels import AttnImplementation, ExpertsImplementation
from anatomist.axes.methods import Peft, Trainer
from anatomist.axes.optimizers import OPTIMIZERS
from anatomist.axes.precisions import HALF_DTYPES, Fp8, LoadDtype
from anatomist.axes.quantization import QuantType
from anatomist.axes.shardings import FSDP_STAGES, EpRouting, Fsdp, Offload
from anatomist.trainer_defaults import trainer_defaults


def _trainer_default(name: str, *, when_none: Any = None, **metadata: Any) -> Any:
    """A field whose default is TrainingArguments' own (`when_none` where that is None)."""

    def default() -> Any:
        value = trainer_defaults()[name]
        return when_none if value is None else value

    return dataclasses.field(default_factory=default, metadata=metadata)


@dataclass(kw_only=True, slots=True, frozen=True)
class RecipeFields:
    """One combination of the efficiency methods, as values; field names follow TrainingArguments.

    Build a `Recipe`, which checks them; each field's description is `help.FIELD_HELP[name]`.
    """


    per_device_train_batch_size: int = _trainer_default("per_device_train_batch_size")
    gradient_accumulation_steps: int = _trainer_default("gradient_accumulation_steps")
    gradient_checkpointing: bool = _trainer_default("gradient_checkpointing", when_none=False)
    checkpoint_every: int = 1
    checkpoint_offload: bool = False
    activation_offloading: bool = False
    dtype: LoadDtype = "auto"
    fp16: bool = _trainer_default("fp16")
    bf16: bool = _trainer_default("bf16")
    tf32: bool = _trainer_default("tf32", when_none=False)
    fp8: Fp8 = "none"
    fp8_all_gather: bool | None = None
    optim: str = _trainer_default("optim", choices=tuple(OPTIMIZERS))
    attn_implementation: AttnImplementation | None = None
    experts_implementation: ExpertsImplementation = "grouped_mm"
    torch_compile: bool = _trainer_default("torch_compile")
    dataloader_num_workers: int = _trainer_default("dataloader_num_workers")
    dataloader_pin_memory: bool = _trainer_default("dataloader_pin_memory")
    zero_stage: Literal[0, 1, 2, 3] = 0
    offload: Offload = "none"
    max_grad_norm: float = _trainer_default("max_grad_norm")
    peft: Peft = "none"
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str | None = None
    lora_target_parameters: str | None = None
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    llm_int8_skip_modules: str | None = None
    bnb_4bit_quant_type: QuantType = "nf4"
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    fsdp: Fsdp = _trainer_default("fsdp", when_none="none")
    tp_size: int = 1
    ep_size: int = 1
    ep_routing: EpRouting = "balanced"
    cp_size: int = 1
    sp_size: int = 1
    dp_replicate_size: int = 1

    # -- LLM fine-tuning as TRL and the Trainer run it ------------------------------------------
    use_liger_kernel: bool = _trainer_default("use_liger_kernel")
    cut_cross_entropy: bool = False
    trainer: Trainer = "trainer"
    padding_free: bool = False
    packing: bool = False
    precompute_ref_log_probs: bool = False

    # -- DeepSpeed's buffer sizes (zero_optimization; axes/shardings.py DEEPSPEED_SETTINGS) -----
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    stage3_prefetch_bucket_size: int | None = None
    stage3_max_live_parameters: int | None = None
    stage3_max_reuse_distance: int | None = None
    stage3_param_persistence_threshold: int | None = None
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False

    @property
    def split_by_transformers(self) -> bool:
        """Whether transformers splits the model at load time: tensor or expert parallel (`DistributedConfig`,
        trace/step/tensor_parallel.py)."""
        return self.tp_size > 1 or self.ep_size > 1

    @property
    def uses_parallelism_config(self) -> bool:
        """Whether accelerate's ParallelismConfig lays out the GPUs: HSDP's replicas, context or sequence parallel."""
        return self.dp_replicate_size > 1 or self.cp_size > 1 or self.sp_size > 1

    @property
    def sequence_parts(self) -> int:
        """Into how many parts each sequence is split over a group of GPUs, which train one batch together: context
        parallel's (torch's ring) or sequence parallel's (DeepSpeed's Ulysses); 1 where neither."""
        return self.cp_size * self.sp_size

    @property
    def sharding_stage(self) -> int:
        """The ZeRO-equivalent sharding stage: DeepSpeed's own, or FSDP's (full_shard = 3, shard_grad_op = 2)."""
        return FSDP_STAGES.get(self.fsdp, self.zero_stage)

    @property
    def checkpointing(self) -> str:
        """How the layers checkpoint, as the tables say it: off, on (every layer) or "1 in N", "+offload" (the
        checkpoints on the host), "+TRL offload" (`activation_offloading`). A label: test `checkpoints_every_layer`
        and the fields, not this text."""
        trl = "+TRL offload" if self.activation_offloading else ""
        if not self.gradient_checkpointing:
            return "off" + trl
        layers = "on" if self.checkpoint_every == 1 else f"1 in {self.checkpoint_every}"
        return layers + ("+offload" if self.checkpoint_offload else "") + trl

    @property
    def checkpoints_every_layer(self) -> bool:
        """Gradient checkpointing of every layer with the checkpoints kept on the device and nothing offloaded by TRL:
        the plain checkpointing FSDP's own `activation_checkpointing` does (the label "on")."""
        return (self.gradient_checkpointing and self.checkpoint_every == 1 and not self.checkpoint_offload
                and not self.activation_offloading)

    def checkpointed(self, layer: int) -> bool:
        """Whether gradient checkpointing recomputes repeated layer `layer` (its index among the model's repeated
        layers, in the model's order: transformers counts them so, `_set_gradient_checkpointing`)."""
        return self.gradient_checkpointing and layer % self.checkpoint_every == 0

    @property
    def mixed_precision(self) -> Literal["no", "fp16", "bf16"]:
        """The autocast the Trainer runs (`--fp16`/`--bf16`), whatever the weights' dtype."""
        return "fp16" if self.fp16 else "bf16" if self.bf16 else "no"

    @property
    def quantized(self) -> bool:
        """True when the base's linear weights are loaded by bitsandbytes (4- or 8-bit)."""
        return self.load_in_4bit or self.load_in_8bit

    @property
    def half_weights(self) -> bool:
        """True when the weights are loaded in bf16 or fp16 ("auto" must be resolved first)."""
        return self.dtype in HALF_DTYPES

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
