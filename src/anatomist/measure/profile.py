"""Profile real training steps with torch.profiler and split the time by operation class.

`profile_training` runs real steps of the real model (random init) on the local device
(CUDA if present, else CPU), made as a user of the recipe makes it (`bench.worker.training_model`:
get_peft_model's adapters, bitsandbytes' quantized base; checkpointing with the Trainer's
gradient_checkpointing_kwargs), each step wrapped in `record_function` ranges "forward",
"backward" and "optimizer", after one warm-up step that is not profiled. It then adds up
the SELF time of every ATen op (`aten::*` events; self time, so a composite such as
`aten::linear` does not count its `aten::addmm` twice) by class (data/op_classes.toml), and
takes the phase times from the three ranges. FLOPs per class come from the fake-tensor
count of the same step (`estimate.time.ops`): matrix products exactly (flop_counter), other
ops approximately (per element).

Known limitations: on CPU the time split is the CPU's, not a GPU's (a CPU is far slower at
matrix products relative to memory traffic); a DataLoader is not used (batches are made
in memory), so data-loading time is not part of the step. The step is the Trainer's, on one
process: TRL's trainers, FSDP, Liger Kernel and packed rows are refused (`check_runnable`)
rather than profiled as a step they are not.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from anatomist.anatomy import OpClass, Phase
from anatomist.axes.optimizers import optimizer
from anatomist.errors import InputError
from anatomist.estimate.time.ops import step_flops, step_ops
from anatomist.hardware import detect_local_gpu
from anatomist.op_classes import classify, is_known
from anatomist.recipe import Recipe, ResolvedRecipe
from anatomist.recipe.packages import missing_packages
from anatomist.recipe.spellings import training_arguments
from anatomist.trace.step.inputs import make_batch
from anatomist.workload import Workload

PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)
TOP_OPS = 10


@dataclass(kw_only=True, slots=True)
class ProfileResult:
    """What `anatomist profile --json` prints (DESIGN.md), plus the step's FLOPs and speed."""

    classes: dict[str, dict[str, float]]
    """Per class: share of the step's FLOPs and of the profiled ATen self time, in percent."""
    phases: dict[str, float]
    """Mean seconds per step of forward_s, backward_s, optimizer_s (record_function ranges)."""
    top_ops: list[dict[str, Any]]
    device: str
    unknown_ops: list[str]
    steps: int
    step_s: float
    """Mean wall time of one profiled step (the three ranges)."""
    flops_per_step: int
    """Model FLOPs of one step (no recomputation; `StepFlops.model`)."""
    hardware_flops_per_step: int
    """Hardware FLOPs of one step (with gradient checkpointing's recomputation; `StepFlops.hardware`)."""
    achieved_tflops: float
    """Model FLOPs per second."""
    mfu: float | None
    """Against the local GPU's dense peak for the recipe's dtype; None on CPU."""
    hfu: float | None
    """The same with the hardware FLOPs; None on CPU."""
    op_time_s: float
    """Self time of all ATen ops per step, as the profiler reports it."""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "classes": self.classes, "phases": self.phases, "top_ops": self.top_ops, "device": self.device,
            "unknown_ops": self.unknown_ops, "steps": self.steps, "step_s": self.step_s,
            "flops_per_step": self.flops_per_step, "hardware_flops_per_step": self.hardware_flops_per_step,
            "achieved_tflops": self.achieved_tflops, "mfu": self.mfu, "hfu": self.hfu,
            "op_time_s": self.op_time_s, "notes": self.notes,
        }


