"""What shapes a trace: the keys of the trace caches, in one place.

A trace of one part of a step depends on the model config, task and sequence length
(`Workload.trace_key`), the recipe fields of PART_FIELDS, the depth it is cut to, the batch size,
the cuBLAS workspace the GPU's compute capability gives, and the code that traced it. The first
five are `part_key`; the code is `code_digest` (every module and data file the tracer imports or
reads: TRACE_SOURCES, which tests/test_trace_keys.py checks against what a trace really loads)
together with the versions of anatomist, torch, transformers and peft (`disk_name`).

Nothing here imports torch or transformers: a repeated estimate finds its traces without them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from anatomist.hardware import cublas_workspace_bytes
from anatomist.trace.depth.cuts import Depth

if TYPE_CHECKING:
    from anatomist.recipe import ResolvedRecipe
    from anatomist.workload import Workload

Part = Literal["forward-backward", "optimizer", "inference", "train-step"]
"""Which part of a step a trace covers (`trace.step.driver.trace_step`)."""


PEFT_FIELDS = ("peft", "lora_r", "lora_dropout", "lora_target_modules", "lora_target_parameters", "load_in_4bit",
               "load_in_8bit", "llm_int8_skip_modules", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype")
"""What changes the model a trace builds under PEFT (which layers, which adapters, what is trainable)."""
LLM_FIELDS = ("use_liger_kernel", "cut_cross_entropy", "trainer", "precompute_ref_log_probs")
"""What changes the passes of a causal-LM fine-tune as TRL and the Trainer run it: Liger's kernels, Cut
Cross-Entropy, the trainer's loss (TRL's fused LM head, DPO's pairs and reference model). Padding-free training
changes the traced sequence length (`Workload.for_recipe`), packing nothing traced."""
PART_FIELDS: dict[str, tuple[str, ...]] = {
    "forward-backward": ("dtype", "gradient_checkpointing", "checkpoint_every", "checkpoint_offload", "activation_offloading",
                         "fp16", "bf16", "fp8", "fp8_all_gather", "attn_implementation",
                         "experts_implementation", "torch_compile", "tp_size", "ep_size", "ep_routing", "cp_size",
                         "sp_size", *PEFT_FIELDS, *LLM_FIELDS),
    "inference": ("dtype", "fp16", "bf16", "attn_implementation", "experts_implementation", "tp_size", "ep_size",
                  "ep_routing", *PEFT_FIELDS),
    "optimizer": ("dtype", "optim", "fp16", "max_grad_norm", "tp_size", "ep_size", *PEFT_FIELDS),
}
"""The recipe fields that change each part's trace. Recipes that differ only in the
optimizer share the passes' traces and the other way round; torch.compile changes the passes'
(`compiled`: inductor's partition and fused kernels) but not a checkpointed recipe's (`traced_compile`);
batch size, accumulation beyond 2 micro-batches and sharding change no trace (they are arithmetic on it);
flash_attention_2 shares SDPA's (`traced_attention`)."""


def traced_attention(recipe: ResolvedRecipe) -> str:
    """The attention the traced model is built with: SDPA stands in for flash_attention_2 (which needs
    CUDA and its package); SDPA's flash kernel keeps the same output and log-sum-exp."""
    return "sdpa" if recipe.attn_implementation == "flash_attention_2" else recipe.attn_implementation


def traced_compile(recipe: ResolvedRecipe) -> bool:
    """Whether the traced blocks run compiled (`trace.step.compiled`): under gradient checkpointing they stay eager
    (see its docstring), so a checkpointed recipe's passes are the same trace with torch.compile on or off."""
    return recipe.torch_compile and not recipe.gradient_checkpointing


def traced_micro_batches(recipe: ResolvedRecipe, part: Part) -> int:
    """Micro-batches a trace of `part` runs: two where gradients accumulate, so that a forward pass
    happens with gradients alive; more add nothing new."""
    return min(recipe.gradient_accumulation_steps, 2) if part == "forward-backward" else 1


def flash_attention_cast(recipe: ResolvedRecipe) -> bool:
    """Whether the traced SDPA casts float32 inputs as transformers' flash_attention_2 does
    (`cuda_paths.flash_attention_casts`): flash_attention_2 without autocast on half-precision weights, the dtype it
    casts to. Under autocast SDPA's inputs are cast to the same dtype already (CUDA's autocast lists it), and on float32
    weights the cast is to float32: there flash_attention_2 shares SDPA's trace."""
    return (recipe.attn_implementation == "flash_attention_2" and recipe.mixed_precision == "no"
            and recipe.dtype != "float32")


def _attention_key(recipe: ResolvedRecipe) -> str:
    return recipe.attn_implementation if flash_attention_cast(recipe) else traced_attention(recipe)


TRACED_AS: dict[str, Callable[[ResolvedRecipe], Any]] = {
    "attn_implementation": _attention_key,
    "torch_compile": traced_compile,
}
"""The fields a trace reads through a function of the recipe, keyed by what it reads: recipes that differ in
the field but not in that function's value share the trace."""


SHARDED_FIELDS = ("fsdp", "offload")
"""What else shapes the trace of an FSDP recipe (`trace.step.fsdp`): the strategy and CPU offload. The strategy sets
only whether a unit reshards after its forward, which an optimizer step never sees: its key (`part_key`) has none."""


def traced_world(recipe: ResolvedRecipe, num_gpus: int) -> int:
    """The world size the trace of `recipe` on `num_gpus` devices runs at: FSDP's step is traced as one rank of
    `num_gpus` (`trace.step.fsdp`), or under HSDP of its shard group (`num_gpus / dp_replicate_size`: a rank holds and
    gathers what FSDP over that many holds, its gradients' all-reduce across the replicas runs in place on the
    reduce-scattered shard), tensor parallel's without FSDP as one of its `tp_size` (`trace.step.tensor_parallel`);
    every other recipe's on one device (data parallelism holds on each device what one device holds; ZeRO is
    arithmetic over it). The one-device ops of an expert parallel recipe (`one_device`: without FSDP) are one rank's
    of `ep_size`, which computes what a rank of any world does (its share of the experts on the rows the routing
    sends it)."""
    if recipe.fsdp != "none":
        return num_gpus // recipe.dp_replicate_size
    return max(recipe.tp_size, recipe.ep_size, recipe.cp_size, recipe.sp_size)


def compile_context(workload: Workload, recipe: ResolvedRecipe) -> tuple[Any, ...]:
    """What shapes the compiled graphs of a block besides its own class, parameters and inputs (`trace.step.compiled`):
    the model's config and the recipe fields that change the passes' trace, FSDP's wrapping. Neither the depth nor
    the batch size (the inputs' shapes): the traces of one recipe at two depths share the graphs."""
    return (*workload.trace_key(), tuple(getattr(recipe, f) for f in PART_FIELDS["forward-backward"]),
            *(getattr(recipe, f) for f in SHARDED_FIELDS), traced_zero3_linear(recipe))


def one_device(recipe: ResolvedRecipe) -> ResolvedRecipe:
    """`recipe` as one device runs its computation: without FSDP, whose trace is one rank's. The op costs
    of the time model are one device's; the sharded step's collectives are `estimate.time.collectives`'. Tensor
    parallel stays: a device of it computes its shards of each product, and its collectives are among its ops. So does
    expert parallel: a device runs its share of the experts on the rows the all-to-all brings it (`traced_world`)."""
    return recipe if recipe.fsdp == "none" else recipe.replace(fsdp="none", offload="none")


def part_key(workload: Workload, recipe: ResolvedRecipe, part: Part, depth: Depth, batch_size: int,
             compute_capability: str, num_gpus: int = 1) -> tuple[Any, ...]:
    """Everything that decides the trace of `part` (on `num_gpus` devices): the key of the trace caches."""
    from anatomist.recipe import ResolvedRecipe

    if not isinstance(recipe, ResolvedRecipe):  # "auto" would key the same trace twice
        raise TypeError("trace keys take a ResolvedRecipe: recipe.resolved(workload)")
    fields = tuple(TRACED_AS[f](recipe) if f in TRACED_AS else getattr(recipe, f) for f in PART_FIELDS[part])
    strategy = (recipe.fsdp,) if part != "optimizer" else ()
    sharded = (traced_world(recipe, num_gpus), *strategy, recipe.offload) if recipe.fsdp != "none" else ()
    samples = workload.model_key() if part == "optimizer" else workload.trace_key()  # a step reads no sample
    return (
        *samples, part, fields, traced_micro_batches(recipe, part),
        depth, batch_size if part != "optimizer" else 1, cublas_workspace_bytes(compute_capability), sharded,
        *_kernel_paths(recipe, part, compute_capability),
    )


def _kernel_paths(recipe: ResolvedRecipe, part: Part, compute_capability: str) -> tuple[Any, ...]:
    """What else of the GPU changes a traced part: Liger's fused cross-entropy takes another path from
    compute capability 8.0 on (trace/standins/liger_kernels.py); ZeRO-3's linear saves what torch's does not
    (`traced_zero3_linear`)."""
    paths: tuple[Any, ...] = ("zero3-linear",) if traced_zero3_linear(recipe) and part != "optimizer" else ()
    if recipe.use_liger_kernel and part in ("forward-backward", "train-step"):
        return (*paths, "liger-sm80" if int(compute_capability.split(".")[0]) >= 8 else "liger-pre-sm80")
    return paths


def traced_zero3_linear(recipe: ResolvedRecipe) -> bool:
    """Whether the step is traced with DeepSpeed ZeRO-3's linear (trace/standins/zero3_linear.py): a ZeRO-3 recipe with
    LoRA on a base that calls `F.linear` (bitsandbytes' 4- and 8-bit layers do not), where it keeps the frozen base
    layers' inputs. Elsewhere it saves what torch's linear saves, so those recipes share torch's trace."""
    return recipe.zero_stage == 3 and recipe.peft != "none" and not (recipe.load_in_4bit or recipe.load_in_8bit)


def plan_key(workload: Workload, recipe: ResolvedRecipe) -> tuple[Any, ...]:
    """The key of a model's trace plan and exact size (`plan.model_plan`), at every length of its samples (the
    model is laid out on the meta device, fed nothing): the model in its load dtype (the trainable parameters'
    bytes) as PEFT makes it, and which of its blocks checkpoint (partial checkpointing makes kinds of blocks:
    `layout.CHECKPOINTED`) and which of its layers FP8 converts."""
    return ("plan", *workload.model_key(), recipe.dtype, recipe.fp8, tuple(getattr(recipe, f) for f in PEFT_FIELDS),
            recipe.checkpoint_every if recipe.gradient_checkpointing else 1)


TRACE_SOURCES: tuple[str, ...] = (
    "__init__.py", "anatomy.py", "config_fields.py", "errors.py", "hardware.py", "model_catalog.py", "model_config.py",
    "model_facts.py", "op_classes.py", "deepspeed_bounds.py", "token_stats.py", "trainer_defaults.py", "user_cache.py",
    "workload.py", "workload_loader.py",
    "recipe/__init__.py", "recipe/axis_values.py", "recipe/checks.py", "recipe/fields.py", "recipe/kinds.py",
    "recipe/parallel_checks.py", "recipe/presets.py", "recipe/recipe.py", "recipe/spellings.py",
    "axes/__init__.py", "axes/kernels.py", "axes/liger.py", "axes/methods.py", "axes/optimizers.py",
    "axes/precisions.py", "axes/quantization.py", "axes/shardings.py",
    "trace/__init__.py",
    "trace/engine/__init__.py", "trace/engine/allocator.py", "trace/engine/autocast.py", "trace/engine/cuda_paths.py",
    "trace/engine/op_costs.py", "trace/engine/records.py", "trace/engine/tracer.py",
    "trace/step/__init__.py", "trace/step/compiled.py", "trace/step/context_parallel.py", "trace/step/driver.py",
    "trace/step/experts.py",
    "trace/step/fp8.py", "trace/step/fsdp.py", "trace/step/inputs.py", "trace/step/offload.py",
    "trace/step/optimizer_build.py",
    "trace/step/passes.py", "trace/step/peft.py", "trace/step/peft_defaults.py", "trace/step/sequence_parallel.py", "trace/step/tensor_parallel.py",
    "trace/step/trainers.py",
    "trace/standins/__init__.py", "trace/standins/cce.py", "trace/standins/kernel_ops.py",
    "trace/standins/liger_kernels.py", "trace/standins/low_bit_adam.py", "trace/standins/trl_head.py",
    "trace/standins/zero3_linear.py",
    "trace/depth/__init__.py", "trace/depth/configs.py", "trace/depth/cuts.py", "trace/depth/layout.py",
    "trace/depth/plan.py", "trace/depth/worlds.py", "trace/depth/lengths.py",
    "trace/store/__init__.py", "trace/store/cache.py", "trace/store/keys.py", "trace/store/parts.py",
    "trace/store/pool.py",
    "data/__init__.py", "data/op_classes.toml", "data/cuda_autocast.toml", "data/gpus.toml", "data/liger.toml",
)
"""Every file of this package a trace depends on, relative to the package: the modules the tracer
imports and the data files it reads (a test traces a model in a fresh interpreter and fails if it
loads one that is not listed). A changed file invalidates every stored trace."""


@cache
def code_digest() -> str:
    """Digest of TRACE_SOURCES' contents: a changed tracer, op table or autocast policy is a new key."""
    digest = hashlib.sha256()
    package = Path(__file__).parents[2]
    for name in TRACE_SOURCES:
        digest.update(name.encode())
        digest.update((package / name).read_bytes())
    return digest.hexdigest()[:16]


@cache
def software_versions() -> tuple[str | None, ...]:
    """anatomist, torch, transformers and peft versions (from their metadata: nothing is imported) and
    the code digest: what else a stored trace must have been made with."""
    from anatomist import __version__

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return (__version__, version("torch"), version("transformers"), version("peft"), code_digest())


def disk_name(key: tuple[Any, ...]) -> str:
    """The file name of a stored trace: a digest of its key and the software that traced it."""
    return hashlib.sha256(repr((software_versions(), key)).encode()).hexdigest()[:40]
