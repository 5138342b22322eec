"""DeepSpeed ZeRO and CPU offload applied to one device's traced peak, with DeepSpeed's own buffers; plain data
parallelism's gradient buckets.

Data parallelism (DistributedDataParallel, what the Trainer runs on several devices without ZeRO or FSDP) holds
what one device holds, and its gradient buckets: to all-reduce the gradients the reducer copies them into buckets
of bucket_cap_mb (25 MiB), one flat tensor per bucket, made when the model is wrapped and kept, together holding
every trainable parameter's gradient in its dtype. With `gradient_as_bucket_view=False`, DDP's default, which
neither the Trainer nor accelerate changes, the `.grad` tensors are a second copy beside them (PyTorch's DDP docs:
`gradient_as_bucket_view` "can reduce peak memory usage, where the saved memory size will be equal to the total
gradients size"). So each device holds one more copy of the trainable gradients throughout the step
(`ddp_bucket_bytes`), counted as functionality-specific memory.

PyTorch FSDP is not here: its step is traced per rank (trace/sharded.py). DeepSpeed cannot run on
this machine's CPU build, so ZeRO stays an arithmetic model over one device's trace: ZeRO partitions
whole categories across the N data-parallel devices (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", section 5): stage 1 the optimizer states,
stage 2 also the gradients, stage 3 also the weights.

DeepSpeed with fp16/bf16 does not run autocast over fp32 weights, as the Trainer alone does: it casts
the model to the half dtype and keeps the fp32 master weights inside the optimizer (the paper's
"mixed-precision Adam": 2 + 2 + K bytes per parameter, K = 12 = fp32 weights, momentum and variance).
So on the device: weights 2 B/param, gradients in the half dtype (DeepSpeed's default gradient
accumulation dtype is the model's: deepspeed 0.19 `engine.get_data_types`), optimizer states = the
traced states + 4 B/param of master weights (/N from stage 1). With fp32, the traced categories are
DeepSpeed's and are only divided. Under LoRA/QLoRA the gradients, master weights and states are the
trainable (adapter) parameters' only, and a 4-/8-bit base keeps its traced codes (it is not recast).

DeepSpeed's buffers (deepspeed 0.19.8, sized from the recipe's ZeRO values, "auto" filled as the
Trainer fills it: `Recipe.resolved`; each is functionality-specific memory unless said):
- stages 1-2, `stage_1_and_2.py` `setup_buckets`: the gradient reduction bucket of
  reduce_bucket_size elements in the gradient dtype, doubled with overlap_comm (which `plan --emit
  deepspeed` sets from stage 2).
- stage 3, `stage3.py`: the reduction bucket (reduce_bucket_size elements, one); the gradient
  partitions as one flat buffer of P/N elements made at start-up and kept (`grad_partitions_flat_buffer`:
  the gradients, in every phase); the parameter partitions (P/N) but for parameters of at most
  stage3_param_persistence_threshold elements, which stay whole; and the gathered parameters:
  `partitioned_param_coordinator.py` `__params_to_release` keeps a module's parameters gathered after
  it ran when they are used again within the next stage3_max_reuse_distance parameter elements of the
  recorded module order (forward then backward: a model of fewer elements keeps every block gathered
  from its forward to its backward), and the prefetch fetches up to stage3_prefetch_bucket_size more
  (capped by stage3_max_live_parameters): the gathered set is taken as min(the non-persistent
  parameters, max(stage3_max_reuse_distance, one block) + stage3_prefetch_bucket_size), a bound.
- allgather_bucket_size sizes nothing: with NCCL's all_gather_into_tensor, ZeRO-1/2 gather the updated
  partitions in place (`runtime/utils.py` `all_gather_dp_groups`).

CPU offload, as `plan --emit deepspeed` writes it: ZeRO-Offload (Ren et al. 2021) keeps the optimizer
states, master weights included, on the host and moves each gradient partition there as backward
produces it (stage >= 2); at stage 3 the parameter partitions are offloaded too (`offload_param`,
ZeRO-Infinity): the device holds the persistent and gathered parameters; the optimizer step runs on the
host. From stage 1 the optimizer step's temporaries cover this device's partition only. The allocator's
reserve keeps its ratio to the allocated peak.

Known limitations: the gradient buckets on their way to the host under offload, and the pinned
staging buffers, are not added. NOT validated on a GPU (DeepSpeed needs CUDA or oneCCL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from anatomist.anatomy import MemoryCategory, Phase
from anatomist.axes.shardings import RESHARD_AFTER_FORWARD
from anatomist.recipe import Recipe, ResolvedRecipe
from anatomist.trace.allocator import round_size
from anatomist.trace.records import PhasePeak

HALF_BYTES = 2
MASTER_WEIGHT_BYTES = 4


def ddp_bucket_bytes(trainable_bytes: int) -> int:
    """DistributedDataParallel's gradient buckets on one device (module docstring): the trainable parameters' bytes.
    Each bucket is rounded to the allocator's 512-byte blocks; counted as the sum rounded once (under 512 bytes a
    bucket short: a bucket is up to 25 MiB)."""
    return round_size(trainable_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSize:
    """What the ZeRO arithmetic needs of the model as the recipe trains it."""

    parameters: int
    """Parameters of the full model (the meta-device count)."""
    trainable: int
    """Trainable parameters: those with gradients, fp32 master weights and optimizer states (all but the
    frozen base under LoRA/QLoRA)."""
    persistent: int = 0
    """Parameters of at most stage3_param_persistence_threshold elements (kept whole under ZeRO-3)."""
    block: int = 0
    """Parameters of the largest repeated block."""
    trainable_bytes: int = 0
    """Bytes of the trainable parameters in their dtypes (data parallelism's gradient buckets)."""


def persistent_parameters(numels: tuple[int, ...], threshold: int) -> int:
    """Elements of the parameters ZeRO-3 keeps whole: those of at most `threshold` elements
    (`stage3.py`: `ds_persist` when numel <= param_persistence_threshold)."""
    return sum(n for n in numels if n <= threshold)


def shard(peak: PhasePeak, recipe: ResolvedRecipe, model: ModelSize, num_gpus: int, mode: str,
          phase: Phase) -> PhasePeak:
    """`peak` of `phase` (traced on one device) as one of `num_gpus` devices holds it under DeepSpeed ZeRO, or under
    data parallelism (one device's and DDP's gradient buckets); FSDP's unchanged (its peak is traced per rank)."""
    stage = recipe.zero_stage
    if mode != "train" or recipe.fsdp != "none" or (stage == 0 and num_gpus <= 1):
        return peak
    if stage == 0:
        buckets = ddp_bucket_bytes(model.trainable_bytes)
        categories = dict(peak.categories)
        categories[MemoryCategory.FUNCTIONALITY] += buckets
        return PhasePeak(allocated=peak.allocated + buckets, reserved=peak.reserved + buckets, categories=categories)
    n = max(num_gpus, 1)
    p, t = model.parameters, model.trainable
    categories = dict(peak.categories)
    mixed = recipe.mixed_precision != "no"
    quantized = recipe.load_in_4bit or recipe.load_in_8bit  # the base's codes are not recast to the half dtype
    if mixed and not quantized:  # DeepSpeed's mixed-precision layout: the whole module cast to the half dtype
        categories[MemoryCategory.WEIGHTS] = HALF_BYTES * p
    weight_bytes = categories[MemoryCategory.WEIGHTS] / max(p, 1)
    grad_bytes = HALF_BYTES if mixed else 4
    if mixed:  # gradients in the half dtype, fp32 master weights of the trainable parameters in the optimizer
        categories[MemoryCategory.GRADIENTS] = categories[MemoryCategory.GRADIENTS] // 2
        categories[MemoryCategory.OPTIMIZER_STATES] += MASTER_WEIGHT_BYTES * t
    categories[MemoryCategory.OPTIMIZER_STATES] //= n
    if phase is Phase.OPTIMIZER:  # the step's temporaries cover this device's partition only
        categories[MemoryCategory.TEMPORARY] //= n
    categories[MemoryCategory.FUNCTIONALITY] += buffer_bytes(recipe, grad_bytes)
    if stage == 2:
        categories[MemoryCategory.GRADIENTS] //= n
    if stage == 3:
        partitioned = p - model.persistent
        kept = max(recipe.stage3_max_reuse_distance or 0, model.block) + (recipe.stage3_prefetch_bucket_size or 0)
        gathered = min(partitioned, kept)
        on_host = 0 if recipe.offload == "none" else math.ceil(partitioned / n)
        categories[MemoryCategory.WEIGHTS] = round(
            weight_bytes * (math.ceil(partitioned / n) - on_host + model.persistent + gathered))
        categories[MemoryCategory.GRADIENTS] = grad_bytes * math.ceil(t / n)  # the flat partitions, always there
    if recipe.offload in ("cpu", "nvme"):
        categories[MemoryCategory.OPTIMIZER_STATES] = 0
        if phase is Phase.OPTIMIZER:  # the step runs on the host
            categories[MemoryCategory.TEMPORARY] = 0
        if stage >= 2:
            categories[MemoryCategory.GRADIENTS] = 0
    allocated = sum(categories.values())
    # The caching allocator's reserve is kept in proportion: most of it is segments of the
    # categories that sharding shrinks.
    reserved = round(allocated * peak.reserved / peak.allocated) if peak.allocated else 0
    return PhasePeak(allocated=allocated, reserved=max(reserved, allocated), categories=categories)


def buffer_bytes(recipe: ResolvedRecipe, grad_bytes: int) -> int:
    """DeepSpeed's gradient reduction buckets on one device (module docstring)."""
    if recipe.zero_stage == 0 or recipe.reduce_bucket_size is None:
        return 0
    buffers = 2 if recipe.zero_stage == 2 and overlap_comm(recipe) else 1
    return buffers * recipe.reduce_bucket_size * grad_bytes


def overlap_comm(recipe: Recipe) -> bool:
    """Whether the run overlaps reduction with backward: what `plan --emit deepspeed` writes (from stage 2)."""
    return recipe.zero_stage >= 2


def sharding_notes(recipe: ResolvedRecipe, num_gpus: int, mode: str) -> list[str]:
    """What the estimate says of how the recipe's sharding was predicted."""
    if mode != "train":
        return []
    if recipe.zero_stage:
        gathered = (f"; gathered parameters up to stage3_max_reuse_distance={recipe.stage3_max_reuse_distance:,} + "
                    f"stage3_prefetch_bucket_size={recipe.stage3_prefetch_bucket_size:,} elements, those of at most "
                    f"{recipe.stage3_param_persistence_threshold:,} kept whole"
                    if recipe.zero_stage == 3 else "")
        return [f"DeepSpeed ZeRO-{recipe.zero_stage} on {num_gpus} GPU(s): arithmetic over one device's trace (DeepSpeed "
                f"cannot run here) with its buffers: reduce_bucket_size={recipe.reduce_bucket_size:,} elements"
                f"{gathered}; not validated on a GPU"]
    if recipe.fsdp == "none":
        return [f"data parallelism on {num_gpus} GPUs: each holds one device's step and DistributedDataParallel's "
                "gradient buckets (gradient_as_bucket_view=False, the Trainer's: one more copy of the trainable "
                "gradients, as functionality)"] if num_gpus > 1 else []
    offload = "; CPUOffloadPolicy: sharded parameters, gradients, optimizer states and step on the host" \
        if recipe.offload == "cpu" else ""
    return [f"fsdp {recipe.fsdp}: one rank of {num_gpus} traced running PyTorch's FSDP2 as the Trainer wraps it "
            f"(fully_shard per block, the output head and final norm, then the root; reshard_after_forward="
            f"{RESHARD_AFTER_FORWARD[recipe.fsdp]}) under the fake process group: weights are this rank's shards and "
            f"the unsharded parameters of the units in flight, functionality includes the all-gather and "
            f"reduce-scatter buffers{offload}"]
