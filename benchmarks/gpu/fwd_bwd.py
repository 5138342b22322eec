"""Part d: forward + backward alone, no optimizer, over a grid of batch sizes and sequence lengths.

    python benchmarks/gpu/fwd_bwd.py --model MODEL --unit NAME --results RESULTS.jsonl --attempt ID \
        [--batches 1,4,16] [--seq-lens 128,512] [--attn eager,sdpa] [--weights bf16,fp32-autocast] [--dry-run]

For each weights mode, attention kernel, sequence length and batch size (in that order: the
model is built once per weights mode and kernel, and an OOM skips the larger batches of its
setting), one real forward and backward of the task
model (random init, built from its config) after a warm-up pass:

- `bf16` weights (the model built in bfloat16, no autocast): what the issue asks for, activations
  and attention without the optimizer, predicted with `--dtype bfloat16`.
- `fp32-autocast` weights (fp32 master weights, bf16 autocast, as `--bf16` trains): compared
  with `estimate_memory` for that recipe with SGD, whose per-phase peaks minus the optimizer
  state (static through forward and backward) are the forward and backward peaks of this loop.

Measured with `torch.cuda.reset_peak_memory_stats` / `max_memory_allocated` around each phase;
times are medians of 3 timed passes (`perf_counter` after a synchronize). Each setting also gets
an isolated attention forward+backward on [batch, heads, seq, head_dim] bf16 tensors, to see the
attention kernel's own memory apart from the rest of the model (eager: the [b, h, s, s] scores).
`--dry-run` runs the same code on the CPU with the counters null.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from results import ResultsLog, quantity

PART = "d"
WEIGHTS_MODES = ("bf16", "fp32-autocast")
TIMED_REPEATS = 3


@dataclass(kw_only=True, slots=True)
class Cell:
    """One point of the grid."""

    weights: str
    attn: str
    seq_len: int
    batch: int

    @property
    def name(self) -> str:
        return f"{self.weights}/{self.attn}/s{self.seq_len}/b{self.batch}"


@dataclass(kw_only=True, slots=True)
class Measured:
    """One forward+backward (bytes, seconds); None where the device cannot say (CPU)."""

    base_bytes: int | None
    """Allocated before forward: weights, inputs, library workspaces."""
    forward_peak_bytes: int | None
    activations_bytes: int | None
    """Allocated after forward minus before: what forward keeps for backward (and the loss)."""
    backward_peak_bytes: int | None
    reserved_peak_bytes: int | None
    forward_s: float
    backward_s: float


class Device:
    """CUDA counters, or nothing (a CPU dry run)."""

    def __init__(self, dry_run: bool) -> None:
        self.cuda = not dry_run
        self.torch_device = torch.device("cuda" if self.cuda else "cpu")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated() if self.cuda else None

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.cuda else None

    def peak_reserved(self) -> int | None:
        return torch.cuda.max_memory_reserved() if self.cuda else None

    def free_all(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def timed(device: Device, fn: Callable[[], Any]) -> tuple[Any, float]:
    device.sync()
    start = time.perf_counter()
    out = fn()
    device.sync()
    return out, time.perf_counter() - start


def measure_model(model: Any, batch: dict[str, torch.Tensor], device: Device, autocast: bool) -> Measured:
    """Warm up, then one measured forward+backward, then timed repeats; gradients set to None first."""
    cast = torch.autocast(device.torch_device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    def forward() -> torch.Tensor:
        with cast:
            return model(**batch).loss

    forward().backward()  # warm-up: kernels, cuBLAS workspaces of both threads
    model.zero_grad(set_to_none=True)
    device.reset_peak()
    base = device.allocated()
    loss, forward_s = timed(device, forward)
    after_forward, forward_peak, reserved_forward = device.allocated(), device.peak(), device.peak_reserved()
    device.reset_peak()
    _, backward_s = timed(device, loss.backward)
    backward_peak, reserved_backward = device.peak(), device.peak_reserved()
    del loss
    model.zero_grad(set_to_none=True)
    forwards, backwards = [forward_s], [backward_s]
    for _ in range(TIMED_REPEATS - 1 if device.cuda else 0):
        loss, f_s = timed(device, forward)
        _, b_s = timed(device, loss.backward)
        forwards.append(f_s)
        backwards.append(b_s)
        del loss
        model.zero_grad(set_to_none=True)
    return Measured(
        base_bytes=base, forward_peak_bytes=forward_peak,
        activations_bytes=None if after_forward is None or base is None else after_forward - base,
        backward_peak_bytes=backward_peak,
        reserved_peak_bytes=None if reserved_forward is None else max(reserved_forward, reserved_backward or 0),
        forward_s=statistics.median(forwards), backward_s=statistics.median(backwards),
    )


def attention_probe(cell: Cell, config: Any, causal: bool, device: Device) -> dict[str, int | None]:
    """The attention op alone, bf16, no dropout: bytes it keeps for backward and its peak above inputs."""
    heads = int(getattr(config, "num_attention_heads", None) or config.n_head)
    hidden = int(getattr(config, "hidden_size", None) or config.n_embd)
    shape = (cell.batch, heads, cell.seq_len, hidden // heads)
    q, k, v = (torch.randn(shape, device=device.torch_device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    device.reset_peak()
    base = device.allocated()
    if cell.attn == "sdpa":
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:  # what transformers' eager attention does: fp32 softmax of the scaled scores, cast back
        scores = torch.matmul(q, k.transpose(-1, -2)) / (shape[-1] ** 0.5)
        if causal:
            mask = torch.ones(cell.seq_len, cell.seq_len, device=device.torch_device, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    kept = device.allocated()
    out.backward(torch.ones_like(out))
    peak = device.peak()
    return {"attention_kept_bytes": None if kept is None or base is None else kept - base,
            "attention_peak_bytes": None if peak is None or base is None else peak - base}


def predict(workload: Any, cell: Cell, gpu: Any, *, with_time: bool) -> tuple[dict[str, float | None], str | None]:
    """anatomist's forward and backward peaks (and times) for the cell, or why there is none."""
    from anatomist.estimate import estimate_memory, estimate_time
    from anatomist.recipe import Recipe

    knobs: dict[str, Any] = {"per_device_train_batch_size": cell.batch, "attn_implementation": cell.attn,
                             "optim": "sgd", "max_grad_norm": 0.0}
    knobs["dtype"] = load_dtype(cell.weights)  # explicit: "auto" would follow the config's dtype
    knobs["bf16"] = cell.weights == "fp32-autocast"
    recipe = Recipe(**knobs)
    memory = estimate_memory(workload, recipe.resolved(workload), gpu)
    state = memory.anatomy.optimizer_states  # SGD momentum: static through forward and backward
    out: dict[str, float | None] = {
        "forward_peak_bytes": memory.phase_peaks.get("forward", state) - state,
        "backward_peak_bytes": memory.phase_peaks.get("backward", state) - state,
    }
    if with_time:  # GPU seconds: nothing to compare with CPU times in a dry run
        phases = estimate_time(workload, recipe.resolved(workload), gpu).phases_s
        out["forward_s"], out["backward_s"] = phases.get("forward"), phases.get("backward")
    return out, None


