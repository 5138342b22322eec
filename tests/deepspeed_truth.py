"""DeepSpeed's own accounting of one rank of a real ZeRO step: the measured side of test_deepspeed_accuracy.py.

Run as a script, in a process of its own (a process group is process-wide state):

    python tests/deepspeed_truth.py --config DIR --seq-len N --world W CASES_JSON

W processes (spawned here) form a gloo group on this machine; DeepSpeed runs on its CPU accelerator
(`DS_ACCELERATOR=cpu`). Each rank trains the model (real CPU weights, loaded in the case's dtype) with
transformers' own Trainer and the DeepSpeed config `anatomist plan --emit deepspeed` writes for the case:
the Trainer fills its "auto" values, builds its optimizer and hands both to `deepspeed.initialize`, as it
does on a GPU. Training runs under PyTorch's `torch.distributed._tools.mem_tracker.MemTracker` from before
DeepSpeed starts (so that it sees every buffer DeepSpeed makes), and its peak is taken over the second step
(the first creates the optimizer state), on CUDA's code paths, each storage counted in the CUDA
allocator's 512-byte blocks (`anatomist.bench.trackers.as_on_cuda`), and each gloo collective returning
only once gloo let go of its tensors (`collectives_hold_nothing`).

The peak is taken apart at the optimizer's step: "passes" (forward and backward, up to the step) and "step"
(within the optimizer's step). Beside it, each rank reads DeepSpeed's own ZeRO optimizer after the step: the bytes of its
fp32 partitions (the master weights), of its optimizer's state tensors, of its flat low-precision
parameter groups (ZeRO-1/2) or parameter partitions (ZeRO-3), and of the gradient partitions it keeps
(ZeRO-2: `grads_in_partition`, read just before its step frees it; ZeRO-3: `grad_partitions_flat_buffer`).

Prints one JSON object: case name -> list, per rank, of {"peak", "passes", "step": MemTracker's peak snapshots
(bytes by its categories, "Total"), "zero": the optimizer's own bytes by the names above}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _bytes(tensors: Any) -> int:
    """Bytes of the storages of `tensors` (each storage once)."""
    import torch

    seen: dict[int, int] = {}
    for t in tensors:
        if torch.is_tensor(t) and t.numel():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _state_bytes(optimizer: Any) -> int:
    import torch

    return _bytes(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


class _AtTheStep:
    """What a ZeRO optimizer's step sees of the last step tracked: the reduced gradients of this device's partition
    as it begins (ZeRO-1/2: views of the flat buffer made in backward, which the step frees), and MemTracker's peak
    before it (forward and backward) and within it (the optimizer step)."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.gradients = 0
        self.passes: dict[str, int] = {}
        self.step: dict[str, int] = {}

    def __enter__(self) -> _AtTheStep:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        self._steps = {cls: cls.step for cls in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)}
        for cls, original in self._steps.items():
            cls.step = self._watched(original)
        return self

    def _watched(self, original: Any) -> Any:
        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            groups = [g if isinstance(g, list) else [g] for g in optimizer.averaged_gradients.values()
                      if g is not None] if isinstance(optimizer.averaged_gradients, dict) else []
            self.gradients = _bytes(t for group in groups for t in group)
            self.passes = _peak(self.tracker)
            _reset_peak(self.tracker)
            result = original(optimizer, *args, **kwargs)
            self.step = _peak(self.tracker)
            return result

        return step

    def __exit__(self, *exc: object) -> None:
        for cls, original in self._steps.items():
            cls.step = original


class _NoHooks(dict):
    """The hooks of a frozen parameter: none (a dict a RemovableHandle can refer to weakly)."""


