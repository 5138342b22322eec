"""DeepSpeed ZeRO and PyTorch FSDP sharding, and CPU offload, applied to a traced peak.

An arithmetic model, not a trace: ZeRO partitions whole categories across the N
data-parallel devices (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", section 5): stage 1 the optimizer states, stage 2 also the
gradients, stage 3 also the weights.

DeepSpeed with fp16/bf16 does not run autocast over fp32 weights, as the Trainer alone does:
it casts the model to the half dtype and keeps the fp32 master weights inside the optimizer
(the paper's "mixed-precision Adam": 2 + 2 + K bytes per parameter, K = 12 = fp32 weights,
momentum and variance). So on the device: weights 2 B/param (/N at stage 3), gradients in the
half dtype (half the traced fp32 gradients; /N from stage 2), optimizer states = the traced
states + 4 B/param of master weights (/N from stage 1). With fp32, the traced categories are
DeepSpeed's and are only divided.

PyTorch FSDP shards the same categories (Zhao et al. 2023, "PyTorch FSDP", section 3):
full_shard like stage 3, shard_grad_op like stage 2 (`Recipe.sharding_stage`); it keeps the
fp32 weights sharded and gathers them in the half dtype, so the traced categories are divided.

CPU offload, as `plan --emit deepspeed` writes it: ZeRO-Offload (Ren et al. 2021) keeps the
optimizer states, master weights included, on the host and moves each gradient partition
there as backward produces it (stage >= 2), so neither stays on the device; at stage 3 the
parameters are offloaded too (`offload_param`, ZeRO-Infinity), so the device holds only the
layers being gathered; the optimizer step runs on the host. From stage 1 the optimizer
step's temporaries cover this device's partition only. The allocator's reserve keeps its
ratio to the allocated peak.

Known limitations: DeepSpeed's own buffers are not added: the reduce and all-gather buckets
(`plan --emit deepspeed` sets both to BUCKET_ELEMENTS), stage-3 prefetch and the gathered
layers, and under offload the gradient buckets on their way to the host. NOT validated on a GPU.
"""

from __future__ import annotations

from anatomist.anatomy import MemoryCategory, Phase
from anatomist.axes.shardings import RESHARD_AFTER_FORWARD
from anatomist.recipe import ResolvedRecipe
from anatomist.trace.records import PhasePeak

HALF_BYTES = 2
MASTER_WEIGHT_BYTES = 4
BUCKET_ELEMENTS = 50_000_000
"""reduce_bucket_size and allgather_bucket_size of the emitted DeepSpeed configs (DeepSpeed's
default is 5e8 elements, a GB per half-precision bucket); written out so that the buffers the
estimate leaves out stay small and known."""


def shard(peak: PhasePeak, recipe: ResolvedRecipe, parameters: int, num_gpus: int, mode: str, phase: Phase) -> PhasePeak:
    """`peak` of `phase` (traced on one device, no sharding) as one of `num_gpus` devices holds it under `recipe`."""
    stage = recipe.sharding_stage
    if mode != "train" or (stage == 0 and num_gpus == 1) or recipe.fsdp != "none":
        return peak  # FSDP's peak is traced per rank (trace/sharded.py)
    n = max(num_gpus, 1)
    categories = dict(peak.categories)
    if recipe.zero_stage >= 1 and recipe.mixed_precision != "no":  # DeepSpeed's mixed-precision layout
        categories[MemoryCategory.WEIGHTS] = HALF_BYTES * parameters
        categories[MemoryCategory.GRADIENTS] = categories[MemoryCategory.GRADIENTS] // 2
        categories[MemoryCategory.OPTIMIZER_STATES] += MASTER_WEIGHT_BYTES * parameters
    if stage >= 1:
        categories[MemoryCategory.OPTIMIZER_STATES] //= n
        if phase is Phase.OPTIMIZER:  # the step's temporaries cover this device's partition only
            categories[MemoryCategory.TEMPORARY] //= n
    if stage >= 2:
        categories[MemoryCategory.GRADIENTS] //= n
    if stage >= 3:
        categories[MemoryCategory.WEIGHTS] //= n
    if recipe.offload in ("cpu", "nvme"):
        categories[MemoryCategory.OPTIMIZER_STATES] = 0
        if phase is Phase.OPTIMIZER:  # the step runs on the host
            categories[MemoryCategory.TEMPORARY] = 0
        if stage >= 2:
            categories[MemoryCategory.GRADIENTS] = 0
        if stage >= 3:
            categories[MemoryCategory.WEIGHTS] = 0
    allocated = sum(categories.values())
    # The caching allocator's reserve is kept in proportion: most of it is segments of the
    # categories that sharding shrinks.
    reserved = round(allocated * peak.reserved / peak.allocated) if peak.allocated else 0
    return PhasePeak(allocated=allocated, reserved=max(reserved, allocated), categories=categories)


def sharding_notes(recipe: ResolvedRecipe, num_gpus: int, mode: str) -> list[str]:
    """What the estimate says of how the recipe's sharding was predicted."""
    if mode != "train" or recipe.fsdp == "none":
        return []
    offload = "; CPUOffloadPolicy: sharded parameters, gradients, optimizer states and step on the host" \
        if recipe.offload == "cpu" else ""
    return [f"fsdp {recipe.fsdp}: one rank of {num_gpus} traced running PyTorch's FSDP2 as the Trainer wraps it "
            f"(fully_shard per block, the output head and final norm, then the root; reshard_after_forward="
            f"{RESHARD_AFTER_FORWARD[recipe.fsdp]}) under the fake process group: weights are this rank's shards and "
            f"the unsharded parameters of the units in flight, functionality includes the all-gather and "
            f"reduce-scatter buffers{offload}"]
