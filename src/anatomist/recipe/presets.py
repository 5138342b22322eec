"""What anatomist fills in where the user is silent: the presets given values imply, and the values a recipe
settled for a model takes where it names none (`Recipe.with_presets`, `Recipe.resolved`)."""

from __future__ import annotations

from typing import Any

QLORA_PRESET: dict[str, Any] = {"load_in_4bit": True, "bnb_4bit_use_double_quant": True,
                                "bnb_4bit_compute_dtype": "bfloat16", "gradient_checkpointing": True}
"""What `peft="qlora"` means in practice (Dettmers et al. 2023, "QLoRA", sec. 3: NF4 with double
quantization, bf16 compute; PEFT's prepare_model_for_kbit_training turns on gradient checkpointing):
filled in by `Recipe.with_presets` where the user is silent."""
LORA_FALLBACK_TARGETS = "all-linear"
"""The LoRA targets of a recipe that names none, for a model PEFT has no default for (its
TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING lacks the model type, or transformers 5's fused experts leave
its default nothing to match): PEFT's own shorthand for every linear layer but the output head, what the QLoRA
paper trains (Dettmers et al. 2023, sec. 4: "LoRA on all linear transformer block layers") and what axolotl's
lora_target_linear and LLaMA-Factory's lora_target: all set."""
CLASSIFIER_HEADS = "classifier,score"
"""What a quantized sequence classifier keeps unquantized where the recipe does not say (llm_int8_skip_modules): the
heads PEFT trains in full (PeftModelForSequenceClassification's modules_to_save). transformers' bitsandbytes skips
only the module of the model's last parameter, which for an encoder is `classifier.bias`: its classifier is quantized,
and PEFT's requires_grad on the 4-bit weight then fails ("only Tensors of floating point dtype can require
gradients"); QLoRA users of classifiers pass this skip list."""


def implied_presets(given: dict[str, Any]) -> dict[str, Any]:
    """The fields `given`'s values imply, to be filled in where `given` is silent: QLoRA's usual settings
    (QLORA_PRESET), padding-free rows under packing, gradient checkpointing under its own settings."""
    preset = dict(QLORA_PRESET) if given.get("peft") == "qlora" else {}
    if given.get("packing"):
        preset["padding_free"] = True  # TRL: padding_free = padding_free or (packing and strategy "bfd")
    if given.get("checkpoint_every", 1) > 1 or given.get("checkpoint_offload"):
        preset["gradient_checkpointing"] = True
    return preset
