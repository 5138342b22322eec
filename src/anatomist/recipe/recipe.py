"""Recipe: the fields (`fields.py`), checked, with their presets and their resolution for a model.

Two steps turn what a user gives into what the estimator reads, both at the entry points (the
CLI, a recipe file, `estimate()`, `plan()`), never below them:
- `Recipe.with_presets(**given)` (and `from_dict`): the presets the given values imply, filled in
  where the user is silent (`peft="qlora"`: QLORA_PRESET). `Recipe(...)` itself never rewrites a value.
- `recipe.resolved(workload)`: a `ResolvedRecipe`, its load dtype made concrete for the model
  ("auto" -> the config's). Everything below the entry points takes a ResolvedRecipe.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Self

from anatomist.axes.kernels import AttnImplementation
from anatomist.axes.shardings import DEEPSPEED_SETTINGS, deepspeed_values
from anatomist.errors import InputError
from anatomist.recipe.checks import check_fields, check_model
from anatomist.recipe.fields import RecipeFields
from anatomist.recipe.kinds import field_kinds
from anatomist.recipe.presets import CLASSIFIER_HEADS, LORA_FALLBACK_TARGETS, implied_presets

if TYPE_CHECKING:
    from anatomist.workload import Workload


@dataclass(kw_only=True, slots=True, frozen=True)
class Recipe(RecipeFields):
    """One combination of the efficiency methods; field names follow TrainingArguments (`fields.py`), each
    described in `help.py` (what `anatomist estimate --help` shows: the flags are generated from these fields,
    cli/recipe_flags.py). Made only with values that pass `checks.check_fields`.

    Example:
        >>> Recipe(per_device_train_batch_size=1, gradient_accumulation_steps=4, fp16=True)
    """

    def __post_init__(self) -> None:
        check_fields(self)

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes` (of this class: a ResolvedRecipe stays one); no preset is applied."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def with_presets(cls, **given: Any) -> Recipe:
        """The recipe `given` sets, with the presets its values imply where `given` is silent:
        `peft="qlora"` is QLoRA as people run it (QLORA_PRESET).

        Example:
            >>> Recipe.with_presets(peft="qlora").load_in_4bit
            True
        """
        return cls(**{**implied_presets(given), **given})

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "recipe") -> Recipe:
        """Build a Recipe from its own field names, with the presets they imply (`with_presets`); unknown
        keys and values of the wrong type are an error.

        Files in other tools' formats (TrainingArguments, TRL, accelerate, DeepSpeed): recipe/files/.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"{source}: unknown recipe field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        kinds = field_kinds()
        for name, value in data.items():
            if not kinds[name].accepts(value):
                raise InputError(f"{source}: field {name} must be {kinds[name].describe()}, got {value!r}")
        return cls.with_presets(**data)

    def resolved(self, workload: Workload) -> ResolvedRecipe:
        """This recipe settled for `workload`: its load dtype concrete ("auto" -> the checkpoint's), its attention
        (unset -> transformers' choice for the model), its LoRA targets where PEFT has no default for the model
        (unset -> LORA_FALLBACK_TARGETS), a quantized classifier's head (unset -> CLASSIFIER_HEADS) and, under
        DeepSpeed, its buffer sizes (unset -> "auto" as the Trainer fills it, or DeepSpeed's default).

        Raises:
            InputError: what the model cannot take (`checks.check_model`), or a dtype the model's code rejects.
        """
        check_model(self, workload)
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.zero_stage:  # DeepSpeed's buffer sizes, "auto" filled as the Trainer fills it
            values |= deepspeed_values(workload.hidden_size(), {n: values[n] for n in DEEPSPEED_SETTINGS})
        values["attn_implementation"] = self.attn_implementation or workload.default_attention()
        # accelerate's AO backend gathers float8 weights by default; only FSDP2 gathers weights at all.
        values["fp8_all_gather"] = self.fp8 == "tensorwise" and self.fsdp != "none" and self.fp8_all_gather is not False
        if self.peft != "none" and self.lora_target_modules is None and self.lora_target_parameters is None \
                and workload.lora_default_targets() is None:
            values["lora_target_modules"] = LORA_FALLBACK_TARGETS
        if self.quantized and self.llm_int8_skip_modules is None and workload.task == "sequence-classification":
            values["llm_int8_skip_modules"] = CLASSIFIER_HEADS
        return ResolvedRecipe(**{**values, "dtype": workload.weights_dtype(self.dtype)})


@dataclass(kw_only=True, slots=True, frozen=True)
class ResolvedRecipe(Recipe):
    """A Recipe settled for one model (`Recipe.resolved`): its `dtype` is float32, bfloat16 or float16,
    never "auto", and its `attn_implementation` is set. The estimator, the tracer and the time model take only this."""

    attn_implementation: AttnImplementation = None  # type: ignore[assignment]  # Recipe's None resolved: set
    fp8_all_gather: bool = False

    def __post_init__(self) -> None:
        if self.dtype == "auto" or self.attn_implementation is None:
            raise TypeError("a ResolvedRecipe has a concrete dtype and attention: make it with recipe.resolved(workload)")
        Recipe.__post_init__(self)
