"""The time model's phases: each the slower of the GPU's work and the host's issuing of it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_CONFIGS

from anatomist.anatomy import Phase
from anatomist.calibration.fit import Components, fit, predict
from anatomist.estimate.time.ops import recomputed_kernels, step_ops
from anatomist.estimate.time.roofline import HOST_PHASE_WEIGHTS, RECOMPUTE_HOST_WEIGHT, Factors
from anatomist.recipe import Recipe
from anatomist.workload_loader import load_workload

F = Factors(tensor_core_efficiency=0.5, fp32_efficiency=0.5, bandwidth_efficiency=0.5, kernel_overhead_s=2e-6,
            micro_batch_overhead_s=1e-3, host_op_s=20e-6)


def _step(accumulation: int = 1) -> Components:
    """forward: 100 calls of an 8 us memory-bound kernel; backward: 10 calls of a 100 us tensor-core product;
    optimizer: 1000 calls of a 0.5 us memory-bound kernel (a Python loop over parameters)."""
    return Components(tensor_core_s=np.array([0.0, 100e-6, 0.0]), cuda_core_s=np.zeros(3),
                      memory_s=np.array([8e-6, 0.0, 0.5e-6]),
                      calls=np.array([100.0 * accumulation, 10.0 * accumulation, 1000.0]),
                      phase=np.array([0, 1, 2]), micro_batches=float(accumulation))


def test_a_phase_is_the_slower_of_the_gpu_and_the_host() -> None:
    assert HOST_PHASE_WEIGHTS == (1.0, 0.46, 0.17)
    # forward: GPU 100 x (8/0.5 + 2) us = 1.8 ms, host 100 x 20 us x 1 = 2 ms -> 2 ms (the host's)
    # backward: GPU 10 x (100/0.5 + 2) us = 2.02 ms, host 10 x 20 us x 0.46 = 0.092 ms -> 2.02 ms (the GPU's)
    # optimizer: GPU 1000 x (0.5/0.5 + 2) us = 3 ms, host 1000 x 20 us x 0.17 = 3.4 ms -> 3.4 ms (the host's)
    # + 1 ms per micro-batch: 2 + 2.02 + 3.4 + 1 = 8.42 ms
    assert predict(_step(), F) == pytest.approx(8.42e-3)
    # two micro-batches: 2 x (2 + 2.02 + 1) + 3.4 = 13.44 ms
    assert predict(_step(2), F) == pytest.approx(13.44e-3)
    # without a host bound (time model 3): 1.8 + 2.02 + 3 + 1 = 7.82 ms
    assert predict(_step(), F.replace(host_op_s=0.0)) == pytest.approx(7.82e-3)


def test_the_fit_finds_the_hosts_time_per_kernel() -> None:
    """Steps made with known factors, the host bound in some phases: the fit gives its time per kernel back."""
    truth = F.replace(host_op_s=30e-6)
    steps = [_step(a) for a in (1, 2, 3, 4, 6, 8)]
    steps += [Components(tensor_core_s=c.tensor_core_s * 4, cuda_core_s=c.cuda_core_s, memory_s=c.memory_s * 3,
                         calls=c.calls, phase=c.phase, micro_batches=c.micro_batches) for c in steps[:3]]
    measured = [predict(c, truth) for c in steps]
    fitted, loss = fit(steps, measured, base=F.replace(host_op_s=5e-6), fixed_micro_batch_overhead=True)
    assert loss < 1e-8
    assert fitted.host_op_s == pytest.approx(30e-6, rel=1e-3)


def _checkpointed(recomputed: float) -> Components:
    """`_step` with every layer checkpointed: 50 kernels more in the backward (1 us memory-bound each), the layers'
    forward run again, `recomputed` of them counted as such."""
    return Components(tensor_core_s=np.array([0.0, 100e-6, 0.0, 0.0]), cuda_core_s=np.zeros(4),
                      memory_s=np.array([8e-6, 0.0, 0.5e-6, 1e-6]), calls=np.array([100.0, 10.0, 1000.0, 50.0]),
                      phase=np.array([0, 1, 2, 1]), micro_batches=1.0, recomputed=recomputed)


def test_a_recomputed_forward_costs_the_host_twice_a_forward_kernel() -> None:
    assert RECOMPUTE_HOST_WEIGHT == 2.0
    # backward: GPU 10 x 202 us + 50 x (1/0.5 + 2) us = 2.22 ms; host (10 x 0.46 + 50 x 2.0) x 20 us = 2.092 ms
    assert predict(_checkpointed(50.0), F) == pytest.approx(2e-3 + 2.22e-3 + 3.4e-3 + 1e-3)
    # a host twice as slow: forward 4 ms, backward (10 x 0.46 + 50 x 2.0) x 40 us = 4.184 ms, optimizer 6.8 ms
    slow = F.replace(host_op_s=40e-6)
    assert predict(_checkpointed(50.0), slow) == pytest.approx(4e-3 + 4.184e-3 + 6.8e-3 + 1e-3)
    # counted as ordinary backward kernels (time model 5), 60 x 0.46 x 40 us = 1.1 ms: the GPU's 2.22 ms instead
    assert predict(_checkpointed(0.0), slow) == pytest.approx(4e-3 + 2.22e-3 + 6.8e-3 + 1e-3)


def test_the_recomputed_kernels_are_the_checkpointed_layers_forward(tmp_path: Path) -> None:
    """Traced: what checkpointing adds to the backward of a tiny Llama is its layers' forward (less than the whole
    forward, which also embeds and scores), and checkpointing one layer in two adds about half as many."""
    (tmp_path / "config.json").write_text(json.dumps({**TINY_CONFIGS["llama"], "num_hidden_layers": 4}))
    workload = load_workload(str(tmp_path), seq_len=32, task="causal-lm")

    def recomputed(recipe: Recipe) -> tuple[float, float]:
        resolved = recipe.resolved(workload)
        ops = step_ops(workload, resolved)
        return recomputed_kernels(workload, resolved), ops.kernels(Phase.FORWARD)

    none, forward = recomputed(Recipe())
    every, _ = recomputed(Recipe(gradient_checkpointing=True))
    half, _ = recomputed(Recipe(gradient_checkpointing=True, checkpoint_every=2))
    assert none == 0
    assert 0.5 * forward < every < forward
    assert half == pytest.approx(every / 2, rel=0.1)
