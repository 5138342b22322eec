"""FP8 training as accelerate runs it with torchao (`mixed_precision="fp8"`, the AO backend).

`Accelerator.prepare` converts the model with accelerate's own `convert_model_to_fp8_ao`: every nn.Linear whose
in and out features are multiples of 16 becomes torchao's Float8Linear, but the model's first and last linear
layers (`filter_linear_layers`, "for stability reasons"); the step then runs under bf16 autocast. The trace
calls that same function on the traced model, real or fake, so the layers converted are accelerate's. A
Float8Linear keeps its high-precision weight and casts, per product, the input and the weight to float8_e4m3fn
(and the output's gradient to float8_e5m2) with their scales, multiplies with torch._scaled_mm, and saves the
float8 casts for backward: what the trace records as it runs (torchao's meta kernels on fake tensors, its CPU
kernels on real ones).

The config is accelerate's: for tensorwise scales, the one `AORecipeKwargs` builds when the script passes none
(the Trainer passes none): inner dimensions padded to multiples of 16, and FSDP2's all-gather of the converted
weights in float8 (`enable_fsdp_float8_all_gather`, on unless `Recipe.fp8_all_gather` is False): each rank casts
its shard to float8 before the all-gather (torchao's `fsdp_pre_all_gather`), so the gathered and unsharded weights
are one byte an element, which the traced FSDP step allocates as it runs. For rowwise scales, torchao's recipe
(`Float8LinearConfig.from_recipe_name`), which a script passes in its own AORecipeKwargs; torchao gathers those
weights in bf16.

Known limitations: where the blocks run compiled (`keys.traced_compile`), the weights are traced gathered in bf16:
the compiled graph's runner (`trace.step.compiled`) hands torchao's float8 weight to nodes AOTAutograd captured for
plain tensors, which torchao refuses (its float8 tensor has no permute); that memory is an upper bound (the
unsharded weights of the units in flight at two bytes an element, not one), and the time model's all-gather is
float8's (`collectives.gathered_weight_bytes`). Capturing with stand-ins of torchao's subclass (its inner tensors
flattened and wrapped again) lets AOTAutograd trace through it, but no real compiled FSDP step checks that trace
yet (FSDPMemTracker does not see inductor's CPU buffers), so it is not used. accelerate's optimizer hook `precompute_float8_dynamic_scale_for_fsdp`
(one amax per weight after each optimizer step, kilobytes) is not traced; `force_recompute_fp8_weight_in_bwd`
(axolotl sets it with the float8 all-gather) is not either: on a 4-block Llama under FSDPMemTracker it changed no
byte of the peak.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from anatomist.errors import InputError
from anatomist.trace.store.keys import traced_compile

if TYPE_CHECKING:
    import torch
    from torchao.float8 import Float8LinearConfig

    from anatomist.recipe import ResolvedRecipe


def traced_float8_gather(recipe: ResolvedRecipe) -> bool:
    """Whether the traced FSDP step gathers the FP8 layers' weights in float8: where the recipe does, but for compiled
    blocks (see the module docstring)."""
    return recipe.fp8_all_gather and not traced_compile(recipe)


def fp8_config(recipe: ResolvedRecipe) -> Float8LinearConfig:
    """torchao's config of `recipe.fp8` as accelerate's AO backend builds it (see the module docstring)."""
    from torchao.float8 import Float8LinearConfig

    if recipe.fp8 == "tensorwise":
        from accelerate.utils import AORecipeKwargs

        config = AORecipeKwargs(pad_inner_dim=True, enable_fsdp_float8_all_gather=traced_float8_gather(recipe)).config
        assert config is not None  # built by AORecipeKwargs where none is given
        return config
    return Float8LinearConfig.from_recipe_name(recipe.fp8)


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

    convert_model_to_fp8_ao(model, config=fp8_config(recipe))