def predicted_or_reason(workload: Any, cell: Cell, gpu: Any, *, dry_run: bool) -> tuple[dict[str, float | None], str | None]:
    """`predict`, never raising: a failed prediction is recorded beside the measurement."""
    if dry_run and cell.attn != "sdpa":
        # Each prediction traces the model anew (~10 s of a 2-core CPU): one kernel exercises the code.
        return {}, "prediction left out of the dry run for this kernel"
    try:
        return predict(workload, cell, gpu, with_time=not dry_run)
    except Exception as exc:  # noqa: BLE001 - the measurement stands without a prediction
        return {}, f"prediction failed: {type(exc).__name__}: {str(exc)[:300]}"


def load_dtype(weights: str) -> str:
    """The load dtype of a weights mode: bf16 weights, or fp32 master weights under autocast."""
    return "bfloat16" if weights == "bf16" else "float32"


def build(workload: Any, attn: str, weights: str, device: Device) -> Any:
    """The task model in the mode's load dtype, initialised on the device when transformers allows it."""
    try:
        with torch.device(device.torch_device):
            model = workload.build_model(attn, load_dtype(weights))
    except (RuntimeError, TypeError, NotImplementedError):
        model = workload.build_model(attn, load_dtype(weights)).to(device.torch_device)
    return model.train()


def measure_cell(model: Any, workload: Any, cell: Cell, device: Device) -> tuple[Measured | None, tuple[str, str] | None]:
    """The cell's measurement, or (status, reason) of its failure: an OOM, or any crash."""
    from anatomist.trace.step.inputs import make_batch

    try:
        batch = {k: v.to(device.torch_device) for k, v in make_batch(workload, cell.batch).items()}
        return measure_model(model, batch, device, autocast=cell.weights == "fp32-autocast"), None
    except torch.cuda.OutOfMemoryError as exc:
        return None, ("oom", f"out of memory: {str(exc).splitlines()[0]}")
    except Exception as exc:  # noqa: BLE001 - a crash is a recorded result; the grid goes on
        return None, ("error", f"{type(exc).__name__}: {str(exc)[:300]}")


