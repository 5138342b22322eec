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

PyTorch FSDP is not here: its step is traced per rank (trace/step/fsdp.py). DeepSpeed ZeRO is arithmetic over one
device's trace of the step as the engine runs it (`as_deepspeed_runs`): ZeRO partitions whole categories across
the N data-parallel devices (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", section 5): stage 1 the optimizer states, stage 2 also the gradients, stage 3 also the weights.
Each rule follows deepspeed 0.19.8 and is checked against DeepSpeed's own ZeRO optimizer running the Trainer's step
on a CPU gloo group, measured by PyTorch's MemTracker (tests/test_deepspeed_accuracy.py):
- With fp16/bf16 the engine casts the module to that dtype and runs it without autocast: weights, activations and
  gradients are pure half precision whatever the load dtype (`runtime/engine.py` `_cast_module_mixed_precision`).
  Without, it runs the module as loaded.
- Master weights: every ZeRO stage copies this device's partition of the trainable parameters into a flat fp32
  tensor per parameter group, whatever the load dtype and precision, fp32 weights included (`stage_1_and_2.py`
  `single_partition_of_fp32_groups`, `.clone().to(master_weights_and_grads_dtype)`; `stage3.py`
  `fp32_partitioned_groups_flat`): 4 B x trainable/N; 2 B with bf16_master_weights_and_grads.
- Optimizer states: the optimizer the Trainer built is handed those flat partitions as its parameters, so its
  state is that of one 1-D fp32 tensor of trainable/N elements (`OptimizerSpec.flat_state_bytes`: AdamW 8 B, SGD
  4 B, Adafactor 4 B, since a 1-D tensor's second moment is not factored; the low-bit ones' blocks), in bf16 with
  bf16_optimizer_states (which needs bf16 master weights: `base_optimizer.py` `_configure_master_weights`, where
  bf16 master weights with fp32 states also need ZeRO-Offload).
- Gradients: ZeRO's gradient partitions are in its gradient-accumulation dtype, which is fp16/bf16 where that mode is
  on and fp32 where not, bf16-loaded weights included (`engine.get_data_types`: grad_accum_dtype unset; the
  parameters' own .grad stay in their dtype until reduced). Stage 1 keeps them whole.
  Stage 2 reduces them into a flat partition of trainable/N elements made at the first reduction of a gradient of
  this device's partition (`copy_grads_in_partition`) and held until the step: at the passes' peak, early in
  backward, counted as the traced gradients / N (known limitation: on the device whose partition holds the output
  head the partition can exist from just after the head's backward, up to 2 B x trainable/N more). Stage 3 keeps a
  flat buffer of its partition from start-up (`grad_partitions_flat_buffer`). In the step, each parameter group's
  gradient is copied into the master dtype (`.to(fp32)`, freed after its group's step; stage 3 by sub-groups of
  sub_group_size elements): 4 B x trainable/N more where the gradients are half.
- The step's temporaries cover this device's partition in the master dtype: the traced step's, over N, in fp32.

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
staging buffers, are not added. NOT validated on a GPU; checked against DeepSpeed's CPU accelerator over gloo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from anatomist.anatomy import TENSOR_CATEGORIES, MemoryCategory, Phase
from anatomist.axes.optimizers import optimizer
from anatomist.axes.shardings import RESHARD_AFTER_FORWARD
from anatomist.recipe import Recipe, ResolvedRecipe
from anatomist.trace.engine.allocator import round_size
from anatomist.trace.engine.records import PhasePeak
from anatomist.trace.store.keys import traced_zero3_linear

HALF_BYTES = 2
MASTER_WEIGHT_BYTES = 4
HALF_DTYPE_OF = {"fp16": "float16", "bf16": "bfloat16"}
ZERO_SUB_GROUP_ELEMENTS = 10**9
"""DeepSpeed's sub_group_size default (`DeepSpeedZeroConfig`), which the Trainer leaves: ZeRO-3 steps its partition
in sub-groups of at most this many elements, each with its own fp32 gradient."""


def ddp_bucket_bytes(trainable_bytes: int) -> int:
    """DistributedDataParallel's gradient buckets on one device (module docstring): the trainable parameters' bytes.
    Each bucket is rounded to the allocator's 512-byte blocks; counted as the sum rounded once (under 512 bytes a
    bucket short: a bucket is up to 25 MiB)."""
    return round_size(trainable_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroSize:
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
    parameter_bytes: int = 0
    """Bytes of every parameter in its dtype as the step runs it (ZeRO-3's flat partitions)."""
    persistent_bytes: int = 0
    """What the parameters kept whole take: each a tensor of its own, rounded as the caching allocator rounds it."""

    @property
    def trainable_element_bytes(self) -> int:
        """Bytes per element of the trainable parameters as the step runs them."""
        return round(self.trainable_bytes / self.trainable) if self.trainable else MASTER_WEIGHT_BYTES


def persistent_parameters(numels: tuple[int, ...], threshold: int) -> int:
    """Elements of the parameters ZeRO-3 keeps whole: those of at most `threshold` elements
    (`stage3.py`: `ds_persist` when numel <= param_persistence_threshold)."""
    return sum(n for n in numels if n <= threshold)


def persistent_bytes(numels: tuple[int, ...], threshold: int, element_bytes: float) -> int:
    """What the parameters ZeRO-3 keeps whole take on the device: one tensor each, rounded by the allocator."""
    return sum(round_size(math.ceil(n * element_bytes)) for n in numels if n <= threshold)


def shard(peak: PhasePeak, recipe: ResolvedRecipe, model: ZeroSize, num_gpus: int, mode: str,
          phase: Phase) -> PhasePeak:
    """`peak` of `phase` (traced on one device) as one of `num_gpus` devices holds it under DeepSpeed ZeRO, or under
    data parallelism (one device's and DDP's gradient buckets); FSDP's and tensor parallel's unchanged (their peaks are
    traced per rank)."""
    stage = recipe.zero_stage
    if mode != "train" or recipe.fsdp != "none" or recipe.tp_size > 1 or (stage == 0 and num_gpus <= 1):
        return peak
    if stage == 0:
        buckets = ddp_bucket_bytes(model.trainable_bytes)
        categories = dict(peak.categories)
        categories[MemoryCategory.FUNCTIONALITY] += buckets
        return PhasePeak(allocated=peak.allocated + buckets, reserved=peak.reserved + buckets, categories=categories)
    categories = _zero_categories(dict(peak.categories), recipe, model, max(num_gpus, 1), phase)
    allocated = sum(categories.values())
    # The caching allocator's reserve is kept in proportion: most of it is segments of the
    # categories that sharding shrinks.
    reserved = round(allocated * peak.reserved / peak.allocated) if peak.allocated else 0
    return PhasePeak(allocated=allocated, reserved=max(reserved, allocated), categories=categories)


def counted_shares(recipe: ResolvedRecipe, model: ZeroSize, num_gpus: int, mode: str,
                   phase: Phase) -> tuple[float, ...] | None:
    """How much of each traced category (`TENSOR_CATEGORIES`) of a point of `phase` stays as traced on one of
    `num_gpus` devices under ZeRO (`shard`, `_zero_categories`): the rest is replaced by what does not change within
    the phase (the optimizer's states; ZeRO-3's gradient partitions and its partitioned and gathered weights; ZeRO-2's
    flat partition in the step, offloaded gradients), or shrinks with the partition (ZeRO-2's reduced gradients, the
    step's temporaries). The phase's peak is the point highest in what stays (`ExtrapolatedCurves.phase_at`). None
    where every category stays (no ZeRO)."""
    stage, offloaded = recipe.zero_stage, recipe.offload != "none"
    if mode != "train" or recipe.fsdp != "none" or recipe.tp_size > 1 or stage == 0:
        return None
    n = max(num_gpus, 1)
    shares = dict.fromkeys(TENSOR_CATEGORIES, 1.0)
    shares[MemoryCategory.OPTIMIZER_STATES] = 0.0
    if phase is Phase.OPTIMIZER:
        master_bytes = HALF_BYTES if recipe.bf16_master_weights_and_grads else MASTER_WEIGHT_BYTES
        shares[MemoryCategory.TEMPORARY] = 0.0 if offloaded else master_bytes / (model.trainable_element_bytes * n)
    if stage == 2 and phase is not Phase.OPTIMIZER and not offloaded:
        shares[MemoryCategory.GRADIENTS] = 1 / n
    elif stage >= 2:
        shares[MemoryCategory.GRADIENTS] = 0.0
    if stage == 3 and model.parameter_bytes:
        shares[MemoryCategory.WEIGHTS] = 0.0
    return tuple(shares[c] for c in TENSOR_CATEGORIES)


def _zero_categories(categories: dict[MemoryCategory, int], recipe: ResolvedRecipe, model: ZeroSize, n: int,
                     phase: Phase) -> dict[MemoryCategory, int]:
    """One device's categories under ZeRO, from one device's traced step as DeepSpeed runs it (`as_deepspeed_runs`:
    weights and gradients already in the engine's dtype). The module docstring says what each rule follows."""
    stage, offloaded = recipe.zero_stage, recipe.offload != "none"
    part = -(-model.trainable // n)  # this device's elements of the flat partitions of the trainable parameters
    grad_bytes = HALF_BYTES if recipe.mixed_precision != "no" else MASTER_WEIGHT_BYTES  # ZeRO's gradient partitions
    master_bytes = HALF_BYTES if recipe.bf16_master_weights_and_grads else MASTER_WEIGHT_BYTES
    categories[MemoryCategory.OPTIMIZER_STATES] = 0 if offloaded else zero_optimizer_bytes(recipe, part)
    if phase is Phase.OPTIMIZER:
        # The step runs over this device's partition, in the master dtype; offloaded, on the host.
        step = categories[MemoryCategory.TEMPORARY] * master_bytes // (model.trainable_element_bytes * n)
        categories[MemoryCategory.TEMPORARY] = 0 if offloaded else step
    categories[MemoryCategory.FUNCTIONALITY] += buffer_bytes(recipe, grad_bytes)
    if stage == 2 and phase is Phase.OPTIMIZER:  # the flat gradient partition the step reads
        categories[MemoryCategory.GRADIENTS] = grad_bytes * part
    elif stage == 2:  # at the passes' peak, what has been reduced into the partition so far
        categories[MemoryCategory.GRADIENTS] //= n
    if stage == 3:
        categories[MemoryCategory.GRADIENTS] = grad_bytes * part  # the flat partitions, made at start-up
        categories[MemoryCategory.WEIGHTS] = _stage3_weight_bytes(categories[MemoryCategory.WEIGHTS], recipe, model, n,
                                                                  gathered=phase is not Phase.OPTIMIZER)
    if phase is Phase.OPTIMIZER and not offloaded and master_bytes != grad_bytes:
        categories[MemoryCategory.GRADIENTS] += master_bytes * min(part, ZERO_SUB_GROUP_ELEMENTS)
    if offloaded and stage >= 2:
        categories[MemoryCategory.GRADIENTS] = 0
    return categories


def _stage3_weight_bytes(traced: int, recipe: ResolvedRecipe, model: ZeroSize, n: int, *, gathered: bool) -> int:
    """ZeRO-3's weights on one device: its partition of the parameters (none under offload_param), those kept whole,
    and in forward and backward the gathered ones (module docstring; backward's last module releases them before the
    step). The partition and the gathered parameters are flat buffers in the parameters' dtype (`stage3.py`, the
    coalesced all-gather): not rounded tensor by tensor, as the traced weights (`traced`, the fallback) are."""
    element_bytes = (model.parameter_bytes or traced) / max(model.parameters, 1)
    partitioned = model.parameters - model.persistent
    kept = max(recipe.stage3_max_reuse_distance or 0, model.block) + (recipe.stage3_prefetch_bucket_size or 0)
    on_device = 0 if recipe.offload != "none" else math.ceil(partitioned / n)
    flat = on_device + (min(partitioned, kept) if gathered else 0)
    return round(element_bytes * flat) + model.persistent_bytes


def zero_optimizer_bytes(recipe: ResolvedRecipe, part: int) -> int:
    """What ZeRO's optimizer holds on one device for a partition of `part` elements: the master weights (fp32, or
    bf16 with bf16_master_weights_and_grads) and the optimizer's state over them (fp32, or bf16 with
    bf16_optimizer_states), whatever dtype the model was loaded in."""
    master_bytes = HALF_BYTES if recipe.bf16_master_weights_and_grads else MASTER_WEIGHT_BYTES
    state_bytes = HALF_BYTES if recipe.bf16_optimizer_states else MASTER_WEIGHT_BYTES
    return master_bytes * part + optimizer(recipe.optim).flat_state_bytes(part, state_bytes)


def as_deepspeed_runs(recipe: ResolvedRecipe) -> ResolvedRecipe:
    """`recipe`'s step as DeepSpeed runs it, which is what is traced for a ZeRO recipe: with fp16 or bf16 the engine
    casts every floating-point parameter to that dtype (deepspeed 0.19.8 `runtime/engine.py`
    `_configure_distributed_model`, `_cast_module_mixed_precision`) and the step runs without autocast (accelerate
    leaves mixed precision to DeepSpeed: the Trainer opens none), so weights, activations and gradients are those of
    pure half-precision training whatever the load dtype. Known limitations: the engine also casts PEFT's fp32 LoRA
    adapters to the half dtype, which the trace keeps in fp32 with their inputs' fp32 copies (a 5-block Llama's LoRA
    step under ZeRO-2 predicted 9% high against DeepSpeed's own); a 4-/8-bit base keeps its traced layout, and the
    fp32 copies prepare_model_for_kbit_training makes stay fp32 here."""
    if recipe.zero_stage == 0 or recipe.mixed_precision == "no" or recipe.quantized:
        return recipe
    return recipe.replace(dtype=HALF_DTYPE_OF[recipe.mixed_precision], fp16=False, bf16=False,
                          bf16_master_weights_and_grads=False, bf16_optimizer_states=False)  # shard()'s, not the trace's


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
        linear = ("; traced with ZeRO-3's linear (memory_efficient_linear, DeepSpeed's default), which keeps each frozen "
                  "base layer's input for backward" if traced_zero3_linear(recipe) else "")
        zero = (f"DeepSpeed ZeRO-{recipe.zero_stage} on {num_gpus} GPU(s): arithmetic over one device's trace "
                f"(DeepSpeed cannot run here) with its buffers: reduce_bucket_size={recipe.reduce_bucket_size:,} "
                f"elements{gathered}{linear}; not validated on a GPU")
        return [zero, sequence_parallel_note(recipe, num_gpus)] if recipe.sp_size > 1 else [zero]
    if recipe.tp_size > 1:
        return [tensor_parallel_note(recipe, num_gpus)]
    if recipe.ep_size > 1:
        return [expert_parallel_note(recipe, num_gpus)]
    if recipe.cp_size > 1:
        return [context_parallel_note(recipe, num_gpus)]
    if recipe.fsdp == "none":
        return [f"data parallelism on {num_gpus} GPUs: each holds one device's step and DistributedDataParallel's "
                "gradient buckets (gradient_as_bucket_view=False, the Trainer's: one more copy of the trainable "
                "gradients, as functionality)"] if num_gpus > 1 else []
    offload = "; CPUOffloadPolicy: sharded parameters, gradients, optimizer states and step on the host" \
        if recipe.offload == "cpu" else ""
    replicas = recipe.dp_replicate_size
    if replicas > 1:
        hybrid = (f"HSDP, {replicas} replicas of FSDP over {num_gpus // replicas} GPUs (accelerate's 2-D mesh): a rank "
                  f"holds what a rank of FSDP over {num_gpus // replicas} holds (its gradients' all-reduce across the "
                  "replicas runs in place on the reduce-scattered shard), so it is traced as one of those")
        return [f"fsdp {recipe.fsdp}: {hybrid}; PyTorch's FSDP2 as the Trainer wraps it (fully_shard per block, the "
                f"output head and final norm, then the root; reshard_after_forward={RESHARD_AFTER_FORWARD[recipe.fsdp]}) "
                f"under the fake process group{offload}"]
    return [f"fsdp {recipe.fsdp}: one rank of {num_gpus} traced running PyTorch's FSDP2 as the Trainer wraps it "
            f"(fully_shard per block, the output head and final norm, then the root; reshard_after_forward="
            f"{RESHARD_AFTER_FORWARD[recipe.fsdp]}) under the fake process group: weights are this rank's shards and "
            f"the unsharded parameters of the units in flight, functionality includes the all-gather and "
            f"reduce-scatter buffers{offload}"]


def tensor_parallel_note(recipe: ResolvedRecipe, num_gpus: int) -> str:
    """How a tensor parallel recipe's rank was traced (`trace.step.tensor_parallel`)."""
    fsdp = (f", then transformers' FSDP2 over the {num_gpus // recipe.tp_size} data-parallel ranks (full_shard"
            f"{', weights gathered in bfloat16, gradients reduced in float32' if recipe.bf16 else ''})"
            if recipe.fsdp != "none" else "")
    return (f"tensor parallel {recipe.tp_size}: one rank of {num_gpus} traced with the model split as "
            f"from_pretrained(distributed_config=DistributedConfig(tp_size={recipe.tp_size}"
            f"{f', fsdp_size={num_gpus // recipe.tp_size}' if recipe.fsdp != 'none' else ''})) splits it (its tp_plan: "
            f"linear layers colwise and rowwise, embeddings by vocabulary){fsdp}, under the fake process group: weights, "
            "gradients and optimizer states are this rank's shards, activations its part of each split layer's, "
            "functionality includes the collectives' buffers")


def expert_parallel_note(recipe: ResolvedRecipe, num_gpus: int) -> str:
    """How an expert parallel recipe's rank was traced (`trace.step.tensor_parallel`, `trace.step.experts`)."""
    ep, copies = recipe.ep_size, num_gpus // recipe.ep_size
    experts = (f"FSDP-sharded again over the {copies} GPUs that hold the same ones" if copies > 1 else
               "each expert whole on one GPU")
    return (f"expert parallel {ep}: one rank of {num_gpus} traced with the model split as from_pretrained("
            f"distributed_config=DistributedConfig(fsdp_size={num_gpus}, ep_size={ep})) splits it: 1/{ep} of each "
            f"layer's experts, {experts}, reached by transformers' all-to-all (split sizes of the {recipe.ep_routing} "
            f"routing); the rest of the model under transformers' FSDP2 over all {num_gpus} (full_shard"
            f"{', weights gathered in bfloat16, gradients reduced in float32' if recipe.bf16 else ''}), under the fake "
            "process group")


def context_parallel_note(recipe: ResolvedRecipe, num_gpus: int) -> str:
    """How a context parallel recipe's rank was traced (`trace.step.context_parallel`)."""
    cp, replicas = recipe.cp_size, recipe.dp_replicate_size
    group = num_gpus // replicas
    hybrid = f"dp_replicate_size={replicas}, " if replicas > 1 else ""
    sharded = (f"FSDP2 over the {group} GPUs of a replica (full_shard), {replicas} replicas" if replicas > 1
               else f"FSDP2 over all {num_gpus} GPUs (full_shard)")
    return (f"context parallel {cp}: one rank of {num_gpus} traced as the Trainer runs accelerate's "
            f"ParallelismConfig({hybrid}dp_shard_size={group // cp}, cp_size={cp}): 1/{cp} of each sequence, attention "
            "by PyTorch's ring (its own functions: the group's keys and values all-gathered, partial outputs merged in "
            f"float32, key and value gradients passed around the ring), {sharded}, under the fake process group; the "
            "GPUs of a group share one batch")


def sequence_parallel_note(recipe: ResolvedRecipe, num_gpus: int) -> str:
    """How a sequence parallel recipe's rank was traced (`trace.step.sequence_parallel`)."""
    sp = recipe.sp_size
    return (f"sequence parallel {sp}: one rank traced as the Trainer runs accelerate's ParallelismConfig(sp_backend="
            f"'deepspeed', sp_size={sp}): 1/{sp} of each sequence, attention by DeepSpeed's own Ulysses (an all-to-all "
            f"gives each GPU the whole sequence of 1/{sp} of the heads, SDPA, an all-to-all back), under the fake "
            f"process group; ZeRO partitions over all {num_gpus} GPUs; the GPUs of a group share one batch")
