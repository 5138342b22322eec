"""PyTorch's own accounting of one rank of a real FSDP2 and/or tensor parallel step: the measured side of
test_fsdp_accuracy.py.

Run as a script, in a process of its own (a process group is process-wide state):

    python tests/fsdp_truth.py --config DIR --seq-len N --batch B --world W --backend fake|gloo CASES_JSON

With `--backend fake` this process is rank 0 of a world of W over PyTorch's fake process group (its
collectives move no data; every tensor is real); with `--backend gloo` W real processes (spawned
here) form a gloo group on this machine. Each rank builds the model with real CPU weights, wraps it
with accelerate's own `fsdp2_prepare_model` (what the Trainer runs with `fsdp_version: 2`; not
anatomist's wrapping), runs a first step (the optimizer state), then a steady-state step under
`torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker` as the Trainer runs it: micro-batches
under `set_requires_gradient_sync(False)` but the last, forward under autocast, backward, clipping,
the optimizer step, zero_grad(set_to_none=True). The step takes CUDA's code paths and autocast
policy (which kernels run, not how memory is counted), and FSDPMemTracker rounds each storage to the
CUDA allocator's 512 bytes, as it does on CUDA (`anatomist.bench.trackers.as_on_cuda`). The hooks
FSDPMemTracker puts on a unit of several modules (accelerate's `fully_shard([norm, lm_head])`) are
registered as FSDP's own group (`GroupedFSDPMemTracker`): on each module alone they change the step.
Over gloo, each collective returns once gloo has let go of its tensors (`collectives_hold_nothing`).

Tensor parallel (a case's "tp", default 1), as a user of transformers 5.24 runs it: the model split at load time as
`from_pretrained(..., distributed_config=DistributedConfig(tp_size=tp, fsdp_size=W // tp))` splits it, by
transformers' own functions (`initialize_distributed_mesh`: this rank's meshes; `maybe_distribute_model`: the tensor
parallel plan, then, with FSDP, transformers' own FSDP2 over the other ranks, bfloat16 gathers where the case is bf16),
before PEFT and the Trainer's checkpointing; the Trainer then leaves the model as it is. The weights the plan names are
checked to be DTensors holding this rank's part. Not accelerate's `ParallelismConfig` with `fsdp2_prepare_model`:
accelerate 1.15 prepares a tensor parallel model under FSDP2 with a class transformers 5.24 no longer has
(`transformers.integrations.tensor_parallel.ReplicateParallel`). Every rank is seeded alike: the ranks of a tp group
need the same weights and batches. Where the parameters live on several meshes (or some on none) the optimizer and
the clipping are the Trainer's: one parameter group per mesh (`Trainer.create_optimizer`), one norm per mesh
(`Trainer._mixed_mesh_grad_norm`). With "fsdp": "none" (pure tensor parallel) nothing is FSDP's: no
`set_requires_gradient_sync`, and the step is measured by `torch.distributed._tools.mem_tracker.MemTracker`, the
tracker FSDPMemTracker extends (categories PARAM, BUFFER, GRAD, ACT, TEMP, OPT, OTH), in the same output. DTensor's own collectives (`_c10d_functional.all_reduce`,
`all_gather_into_tensor`, ...) are not among those `collectives_hold_nothing` wraps: alone, on 2 ranks, gloo kept
a functional all-gather's output after its wait in 2 of 400 calls (all-reduce, reduce-scatter: none of 400);
on the steps below that changed no snapshot.
Measured (torch 2.13, transformers 5.24, accelerate 1.15; Llama hidden 256, 4 blocks, 4 heads, 2 KV heads,
128 tokens, 2 samples): over fake and over gloo the same bytes on every rank, at the peak and at every moment:
tp 2 (world 2) 47,446,528 bytes, in bf16 46,921,728, with 2 micro-batches and checkpointing 45,016,064; FSDP 2 x
tp 2 (world 4) 36,770,816, in bf16 26,721,792. The input embeddings' gradient is whole on every rank (Replicate,
1,024,000 bytes) where their weight is split by vocabulary (Shard(0), 512,000): DTensor's embedding backward.

Prints one JSON object: case name -> list, per rank, of {"peak": the tracker's peak snapshot (bytes
by its categories, "Total"), "peak_moment": the moment it falls in, "moments": moment -> the tracker's
highest snapshot within it}. A moment is a place in the step named as anatomist's traces name it
(`anatomist.trace.engine.records.Event`): "phase segment micro-step block", e.g. "backward blocks 1 4" (the
backward of the fifth block in the second micro-batch) or "backward post 0 -1" (after the last block:
the head and the loss). The segments are marked by hooks of this file's own (`_watch_blocks`) that
follow the definition of the tracer's (trace/step/driver.py): forward enters block i at its input, backward
enters block i when the gradient of its output exists. They are registered after FSDP's, as the tracer's
are, so FSDP's work at a boundary falls on the same side of it: in forward a block's all-gather (FSDP's
pre-forward hook) in the segment before it; in backward a block's all-gather (prefetched by the
pre-backward of the block after it) in the segment after it, its reduce-scatter in the block before it
("pre" for the first). The bytes are the tracker's; the hooks only say where in the step each of its
snapshots is taken.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, cast

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _snapshot(snapshot: dict[Any, int]) -> dict[str, int]:
    """A tracker's snapshot of one device, by the names of its categories: FSDPMemTracker's ("ALL_GATHER", ...,
    "Total"), MemTracker's ("PARAM", "BUFFER", "GRAD", "ACT", "TEMP", "OPT", "OTH", "Total")."""
    return {str(k).rsplit(".", 1)[-1]: int(v) for k, v in snapshot.items()}


