"""Does the plan pick the fastest recipe that fits? Checked by running every candidate for real.

The "GPU" is one core of this machine's CPU, described by what it measurably does: its fp32
matrix-product rate and copy bandwidth (measured here, not looked up), no CUDA context, and a
memory limit set between the candidates' predicted needs so that the largest recipes do not fit.
One thread, timed by the process's CPU time (`time.process_time`), not the wall clock: CI runs
the slow tests in two xdist workers on two cores, and two threads timed by the wall clock then
shared their cores with the other worker's torch; small products lost the most, and a 4 x 4 batch
measured 27% faster than 2 x 8 where the model, fitted on the same contended steps, said 7% (the
plan picked 2 x 8 inside its tie and reached 0.78 of the fastest pickable, bar 0.8). One thread
timed by CPU time under the same contention on the build machine (a second process multiplying
512 x 512 matrices on two threads): the candidates without checkpointing within 1-3% of their
predictions but 8 x 2 (-11%). The time
model's factors, the overheads included, are fitted (`fit_calibration`) on seven real steps of
recipes that are NOT among the candidates. Then:

- memory: each candidate's real step runs on real CPU tensors under the estimator's tracer
  (full depth, real weights), which counts the live bytes as the caching allocator would;
- time: each candidate's real step (`measure.profile.training_step`: the real model, the
  Trainer's optimizer) is timed, best of 5 rounds with the candidates interleaved; then the pick
  and the sweep's fastest pickable recipe are timed again head to head, best of 11 rounds (the
  fastest of fourteen noisy timings is biased up: in one CI run a recipe that checkpoints one
  layer of three timed 17% faster than the same batch without checkpointing).

The top pick must fit for real and reach, head to head, 90% of the fastest recipe the plan could
pick, less the plan's own speed tie (the GPU bar is 95%; a shared 2-core CPU is noisier).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from anatomist.anatomy import TimeAnatomy
from anatomist.calibration.measured import TimedStep, fit_calibration
from anatomist.estimate.time.device import time_from_ops
from anatomist.estimate.time.ops import step_ops
from anatomist.hardware import GPU, get_gpu
from anatomist.measure.profile import training_step
from anatomist.plan import SearchSpace, plan
from anatomist.recipe import Recipe
from anatomist.trace.step.driver import trace_step
from anatomist.workload import Workload
from anatomist.workload_loader import load_workload

# Hidden size 256, not 128: at 128 a micro-batch of one is so small a product that this CPU runs it far below the
# rate the time model fits (the sweep measured 1 x 16 at 0.68x its prediction; the calibration's worst error was
# 32-40%), and the plan's ranking of micro-batch sizes became noise; at 256 the worst error is 17%.
CONFIG = {
    "model_type": "bert", "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
    "intermediate_size": 1024, "vocab_size": 1000, "max_position_embeddings": 128, "type_vocab_size": 2,
}
SEQ_LEN = 128
GLOBAL_BATCH = 16
TIMED_ROUNDS = 5
FINAL_ROUNDS = 11


def best_step_s(workload: Workload, recipes: list[Recipe], rounds: int = TIMED_ROUNDS) -> list[float]:
    """Each recipe's fastest real step in CPU time over `rounds` rounds, the recipes interleaved within
    a round, so that a slow spell of the shared machine does not fall on one recipe only."""
    steps = [training_step(workload, r, torch.device("cpu")) for r in recipes]
    for step in steps:
        step()  # warm-up: optimizer state
    best = [float("inf")] * len(steps)
    for _ in range(rounds):
        for i, step in enumerate(steps):
            start = time.process_time()
            step()
            best[i] = min(best[i], time.process_time() - start)
    return best


def measured_peak(workload: Workload, recipe: Recipe, compute_capability: str) -> int:
    real = trace_step(workload, recipe.resolved(workload), depth=None, batch_size=recipe.per_device_train_batch_size,
                      compute_capability=compute_capability, part="train-step", fake=False)
    return max(p.allocated for p in real.peaks().values())


def cpu_device(memory_bytes: int) -> GPU:
    """This CPU as the plan's device: measured fp32 matmul rate and copy bandwidth."""
    a = torch.randn(1024, 1024)
    a @ a
    start = time.process_time()
    for _ in range(5):
        a @ a
    tflops = 5 * 2 * 1024**3 / (time.process_time() - start) / 1e12
    x = torch.empty(32 * 2**20 // 4)
    y = torch.empty_like(x)
    y.copy_(x)
    start = time.process_time()
    for _ in range(5):
        y.copy_(x)
    gbps = 5 * 2 * x.nbytes / (time.process_time() - start) / 1e9
    name = f"cpu ({torch.get_num_threads()} threads)"
    return replace(get_gpu("A100-80GB"), name=name, catalog_name=name, memory_bytes=memory_bytes,
                   cuda_context_bytes=0, bandwidth_gbps=gbps, fp32_tflops=tflops, tf32_tflops=0.0,
                   fp16_tflops=0.0, bf16_tflops=0.0, bf16=False, sm_count=0)  # no SMs: no tiles in waves


@pytest.fixture(scope="module", autouse=True)
def one_core() -> Iterator[None]:
    """The device is one core (the module docstring says why)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Workload:
    folder = tmp_path_factory.mktemp("quality-bert")
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return load_workload(str(folder), seq_len=SEQ_LEN, task="sequence-classification")


@pytest.mark.slow  # real training steps in subprocesses: minutes on 2 cores
def test_top_pick_fits_and_is_fastest_for_real(workload: Workload) -> None:
    probe = cpu_device(2**40)
    # Not among the candidates (global batch 3 to 12). Seven, so that the per-kernel and per-micro-batch
    # overheads are fitted too (`fit.fit` keeps the GPU prior's where there are fewer steps than factors):
    # on a CPU they are the host's Python and dispatch, which the GPU prior does not describe (with three
    # steps a 1 x 16 recipe came out 25-40% slower than predicted, checkpointed ones up to 2.4x).
    calibration_recipes = [
        Recipe(per_device_train_batch_size=1, gradient_accumulation_steps=3),
        Recipe(per_device_train_batch_size=1, gradient_accumulation_steps=5, gradient_checkpointing=True),
        Recipe(per_device_train_batch_size=3, gradient_accumulation_steps=2, gradient_checkpointing=True),
        Recipe(per_device_train_batch_size=5),
        Recipe(per_device_train_batch_size=6, gradient_checkpointing=True),
        Recipe(per_device_train_batch_size=10, gradient_checkpointing=True),
        Recipe(per_device_train_batch_size=12, optim="adafactor"),
    ]
    cal = fit_calibration([TimedStep(workload=workload, recipe=r.resolved(workload), gpu=probe, step_s=s)
                           for r, s in zip(calibration_recipes, best_step_s(workload, calibration_recipes), strict=True)],
                          source=f"this CPU, {len(calibration_recipes)} real steps")

    def cpu_time(w: Workload, r: Recipe, g: GPU, *, num_gpus: int = 1, **cluster: object) -> TimeAnatomy:
        return time_from_ops(step_ops(w, r.resolved(w)), w, r.resolved(w), g, cal)

    # One optimizer: the model ties AdamW and Adafactor here, and their measured speeds on this
    # shared CPU differ run to run by up to 20% either way, which no plan could rank.
    # No offloading: its pinned host buffers need an accelerator (save_on_cpu refuses pin_memory on this CPU).
    space = SearchSpace(global_batch_size=GLOBAL_BATCH, optims=("adamw_torch",), compile_options=(False,),
                        shardings=("none",), offload_checkpoints=False, offload_activations=False)
    # The limit: halfway between two predicted totals two thirds up, so a third of the candidates do not fit.
    totals = sorted(c.device_total for c in plan(workload, probe, space=space, margin=0.0, time_model=cpu_time).candidates)
    limit = (totals[len(totals) * 2 // 3] + totals[len(totals) * 2 // 3 + 1]) // 2
    result = plan(workload, replace(probe, memory_bytes=limit), space=space, margin=0.0, time_model=cpu_time)
    assert 0 < len(result.feasible) < len(result.candidates)

    measured = {}
    step_s = best_step_s(workload, [c.recipe for c in result.candidates])
    for c, seconds in zip(result.candidates, step_s, strict=True):
        peak, speed = measured_peak(workload, c.recipe, probe.compute_capability), GLOBAL_BATCH / seconds
        measured[c.recipe] = (peak, speed)
        r = c.recipe
        print(f"{r.per_device_train_batch_size:>2} x {r.gradient_accumulation_steps:<2} ckpt {r.gradient_checkpointing!s:5} {r.optim:10} "
              f"predicted {c.device_total / 2**20:5.1f} MiB {c.samples_per_second:5.1f}/s fits {c.fits!s:5} | "
              f"measured {peak / 2**20:5.1f} MiB {speed:5.1f}/s fits {peak <= limit}")
    # "Fits for real": measured live bytes within the limit. The plan also adds the allocator's predicted reserve
    # and asks the top of the memory interval to fit, so it is the stricter of the two and leaves out recipes that
    # fit: the pick is measured against the fastest of those it could pick. Among recipes predicted within the speed
    # tie it prefers headroom, so it may be slower by that much, and by this shared CPU's noise (10%).
    pickable = max((c.recipe for c in result.feasible), key=lambda r: measured[r][1])
    fastest_fitting = max(speed for peak, speed in measured.values() if peak <= limit)
    pick = result.best.recipe
    print(f"limit {limit / 2**20:.1f} MiB; {cal}; speed tie {result.speed_error:.1%}; sweep: pick {measured[pick][1]:.1f}/s, "
          f"fastest the plan could pick {measured[pickable][1]:.1f}/s, fastest that fits for real {fastest_fitting:.1f}/s")
    assert measured[pick][0] <= limit
    if pickable != pick:
        pick_s, pickable_s = best_step_s(workload, [pick, pickable], rounds=FINAL_ROUNDS)
        print(f"head to head: pick {GLOBAL_BATCH / pick_s:.1f}/s, fastest the plan could pick {GLOBAL_BATCH / pickable_s:.1f}/s")
        assert pickable_s >= (1 - result.speed_error - 0.1) * pick_s
