"""The recipe: what a training run sets, as TrainingArguments names it, from the user's input to what the
estimator reads.

- `fields.py`: the fields and their defaults (`RecipeFields`), and what is read off them;
- `help.py`: what `--help` and the page say of each field (outside the trace code digest);
- `checks.py`: every check, against the recipe itself, the model and the GPU;
- `recipe.py`: `Recipe` (the fields, checked; presets; `from_dict`) and `ResolvedRecipe` (settled for a model);
- `presets.py`: what is filled in where the user is silent; `kinds.py`: what values each field takes;
- `axis_values.py`: where a recipe stands on the precision and sharding axes (`axes/`);
- `spellings.py`: the keyword arguments of TrainingArguments, TRL, PEFT and bitsandbytes;
- `packages.py`: what training needs installed; `files/`: recipes read from other tools' files.

The names most code needs are here: `from anatomist.recipe import Recipe, ResolvedRecipe`.
"""

from anatomist.recipe.kinds import field_kinds
from anatomist.recipe.presets import CLASSIFIER_HEADS, LORA_FALLBACK_TARGETS, QLORA_PRESET
from anatomist.recipe.recipe import Recipe, ResolvedRecipe

__all__ = ["CLASSIFIER_HEADS", "LORA_FALLBACK_TARGETS", "QLORA_PRESET", "Recipe", "ResolvedRecipe", "field_kinds"]
