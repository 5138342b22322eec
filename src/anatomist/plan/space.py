"""The recipe space `anatomist plan` searches, and how it is enumerated.

Axes are split by cost. Batch size, accumulation, ZeRO/FSDP sharding, CPU offload and
torch.compile do not change what the memory tracer records (the estimator extrapolates batch
size and applies sharding arithmetically), so they are enumerated in full. Checkpointing,
precision and optimizer each need a new fake-tensor trace (1-3 s for bert-large), so only
their useful values are searched; attention kernels other than SDPA are compared at the top
pick only (`search.py`), since eager attention keeps the [b, heads, s, s] probabilities and is
never faster in any model anatomist has (the seeds' "SDPA / Flash Attention" section).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from anatomist.errors import InputError
from anatomist.hardware import GPU
from anatomist.recipe import Recipe

DEFAULT_OPTIMS: tuple[str, ...] = ("adamw_torch_fused", "adafactor", "adamw_bnb_8bit")
"""AdamW (fused, the fastest of the torch AdamWs), and the seeds' two memory-saving optimizers.
SGD is left out by default: it changes the optimisation algorithm, not just its cost."""

UNBOUNDED_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
"""Per-device batch sizes tried when no global batch size is asked for (accumulation 1)."""

# name -> Recipe fields; the sharding options of one and of several devices.
SINGLE_GPU_SHARDING: dict[str, dict[str, object]] = {
    "none": {},
    "zero2+offload": {"zero_stage": 2, "offload": "cpu"},
}
MULTI_GPU_SHARDING: dict[str, dict[str, object]] = {
    "ddp": {},
    "zero1": {"zero_stage": 1},
    "zero2": {"zero_stage": 2},
    "zero3": {"zero_stage": 3},
    "zero2+offload": {"zero_stage": 2, "offload": "cpu"},
    "zero3+offload": {"zero_stage": 3, "offload": "cpu"},
    "fsdp_shard_grad_op": {"fsdp": "shard_grad_op"},
    "fsdp_full_shard": {"fsdp": "full_shard"},
}

PRECISIONS: dict[str, dict[str, object]] = {
    "fp32": {"dtype": "float32"},
    "tf32": {"dtype": "float32", "tf32": True},
    "fp16": {"dtype": "float32", "fp16": True},
    "bf16": {"dtype": "float32", "bf16": True, "tf32": True},
    "bf16-weights": {"dtype": "bfloat16", "bf16": True},
}
"""fp32/tf32/fp16/bf16 keep fp32 master weights (loaded in float32; fp16/bf16 autocast per op);
bf16-weights loads the weights in bfloat16 and trains in pure bf16 (how most LLM checkpoints
load in transformers 5, with --bf16 on top as people run it): no fp32 master weights."""
QLORA_PRECISIONS: dict[str, dict[str, object]] = {
    "nf4+bf16": {"dtype": "bfloat16", "bf16": True, "bnb_4bit_compute_dtype": "bfloat16"},
    "nf4+fp16": {"dtype": "float16", "fp16": True, "bnb_4bit_compute_dtype": "float16"},
}
"""QLoRA's one precision per GPU: the 4-bit base dequantized to the autocast dtype for each
product (bf16 where the GPU has it, else fp16), loaded in that dtype as TRL loads it;
`prepare_model_for_kbit_training` then casts every non-quantized parameter to fp32."""

METHODS: dict[str, dict[str, object]] = {
    "full": {"peft": "none", "load_in_4bit": False, "load_in_8bit": False},
    "lora": {"peft": "lora", "load_in_4bit": False, "load_in_8bit": False},
    "qlora": {"peft": "qlora", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
              "bnb_4bit_use_double_quant": True},
}
"""What is trained: every weight, or LoRA adapters on a frozen base (bf16/fp32, or QLoRA's
4-bit NF4 base with double quantization). Only "full" is searched unless asked: LoRA and QLoRA
change what the model learns, not just what it costs."""
PEFT_TRADE_OFF = (
    "{method} trains r={r} adapters on a frozen base, not every weight: a different fine-tune, usually "
    "close to full fine-tuning on instruction data but not always; compare on your own evaluation"
)

BF16_WEIGHTS_TRADE_OFF = (
    "numerics: bf16 weights keep no fp32 master copy, so updates below bf16's resolution (~0.4% of a "
    "weight) are rounded away; if the loss stalls, load in float32 with bf16 autocast instead"
)


@dataclass(kw_only=True, slots=True)
class SearchSpace:
    """What the planner may vary; everything else keeps `base`'s value."""

    global_batch_size: int | None = None
    """Samples per optimizer step over all devices; None: any per-device batch, no accumulation."""
    num_gpus: int = 1
    """Data-parallel devices."""
    optims: tuple[str, ...] = DEFAULT_OPTIMS
    compile_options: tuple[bool, ...] = (False, True)
    checkpointing_options: tuple[bool, ...] = (False, True)
    shardings: tuple[str, ...] | None = None
    """Names from SINGLE_GPU_SHARDING / MULTI_GPU_SHARDING; None: all of those for `num_gpus`."""
    precisions: tuple[str, ...] | None = None
    """Names from PRECISIONS; None: every precision the GPU supports (`precisions_for`)."""
    methods: tuple[str, ...] = ("full",)
    """Names from METHODS: what is trained. LoRA and QLoRA are searched without ZeRO/FSDP (the
    adapters' gradients and optimizer states are too small for sharding to pay)."""
    base: Recipe = field(default_factory=Recipe)
    """Fields the search does not vary (dataloader workers, max_grad_norm ...)."""

    def __post_init__(self) -> None:
        unknown_methods = [m for m in self.methods if m not in METHODS]
        if unknown_methods or not self.methods:
            raise InputError(f"fine-tuning methods are {', '.join(METHODS)}; got {', '.join(unknown_methods) or 'none'}")
        if self.num_gpus <= 0:
            raise InputError(f"--gpus must be greater than 0, got {self.num_gpus}")
        known = MULTI_GPU_SHARDING if self.num_gpus > 1 else SINGLE_GPU_SHARDING
        unknown = [name for name in self.shardings or () if name not in known]
        if unknown or self.shardings == ():
            raise InputError(f"sharding options on {self.num_gpus} GPU(s) are {', '.join(known)}; got {', '.join(unknown) or 'none'}")
        if self.global_batch_size is not None:
            if self.global_batch_size <= 0:
                raise InputError(f"--global-batch-size must be greater than 0, got {self.global_batch_size}")
            if self.global_batch_size % self.num_gpus:
                raise InputError(
                    f"a global batch of {self.global_batch_size} cannot be split evenly over {self.num_gpus} GPUs "
                    f"(every device needs the same micro-batch x accumulation); use a multiple of {self.num_gpus}, "
                    f"e.g. {max(self.num_gpus, self.global_batch_size // self.num_gpus * self.num_gpus)}"
                )

    def batch_options(self) -> list[tuple[int, int]]:
        """(per-device batch, accumulation) pairs that form the global batch exactly.

        Per-device batches are divisors of the per-device share that are powers of two or
        multiples of 8: the seeds advise multiples of 8 for tensor-core friendly shapes.
        """
        if self.global_batch_size is None:
            return [(b, 1) for b in UNBOUNDED_BATCH_SIZES]
        share = self.global_batch_size // self.num_gpus
        sizes = [b for b in range(1, share + 1) if share % b == 0 and (b & (b - 1) == 0 or b % 8 == 0)]
        return [(b, share // b) for b in sizes]

    def sharding_options(self, method: str = "full") -> dict[str, dict[str, object]]:
        """The searched sharding options for `method` (adapters: plain data parallelism only)."""
        known = MULTI_GPU_SHARDING if self.num_gpus > 1 else SINGLE_GPU_SHARDING
        return {name: fields for name, fields in known.items()
                if (self.shardings is None or name in self.shardings) and (method == "full" or not fields)}


def precisions_for(gpu: GPU) -> tuple[list[str], list[str]]:
    """(precisions searched, notes on those left out) for what `gpu` supports.

    fp16 is left out where bf16 has the same dense peak: same memory and speed, and bf16
    needs no loss scaling (seeds: "bf16 ... no need for loss scaling").
    """
    searched = ["fp32"]
    notes = []
    if gpu.tf32:
        searched.append("tf32")
    else:
        notes.append(f"tf32: {gpu.name} has no TF32 tensor cores (compute capability {gpu.compute_capability})")
    if gpu.bf16:
        searched.extend(["bf16", "bf16-weights"])
        if gpu.fp16_tflops <= gpu.bf16_tflops:
            notes.append(
                f"fp16: not searched; bf16 has the same dense peak on {gpu.name} ({gpu.bf16_tflops:g} TFLOP/s) "
                "and needs no loss scaling"
            )
        else:
            searched.append("fp16")
    else:
        notes.append(f"bf16: {gpu.name} has no bf16 support (needs compute capability >= 8.0)")
        if gpu.fp16_tflops > 0:
            searched.append("fp16")
    return searched, notes


def searched_precisions(space: SearchSpace, gpu: GPU, method: str = "full") -> list[str]:
    """The precisions the search varies for `method`: the space's own choice, else all the GPU
    supports; QLoRA's one (QLORA_PRECISIONS) whatever the space says."""
    if method == "qlora":
        return ["nf4+bf16" if gpu.bf16 else "nf4+fp16"]
    supported, _ = precisions_for(gpu)
    return [p for p in supported if space.precisions is None or p in space.precisions]


def precision_fields(name: str) -> dict[str, object]:
    """The Recipe fields of a PRECISIONS or QLORA_PRECISIONS name."""
    return {"fp16": False, "bf16": False, "tf32": False, **(PRECISIONS | QLORA_PRECISIONS)[name]}


def enumerate_recipes(space: SearchSpace, gpu: GPU) -> Iterator[Recipe]:
    """Every recipe of the space, expensive axes outermost (so traces are made in order)."""
    for method in space.methods:
        precisions = searched_precisions(space, gpu, method)
        for ckpt, precision, optim in itertools.product(space.checkpointing_options, precisions, space.optims):
            yield from _recipes(space, method, ckpt, precision, optim)


def _recipes(space: SearchSpace, method: str, ckpt: bool, precision: str, optim: str) -> Iterator[Recipe]:
    """The cheap axes (batch, sharding, compile) of one traced combination."""
    for (batch, accum), sharding, compiled in itertools.product(
        space.batch_options(), space.sharding_options(method).values(), space.compile_options
    ):
        fields: dict[str, object] = {
            "per_device_train_batch_size": batch,
            "gradient_accumulation_steps": accum,
            "gradient_checkpointing": ckpt,
            "optim": optim,
            "attn_implementation": "sdpa",
            "torch_compile": compiled,
            "zero_stage": 0, "offload": "none", "fsdp": "none",
        }
        yield space.base.replace(**{**fields, **METHODS[method], **precision_fields(precision), **sharding})


def method_of(recipe: Recipe) -> str:
    """The METHODS name of `recipe`: full, lora (incl. an 8-bit base) or qlora (a 4-bit base)."""
    return "full" if recipe.peft == "none" else "qlora" if recipe.load_in_4bit else "lora"


def precision_of(recipe: Recipe) -> str:
    """The PRECISIONS (or QLORA_PRECISIONS) name of `recipe` (its dtype resolved)."""
    if recipe.load_in_4bit:
        return f"{recipe.bnb_4bit_quant_type}+{recipe.mixed_precision if recipe.mixed_precision != 'no' else 'fp32'}"
    if recipe.dtype == "bfloat16":
        return "bf16-weights"
    return "fp16" if recipe.fp16 else "bf16" if recipe.bf16 else "tf32" if recipe.tf32 else "fp32"


def sharding_of(recipe: Recipe, num_gpus: int) -> str:
    """The sharding option's name (as in SINGLE/MULTI_GPU_SHARDING) for `recipe`."""
    if recipe.fsdp != "none":
        return f"fsdp_{recipe.fsdp}"
    if recipe.zero_stage == 0:
        return "ddp" if num_gpus > 1 else "none"
    return f"zero{recipe.zero_stage}" + ("+offload" if recipe.offload != "none" else "")
