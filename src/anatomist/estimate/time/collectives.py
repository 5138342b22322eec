"""The data-parallel collectives of one optimizer step, and what of them compute does not hide.

The collectives, in (N-1)/N x bytes per ring, at the bus bandwidth (`bus_bytes_per_s`: across nodes the
slower of the intra-node bus and the network):

    DDP                 all-reduce of the gradients, 2x their bytes, on the last micro-batch (no_sync
                        before), in 25 MiB buckets while the backward runs (bucket_cap_mb)
    ZeRO-1              the same volume, after the last backward: reduce-scatter of the gradients, then
                        all-gather of the updated weights after the optimizer step
    ZeRO-2              reduce-scatter on every micro-batch (DeepSpeed keeps only its partition of the
                        gradients), in reduce_bucket_size buckets under the backward (overlap_comm, as
                        `plan --emit deepspeed` writes it), all-gather of the updated weights after the step
    ZeRO-3, FSDP        every weight (a frozen base's too) all-gathered before each micro-batch's forward
    full_shard          and again before its backward, unit by unit (a block, and the root), the next
                        unit's prefetched while one computes; reduce-scatter per unit under the backward,
                        on every micro-batch (DeepSpeed) or the last (FSDP's no_sync)
    FSDP shard_grad_op  as full_shard without the backward all-gather (the weights stay whole from
                        forward to backward)

Under tensor parallel (`tp_size` T) these run among the N / T data-parallel ranks, each over its 1/T of every
weight and gradient; tensor parallel's own collectives are the traced rank's (`tensor_parallel_s`).

A phase takes max(compute, its collectives) plus what cannot overlap: the first unit's all-gather (nothing
computes before it) and the last reduction (its gradients exist only when the backward ends: the last
unit's, or the last bucket). Rajbhandari et al. 2020 (ZeRO, sec. 7): ZeRO-3 moves 1.5x the all-reduce's
volume; Zhao et al. 2023 (PyTorch FSDP, sec. 3.3-3.4): the backward prefetch and the overlap of the
reduce-scatter with the backward. Checked against llm-foundry's published MPT runs on 16 to 512 GPUs
(docs/time.md, "Beyond one node").

Their constants live in data/plan_throughput.toml with their sources; none was measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from anatomist.estimate.sharding import overlap_comm
from anatomist.estimate.time.network import (
    DEFAULT_NODES,
    bus_bytes_per_s,
    intra_node_bytes_per_s,
    node_network_bytes_per_s,
)
from anatomist.estimate.time.ops import StepOps
from anatomist.hardware import GPU
from anatomist.recipe import ResolvedRecipe
from anatomist.trace.depth.plan import ModelSize
from anatomist.trace.engine.records import COLLECTIVE_PREFIX, ULYSSES_ALL_TO_ALL

DDP_BUCKET_BYTES = 25 * 2**20
"""DistributedDataParallel's default bucket_cap_mb (25 MiB), which the Trainer leaves as it is."""


