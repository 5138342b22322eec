"""What an estimate says of LoRA and QLoRA beyond the rule: which layers the adapters reach where the recipe left
it to PEFT, and what bitsandbytes leaves unquantized (a Mixture of Experts' fused experts, a classifier's head).

Torch-free: read from the recipe, the workload's facts and the model's size (`trace.depth.plan.ModelSize`).
"""

from __future__ import annotations

from anatomist.anatomy import GIB
from anatomist.recipe import CLASSIFIER_HEADS, LORA_FALLBACK_TARGETS, ResolvedRecipe
from anatomist.trace.depth.plan import ModelSize
from anatomist.workload import Workload

EXPERT_PARAMETERS = "mlp.experts.gate_up_proj,mlp.experts.down_proj"
"""The fused expert weights of transformers 5's Mixture-of-Experts layers (Mixtral, Qwen3-MoE, DeepSeek-V2/V3,
gpt-oss), as --lora-target-parameters names them."""


def peft_notes(workload: Workload, recipe: ResolvedRecipe, size: ModelSize) -> list[str]:
    """The notes of a LoRA / QLoRA `recipe` on `workload` (none without PEFT)."""
    if recipe.peft == "none":
        return []
    notes = []
    if recipe.lora_target_modules == LORA_FALLBACK_TARGETS and workload.lora_default_targets() is None:
        notes.append(f"LoRA targets: PEFT has no default for {workload.model_type} models, so where none are given "
                     f"anatomist takes {LORA_FALLBACK_TARGETS} (every linear layer but the output head: what the QLoRA "
                     "paper trains, axolotl's lora_target_linear), as the emitted LoraConfig says; "
                     "--lora-target-modules names others")
    if workload.is_moe:
        notes.append(_experts_adapted(size.adapted_parameters))
    unquantized = size.parameters - size.trainable_parameters - size.quantized_parameters
    if recipe.quantized and workload.is_moe:
        notes.append(f"{'4' if recipe.load_in_4bit else '8'}-bit base of a Mixture of Experts: transformers' "
                     "bitsandbytes integration quantizes nn.Linear layers only; the experts' fused weights are "
                     f"parameters of their own, so {_count(unquantized)} of the {_count(size.parameters)} "
                     f"parameters (the experts, embeddings, norms and head) stay unquantized, loaded in {recipe.dtype} "
                     f"and cast to float32 by prepare_model_for_kbit_training ({unquantized * 4 / GIB:,.1f} GiB)")
    if recipe.quantized and recipe.llm_int8_skip_modules == CLASSIFIER_HEADS and workload.task == "sequence-classification":
        notes.append(f"the classifier's head stays unquantized (BitsAndBytesConfig llm_int8_skip_modules="
                     f"{CLASSIFIER_HEADS.split(',')}): PEFT trains it in full (modules_to_save), which a 4-bit weight "
                     "cannot (transformers skips only the module of the last parameter, the head's bias)")
    return notes


def _experts_adapted(adapted: tuple[str, ...]) -> str:
    """Whether PEFT's adapters reach the experts' fused weights, which are parameters, not nn.Linear modules: only
    through target_parameters (which PEFT fills itself from all-linear for the models whose v4 layout it converts)."""
    if not adapted:
        return ("Mixture of Experts under LoRA: the experts' fused weights are parameters, not nn.Linear modules, so "
                "the targeted modules do not reach them and the experts stay frozen; PEFT's target_parameters adapt "
                f"them (--lora-target-parameters {EXPERT_PARAMETERS})")
    return (f"Mixture of Experts under LoRA: PEFT adapts {', '.join(adapted)} through target_parameters "
            "(lora.ParamWrapper): each forward adds the adapters' product to the whole weight, for the experts a "
            "temporary the size of one layer's experts that backward keeps")


def _count(parameters: int) -> str:
    """A parameter count as a model card says it: 45.1 billion, 712.8 thousand."""
    for size, name in ((1e9, "billion"), (1e6, "million"), (1e3, "thousand")):
        if parameters >= size:
            return f"{parameters / size:,.1f} {name}"
    return str(parameters)
