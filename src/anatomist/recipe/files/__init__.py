"""The training configuration people already have, read into a Recipe: `--recipe FILE`.

A JSON or YAML file of any of these kinds, told apart by its keys:

- anatomist's own: Recipe's field names (TrainingArguments' where it has them; `zero_stage`,
  `peft`, `dtype`, ... beside them), as before;
- TrainingArguments: any of its fields, as `TrainingArguments.to_json_string()` writes them or
  by hand; its `deepspeed` (a path or a mapping) and `fsdp`/`fsdp_config` are read too;
- TRL: the YAML `trl sft --config` reads (SFTConfig, ModelConfig, ScriptArguments fields),
  with TRL's own defaults where it is silent; it can name the model and the sequence length;
- accelerate: the YAML `accelerate launch --config_file` reads (`accelerate config` writes it);
  it can name the number of devices;
- DeepSpeed: a ds_config JSON; "auto" values are taken from elsewhere (flags, defaults);
- axolotl: the YAML `axolotl train` reads (base_model, adapter, micro_batch_size, sequence_len, ...);
- LLaMA-Factory: the YAML `llamafactory-cli train` reads (finetuning_type, lora_rank, cutoff_len, ...).

The fields anatomist models become the Recipe; every other field the file moves off its tool's
default is named once in `RecipeFile.note()` ("not modelled: ..."). A key the format's own tool
would refuse (known.py: a typo, named with the closest known key), a value anatomist cannot
represent (an optimizer or precision it does not model, FSDP hybrid sharding), a setting that
changes memory and is not modelled yet (unmodelled.py: tensor parallel, FSDP offload, ...), or
two values that disagree (DeepSpeed's micro-batch against TrainingArguments' batch, which the
Trainer refuses too) is an InputError naming the file and the key.

Example:
    >>> source = read_recipe_file("sft.yaml")
    >>> source.recipe.gradient_checkpointing, source.model, source.seq_len, source.note()
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from anatomist.errors import InputError
from anatomist.recipe import Recipe
from anatomist.recipe.files.accelerate import looks_like_accelerate, read_accelerate
from anatomist.recipe.files.axolotl import looks_like_axolotl, read_axolotl
from anatomist.recipe.files.deepspeed import looks_like_deepspeed, read_deepspeed
from anatomist.recipe.files.llamafactory import looks_like_llamafactory, read_llamafactory
from anatomist.recipe.files.reading import OPTIMIZER_ALIASES, WORKLOAD_KEYS, Reading, load_mapping
from anatomist.recipe.files.trainer import read_trainer

Kind = Literal["anatomist", "TrainingArguments", "TRL", "accelerate", "DeepSpeed", "axolotl", "LLaMA-Factory"]


@dataclass(kw_only=True, slots=True, frozen=True)
class RecipeFile:
    """A recipe file, read: the Recipe it makes and what else it says."""

    path: str
    """The file as the user named it."""
    kind: Kind
    """Which tool's format it is in."""
    recipe: Recipe
    """The Recipe it makes: `fields` over the defaults."""
    fields: dict[str, Any]
    """The Recipe fields it sets (and its tool's defaults, where they differ from anatomist's)."""
    model: str | None = None
    """The model it names (TRL's and LLaMA-Factory's model_name_or_path, axolotl's base_model)."""
    seq_len: int | None = None
    """Tokens per sample (TRL's max_length, axolotl's sequence_len, LLaMA-Factory's cutoff_len)."""
    num_gpus: int | None = None
    """Devices it runs on, every node's (accelerate's num_processes; DeepSpeed's train_batch_size / micro-batch /
    accumulation)."""
    nodes: int | None = None
    """Machines those devices are on (accelerate's num_machines)."""
    not_modelled: tuple[str, ...] = ()
    """Fields it sets away from their tool's default that anatomist does not model, in file order."""
    at_default: int = 0
    """Fields anatomist does not model that it leaves at their default (counted, not named)."""

    def note(self) -> str | None:
        """One line for stderr naming what the prediction leaves out; None when it leaves out nothing set."""
        if not self.not_modelled:
            return None
        rest = f"; {self.at_default} more at their defaults" if self.at_default else ""
        return f"{self.path} ({self.kind}): not modelled: {', '.join(self.not_modelled)}{rest}"


def read_recipe_file(path: str | Path) -> RecipeFile:
    """Read `path` (JSON or YAML, told apart by its content) as whichever kind its keys say.

    Raises:
        InputError: the file is missing or unparsable, names a field no known tool has, or sets
            a value that cannot be modelled or that conflicts with another; the message names the
            file and the field.
    """
    return read_recipe_mapping(load_mapping(Path(path)), str(path))


def read_recipe_mapping(data: dict[str, Any], file: str) -> RecipeFile:
    """Read `data`, the content of a recipe file (or a live `TrainingArguments.to_dict()`), named
    `file` in messages, as `read_recipe_file` reads a file.

    Raises:
        InputError: as `read_recipe_file`.
    """
    reading = Reading()
    kind: Kind
    if looks_like_accelerate(data):
        kind = "accelerate"
        read_accelerate(data, reading, file)
    elif looks_like_deepspeed(data):
        kind = "DeepSpeed"
        read_deepspeed(data, reading, file)
    elif looks_like_llamafactory(data):
        kind = "LLaMA-Factory"
        read_llamafactory(data, reading, file)
    elif looks_like_axolotl(data):
        kind = "axolotl"
        read_axolotl(data, reading, file)
    else:
        kind = read_trainer(data, reading, file)  # type: ignore[assignment]
    merged = reading.merged()
    if merged.get("optim") in OPTIMIZER_ALIASES:
        merged["optim"] = OPTIMIZER_ALIASES[merged["optim"]]
    workload = {key: merged.pop(key, None) for key in WORKLOAD_KEYS}
    return RecipeFile(path=file, kind=kind, recipe=_recipe(merged, reading, file), fields=merged, model=workload["model"],
                      seq_len=_positive(workload["seq_len"], reading, "seq_len"),
                      num_gpus=_positive(workload["num_gpus"], reading, "num_gpus"),
                      nodes=_positive(workload["nodes"], reading, "nodes"),
                      not_modelled=tuple(dict.fromkeys(reading.not_modelled)), at_default=reading.at_default)


def _recipe(fields: dict, reading: Reading, file: str) -> Recipe:
    """The Recipe, its errors naming the file, and the file's own key where it has another name."""
    try:
        return Recipe.from_dict(fields, source=file)
    except InputError as exc:
        message = str(exc)
        if not message.startswith(file):
            message = f"{file}: {message}"
        said = message.removeprefix(file)  # the file's own name (muon-pretrain-fsdp2.yaml) names no field
        keys = [o.key for name, o in ((n, reading.origin_of(n)) for n in fields)
                if o is not None and o.key != name and re.search(rf"\b{re.escape(name)}\b", said)]
        raise InputError(message + (f" (from {', '.join(keys)})" if keys else "")) from None


def _positive(value: object, reading: Reading, name: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        origin = reading.origin_of(name)
        where = f"{origin.file}: {origin.key}" if origin else name
        raise InputError(f"{where} must be a positive integer, got {value!r}")
    return value


__all__ = ["Kind", "RecipeFile", "read_recipe_file", "read_recipe_mapping"]
