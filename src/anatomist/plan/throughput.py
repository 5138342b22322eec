"""The time side of the plan: which time model predicts a recipe's step time.

`resolve_time_model()` returns the calibrated `anatomist.estimate.time.estimate_time` when it
is importable, else `fallback_time`, a simple FLOPs model that is NOT calibrated on any GPU:

    FLOPs per step = (6 N + 12 L h s) x tokens  (Kaplan et al. 2020 sec. 2.1; PaLM appendix B)
                     x 4/3 with activation checkpointing (one more forward)
    compute_s      = FLOPs / (dense peak for the precision x utilisation(micro-batch tokens))
    optimizer_s    = bytes the update reads and writes / HBM bandwidth
    + offload_s (PCIe + CPU Adam) and comm_s (all-reduce / all-gather) where they apply.

Every constant lives in data/plan_throughput.toml with its source. The plan marks its output
"time: uncalibrated" whenever this fallback is used.
"""

from __future__ import annotations

import contextlib
import inspect
import tomllib
from functools import cache
from importlib import resources
from typing import Any, Protocol

from anatomist.anatomy import TimeAnatomy
from anatomist.hardware import GPU
from anatomist.recipe import Recipe
from anatomist.workload import Workload


class TimeModel(Protocol):
    """Predicts the time of one optimizer step of `recipe` on `num_gpus` devices of `gpu`."""

    def __call__(self, workload: Workload, recipe: Recipe, gpu: GPU, *, num_gpus: int = 1) -> TimeAnatomy: ...


@cache
def constants() -> dict[str, Any]:
    return tomllib.loads(resources.files("anatomist.data").joinpath("plan_throughput.toml").read_text())


_PARAMS: dict[tuple[str, str], int] = {}


def parameter_count(workload: Workload) -> int:
    """Parameters of the task model, built on the meta device (no memory, no weights)."""
    import torch

    key = (workload.task, workload.config.to_json_string(use_diff=False))
    if key not in _PARAMS:
        with torch.device("meta"), contextlib.redirect_stderr(None):
            model = workload.build_model("sdpa")
        _PARAMS[key] = sum(p.numel() for p in model.parameters())
    return _PARAMS[key]


def _attention_shape(workload: Workload) -> tuple[int, int]:
    """(layers, hidden size) for the 12 L h s attention-score FLOPs per token."""
    from anatomist.estimate.step import num_layers

    cfg = workload.config
    hidden = next((getattr(cfg, n) for n in ("hidden_size", "n_embd", "d_model") if isinstance(getattr(cfg, n, None), int)), 0)
    return num_layers(workload), hidden


def _precision(recipe: Recipe) -> str:
    return "fp16" if recipe.fp16 else "bf16" if recipe.bf16 else "tf32" if recipe.tf32 else "fp32"


def flops_per_step(workload: Workload, recipe: Recipe, *, num_gpus: int = 1) -> int:
    """Training FLOPs of one optimizer step on all devices (2 per multiply-add)."""
    layers, hidden = _attention_shape(workload)
    tokens = workload.seq_len * recipe.per_device_train_batch_size * recipe.gradient_accumulation_steps * num_gpus
    per_token = 6 * parameter_count(workload) + 12 * layers * hidden * workload.seq_len
    factor = constants()["compute"]["checkpoint_recompute_flops_factor"] if recipe.gradient_checkpointing else 1.0
    return round(per_token * tokens * factor)


def _optimizer_bytes_per_param(optim: str) -> int:
    c = constants()["optimizer"]
    if optim in ("adamw_bnb_8bit", "adamw_torch_8bit"):
        return int(c["eightbit_bytes_per_param"])
    if optim == "adafactor":
        return int(c["adafactor_bytes_per_param"])
    if optim == "sgd":
        return int(c["sgd_bytes_per_param"])
    return int(c["adamw_bytes_per_param"])