def _moment_tracker(model: Any, optimizer: Any) -> Any:
    """PyTorch's tracker of this rank's step, which also keeps its highest snapshot within each moment of the step:
    FSDPMemTracker on an FSDP model, leaving FSDP's hooks of a unit of several modules as FSDP registers them
    (`anatomist.bench.trackers`); MemTracker, the tracker FSDPMemTracker extends, on a model without FSDP (pure
    tensor parallel), told of the weights and optimizer states that exist before it, which it counts only when told.

    The moment (phase, segment, micro-step, block) is set by `step` and `_watch_blocks`; after each op
    the tracker updates its peak (`_update_peak_stats`), and the current snapshot of the rank's device (the CPU; the
    tracker also counts, apart, the meta tensors transformers' tensor parallel hooks make to read a stride from) is
    kept where it is the moment's highest. Of equal ones the last is kept: FSDPMemTracker names an all-gather output
    ALL_GATHER only when the collective runs, one op after the buffer's allocation made the total.
    """
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    from anatomist.bench.trackers import GroupedFSDPMemTracker

    fsdp, cpu = isinstance(model, FSDPModule), torch.device("cpu")

    class MomentTracker(GroupedFSDPMemTracker if fsdp else MemTracker):  # type: ignore[misc]
        def __init__(self) -> None:
            if fsdp:
                super().__init__(model, optimizer)
            else:
                super().__init__()
                self.track_external(model, optimizer)
            self.phase, self.segment, self.micro_step, self.block = "forward", "pre", 0, -1
            self.moments: dict[str, dict[str, int]] = {}
            self.peak_moment = ""

        def moment(self) -> str:
            return f"{self.phase} {self.segment} {self.micro_step} {self.block}"

        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            """MemTracker's (FSDPMemTracker registers none): it refuses the model's forward a second time, which
            it takes for a second step; each micro-batch's forward starts its per-module statistics anew (not
            its snapshots)."""
            if module is model and not self._mod_tracker.is_bw:
                self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

        def _update_peak_stats(self, peak_state: Any) -> None:
            peak = self._peak_mem.get(cpu)
            super()._update_peak_stats(peak_state)
            if self._peak_mem.get(cpu) != peak:
                self.peak_moment = self.moment()
            snapshot = self._curr_mem_snap.get(cpu)
            kept = self.moments.get(self.moment())
            if snapshot is not None and (kept is None or snapshot["Total"] >= kept["Total"]):
                self.moments[self.moment()] = _snapshot(snapshot)

    return MomentTracker()


