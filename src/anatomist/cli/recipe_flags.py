"""The recipe flags, generated from the Recipe dataclass, and `--recipe FILE`.

Every field of `Recipe` is one flag, its name the field's in kebab case (`--zero-stage`), its
help the field's `metadata["help"]`, its type and choices the field's annotation (`Literal`
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
conventions (kebab case, `metadata["help"]`, Literal choices) as HfArgumentParser, with none of
its imports. Flags not given stay None and do not override the file or the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from anatomist.recipe import Recipe, field_kinds

if TYPE_CHECKING:
    from anatomist.recipe_files import RecipeFile

METAVARS = {int: "N", float: "X", str: "TEXT"}


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
    for field in dataclasses.fields(Recipe):
        kind = kinds[field.name]
        names = [flag_name(field.name), *field.metadata.get("aliases", ())]
        help_text = _help(field)
        if kind.type is bool:
            group.add_argument(*names, dest=field.name, default=None, action=argparse.BooleanOptionalAction,
                               help=help_text)
        elif kind.choices is not None:
            group.add_argument(*names, dest=field.name, default=None, type=kind.type, choices=kind.choices,
                               metavar="|".join(map(str, kind.choices)), help=help_text)
        else:
            group.add_argument(*names, dest=field.name, default=None, type=kind.type,
                               metavar=field.metadata.get("metavar", METAVARS[kind.type]), help=help_text)


def _help(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        default = "unset" if field.default is None else field.default
    else:
        default = "TrainingArguments' own"
    return f"{field.metadata['help']} (default: {default})".replace("%", "%%")


def given_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe fields set on the command line (a flag not given is None)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe) if getattr(args, f.name, None) is not None}


def recipe_file_from_args(args: argparse.Namespace) -> RecipeFile | None:
    """The `--recipe` file, read, or None; what it sets that anatomist does not model is said once on stderr."""
    if not getattr(args, "recipe", None):
        return None
    from anatomist.cli.common import warn
    from anatomist.recipe_files import read_recipe_file

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
