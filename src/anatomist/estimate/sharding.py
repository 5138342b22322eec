"""DeepSpeed ZeRO sharding and CPU offload applied to a traced single-device peak.

An arithmetic model, not a trace: ZeRO partitions whole categories across the
data-parallel devices (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", section 5):
  stage 1: optimizer states / N;  stage 2: also gradients / N;  stage 3: also weights / N.
PyTorch FSDP shards the same categories (Zhao et al. 2023, "PyTorch FSDP", section 3):
full_shard like stage 3, shard_grad_op like stage 2 (`Recipe.sharding_stage`).
Offload to CPU (ZeRO-Offload) moves the optimizer states off the device entirely.
The bytes removed from a category are removed from the phase's allocated and reserved
peaks, since these categories are alive throughout the step.

Known limitations: DeepSpeed's own bucket buffers (reduce_bucket_size, allgather_bucket_size,
stage-3 prefetch) are not added; they are a few hundred MB at the defaults.
"""

from __future__ import annotations

from anatomist.anatomy import MemoryCategory
from anatomist.estimate.step import PhasePeak
from anatomist.recipe import Recipe


def shard(peak: PhasePeak, recipe: Recipe, parameters: int, num_gpus: int, mode: str) -> PhasePeak:  # noqa: ARG001
    stage = recipe.sharding_stage
    if mode != "train" or (stage == 0 and num_gpus == 1):
        return peak
    keep = dict.fromkeys(peak.categories, 1.0)
    n = max(num_gpus, 1)
    if stage >= 1:
        keep[MemoryCategory.OPTIMIZER_STATES] = 1.0 / n
    if stage >= 2:
        keep[MemoryCategory.GRADIENTS] = 1.0 / n
    if stage >= 3:
        keep[MemoryCategory.WEIGHTS] = 1.0 / n
    if recipe.offload in ("cpu", "nvme"):
        keep[MemoryCategory.OPTIMIZER_STATES] = 0.0
    categories = {c: round(v * keep[c]) for c, v in peak.categories.items()}
    removed = sum(peak.categories.values()) - sum(categories.values())
    return PhasePeak(
        allocated=peak.allocated - removed,
        reserved=max(peak.reserved - removed, peak.allocated - removed),
        categories=categories,
    )