def _watch_blocks(tracker: Any, blocks: list[Any]) -> list[Any]:
    """Set `tracker`'s segment and block as the step runs through `blocks` (the decoder layers, in order).

    Forward enters block i at its input; backward enters the last block when the gradient of its output
    exists, block i - 1 when the gradient of block i's input does, and "pre" at the gradient of the first
    block's input. Returns the hooks' handles.
    """
    import torch

    last = len(blocks) - 1

    def in_backward() -> bool:  # a checkpointed block's recomputation runs its forward in backward
        return torch._C._current_graph_task_id() != -1

    def first_tensor(value: Any) -> Any:
        value = value[0] if isinstance(value, (tuple, list)) and value else value
        return value if isinstance(value, torch.Tensor) and value.requires_grad else None

    def enter(block: int) -> Any:
        def hook(_grad: Any) -> None:
            tracker.segment, tracker.block = ("blocks", block) if block >= 0 else ("pre", -1)

        return hook

    def enter_block(block: int) -> Any:
        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if in_backward():
                return
            tracker.segment, tracker.block = "blocks", block
            hidden = first_tensor(args) if args else first_tensor(kwargs.get("hidden_states"))
            if hidden is not None:
                hidden.register_hook(enter(block - 1))

        return hook

    def leave_blocks(_module: Any, _args: Any, output: Any) -> None:
        if in_backward():
            return
        tracker.segment, tracker.block = "post", -1
        hidden = first_tensor(output)
        if hidden is not None:
            hidden.register_hook(enter(last))

    handles = [b.register_forward_pre_hook(enter_block(i), with_kwargs=True) for i, b in enumerate(blocks)]
    return [*handles, blocks[last].register_forward_hook(leave_blocks)]


_TP_SHARDED_DIM = {"colwise": 0, "colwise_gather_output": 0, "embedding_rowwise": 0, "rowwise": -1}