@dataclass(frozen=True, slots=True)
class Collectives:
    """One device's collectives in one optimizer step, as seconds at the bus bandwidth, and when they run."""

    micro_batches: int
    gather_forward_s: float = 0.0
    """All-gather of the weights before each micro-batch's forward (ZeRO-3, FSDP)."""
    gather_backward_s: float = 0.0
    """And before its backward (ZeRO-3, FSDP full_shard)."""
    reduce_s: float = 0.0
    """Gradient reduction of one reducing micro-batch."""
    reduces_every_micro_batch: bool = False
    """DeepSpeed ZeRO-2/3 reduce each micro-batch's gradients; DDP and FSDP only the last's (no_sync)."""
    reduce_overlapped: bool = True
    """Whether the reduction runs while the backward computes (ZeRO-1 reduces after it)."""
    reduce_tail_s: float = 0.0
    """What of a reduction starts only when the backward ends: the last bucket or unit."""
    units: int = 1
    """Units gathered one after another (blocks and the root): the first one's gather is not hidden."""
    after_step_s: float = 0.0
    """ZeRO-1/2's all-gather of the updated weights after the optimizer step."""

    def total_s(self) -> float:
        """Every collective of the step, hidden or not."""
        reductions = self.micro_batches if self.reduces_every_micro_batch else 1
        return (self.micro_batches * (self.gather_forward_s + self.gather_backward_s) + reductions * self.reduce_s
                + self.after_step_s)

    def exposed_s(self, forward_s: float, backward_s: float) -> float:
        """What of them the device waits for, given the step's forward and backward compute (all micro-batches)."""
        k = self.micro_batches
        forward, backward = forward_s / k, backward_s / k
        exposed = k * _phase_exposed_s(self.gather_forward_s, 0.0, forward, self.units)
        for micro in range(k):
            reduce = self.reduce_s if self.reduces_every_micro_batch or micro == k - 1 else 0.0
            if self.reduce_overlapped:
                tail = self.reduce_tail_s if reduce else 0.0
                exposed += _phase_exposed_s(self.gather_backward_s, reduce, backward, self.units) + tail
            else:
                exposed += _phase_exposed_s(self.gather_backward_s, 0.0, backward, self.units) + reduce
        return exposed + self.after_step_s


def _phase_exposed_s(gather_s: float, reduce_s: float, compute_s: float, units: int) -> float:
    """A phase's collectives beyond its compute, plus its first unit's all-gather, which nothing hides."""
    return max(gather_s + reduce_s - compute_s, 0.0) + gather_s / units


def collectives(
    recipe: ResolvedRecipe, size: ModelSize, *, num_gpus: int = 1, nodes: int = DEFAULT_NODES,
    network: str | None = None, gpu: GPU | None = None,
) -> Collectives:
    """The collectives of one optimizer step of `recipe` on `num_gpus` devices (module docstring), for a model of
    `size`."""
    k = recipe.gradient_accumulation_steps
    replicas = num_gpus // recipe.tp_size  # the data-parallel ranks: a tensor parallel group shares one batch
    if replicas <= 1:
        return Collectives(micro_batches=k)
    bus = bus_bytes_per_s(num_gpus, nodes, network, gpu)
    ring = (replicas - 1) / replicas
    share = 1 / recipe.tp_size  # a rank's part of every weight and gradient under tensor parallel
    # PEFT makes adapters in fp32 whatever the base's dtype. Full fine-tuning reduces gradients in the weights'
    # dtype: half weights' own; under autocast of fp32 weights DDP's are fp32, while DeepSpeed keeps the model in
    # the half dtype and FSDP's MixedPrecisionPolicy reduces in it.
    sharded = recipe.zero_stage > 0 or recipe.fsdp != "none"
    half = recipe.peft == "none" and (recipe.half_weights or (recipe.mixed_precision != "no" and sharded))
    element = 2 if half else 4
    if recipe.split_by_transformers:  # transformers' FSDP: in float32 under its bf16 policy
        element = 4 if recipe.bf16 or not recipe.half_weights else 2  # (`fsdp_mixed_precision`), else as loaded
    if recipe.ep_size > 1:
        return _expert_parallel(recipe, size, element, num_gpus, bus, _copies_bus(recipe, num_gpus, nodes, network, gpu))
    grad_bytes = parameter_count(recipe, size) * element * share
    reduce_scatter = ring * grad_bytes / bus
    if recipe.dp_replicate_size > 1:  # HSDP: gathers and reduce-scatters within a shard group, all-reduce across
        return _hybrid(recipe, size, grad_bytes, num_gpus, nodes, network, gpu)
    if recipe.sharding_stage >= 3 or recipe.fsdp == "shard_grad_op":
        gather = ring * gathered_weight_bytes(recipe, size) * share / bus
        units = size.blocks + 1
        return Collectives(micro_batches=k, gather_forward_s=gather,
                           gather_backward_s=gather if recipe.sharding_stage >= 3 else 0.0,
                           reduce_s=reduce_scatter, reduces_every_micro_batch=recipe.zero_stage >= 2,
                           reduce_tail_s=reduce_scatter / units, units=units)
    if recipe.zero_stage == 0:  # DDP
        return Collectives(micro_batches=k, reduce_s=2 * reduce_scatter,
                           reduce_tail_s=2 * reduce_scatter * min(1.0, DDP_BUCKET_BYTES / grad_bytes))
    bucket = recipe.reduce_bucket_size * element if recipe.reduce_bucket_size else grad_bytes
    return Collectives(micro_batches=k, reduce_s=reduce_scatter, reduces_every_micro_batch=recipe.zero_stage >= 2,
                       reduce_overlapped=overlap_comm(recipe), reduce_tail_s=reduce_scatter * min(1.0, bucket / grad_bytes),
                       after_step_s=reduce_scatter)


