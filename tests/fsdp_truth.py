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
policy (`cuda_code_paths`, `cuda_autocast_policy`: which kernels run, not how memory is counted),
and FSDPMemTracker rounds each storage to the CUDA allocator's 512 bytes, as it does on CUDA.

Prints one JSON object: case name -> list, per rank, of FSDPMemTracker's peak snapshot (bytes by
its categories, "Total").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _round_as_cuda() -> None:
    from torch.distributed._tools import mem_tracker

    block = mem_tracker._PYTORCH_MIN_ALLOCATE
    mem_tracker._WeakRefInfo._calculate_mem_consumed = (  # type: ignore[method-assign]
        lambda self: math.ceil(self.size * self.element_size / block) * block)


def measure(config: str, seq_len: int, batch: int, case: dict[str, Any]) -> dict[str, int]:
    """FSDPMemTracker's peak of one steady-state step of `case` on this rank."""
    import torch
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin, fsdp2_prepare_model
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from anatomist.trace.autocast import cuda_autocast_policy
    from anatomist.trace.cuda_model import cuda_code_paths
    from anatomist.trace.inputs import make_batch
    from anatomist.workload import load_workload

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
    model = workload.build_model("sdpa", "float32")
    if case.get("lora"):  # LoRA as PEFT's FSDP guide runs it: adapters on the model, then the Trainer wraps it
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, bias="none",
                                                 task_type="CAUSAL_LM"))
    if case.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable()  # the Trainer does it before accelerator.prepare
    model = fsdp2_prepare_model(accelerator, model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    accumulation = case.get("accumulation", 1)
    batches = [make_batch(workload, batch) for _ in range(accumulation)]

    def step() -> None:
        for micro, inputs in enumerate(batches):
            sync = micro == accumulation - 1
            model.set_requires_gradient_sync(sync)
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mixed != "no" else contextlib.nullcontext()
            with autocast:
                loss = model(**inputs).loss
            (loss / accumulation).backward()
        model.set_requires_gradient_sync(True)
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    policy = cuda_autocast_policy() if mixed != "no" else contextlib.nullcontext()
    with cuda_code_paths(), policy:
        step()
        tracker = FSDPMemTracker(model, optimizer)
        with tracker:
            step()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    return {str(k).rsplit(".", 1)[-1]: int(v) for k, v in peak.items()}


def _collectives_release_their_tensors() -> None:
    """Make each gloo collective FSDP calls return only once gloo has let go of its tensors.

    Gloo's worker thread keeps references to a collective's tensors until it drops the finished work,
    which can be after the call has returned and FSDP has dropped its own (seen: the storage's use count
    still raised after `all_gather_single` returned, in about half the calls). So the moment a buffer's
    storage died, and with it FSDPMemTracker's peak, moved with the machine's load (-3.2% against -0.9%,
    2026-11-23). Waiting for the counts to fall back makes each buffer live as long as FSDP holds it, as
    with the fake process group, whose collectives hold nothing. The call itself is FSDP's, on FSDP's
    tensors, so FSDPMemTracker still sees and names the all-gather and reduce-scatter buffers.
    """
    import time

    import torch
    import torch.distributed as dist

    def held(tensors):
        return [torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in tensors]

    def released(collective):
        def call(*args, **kwargs):
            if kwargs.get("async_op"):  # only with fully_shard(...).unshard_async_op, which accelerate leaves off
                raise RuntimeError("fsdp_truth.py expects FSDP's collectives to be synchronous")
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            before = held(tensors)
            collective(*args, **kwargs)
            deadline = time.monotonic() + 60
            while held(tensors) != before:
                if time.monotonic() > deadline:
                    raise RuntimeError("gloo kept a collective's tensors for a minute")
                time.sleep(0)
        return call

    dist.all_gather_single = released(dist.all_gather_single)
    dist.reduce_scatter_single = released(dist.reduce_scatter_single)


def _rank(rank: int, world: int, address: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    _round_as_cuda()
    _collectives_release_their_tensors()
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    try:
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
    parser.add_argument("cases", help="JSON list of {name, fsdp, bf16, accumulation, gradient_checkpointing, lora}")
    args = parser.parse_args()
    cases = json.loads(args.cases)
    if args.backend == "fake":
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        _round_as_cuda()
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