def _distributed(model: Any, world: int, tp: int, fsdp: bool, bf16: bool, ep: int = 1) -> Any:
    """`model` split as `from_pretrained(..., distributed_config=DistributedConfig(tp_size=tp, fsdp_size=...))` splits
    it at load time: transformers' own mesh of this rank (`initialize_distributed_mesh`) and its own
    `maybe_distribute_model` (the tensor parallel plan, then, with FSDP, transformers' FSDP2 over the other ranks,
    its mixed precision policy with bf16), on the model as from_pretrained has it then, its head not yet tied to the
    embeddings; tied after, as from_pretrained ties them once loaded. Not from_pretrained itself: on the CPU a rank's
    shard of a loaded weight stays a view of the whole tensor read from the checkpoint (on a GPU it is copied to the
    device), which PyTorch's trackers count whole. Raises unless every weight the plan names is a DTensor holding this
    rank's part of it (`_TP_SHARDED_DIM`: the dimension each style shards). Expert parallel (`ep` > 1:
    `DistributedConfig(ep_size=ep)`, over FSDP's ranks) the same way: its experts' weights checked to hold 1/ep of the
    experts, sharded again by FSDP over the world / ep ranks that hold the same ones (`_check_experts`)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from transformers.distributed import DistributedConfig
    from transformers.distributed.utils import initialize_distributed_mesh

    config = DistributedConfig(tp_size=tp, fsdp_size=world // tp if fsdp else 1, fsdp_mixed_precision=bf16,
                               ep_size=ep if ep > 1 else None)
    if config.tp_size * config.fsdp_size != world:
        raise ValueError(f"tp {tp} x fsdp {config.fsdp_size} is not the world of {world}")
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head.weight is embeddings.weight
    if tied:
        head.weight = torch.nn.Parameter(embeddings.weight.detach().clone())
    plan, ep_plan, _ = model._resolve_parallel_plans(config)
    experts = {name: model.get_parameter(name).shape[0] for name, style in ep_plan.items() if style == "grouped_gemm"}
    _, meshes = initialize_distributed_mesh(config)
    model = type(model).maybe_distribute_model(model, config, meshes)
    model.tie_weights()
    if tied != (model.get_output_embeddings().weight is model.get_input_embeddings().weight):
        raise RuntimeError("the head is not tied again as from_pretrained ties it")
    if ep > 1:
        _check_experts(model, experts, ep, world)
    if tp == 1:
        return model
    mesh = meshes.get_mesh("tp")
    parameters = dict(model.named_parameters())
    named = [(name, style) for name, style in plan.items() if name in parameters]
    if not named:
        raise RuntimeError(f"{type(model).__name__}'s tensor parallel plan names no weight")
    for name, style in named:
        param = parameters[name]
        if style not in _TP_SHARDED_DIM:
            raise NotImplementedError(f"{name}: tensor parallel style {style!r}")
        if not isinstance(param, DTensor):
            raise RuntimeError(f"{name} ({style}) is no DTensor: {type(param).__name__}")
        dim = _TP_SHARDED_DIM[style] % param.ndim
        placement = Replicate() if style == "rowwise" and name.endswith("bias") else Shard(dim)
        local = torch.empty(param.shape, device="meta").chunk(tp, dim)[mesh.get_local_rank()].shape
        if fsdp:  # FSDP2 shards the tp shard's rows again over its ranks
            local = torch.empty(local, device="meta").chunk(world // tp, 0)[meshes.get_mesh("fsdp").get_local_rank()].shape
        if param.placements[-1] != placement or param.to_local().shape != local:
            raise RuntimeError(f"{name} ({style}): {param.placements}, {tuple(param.to_local().shape)} held of "
                               f"{tuple(param.shape)}, not {placement} and {tuple(local)}")
    return model


def _check_experts(model: Any, experts: dict[str, int], ep: int, world: int) -> None:
    """Raise unless each expert weight of `experts` (name -> experts of the layer) holds this rank's 1/`ep` of the
    experts, split again over the world / `ep` ranks that hold the same ones (FSDP, where there are two or more)."""
    import torch

    if not experts:
        raise RuntimeError(f"{type(model).__name__}'s expert parallel plan names no weight")
    for name, count in experts.items():
        param = model.get_parameter(name)
        held = count // ep
        if world // ep > 1:
            held = torch.empty(held, device="meta").chunk(world // ep)[0].shape[0]
        if not hasattr(param, "to_local") or param.to_local().shape[0] != held:
            raise RuntimeError(f"{name}: {tuple(param.shape)} held as {type(param).__name__}, not {held} experts")


def _route(model: Any, routing: str, ep: int) -> None:
    """Every MoE layer's router of `model` picks the experts `routing` says, its weights kept (so gradients flow as
    they do): "balanced", token t takes experts (t k + j) mod E, j < k, so each expert gets T k / E of the T tokens'
    k picks, a rank T k from the group; "skewed", every token takes experts 0 .. k-1, rank 0's (k <= E / ep), which then
    receives every token of every rank of its group k times. The trace's routings (`trace.step.experts.split_sizes`)."""
    import torch

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    if not routers:
        raise RuntimeError(f"{type(model).__name__} has no router to route")
    for router in routers:
        top_k, experts = router.top_k, router.num_experts
        if routing == "skewed" and top_k > experts // ep:
            raise ValueError(f"top-{top_k} does not fit in one rank's {experts // ep} experts")

        def forward(hidden: Any, router: Any = router, top_k: int = top_k, experts: int = experts) -> Any:
            logits, weights, _ = type(router).forward(router, hidden)
            tokens = weights.shape[0]
            if routing == "balanced":
                chosen = (torch.arange(tokens * top_k) % experts).view(tokens, top_k)
            else:
                chosen = torch.arange(top_k).repeat(tokens, 1)
            return logits, weights, chosen

        router.forward = forward


