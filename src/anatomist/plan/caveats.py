"""What would make a config `plan --emit` wrote run otherwise than anatomist predicts it, said beside the config:
a setting the target cannot hold, a split set as the model loads, an accelerate on this machine too old for it."""

from __future__ import annotations

from anatomist.axes.shardings import (
    FSDP2_ACCELERATE,
    PARALLELISM_CONFIG_ACCELERATE,
    SEQUENCE_PARALLEL_ACCELERATE,
    installed,
    release,
)
from anatomist.plan.emit import trl_script
from anatomist.recipe import Recipe


def launch_warnings(recipe: Recipe, target: str) -> list[str]:
    """What would make the emitted config run otherwise than anatomist predicts it: activation offloading, which
    only TRL's configs can say; a trainer the target does not say (TRL's, in a DeepSpeed or accelerate config, whose
    training script chooses it; transformers' Trainer, as the YAML TRL's trainers read); with this machine's
    libraries, FSDP under an accelerate without FSDP2 (the Trainer and `accelerate launch` both build accelerate's
    plugin)."""
    warnings = []
    trl_holds = target == "trl" or target == "trainer" and recipe.trainer != "trainer"  # SFTConfig / DPOConfig
    if recipe.activation_offloading and not trl_holds:
        warnings.append("activation_offloading is TRL's (SFTConfig / DPOConfig), no TrainingArguments field: "
                        "--emit trl writes it, or run each training step under "
                        "trl.models.get_act_offloading_ctx_manager(model) as TRL's trainers do")
    if recipe.cut_cross_entropy and target != "trainer":
        warnings.append("cut_cross_entropy patches the model (cut_cross_entropy.transformers.cce_patch), no config "
                        "field: --emit trainer writes it, or call cce_patch(model) before training")
    if recipe.trainer != "trainer" and target in ("deepspeed", "accelerate"):
        warnings.append(f"the {target} config holds that library's settings only: TRL's "
                        f"{trl_script(recipe).upper()}Trainer, the batch, checkpointing and optimizer are the training "
                        f"script's; --emit trl writes them all, as `trl {trl_script(recipe)} --config` reads them")
    if recipe.trainer == "trainer" and target == "trl":
        warnings.append("--emit trl writes the YAML `trl sft` runs: TRL's SFTTrainer, whose fused LM head never holds "
                        "the logits, where this recipe is transformers' Trainer; plan with --trainer sft for its figures")
    if recipe.split_by_transformers:
        split = (f"tensor parallel {recipe.tp_size}" if recipe.tp_size > 1 else f"expert parallel {recipe.ep_size}")
        warnings.append(split + (" and the FSDP over its groups" if recipe.fsdp != "none" else "") + " are set as the "
                        "model loads: the .py's from_pretrained(distributed_config=...), launched with torchrun on "
                        "every GPU; TrainingArguments alone would train without them")
    if recipe.uses_parallelism_config and target in ("trainer", "trl", "deepspeed"):
        warnings.append(_parallelism_config_warning(recipe))
    if recipe.fp8 != "none" and target in ("trainer", "trl"):
        warnings.append("fp8 is accelerate's mixed precision: launch with `accelerate launch --mixed_precision fp8` "
                        "(or an accelerate config from --emit accelerate); bf16 stays False here, as set it would "
                        "replace fp8 (the Trainer reads ACCELERATE_MIXED_PRECISION only where fp16 and bf16 are unset)")
    if recipe.fp8 not in ("none", "tensorwise"):
        warnings.append(f"accelerate's fp8 config runs torchao's default recipe (tensorwise); for {recipe.fp8} the "
                        "script passes AORecipeKwargs(config=Float8LinearConfig.from_recipe_name("
                        f"{recipe.fp8!r})) to its Accelerator")
    return warnings + _older_accelerate(recipe, target)


def _parallelism_config_warning(recipe: Recipe) -> str:
    """That the recipe's layout is an object of accelerate's, which JSON and YAML configs cannot build."""
    if recipe.sp_size > 1:
        layout, otherwise = f"sequence parallel {recipe.sp_size}", "every GPU trains whole sequences"
    else:
        layout = (f"HSDP ({recipe.dp_replicate_size} replicas of FSDP's shard groups)" if recipe.dp_replicate_size > 1
                  else f"context parallel {recipe.cp_size}")
        otherwise = "FSDP shards over every GPU, each its own batch of whole sequences"
    return (f"{layout} is accelerate's ParallelismConfig, an object no JSON or YAML field builds: launch with the "
            "accelerate config from --emit accelerate, or pass TrainingArguments(parallelism_config="
            f"ParallelismConfig(...)) as the .py of --emit trainer does; without it {otherwise}")


def _older_accelerate(recipe: Recipe, target: str) -> list[str]:
    """This machine's accelerate, where it lacks what the recipe's config needs: FSDP2 (1.6), ParallelismConfig (1.10)."""
    version = installed("accelerate")
    if recipe.sp_size > 1 and target in ("accelerate", "trainer") and release(version) < SEQUENCE_PARALLEL_ACCELERATE:
        return [f"accelerate {version} here has no sequence parallel (ParallelismConfig's sp_size came in 1.12): it "
                "would train whole sequences on every GPU; train with accelerate 1.12 or later"]
    if recipe.fsdp == "none" or target not in ("accelerate", "trainer", "trl"):
        return []
    if release(version) < FSDP2_ACCELERATE:
        return [f"accelerate {version} here has no FSDP2 (it came in 1.6): it would run this FSDP config as FSDP1, "
                "which anatomist does not predict; train with accelerate 1.6 or later"]
    if recipe.uses_parallelism_config and release(version) < PARALLELISM_CONFIG_ACCELERATE:
        return [f"accelerate {version} here has no ParallelismConfig (it came in 1.10): it would shard over every GPU "
                "instead of HSDP's replicas or context parallel's groups; train with accelerate 1.10 or later"]
    return []
