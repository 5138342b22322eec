"""Where a recipe stands on the precision and sharding axes (`axes/precisions.py`, `axes/shardings.py`).

A precision is not one Recipe field but four (`dtype`, `fp16`, `bf16`, `tf32`; plus the compute dtype of a 4-bit
base), a sharding two or three (`zero_stage`, `offload`, `fsdp`): these functions are the one place that reads
those fields as a precision or a sharding: the autocast dtype the tracer runs, the dtype whose peak the time
model and MFU use, the names the plan's table and the labels show.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from anatomist.axes.precisions import AUTOCAST_DTYPES, HALF_DTYPES

if TYPE_CHECKING:
    from anatomist.hardware import GPU, Precision
    from anatomist.recipe.fields import RecipeFields


def precision_of(recipe: RecipeFields) -> str:
    """The name of the precision `recipe` trains in (its dtype resolved): a PRECISIONS name, or for a
    combination the plan never searches, a name of the same form (`fp4+fp32`, `fp16-weights`)."""
    if recipe.load_in_4bit:
        return f"{recipe.bnb_4bit_quant_type}+{recipe.mixed_precision if recipe.mixed_precision != 'no' else 'fp32'}"
    if recipe.fp8 != "none":
        fp8 = "fp8" if recipe.fp8 == "tensorwise" else f"fp8-{recipe.fp8}"
        return fp8 + ("-bf16-weights" if recipe.dtype == "bfloat16" else "-fp16-weights" if recipe.dtype == "float16"
                      else "")
    if recipe.dtype == "bfloat16":
        return "bf16-weights"
    if recipe.dtype == "float16":
        return "fp16-weights"
    return "fp16" if recipe.fp16 else "bf16" if recipe.bf16 else "tf32" if recipe.tf32 else "fp32"


def autocast_dtype(recipe: RecipeFields) -> str | None:
    """The torch dtype name autocast casts matrix products to (None: no autocast)."""
    return AUTOCAST_DTYPES.get(recipe.mixed_precision)


def half_dtype(recipe: RecipeFields) -> str | None:
    """The 16-bit dtype the step computes in: the autocast's, else the weights' where they are 16-bit."""
    return autocast_dtype(recipe) or (recipe.dtype if recipe.dtype in HALF_DTYPES else None)


def matmul_precision(recipe: RecipeFields, gpu: GPU) -> Precision:
    """The dtype whose dense peak the recipe's matrix products run at (the MFU and HFU denominator):
    the autocast dtype, else the weights' dtype (`recipe.dtype` resolved: not "auto"), TF32 where the
    recipe allows it and the GPU has it, else fp32."""
    if recipe.fp16 or recipe.dtype == "float16":
        return "fp16"
    if recipe.bf16 or recipe.dtype == "bfloat16":
        return "bf16"
    return "tf32" if recipe.tf32 and gpu.tf32 else "fp32"


def sharding_of(recipe: RecipeFields, num_gpus: int) -> str:
    """The name of `recipe`'s sharding on `num_gpus` devices: a name of `axes.shardings.SHARDING_NAMES`, or with tensor
    parallel (which the plan tries only where nothing fits without it) `tp{N}`, after FSDP's name and a "+" where FSDP
    shards too; with expert (context) parallel `ep{N}` (`cp{N}`) after FSDP's name and a "+"; DeepSpeed's sequence parallel
`sp{N}` after ZeRO's."""
    if recipe.tp_size > 1:
        return (f"fsdp_{recipe.fsdp}+" if recipe.fsdp != "none" else "") + f"tp{recipe.tp_size}"
    if recipe.ep_size > 1:
        return f"fsdp_{recipe.fsdp}+ep{recipe.ep_size}"
    if recipe.cp_size > 1:
        return ("hsdp" if recipe.dp_replicate_size > 1 else f"fsdp_{recipe.fsdp}") + f"+cp{recipe.cp_size}"
    if recipe.fsdp == "full_shard" and recipe.dp_replicate_size > 1:
        return "hsdp"
    if recipe.fsdp != "none":
        return f"fsdp_{recipe.fsdp}" + (f"+hsdp{recipe.dp_replicate_size}" if recipe.dp_replicate_size > 1 else "")
    if recipe.zero_stage == 0:
        return "ddp" if num_gpus > 1 else "none"
    return (f"zero{recipe.zero_stage}" + (f"+sp{recipe.sp_size}" if recipe.sp_size > 1 else "")
            + ("+offload" if recipe.offload != "none" else ""))