def attention_or_oom(cell: Cell, workload: Any, device: Device) -> dict[str, Any]:
    """`attention_probe`, or why it has no figure (eager scores can outgrow the model's own step)."""
    try:
        return attention_probe(cell, workload.config, workload.task == "causal-lm", device)
    except torch.cuda.OutOfMemoryError as exc:
        failure = {"oom": str(exc).splitlines()[0]}
    device.free_all()
    return failure


def run(args: argparse.Namespace) -> None:
    from anatomist.hardware import detect_local_gpu, get_gpu
    from anatomist.workload_loader import load_workload

    log, device = ResultsLog(path=args.results), Device(args.dry_run)
    gpu = (None if args.dry_run else detect_local_gpu()) or get_gpu("H100-SXM")
    probe = load_workload(args.model, seq_len=16)
    limit = probe.max_positions or max(args.seq_lens)
    seq_lens = [s for s in args.seq_lens if s <= limit]
    for weights in args.weights:
        for attn in args.attn:
            model = build(probe, attn, weights, device)
            for seq_len in seq_lens:
                workload = load_workload(args.model, seq_len=seq_len)
                cells = [Cell(weights=weights, attn=attn, seq_len=seq_len, batch=b) for b in sorted(args.batches)]
                run_cells(args, log, device, model, workload, cells, gpu)
            del model
            device.free_all()


def run_cells(args: argparse.Namespace, log: ResultsLog, device: Device, model: Any, workload: Any,
              cells: list[Cell], gpu: Any) -> None:
    """One setting's batch sizes, ascending: after an OOM the larger ones are recorded as skipped."""
    oom_at: int | None = None
    for cell in cells:
        row: dict[str, Any] = {"part": PART, "unit": args.unit, "attempt": args.attempt, "name": cell.name,
                               "mode": "dry-run" if args.dry_run else "gpu"}
        details: dict[str, Any] = {"model": args.model, "task": workload.task, "weights": cell.weights,
                                   "attn": cell.attn, "seq_len": cell.seq_len, "batch": cell.batch}
        if oom_at is not None:
            log.row(**row, status="skipped", reason=f"batch {oom_at} ran out of memory", details=details)
            continue
        measured, failure = measure_cell(model, workload, cell, device)
        if failure is not None:  # the exception (and the tensors its frames held) is gone by now
            model.zero_grad(set_to_none=True)
            device.free_all()
            status, reason = failure
            oom_at = cell.batch if status == "oom" else None
            log.row(**row, status=status, reason=reason, details=details)
            continue
        assert measured is not None
        details["attention"] = attention_or_oom(cell, workload, device)
        predicted, why_not = predicted_or_reason(workload, cell, gpu, dry_run=args.dry_run)
        details["measured"] = asdict(measured)
        reason = f"dry-run: CUDA counters not read (no GPU), times are CPU times; {why_not or 'predicted'}" \
            if args.dry_run else why_not
        log.row(**row, status="ok", reason=reason, details=details, quantities={
            "forward_peak_bytes": quantity(predicted.get("forward_peak_bytes"), measured.forward_peak_bytes),
            "backward_peak_bytes": quantity(predicted.get("backward_peak_bytes"), measured.backward_peak_bytes),
            "activations_bytes": quantity(None, measured.activations_bytes),
            "forward_s": quantity(predicted.get("forward_s"), measured.forward_s),
            "backward_s": quantity(predicted.get("backward_s"), measured.backward_s),
        })
        print(f"validate d: {args.unit} {cell.name} recorded", file=sys.stderr)
        device.free_all()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    def names(text: str) -> list[str]:
        return [x for x in text.split(",") if x]

    parser.add_argument("--model", required=True, help="catalog name or config folder")
    parser.add_argument("--unit", required=True)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--attempt", required=True)
    parser.add_argument("--batches", type=ints, default=[1, 4, 16])
    parser.add_argument("--seq-lens", type=ints, default=[128, 512, 2048])
    parser.add_argument("--attn", type=names, default=["eager", "sdpa"])
    parser.add_argument("--weights", type=names, default=list(WEIGHTS_MODES))
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.weights) - set(WEIGHTS_MODES))
    if unknown:
        parser.error(f"unknown weights mode(s) {', '.join(unknown)}; known: {', '.join(WEIGHTS_MODES)}")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