def check_runnable(recipe: ResolvedRecipe, steps: int, device: torch.device) -> None:
    """Raise InputError for a recipe this machine cannot run, before any model is built."""
    if steps <= 0:
        raise InputError(f"--steps must be greater than 0, got {steps}")
    cpu = device.type == "cpu"
    if cpu and recipe.fp16:
        raise InputError("fp16 mixed precision needs a CUDA GPU and none is present; use --bf16 or fp32 on CPU")
    if cpu and recipe.tf32:
        raise InputError("tf32 needs an Ampere or newer CUDA GPU and none is present; drop --tf32")
    if recipe.attn_implementation == "flash_attention_2" and (cpu or missing_packages(recipe)):
        why = "a CUDA GPU" if cpu else "the flash_attn package (pip install flash-attn)"
        raise InputError(f"flash_attention_2 needs {why}; use --attn-implementation sdpa")
    if optimizer(recipe.optim).package and (cpu or missing_packages(recipe)):
        raise InputError(f"optim {recipe.optim} needs a CUDA GPU and its package ({', '.join(missing_packages(recipe)) or 'installed'})")
    if recipe.zero_stage or recipe.offload != "none":
        raise InputError("profile runs one process without DeepSpeed; drop --zero-stage/--offload (use `anatomist bench`)")
    if recipe.torch_compile:
        raise InputError("profile does not support --torch-compile yet (the op classes would be inductor kernels)")
    if recipe.fsdp != "none":
        raise InputError("profile runs one process, where FSDP would shard nothing; drop --fsdp "
                         "(`anatomist bench` runs FSDP rows on several processes)")
    if recipe.tp_size > 1:
        raise InputError("profile runs one process, where tensor parallel would split nothing; drop --tp-size "
                         "(`anatomist estimate` predicts it)")
    if recipe.trainer != "trainer" or recipe.activation_offloading:
        what = f"TRL's {recipe.trainer.upper()}Trainer" if recipe.trainer != "trainer" else "TRL's activation offloading"
        raise InputError(f"profile runs the Trainer's step (the model's own loss), not {what}; "
                         "`anatomist estimate` predicts it")
    if recipe.use_liger_kernel:
        raise InputError("profile does not apply Liger Kernel" + (" (its Triton kernels need a GPU)" if cpu else " yet")
                         + "; drop --use-liger-kernel")
    if recipe.padding_free or recipe.packing:
        raise InputError("profile runs padded rows, not packed ones; drop --padding-free / --packing")


def _optimizer(model: torch.nn.Module, recipe: ResolvedRecipe, cpu: bool) -> torch.optim.Optimizer:
    """The optimizer the Trainer would build for this recipe (its own class and arguments)."""
    from transformers import Trainer

    args = training_arguments(recipe, "anatomist-profile", report_to="none", use_cpu=cpu)
    # typed PreTrainedModel, but it only reads the model's parameters: a PEFT model works as well
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)  # type: ignore[arg-type]
    return cls([p for p in model.parameters() if p.requires_grad], **kwargs)


def training_step(workload: Workload, recipe: ResolvedRecipe, device: torch.device) -> Callable[[], None]:
    """A real training step of the real model (random init) on `device`, as the Trainer runs it:
    `gradient_accumulation_steps` micro-batches (forward under autocast, backward, loss-scaled
    under fp16), unscale, clip, optimizer step, zero_grad. Each phase is a `record_function`
    range and ends with a device synchronisation, so wall-clock timing of a call is honest."""
    from anatomist.bench.worker import enable_checkpointing, training_model

    cpu = device.type == "cpu"
    with tempfile.TemporaryDirectory(prefix="anatomist-profile-") as folder, contextlib.redirect_stderr(io.StringIO()):
        model = training_model(workload, recipe, folder)  # a quantized base is saved there and loaded back
        if not recipe.quantized:  # bitsandbytes places a quantized one on the GPU as it loads it
            model = model.to(device)
    enable_checkpointing(model, recipe)
    model.train()
    optimizer = _optimizer(model, recipe, cpu)
    lower = torch.float16 if recipe.fp16 else torch.bfloat16 if recipe.bf16 else None
    autocast = torch.autocast(device.type, dtype=lower) if lower is not None else contextlib.nullcontext()
    scaler = torch.amp.GradScaler("cuda") if recipe.fp16 else None
    sync = torch.cuda.synchronize if not cpu else (lambda: None)

    def train_step() -> None:
        for _ in range(recipe.gradient_accumulation_steps):
            batch = {k: v.to(device) for k, v in make_batch(workload, recipe.per_device_train_batch_size).items()}
            with record_function("forward"):
                with autocast:
                    loss = model(**batch).loss / recipe.gradient_accumulation_steps
                sync()
            with record_function("backward"):
                (scaler.scale(loss) if scaler else loss).backward()
                sync()
        with record_function("optimizer"):
            if scaler:
                scaler.unscale_(optimizer)
            if recipe.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()

    return train_step