def _mesh_groups(params: list[Any]) -> list[dict[str, Any]]:
    """`params` in one parameter group per device mesh (plain tensors: one more), as `Trainer.create_optimizer`
    splits its groups where they do not all share one (`has_mixed_dtensor`): one foreach kernel cannot span two."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[Any]] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return [{"params": group} for group in groups.values()]


def measure(config: str, seq_len: int, batch: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """The tracker's peak of one steady-state step of `case` on this rank of a world of `world`, and its
    highest snapshot within each moment of the step."""
    import re

    import torch
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin, fsdp2_prepare_model
    from transformers import Trainer
    from transformers.trainer_optimizer import has_mixed_dtensor

    from anatomist.bench.trackers import as_on_cuda
    from anatomist.trace.step.inputs import make_batch
    from anatomist.workload_loader import load_workload

    torch.set_num_threads(1)  # ranks side by side on a small machine; the memory does not depend on it
    PartialState(cpu=True)  # accelerate's logging needs a state
    workload = load_workload(config, seq_len=seq_len)
    mixed = "bf16" if case.get("bf16") else "no"
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=case["fsdp"] == "full_shard", auto_wrap_policy="transformer_based_wrap",
        cpu_ram_efficient_loading=False)
    if mixed != "no":
        plugin.set_mixed_precision(mixed)
    fsdp, tp, ep = case["fsdp"] != "none", case.get("tp", 1), case.get("ep", 1)
    if not fsdp and tp == 1:
        raise ValueError(f"{case['name']}: neither FSDP nor tensor parallel")
    if (tp > 1 or ep > 1) and (case.get("lora") or case.get("fp8")):
        raise NotImplementedError(f"{case['name']}: tensor or expert parallel with LoRA or fp8")
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), mixed_precision=mixed,
                                        is_main_process=True, device=torch.device("cpu"))
    replicas, cp = case.get("replicas", 1), case.get("cp", 1)
    if replicas > 1 or cp > 1:  # the mesh and config accelerate builds for ParallelismConfig(dp_replicate_size=R) / cp
        from accelerate import ParallelismConfig

        accelerator.parallelism_config = ParallelismConfig(
            dp_replicate_size=replicas, dp_shard_size=world // replicas // cp, cp_size=cp)
        accelerator.torch_device_mesh = accelerator.parallelism_config.build_device_mesh("cpu")
    torch.manual_seed(0)  # the same weights and batches on every rank, as the ranks of a tp group need
    model = workload.build_model(case.get("attn_implementation", "sdpa"), "float32")
    if case.get("routing"):
        _route(model, case["routing"], ep)
    if tp > 1 or ep > 1:  # at load time, before PEFT and the Trainer, which then leaves the model as it is
        model = _distributed(model, world, tp, fsdp, mixed == "bf16", ep)
    if case.get("lora"):  # LoRA as PEFT's FSDP guide runs it: adapters on the model, then the Trainer wraps it
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, bias="none",
                                                 task_type="CAUSAL_LM"))
    if case.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable()  # the Trainer does it before accelerator.prepare
    if case.get("fp8"):  # accelerator.prepare converts (`_prepare_ao`) before it shards, with AORecipeKwargs' defaults
        from accelerate.utils import AORecipeKwargs
        from accelerate.utils.ao import convert_model_to_fp8_ao

        ao = AORecipeKwargs(enable_fsdp_float8_all_gather=case.get("fp8_all_gather", True))
        convert_model_to_fp8_ao(model, config=ao.config)
    if fsdp and tp == ep == 1:
        model = fsdp2_prepare_model(accelerator, model)
    prepare_inputs = _context_parallel(model, accelerator, cp)
    params = [p for p in model.parameters() if p.requires_grad]
    several_meshes = has_mixed_dtensor(params)
    optimizer = torch.optim.AdamW(_mesh_groups(params) if several_meshes else params, lr=1e-4, foreach=True)
    if case.get("fp8") and ao.config.enable_fsdp_float8_all_gather:  # as `_prepare_ao` registers it
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
    accumulation = case.get("accumulation", 1)
    batches = [make_batch(workload, batch) for _ in range(accumulation)]
    blocks = [m for name, m in model.named_modules() if re.fullmatch(r"(.+\.)?layers\.\d+", name)]

    deferred = [0]  # FSDP's own unsharded gradients kept between micro-batches, this rank's bytes

    def step(moments: Any) -> None:
        """One step, telling `moments` (the tracker) where it is."""
        for micro, inputs in enumerate(batches):
            moments.phase, moments.segment, moments.micro_step, moments.block = "forward", "pre", micro, -1
            if fsdp:
                model.set_requires_gradient_sync(micro == accumulation - 1)
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mixed != "no" else contextlib.nullcontext()
            inputs = {k: v.clone() for k, v in inputs.items()}  # context parallel shards them in place
            context, inputs = prepare_inputs(inputs)
            with context():
                with autocast:
                    loss = model(**inputs).loss
                moments.phase, moments.segment, moments.block = "backward", "post", -1
                (loss / accumulation).backward()
            if fsdp and micro < accumulation - 1:
                deferred[0] = max(deferred[0], _deferred_gradient_bytes(model))
        moments.phase, moments.segment, moments.micro_step, moments.block = "optimizer", "pre", 0, -1  # clipping too
        if fsdp:
            model.set_requires_gradient_sync(True)
        if several_meshes:
            Trainer._mixed_mesh_grad_norm(cast(Any, None), model, 1.0)  # the Trainer's, which reads only the model
        else:
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with as_on_cuda(mixed != "no"):
        step(types.SimpleNamespace())
        tracker = _moment_tracker(model, optimizer)
        with tracker:
            handles = _watch_blocks(tracker, blocks)  # after the tracker's own hooks (FSDP's, re-registered)
            step(tracker)
            for handle in handles:
                handle.remove()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {"peak": _snapshot(peak), "peak_moment": tracker.peak_moment, "moments": tracker.moments,
            "deferred_gradients": deferred[0], "ring_calls": _ring_calls(cp)}


def _ring_calls(cp: int) -> dict[str, int]:
    """How many attention calls torch's ring attention ran on this rank so far (none without context parallel)."""
    if cp == 1:
        return {}
    from cp_on_cpu import RING_CALLS

    return dict(RING_CALLS)


