"""PyTorch's own accounting of one rank of a real FSDP2 step: the measured side of test_fsdp_accuracy.py.

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

Prints one JSON object: case name -> list, per rank, of {"peak": FSDPMemTracker's peak snapshot (bytes
by its categories, "Total"), "peak_moment": the moment it falls in, "moments": moment -> FSDPMemTracker's
highest snapshot within it}. A moment is a place in the step named as anatomist's traces name it
(`anatomist.trace.engine.records.Event`): "phase segment micro-step block", e.g. "backward blocks 1 4" (the
backward of the fifth block in the second micro-batch) or "backward post 0 -1" (after the last block:
the head and the loss). The segments are marked by hooks of this file's own (`_watch_blocks`) that
follow the definition of the tracer's (trace/step/driver.py): forward enters block i at its input, backward
enters block i when the gradient of its output exists. They are registered after FSDP's, as the tracer's
are, so FSDP's work at a boundary falls on the same side of it: in forward a block's all-gather (FSDP's
pre-forward hook) in the segment before it; in backward a block's all-gather (prefetched by the
pre-backward of the block after it) in the segment after it, its reduce-scatter in the block before it
("pre" for the first). The bytes are FSDPMemTracker's; the hooks only say where in the step each of its
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
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _snapshot(snapshot: dict[Any, int]) -> dict[str, int]:
    """FSDPMemTracker's snapshot of one device, by the names of its categories ("ALL_GATHER", ..., "Total")."""
    return {str(k).rsplit(".", 1)[-1]: int(v) for k, v in snapshot.items()}


def _moment_tracker(model: Any, optimizer: Any) -> Any:
    """An FSDPMemTracker that also keeps its highest snapshot within each moment of the step, and leaves
    FSDP's hooks of a unit of several modules as FSDP registers them (`anatomist.bench.trackers`).

    The moment (phase, segment, micro-step, block) is set by `step` and `_watch_blocks`; after each op
    FSDPMemTracker updates its peak (`_update_peak_stats`), and the current snapshot is kept where it is
    the moment's highest. Of equal ones the last is kept: FSDPMemTracker names an all-gather output
    ALL_GATHER only when the collective runs, one op after the buffer's allocation made the total.
    """
    from anatomist.bench.trackers import GroupedFSDPMemTracker

    class MomentTracker(GroupedFSDPMemTracker):
        def __init__(self) -> None:
            super().__init__(model, optimizer)
            self.phase, self.segment, self.micro_step, self.block = "forward", "pre", 0, -1
            self.moments: dict[str, dict[str, int]] = {}
            self.peak_moment = ""

        def moment(self) -> str:
            return f"{self.phase} {self.segment} {self.micro_step} {self.block}"

        def _update_peak_stats(self, peak_state: Any) -> None:
            peak = dict(self._peak_mem)
            super()._update_peak_stats(peak_state)
            if self._peak_mem != peak:
                self.peak_moment = self.moment()
            for snapshot in self._curr_mem_snap.values():  # one device: this rank's
                kept = self.moments.get(self.moment())
                if kept is None or snapshot["Total"] >= kept["Total"]:
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


def measure(config: str, seq_len: int, batch: int, case: dict[str, Any]) -> dict[str, Any]:
    """FSDPMemTracker's peak of one steady-state step of `case` on this rank, and its highest snapshot
    within each moment of the step."""
    import re

    import torch
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin, fsdp2_prepare_model

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
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), mixed_precision=mixed,
                                        is_main_process=True, device=torch.device("cpu"))
    torch.manual_seed(0)
    model = workload.build_model(case.get("attn_implementation", "sdpa"), "float32")
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
    model = fsdp2_prepare_model(accelerator, model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    if case.get("fp8") and ao.config.enable_fsdp_float8_all_gather:  # as `_prepare_ao` registers it
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
    accumulation = case.get("accumulation", 1)
    batches = [make_batch(workload, batch) for _ in range(accumulation)]
    blocks = [m for name, m in model.named_modules() if re.fullmatch(r"(.+\.)?layers\.\d+", name)]

    def step(moments: Any) -> None:
        """One step, telling `moments` (the tracker) where it is."""
        for micro, inputs in enumerate(batches):
            moments.phase, moments.segment, moments.micro_step, moments.block = "forward", "pre", micro, -1
            sync = micro == accumulation - 1
            model.set_requires_gradient_sync(sync)
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mixed != "no" else contextlib.nullcontext()
            with autocast:
                loss = model(**inputs).loss
            moments.phase, moments.segment, moments.block = "backward", "post", -1
            (loss / accumulation).backward()
        moments.phase, moments.segment, moments.micro_step, moments.block = "optimizer", "pre", 0, -1  # clipping too
        model.set_requires_gradient_sync(True)
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with as_on_cuda(mixed != "no"):
        step(types.SimpleNamespace())
        tracker = _moment_tracker(model, optimizer)
        with tracker:
            handles = _watch_blocks(tracker, blocks)  # after FSDPMemTracker has re-registered FSDP's hooks
            step(tracker)
            for handle in handles:
                handle.remove()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    return {"peak": _snapshot(peak), "peak_moment": tracker.peak_moment, "moments": tracker.moments}


def _rank(rank: int, world: int, address: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    from anatomist.bench.trackers import collectives_hold_nothing

    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    try:
        with collectives_hold_nothing():
            results = {c["name"]: measure(args.config, args.seq_len, args.batch, c) for c in json.loads(args.cases)}
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
    parser.add_argument("cases", help="JSON list of {name, fsdp, bf16, accumulation, gradient_checkpointing, lora, "
                                      "attn_implementation, fp8, fp8_all_gather}")
    args = parser.parse_args()
    cases = json.loads(args.cases)
    if args.backend == "fake":
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
        print(json.dumps({c["name"]: [measure(args.config, args.seq_len, args.batch, c)] for c in cases}))
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
