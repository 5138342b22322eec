"""The optimizer a traced step runs, built from its spec (`axes/optimizers.py`).

A spec is data: the class the Trainer builds and its arguments, or, for a low-bit Adam whose
kernels cannot run on fake tensors, the layout its library allocates. This module turns either
into a `torch.optim.Optimizer`: the class itself, or `QuantizedAdamLayout` with that layout
(`trace/standins/low_bit_adam.py`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, cast

import torch

from anatomist.axes.optimizers import LEARNING_RATE, OptimizerSpec, optimizer
from anatomist.recipe import ResolvedRecipe
from anatomist.trace.standins.low_bit_adam import QuantizedAdamLayout


def build_optimizer(recipe: ResolvedRecipe, params: list[torch.nn.Parameter] | list[dict[str, Any]]) -> torch.optim.Optimizer:
    """The optimizer the Trainer builds for `recipe` over `params` (or parameter groups), as it behaves on CUDA."""
    spec = optimizer(recipe.optim)
    if spec.quantized_state is not None:
        # never groups: tensor parallel, which groups its parameters by mesh, is refused with a low-bit optimizer
        return QuantizedAdamLayout(cast(list[torch.nn.Parameter], params), lr=LEARNING_RATE, state=spec.quantized_state)
    return _optimizer_class(spec)(params, lr=LEARNING_RATE, **spec.optimizer_kwargs)


def import_optimizer_module(recipe: ResolvedRecipe) -> None:
    """Import the module of `recipe`'s optimizer class, before the tracer starts (`OptimizerSpec.optimizer_class`
    says why)."""
    spec = optimizer(recipe.optim)
    if spec.optimizer_class is not None:
        importlib.import_module(spec.optimizer_class.rpartition(".")[0])


def _optimizer_class(spec: OptimizerSpec) -> Callable[..., torch.optim.Optimizer]:
    """The class `spec.optimizer_class` names (a spec without one has a `quantized_state`)."""
    assert spec.optimizer_class is not None
    module, _, name = spec.optimizer_class.rpartition(".")
    optimizer_class: Callable[..., torch.optim.Optimizer] = getattr(importlib.import_module(module), name)
    return optimizer_class
