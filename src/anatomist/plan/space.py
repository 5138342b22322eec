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
    base: Recipe = field(default_factory=Recipe)
    """Fields the search does not vary (dataloader workers, max_grad_norm ...)."""

    def __post_init__(self) -> None:
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

    def sharding_options(self) -> dict[str, dict[str, object]]:
        known = MULTI_GPU_SHARDING if self.num_gpus > 1 else SINGLE_GPU_SHARDING
        return {name: fields for name, fields in known.items() if self.shardings is None or name in self.shardings}


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


def searched_precisions(space: SearchSpace, gpu: GPU) -> list[str]:
    """The precisions the search varies: the space's own choice, else all the GPU supports."""
    supported, _ = precisions_for(gpu)
    return [p for p in supported if space.precisions is None or p in space.precisions]


def enumerate_recipes(space: SearchSpace, gpu: GPU) -> Iterator[Recipe]:
    """Every recipe of the space, expensive axes outermost (so traces are made in order)."""
    precisions = searched_precisions(space, gpu)
    for ckpt, precision, optim in itertools.product(space.checkpointing_options, precisions, space.optims):
        for (batch, accum), sharding, compiled in itertools.product(
            space.batch_options(), space.sharding_options().values(), space.compile_options
        ):
            fields: dict[str, object] = {
                "per_device_train_batch_size": batch,
                "gradient_accumulation_steps": accum,
                "gradient_checkpointing": ckpt,
                "fp16": False, "bf16": False, "tf32": False,
                "optim": optim,
                "attn_implementation": "sdpa",
                "torch_compile": compiled,
                "zero_stage": 0, "offload": "none", "fsdp": "none",
            }
            yield space.base.replace(**{**fields, **PRECISIONS[precision], **sharding})


def precision_of(recipe: Recipe) -> str:
    """The PRECISIONS name of `recipe` (its dtype resolved)."""
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
