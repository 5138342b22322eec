"""FP8 training as accelerate runs it with torchao (`mixed_precision="fp8"`, the AO backend).

`Accelerator.prepare` converts the model with accelerate's own `convert_model_to_fp8_ao`: every nn.Linear whose
in and out features are multiples of 16 becomes torchao's Float8Linear, but the model's first and last linear
layers (`filter_linear_layers`, "for stability reasons"); the step then runs under bf16 autocast. The trace
calls that same function on the traced model, real or fake, so the layers converted are accelerate's. A
Float8Linear keeps its high-precision weight and casts, per product, the input and the weight to float8_e4m3fn
(and the output's gradient to float8_e5m2) with their scales, multiplies with torch._scaled_mm, and saves the
float8 casts for backward: what the trace records as it runs (torchao's meta kernels on fake tensors, its CPU
kernels on real ones).

Known limitations: FSDP's float8 all-gather (`enable_fsdp_float8_all_gather`, off by default) is not modelled;
torchao's precomputed scales for it neither.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from anatomist.errors import InputError

if TYPE_CHECKING:
    import torch

    from anatomist.recipe import ResolvedRecipe


def convert_to_fp8(model: torch.nn.Module, recipe: ResolvedRecipe) -> None:
    """Convert `model`'s linear layers as accelerate does for `recipe.fp8` (nothing where it is "none").

    Raises:
        InputError: torchao is not installed (it is what the step would run).
    """
    if recipe.fp8 == "none":
        return
    if importlib.util.find_spec("torchao") is None:
        raise InputError("fp8 is traced with torchao's Float8Linear, as accelerate runs it: pip install torchao")
    from accelerate.utils.ao import convert_model_to_fp8_ao
    from torchao.float8 import Float8LinearConfig

    convert_model_to_fp8_ao(model, config=Float8LinearConfig.from_recipe_name(recipe.fp8))