def profile_training(workload: Workload, recipe: Recipe, *, steps: int = 3) -> ProfileResult:
    """Run `steps` profiled training steps (after one warm-up step) and report where time goes.

    Raises:
        InputError: a recipe this machine cannot run, or steps <= 0.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    recipe = recipe.resolved(workload)
    check_runnable(recipe, steps, device)
    cpu = device.type == "cpu"
    train_step = training_step(workload, recipe, device)

    train_step()  # warm-up: optimizer state, allocator, kernels selection
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if not cpu else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            train_step()
        wall_s = (time.perf_counter() - start) / steps
    return _summarise(prof.events(), workload, recipe, steps, device, wall_s)


def _summarise(events: Any, workload: Workload, recipe: ResolvedRecipe, steps: int, device: torch.device, wall_s: float) -> ProfileResult:
    cpu = device.type == "cpu"
    by_op: dict[str, float] = defaultdict(float)  # microseconds over all steps
    phase_us: dict[str, float] = defaultdict(float)
    class_us: dict[OpClass, float] = dict.fromkeys(OpClass, 0.0)
    optimizer_ranges = [(ev.time_range.start, ev.time_range.end) for ev in events if ev.name == Phase.OPTIMIZER]
    for ev in events:
        if ev.name in PHASES:
            phase_us[ev.name] += ev.cpu_time_total
        elif ev.name.startswith("aten::"):
            us = ev.self_cpu_time_total if cpu else ev.self_device_time_total
            by_op[ev.name] += us
            # Ops inside the optimizer step are the optimizer's ("other"), whatever their name.
            in_optimizer = any(a <= ev.time_range.start <= b for a, b in optimizer_ranges)
            class_us[OpClass.OTHER if in_optimizer else classify(ev.name)] += us
    total_us = sum(by_op.values())
    if total_us <= 0:
        raise RuntimeError("the profiler recorded no ATen op time; cannot split the step by class")
    gpu = detect_local_gpu() if not cpu else None
    compute_capability = [gpu.compute_capability] if gpu is not None else []  # else flops' default
    ops = step_ops(workload, recipe, *compute_capability)
    accumulation = recipe.gradient_accumulation_steps
    class_flops = dict.fromkeys(OpClass, 0.0)
    for r in ops.records:
        class_flops[r.op_class] += (r.flops + r.approx_flops) * r.calls_per_step(accumulation)
    all_flops = sum(class_flops.values()) or 1.0
    flops = step_flops(workload, recipe, *compute_capability, ops=ops)
    phases = {f"{p}_s": phase_us[p] / steps / 1e6 for p in PHASES}
    step_s = sum(phases.values())
    mfu: float | None = None
    hfu: float | None = None
    if gpu is not None:
        from anatomist.recipe.axis_values import matmul_precision

        mfu, hfu = flops.utilization(step_s, gpu.peak_tflops(matmul_precision(recipe, gpu)) * 1e12)
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:TOP_OPS]
    unknown = sorted({n for n in by_op if not is_known(n)} | set(ops.unknown_ops()))
    device_name = torch.cuda.get_device_name(device) if not cpu else f"cpu ({torch.get_num_threads()} threads)"
    return ProfileResult(
        classes={str(c): {"flops_pct": 100 * class_flops[c] / all_flops, "time_pct": 100 * class_us[c] / total_us} for c in OpClass},
        phases=phases,
        top_ops=[{"name": n, "class": str(classify(n)), "time_pct": 100 * us / total_us} for n, us in top],
        # (a top op's class is its name's; the class shares above put optimizer-step ops in "other")
        device=device_name,
        unknown_ops=unknown,
        steps=steps,
        step_s=step_s,
        flops_per_step=flops.model,
        hardware_flops_per_step=flops.hardware,
        achieved_tflops=flops.model / step_s / 1e12,
        mfu=mfu,
        hfu=hfu,
        op_time_s=total_us / steps / 1e6,
        notes=[f"wall time per profiled step {wall_s:.4f} s (profiler overhead included)",
               "flops_pct: matrix products counted exactly (flop_counter), other ops approximately per element"],
    )