def _hybrid(recipe: ResolvedRecipe, size: ModelSize, grad_bytes: float, num_gpus: int, nodes: int,
            network: str | None, gpu: GPU | None) -> Collectives:
    """FSDP's collectives under HSDP: R = `dp_replicate_size` replicas of shard groups of S = `num_gpus` / R
    consecutive ranks (accelerate's mesh: dp_replicate outermost), so a group spans S / (GPUs per node) nodes, one
    node where it fits in one. The weights are gathered and the gradients reduce-scattered within a group, then each
    rank's 1/S of the gradients all-reduced across the R replicas (2 (R-1)/R of it), with the reduce-scatter, under
    the backward of the last micro-batch. On more than one node the replicas' rings cross the nodes, one per GPU at
    the same time, so each has a node's network over its GPUs (one NIC of a NIC per GPU; an Ethernet port shared)."""
    replicas = recipe.dp_replicate_size
    shards = num_gpus // replicas
    per_node = num_gpus // nodes
    shard_bus = bus_bytes_per_s(shards, max(1, shards // per_node), network, gpu)
    replica_bus = _ring_share(nodes, per_node, per_node, network, gpu)
    ring = (shards - 1) / shards
    reduce = ring * grad_bytes / shard_bus + 2 * (replicas - 1) / replicas * grad_bytes / shards / replica_bus
    units = size.blocks + 1
    gather = ring * gathered_weight_bytes(recipe, size) / shard_bus
    return Collectives(micro_batches=recipe.gradient_accumulation_steps, gather_forward_s=gather,
                       gather_backward_s=gather if recipe.fsdp == "full_shard" else 0.0, reduce_s=reduce,
                       reduce_tail_s=reduce / units, units=units)


def tensor_parallel_s(ops: StepOps, recipe: ResolvedRecipe, gpu: GPU | None = None) -> float:
    """Seconds per step of tensor parallel's collectives: those the traced rank runs (`COLLECTIVE_PREFIX`: DTensor's
    all-reduce of each rowwise layer's partial output and of each colwise layer's input gradient, the all-gather of a
    gathered output), in (T-1)/T x bytes per ring at the bus bandwidth of one node (a group's ranks are neighbours,
    innermost in transformers' mesh), none hidden: each sits between two products, the second of which needs its
    result. An all-reduce moves its tensor twice (reduce-scatter, then all-gather), an all-gather its output once; the
    trace records input + output bytes. Known limitation: no per-call latency (tens of microseconds in NCCL, which a
    small model's many small all-reduces would feel)."""
    tp = recipe.tp_size
    if tp <= 1:
        return 0.0
    ring, bus, seconds = (tp - 1) / tp, intra_node_bytes_per_s(gpu), 0.0
    for record in ops.records:
        if not record.name.startswith(COLLECTIVE_PREFIX):
            continue
        gathered = record.name.endswith(("all_gather_into_tensor", "reduce_scatter_tensor"))
        tensor = record.bytes * tp / (tp + 1) if gathered else record.bytes / 2  # the whole tensor of the ring
        moved = ring * tensor * (1 if gathered else 2)
        seconds += record.calls_per_step(recipe.gradient_accumulation_steps) * moved / bus
    return seconds


def context_parallel_s(ops: StepOps, recipe: ResolvedRecipe, gpu: GPU | None = None) -> float:
    """Seconds per step of context parallel's ring (torch's `_templated_ring_attention` and its backward, as the traced
    rank runs them: `COLLECTIVE_PREFIX` ops): each layer's all-gather of the group's keys and values, in forward and
    again in backward (accelerate's default "allgather" rotation: a rank receives the C - 1 other parts), and in
    backward the key and value gradients passed on to the next rank at each of the C steps (`permute_tensor`, an
    all_to_all_single: float32, as big as the rank's keys and values), at the bus bandwidth of one node (the group is
    within one), none hidden. What could hide: torch starts the all-gather before the local part's attention and
    waits for it after (one of C attention steps); not modelled. The trace records input + output bytes: an
    all-gather's are C + 1 parts, of which C - 1 arrive; the permute's input and output are one part each."""
    cp = recipe.cp_size
    if cp <= 1:
        return 0.0
    bus, seconds = intra_node_bytes_per_s(gpu), 0.0
    for record in ops.records:
        if record.name == COLLECTIVE_PREFIX + "all_gather_into_tensor":
            moved = record.bytes * (cp - 1) / (cp + 1)
        elif record.name == COLLECTIVE_PREFIX + "all_to_all_single":
            moved = record.bytes / 2
        else:
            continue
        seconds += record.calls_per_step(recipe.gradient_accumulation_steps) * moved / bus
    return seconds


def sequence_parallel_s(ops: StepOps, recipe: ResolvedRecipe, gpu: GPU | None = None) -> float:
    """Seconds per step of DeepSpeed's Ulysses exchanges (`ULYSSES_ALL_TO_ALL`, as the traced rank runs them: each
    layer's queries, keys, values and attention output in forward, their gradients in backward), each sending
    (P - 1) / P of its tensor to the other ranks of the group at the bus bandwidth of one node (the group is within
    one), none hidden: the attention waits for its inputs, the next product for its output. The trace records input +
    output bytes, twice the tensor."""
    sp = recipe.sp_size
    if sp <= 1:
        return 0.0
    sent, bus = (sp - 1) / sp, intra_node_bytes_per_s(gpu)
    return sum(record.calls_per_step(recipe.gradient_accumulation_steps) * record.bytes / 2 * sent / bus
               for record in ops.records if record.name == ULYSSES_ALL_TO_ALL)


def communication_s(
    recipe: ResolvedRecipe, size: ModelSize, *, num_gpus: int = 1, nodes: int = DEFAULT_NODES,
    network: str | None = None, gpu: GPU | None = None,
) -> float:
    """Seconds per step of every collective of `recipe` over `num_gpus` `gpu`s on `nodes` machines joined by
    `network` (a name of `networks()`; None: the default), hidden behind compute or not."""
    return collectives(recipe, size, num_gpus=num_gpus, nodes=nodes, network=network, gpu=gpu).total_s()


def parameter_count(recipe: ResolvedRecipe, size: ModelSize) -> int:
    """The parameters `recipe` trains (of the estimator's exact count, `trace.depth.plan.ModelSize`): every
    parameter of the task model, or with LoRA/QLoRA the adapters', as PEFT makes them."""
    return size.trainable_parameters if recipe.peft != "none" else size.parameters


def _expert_parallel(recipe: ResolvedRecipe, size: ModelSize, element: int, num_gpus: int, bus: float,
                     copies_bus: float) -> Collectives:
    """FSDP's collectives under expert parallel, as transformers lays them out (`DistributedConfig(fsdp_size=N,
    ep_size=E)`, distributed/fsdp.py): the dense parameters gathered and their gradients reduce-scattered over all N
    ranks at `bus`; a rank's 1/E of the routed experts over the N/E ranks that hold the same ones (none where E = N:
    each expert lives whole on one rank), at `copies_bus` (`_copies_bus`). The all-to-all of the tokens is
    `expert_parallel_s`'s."""
    k, units = recipe.gradient_accumulation_steps, size.blocks + 1
    copies = num_gpus // recipe.ep_size
    total = sum(size.parameter_numels) or 1
    dense, experts = size.parameters - size.expert_parameters, size.expert_parameters / recipe.ep_size
    ring, copies_ring = (num_gpus - 1) / num_gpus, (copies - 1) / copies
    per_element = gathered_weight_bytes(recipe, size) / total
    gather = (ring * dense / bus + copies_ring * experts / copies_bus) * per_element
    reduce = (ring * dense / bus + copies_ring * experts / copies_bus) * element
    return Collectives(micro_batches=k, gather_forward_s=gather, gather_backward_s=gather, reduce_s=reduce,
                       reduce_tail_s=reduce / units, units=units)


def _copies_bus(recipe: ResolvedRecipe, num_gpus: int, nodes: int, network: str | None, gpu: GPU | None) -> float:
    """The bandwidth of one ring of the ranks that hold the same experts (ranks r, r + E, r + 2E, ...): across nodes
    the rings that cross a node's network at once are one per expert parallel rank of the node (min(E, GPUs per
    node)); `_ring_share`."""
    per_node = num_gpus // nodes
    return _ring_share(nodes, per_node, min(recipe.ep_size, per_node), network, gpu)


def _ring_share(nodes: int, per_node: int, rings: int, network: str | None, gpu: GPU | None) -> float:
    """The bandwidth of one of `rings` rings that cross each node's network at once (a node of `per_node` GPUs): the
    node's bus bandwidth in one node, else that network over the rings, at most the bus bandwidth."""
    intra = intra_node_bytes_per_s(gpu)
    if nodes <= 1:
        return intra
    return min(intra, node_network_bytes_per_s(per_node, network) / rings)


def expert_parallel_s(ops: StepOps, recipe: ResolvedRecipe, num_gpus: int, nodes: int = DEFAULT_NODES,
                      network: str | None = None, gpu: GPU | None = None) -> float:
    """Seconds per step of expert parallel's all-to-alls (`COLLECTIVE_PREFIX` all_to_all_single: each MoE layer's
    tokens to their experts' ranks and the outputs back, in forward and again in backward), none hidden: the experts
    wait for their rows, the next layer for the outputs. A rank keeps 1/E of what it sends and receives ((E-1)/E
    crosses the links; the trace records input + output bytes, balanced routing: half each way). A group within a
    node moves at the node's bus bandwidth; one across nodes sends (E - G)/E of it, G its node's GPUs, through the
    node's network, shared by the node's G GPUs."""
    ep = recipe.ep_size
    if ep <= 1:
        return 0.0
    per_node = num_gpus // nodes
    intra = intra_node_bytes_per_s(gpu)
    off_node = max(ep - per_node, 0) / ep
    network_share = node_network_bytes_per_s(per_node, network) / per_node if off_node else intra
    seconds = 0.0
    for record in ops.records:
        if record.name == COLLECTIVE_PREFIX + "all_to_all_single":
            each_way = record.bytes / 2
            moved = max((1 - 1 / ep - off_node) * each_way / intra, off_node * each_way / network_share)
            seconds += record.calls_per_step(recipe.gradient_accumulation_steps) * moved
    return seconds


def gathered_weight_bytes(recipe: ResolvedRecipe, size: ModelSize) -> float:
    """Bytes of one all-gather of the whole model under ZeRO-3 / FSDP full_shard: a quantized base's codes as
    they are stored (bitsandbytes' FSDP-QLoRA guide stores them in a float dtype: the same bytes), the FP8 layers'
    weights in float8 where torchao gathers them so (`fp8_all_gather`), every other parameter in the dtype it is
    gathered in (the half dtype under mixed precision or half weights)."""
    element = 2 if recipe.mixed_precision != "no" or recipe.half_weights else 4
    one_byte = size.quantized_codes + (size.fp8_weights if recipe.fp8_all_gather else 0)
    return one_byte + (sum(size.parameter_numels) - one_byte) * element