def fallback_time(workload: Workload, recipe: Recipe, gpu: GPU, *, num_gpus: int = 1) -> TimeAnatomy:
    """The uncalibrated FLOPs/bandwidth model described in the module docstring."""
    c = constants()
    n_params = parameter_count(workload)
    micro_tokens = recipe.per_device_train_batch_size * workload.seq_len
    util = c["compute"]["max_utilisation"] * micro_tokens / (micro_tokens + c["compute"]["half_utilisation_tokens"])
    total_flops = flops_per_step(workload, recipe, num_gpus=num_gpus)
    per_device_flops = total_flops / num_gpus
    compute_s = per_device_flops / (gpu.peak_tflops(_precision(recipe)) * 1e12 * util)  # type: ignore[arg-type]
    stage = recipe.sharding_stage
    shard = num_gpus if stage >= 1 else 1
    optimizer_s = 0.0
    offload_s = 0.0
    if recipe.offload == "none":
        optimizer_s = _optimizer_bytes_per_param(recipe.optim) * n_params / shard / (gpu.bandwidth_gbps * 1e9)
    else:
        o = c["offload"]
        # fp32 gradients down, updated weights (in the half precision if any, else fp32) up.
        up_bytes = 2 if recipe.mixed_precision != "no" else 4
        offload_s = n_params / shard * (4 + up_bytes) / (o["pcie_gbps"] * 1e9)
        offload_s += n_params / shard / o["cpu_adam_params_per_s"]
    comm_s = 0.0
    if num_gpus > 1:
        ring = (num_gpus - 1) / num_gpus
        half = 2 if recipe.mixed_precision != "no" else 4
        # ring all-reduce of the gradients: 2 (N-1)/N x bytes; ZeRO-3 / full_shard: 1.5x that.
        volume = 3 * ring * n_params * half if stage >= 3 else 2 * ring * n_params * half
        comm_s = volume / (c["interconnect"]["bus_gbps"] * 1e9)
    step_s = compute_s + optimizer_s + offload_s + comm_s
    samples = recipe.per_device_train_batch_size * recipe.gradient_accumulation_steps * num_gpus
    peak_flops = gpu.peak_tflops(_precision(recipe)) * 1e12 * num_gpus  # type: ignore[arg-type]
    model_flops = total_flops / (c["compute"]["checkpoint_recompute_flops_factor"] if recipe.gradient_checkpointing else 1.0)
    return TimeAnatomy(
        step_s=step_s,
        samples_per_second=samples / step_s,
        tokens_per_second=samples * workload.seq_len / step_s,
        flops_per_step=total_flops,
        mfu=model_flops / step_s / peak_flops,
        phases_s={"compute": compute_s, "optimizer": optimizer_s, "offload": offload_s, "communication": comm_s},
        calibrated=False,
    )


def resolve_time_model() -> tuple[TimeModel, bool]:
    """(time model, calibrated?): the real estimator when present, else the fallback.

    The real `estimate_time(workload, recipe, gpu)` predicts one device; for num_gpus > 1 the
    fallback's communication term is added to its step time.
    """
    try:
        from anatomist.estimate.time import estimate_time  # type: ignore[import-not-found]
    except ImportError:
        return fallback_time, False
    takes_gpus = "num_gpus" in inspect.signature(estimate_time).parameters

    def real(workload: Workload, recipe: Recipe, gpu: GPU, *, num_gpus: int = 1) -> TimeAnatomy:
        if takes_gpus:
            return estimate_time(workload, recipe, gpu, num_gpus=num_gpus)
        t = estimate_time(workload, recipe, gpu)
        if num_gpus == 1:
            return t
        comm_s = fallback_time(workload, recipe, gpu, num_gpus=num_gpus).phases_s["communication"]
        step_s = t.step_s + comm_s
        samples = t.samples_per_second * t.step_s * num_gpus
        return TimeAnatomy(
            step_s=step_s, samples_per_second=samples / step_s,
            tokens_per_second=samples * workload.seq_len / step_s, flops_per_step=t.flops_per_step * num_gpus,
            mfu=t.mfu * t.step_s / step_s, phases_s={**t.phases_s, "communication": comm_s},
            classes_s=t.classes_s, calibrated=t.calibrated,
        )

    return real, True

