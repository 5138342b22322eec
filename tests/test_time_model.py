"""The time model's phases: each the slower of the GPU's work and the host's issuing of it."""

from __future__ import annotations

import numpy as np
import pytest

from anatomist.calibration.fit import Components, fit, predict
from anatomist.estimate.time.roofline import HOST_PHASE_WEIGHTS, Factors

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
