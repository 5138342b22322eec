"""Offline prediction: memory (traces extrapolated, allocator model) and time (roofline).

    from anatomist.estimate import estimate
    result = estimate(workload, recipe, gpu)      # an Estimate: .memory, .time, .to_dict()

Names are imported on first use, so that light modules of this package (sharding, rules)
can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Estimate", "MemoryEstimate", "estimate", "estimate_memory", "estimate_time"]
_HOME = {"Estimate": "predict", "estimate": "predict", "MemoryEstimate": "memory", "estimate_memory": "memory",
         "estimate_time": "time.device"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"anatomist.estimate.{_HOME[name]}"), name)
    raise AttributeError(f"module 'anatomist.estimate' has no attribute {name!r}")