@contextlib.contextmanager
def _frozen_parameters_unhooked() -> Iterator[None]:
    """MemTracker hooks every parameter's gradient, which torch refuses on a frozen one (a LoRA base); a frozen
    parameter never has a gradient, so its hooks are skipped (as tests/test_peft.py does)."""
    import torch

    originals = {name: getattr(torch.Tensor, name) for name in ("register_hook", "register_post_accumulate_grad_hook")}

    def only_if_trainable(original: Any) -> Any:
        def register(tensor: Any, hook: Any) -> Any:
            return original(tensor, hook) if tensor.requires_grad else torch.utils.hooks.RemovableHandle(_NoHooks())

        return register

    for name, original in originals.items():
        setattr(torch.Tensor, name, only_if_trainable(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _peak(tracker: Any) -> dict[str, int]:
    """MemTracker's peak snapshot of the CPU (DeepSpeed makes meta tensors too), by its categories' names."""
    import torch

    peak = tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {})
    return {str(k).removeprefix("_MemRefType."): int(v) for k, v in peak.items()}


def _zero_bytes(optimizer: Any, gradients_at_step: int) -> dict[str, int]:
    """The ZeRO optimizer's own tensors on this rank, by what they hold."""
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3 (stage3.py)
        return {"master": _bytes(optimizer.fp32_partitioned_groups_flat),
                "states": _state_bytes(optimizer.optimizer),
                "weights": _bytes(optimizer.fp16_partitioned_groups_flat),
                "gradients": _bytes([optimizer.grad_partitions_flat_buffer])}
    return {"master": _bytes(optimizer.single_partition_of_fp32_groups),  # ZeRO-1/2 (stage_1_and_2.py)
            "states": _state_bytes(optimizer.optimizer),
            "weights": _bytes(optimizer.bit16_groups_flat),
            "gradients": gradients_at_step}


def _reset_peak(tracker: Any) -> None:
    """Start MemTracker's peak afresh from what is live now, as it does when it is entered."""
    tracker._peak_mem_snap = tracker.get_tracker_snapshot()  # as MemTracker.__enter__ does
    tracker._peak_mem = {device: snapshot["Total"] for device, snapshot in tracker._peak_mem_snap.items()}


def _dataset(vocab: int, seq_len: int, samples: int, positions: bool) -> Any:
    """`samples` rows of random tokens, their own labels, and where `positions` their position ids (DeepSpeed's
    sequence parallel data loader requires them, as transformers' deepspeed_alst.md says)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (samples, seq_len), generator=generator)
    extra = {"position_ids": torch.arange(seq_len)} if positions else {}
    return [{"input_ids": row, "labels": row, **extra} for row in ids]


@contextlib.contextmanager
def _exchanges_counted(counted: list[int]) -> Iterator[None]:
    """Each all-to-all DeepSpeed's communication module runs (its Ulysses exchanges) counted in `counted`."""
    import deepspeed.comm as comm

    original = comm.all_to_all_single

    def counting(*args: Any, **kwargs: Any) -> Any:
        counted[0] += 1
        return original(*args, **kwargs)

    comm.all_to_all_single = counting
    try:
        yield
    finally:
        comm.all_to_all_single = original


@contextlib.contextmanager
def _gloo_all_to_all_on_subgroups() -> Iterator[None]:
    """torch.distributed.nn's all-to-all on gloo, which the backward of transformers' loss all-gather runs under
    sequence parallel (`deepspeed_sp_compute_loss`), scatters from each rank of the group named by its group rank
    where `scatter` takes a global one: on a group that is not the whole world it fails ("Global rank 0 is not part of
    group"). The same exchange here, each group rank scattering in turn as `group_src`; NCCL runs its own all-to-all."""
    import torch.distributed as dist
    from torch.distributed.nn import functional

    original = functional._AlltoAll.forward

    def forward(ctx: Any, group: Any, out_tensor_list: list[Any], *tensors: Any) -> tuple[Any, ...]:
        ctx.group = group
        ctx.input_tensor_size_list = [t.size() for t in tensors]
        me = dist.get_rank(group=group)
        for source in range(dist.get_world_size(group=group)):
            sent = [t.contiguous() for t in tensors] if source == me else None
            dist.scatter(out_tensor_list[source], sent, group=group, group_src=source)
        return tuple(out_tensor_list)

    functional._AlltoAll.forward = staticmethod(forward)
    try:
        yield
    finally:
        functional._AlltoAll.forward = original


def _linear_restored() -> None:
    """torch's own F.linear back for the next case: ZeRO-3's engine replaces it for the rest of the process
    (partition_parameters.py `_enable_mem_efficient_linear`, "this will persist unless manually reset") with a linear
    that saves every input for backward, which a frozen LoRA base layer otherwise does not."""
    import torch
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    original = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    if original is not None:
        torch.nn.functional.linear = original


def _ulysses_undone() -> None:
    """What DeepSpeed's Ulysses registered process-wide undone for the next case: transformers' SDPA back in its
    attention registry, the sequence parallel groups released and forgotten by DeepSpeed's engine (`groups.mpu`)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
    parallel_state_sp._release_sequence_parallel_groups()
    groups.mpu = None


def _parallelism_config(recipe: Any, world: int) -> dict[str, Any]:
    """TrainingArguments' parallelism_config as `anatomist plan --emit trainer` writes it (sequence parallel: DeepSpeed's
    Ulysses), with DeepSpeed's communication started over the gloo group: on a GPU accelerate's state starts it, on the
    CPU it does not (state.py: `if not cpu`), and Ulysses registers its groups before `deepspeed.initialize` would."""
    if not recipe.uses_parallelism_config:
        return {}
    import deepspeed
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    from anatomist.plan.emit import SP_HANDLER, parallelism_sizes

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    return {"parallelism_config": ParallelismConfig(**parallelism_sizes(recipe, world),
                                                    sp_handler=DeepSpeedSequenceParallelConfig(**SP_HANDLER))}


def _case(config: Path, seq_len: int, world: int, case: dict[str, Any], out: Path) -> dict[str, Any]:
    """One rank's accounting of `case` (a Recipe's fields and its "name")."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from anatomist.bench.trackers import as_on_cuda, collectives_hold_nothing
    from anatomist.plan.emit import deepspeed_config
    from anatomist.recipe import Recipe
    from anatomist.recipe.spellings import lora_config_kwargs, training_arguments_kwargs

    recipe = Recipe.from_dict({k: v for k, v in case.items() if k != "name"})
    model_config = AutoConfig.from_pretrained(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config, dtype=getattr(torch, recipe.dtype),
                                             attn_implementation=recipe.attn_implementation)
    if recipe.peft == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**lora_config_kwargs(recipe, "CAUSAL_LM")))
    kwargs = training_arguments_kwargs(recipe)
    args = TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, max_steps=2, dataloader_num_workers=0,
                             deepspeed=deepspeed_config(recipe, num_gpus=world), **_parallelism_config(recipe, world),
                             **{k: v for k, v in kwargs.items() if k not in ("dataloader_num_workers",)})
    result: dict[str, Any] = {}
    tracker = MemTracker()

    class SecondStep(TrainerCallback):
        """MemTracker's peak over the second step, from its first micro-batch to the optimizer's step."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 1:
                tracker.reset_mod_stats()  # MemTracker's own per-module stats take one forward at a time
                _reset_peak(tracker)

        def on_substep_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            tracker.reset_mod_stats()  # the next micro-batch's forward

    batches = recipe.per_device_train_batch_size * recipe.gradient_accumulation_steps * world * 2
    dataset = _dataset(model_config.vocab_size, seq_len, batches, positions=recipe.sp_size > 1)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[SecondStep()])
    exchanges = [0]
    tracker.track_external(model)
    try:
        with as_on_cuda(recipe.mixed_precision != "no"), collectives_hold_nothing(), _frozen_parameters_unhooked(), \
                _AtTheStep(tracker) as at_step, _exchanges_counted(exchanges), _gloo_all_to_all_on_subgroups():
            with tracker:  # from before DeepSpeed's start: its flat buffers and fp32 partitions are made in view
                trainer.train()
    finally:
        unset_hf_deepspeed_config()  # a ZeRO-3 config would build the next case's model partitioned
        _linear_restored()
        if recipe.sp_size > 1:
            _ulysses_undone()
    result["passes"], result["step"] = at_step.passes, at_step.step
    result["peak"] = max(at_step.passes, at_step.step, key=lambda peak: peak["Total"])
    result["zero"] = _zero_bytes(trainer.model_wrapped.optimizer, at_step.gradients)
    result["exchanges"] = exchanges[0]
    return result



def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import transformers

    transformers.logging.set_verbosity_error()
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for case in json.loads(args.cases):
            results[case["name"]] = _case(Path(args.config), args.seq_len, world, case, Path(out))
    queue.put((rank, results))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _results(queue: Any, ranks: list[Any]) -> Any:
    """Each rank's (rank, results), as they come; a rank that ends without any stops the run."""
    import queue as queues

    received = 0
    while received < len(ranks):
        try:
            yield queue.get(timeout=5)
            received += 1
        except queues.Empty:
            if any(p.exitcode not in (None, 0) for p in ranks):
                for process in ranks:
                    process.kill()
                raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in ranks]}") from None


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("cases")
    args = parser.parse_args()
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    ranks = [context.Process(target=_rank, args=(r, args.world, port, args, queue)) for r in range(args.world)]
    for process in ranks:
        process.start()
    results = dict(_results(queue, ranks))
    for process in ranks:
        process.join()
    names = [c["name"] for c in json.loads(args.cases)]
    print(json.dumps({name: [results[r][name] for r in range(args.world)] for name in names}))


if __name__ == "__main__":
    sys.exit(main())
