"""What a recipe needs installed to train, probed on this machine (the prediction itself needs none of it)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from anatomist.axes.optimizers import optimizer

if TYPE_CHECKING:
    from anatomist.recipe.fields import RecipeFields


def missing_packages(recipe: RecipeFields) -> list[str]:
    """Optional packages `recipe` needs at run time that are not importable here."""
    package = optimizer(recipe.optim).package
    needed = [package] if package else []
    if recipe.attn_implementation == "flash_attention_2":
        needed.append("flash_attn")
    if recipe.zero_stage:
        needed.append("deepspeed")
    if recipe.load_in_4bit or recipe.load_in_8bit:
        needed.append("bitsandbytes")
    if recipe.use_liger_kernel:
        needed.append("liger_kernel")
    if recipe.cut_cross_entropy:
        needed.append("cut_cross_entropy")
    return [name for name in dict.fromkeys(needed) if importlib.util.find_spec(name) is None]
