"""The recipe flags, generated from the Recipe dataclass, and `--recipe FILE`.

Every field of `Recipe` is one flag, its name the field's in kebab case (`--zero-stage`), its
help the field's entry in `recipe/help.py`, its type and choices the field's annotation (`Literal`
-> choices, `bool` -> `--x/--no-x`). A field added to Recipe is a flag with no edit here; the
tests check that every field is in `anatomist estimate --help`.

Why not transformers' `HfArgumentParser`, which does the same for TrainingArguments:
- `--help`, a bad flag or choice, `gpus` and `models` must not import transformers (and with it
  torch): `import transformers.hf_argparser` alone costs 0.8 s, three times this whole parser.
- It writes each field's default into the namespace, calling the default factory: Recipe's
  defaults are read from TrainingArguments (importing transformers and torch), and a flag not
  given would then override the value a `--recipe` file set.
- Its booleans are `--x [true|false]` with `--no_x` only where the default is True; ours are
  `--x/--no-x` for every boolean, as the command line has always had them.
So the flags are built with argparse from `dataclasses.fields` and the resolved annotations
(`recipe.field_kinds`), and parsed by argparse: the same source (the dataclass) and the same
conventions (kebab case, a help text per field, Literal choices) as HfArgumentParser, with none of
its imports. Flags not given stay None and do not override the file or the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from anatomist.cli.common import whole_number
from anatomist.recipe import Recipe, field_kinds
from anatomist.recipe.help import FIELD_HELP

if TYPE_CHECKING:
    from anatomist.recipe.files import RecipeFile

METAVARS = {int: "N", float: "X", str: "TEXT"}

RECIPE_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch and memory savers", ("per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing",
                                 "checkpoint_every", "checkpoint_offload", "activation_offloading", "max_grad_norm")),
    ("precision", ("dtype", "fp16", "bf16", "tf32", "fp8", "fp8_all_gather")),
    ("optimizer", ("optim",)),
    ("kernels and compilation", ("attn_implementation", "experts_implementation", "torch_compile", "use_liger_kernel",
                                 "cut_cross_entropy")),
    ("trainer (transformers' Trainer, TRL's SFT and DPO)", ("trainer", "padding_free", "packing",
                                                            "precompute_ref_log_probs")),
    ("parameter-efficient fine-tuning (PEFT, bitsandbytes)", (
        "peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit", "load_in_8bit",
        "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype")),
    ("sharding over GPUs (DeepSpeed ZeRO, PyTorch FSDP and HSDP, tensor, expert, context and sequence parallel)", (
        "zero_stage", "offload", "fsdp", "tp_size", "ep_size", "ep_routing", "cp_size", "sp_size", "dp_replicate_size",
        "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_param_persistence_threshold")),
    ("data loading", ("dataloader_num_workers", "dataloader_pin_memory")),
)
"""The recipe's fields by what they are about: the sections of `--help` and of the page's "advanced" part. A
field in none of them (one added to Recipe since) is listed under OTHER_GROUP, so none is ever left out."""
OTHER_GROUP = "other recipe fields"


def recipe_groups() -> list[tuple[str, list[dataclasses.Field]]]:
    """(title, the Recipe fields) of each RECIPE_GROUPS group, in its order, then OTHER_GROUP's where any."""
    by_name = {f.name: f for f in dataclasses.fields(Recipe)}
    groups = [(title, [by_name[n] for n in names if n in by_name]) for title, names in RECIPE_GROUPS]
    listed = {n for _, names in RECIPE_GROUPS for n in names}
    other = [f for f in dataclasses.fields(Recipe) if f.name not in listed]
    return [(t, fs) for t, fs in groups if fs] + ([(OTHER_GROUP, other)] if other else [])


def flag_name(field: str) -> str:
    """`per_device_train_batch_size` -> `--per-device-train-batch-size`."""
    return "--" + field.replace("_", "-")


def add_recipe_flags(parser: argparse.ArgumentParser) -> None:
    """Every Recipe field as a kebab-case flag; `--recipe FILE` loads a file first."""
    group = parser.add_argument_group("recipe (TrainingArguments names; flags given override --recipe)")
    group.add_argument("--recipe", metavar="FILE",
                       help="YAML or JSON: these keys, or a TrainingArguments, TRL (trl sft --config), "
                            "accelerate config, DeepSpeed, axolotl or LLaMA-Factory file as you have it")
    kinds = field_kinds()
    for title, fields in recipe_groups():
        group = parser.add_argument_group(f"recipe: {title}")
        for field in fields:
            _add_flag(group, field, kinds[field.name])


def _add_flag(group: argparse._ArgumentGroup, field: dataclasses.Field, kind: Any) -> None:
    """The flag of one Recipe field."""
    names = [flag_name(field.name), *FIELD_HELP[field.name].aliases]
    help_text = _help(field)
    if kind.type is bool:
        group.add_argument(*names, dest=field.name, default=None, action=argparse.BooleanOptionalAction, help=help_text)
    elif kind.choices is not None:
        group.add_argument(*names, dest=field.name, default=None, type=kind.type, choices=kind.choices,
                           metavar="|".join(map(str, kind.choices)), help=help_text)
    else:
        group.add_argument(*names, dest=field.name, default=None, type=whole_number if kind.type is int else kind.type,
                           metavar=FIELD_HELP[field.name].metavar or METAVARS[kind.type], help=help_text)


def _help(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        default = "unset" if field.default is None else field.default
    else:
        default = "TrainingArguments' own"
    return f"{FIELD_HELP[field.name].text} (default: {default})".replace("%", "%%")


def given_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe fields set on the command line (a flag not given is None)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe) if getattr(args, f.name, None) is not None}


def recipe_file_from_args(args: argparse.Namespace) -> RecipeFile | None:
    """The `--recipe` file, read, or None; what it sets that anatomist does not model is said once on stderr."""
    if not getattr(args, "recipe", None):
        return None
    from anatomist.cli.common import warn
    from anatomist.recipe.files import read_recipe_file

    source = read_recipe_file(args.recipe)
    note = source.note()
    if note:
        warn(note)
    return source


def recipe_from_args(args: argparse.Namespace, base: dict[str, Any] | None = None,
                     source: RecipeFile | None = None) -> Recipe:
    """What the recipe file (`source`) sets, else `base`, overridden by the flags given; the defaults and
    the presets those values imply (`Recipe.with_presets`) fill in the rest."""
    given = dict(source.fields) if source is not None else dict(base or {})
    return Recipe.from_dict({**given, **given_flags(args)}, source="flags")