def _context_parallel(model: Any, accelerator: Any, cp: int) -> Any:
    """The Trainer's own preparation of each micro-batch (`Trainer._prepare_context_parallel_inputs`, called on this
    step's accelerator): with context parallel (`cp` > 1) the labels shifted beforehand and the position ids made, and
    a context that runs the forward and backward under torch's `context_parallel` over the mesh's "cp" ranks (what
    accelerate's `maybe_context_parallel` enters), sharding those tensors by sequence in place; the model's attention
    hooked as `prepare` hooks it (`_attach_context_parallel_hooks`: the mask dropped, `is_causal=True`), the ring
    running the CPU's flash kernel (tests/cp_on_cpu.py). Without it the Trainer's function returns the inputs as they
    are and a context that does nothing."""
    import functools

    from transformers import Trainer

    parallelism = getattr(accelerator, "parallelism_config", None)
    trainer: Any = types.SimpleNamespace(accelerator=types.SimpleNamespace(parallelism_config=parallelism))
    if cp > 1:
        from accelerate.big_modeling import _attach_context_parallel_hooks
        from cp_on_cpu import cpu_ring_attention
        from torch.distributed.tensor.experimental import context_parallel

        cpu_ring_attention()
        _attach_context_parallel_hooks(model)
        trainer.accelerator.maybe_context_parallel = functools.partial(context_parallel, accelerator.torch_device_mesh["cp"])
    return lambda inputs: Trainer._prepare_context_parallel_inputs(trainer, model, inputs)


def _deferred_gradient_bytes(model: Any) -> int:
    """Bytes of the gradients FSDP2 holds unsharded between micro-batches in its reduce dtype (its FSDPParams'
    `unsharded_accumulated_grad`, read off the real objects), this rank's part of each."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    total = 0
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        if group is not None:
            for param in group.fsdp_params:
                grad = param.unsharded_accumulated_grad
                if grad is not None:
                    local = grad.to_local() if isinstance(grad, DTensor) else grad
                    total += local.untyped_storage().nbytes()
    return total


def _rank(rank: int, world: int, address: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    from anatomist.bench.trackers import collectives_hold_nothing

    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    try:
        with collectives_hold_nothing():
            results = {c["name"]: measure(args.config, args.seq_len, args.batch, world, c)
                       for c in json.loads(args.cases)}
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--backend", choices=["fake", "gloo"], required=True)
    parser.add_argument("cases", help="JSON list of {name, fsdp, tp, ep, cp, routing, bf16, accumulation, "
                                      "gradient_checkpointing, lora, attn_implementation, fp8, fp8_all_gather}")
    args = parser.parse_args()
    cases = json.loads(args.cases)
    if args.backend == "fake":
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
        print(json.dumps({c["name"]: [measure(args.config, args.seq_len, args.batch, args.world, c)] for c in cases}))
        return
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(args.world, f"tcp://127.0.0.1:{port}", args, out), nprocs=args.world, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.world)]
    print(json.dumps({c["name"]: [r[c["name"]] for r in ranks] for c in cases}))


if __name__ == "__main__":
    sys.exit(main())
