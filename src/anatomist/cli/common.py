"""Flags shared by subcommands: the recipe flags (TrainingArguments names) and the common ones."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from anatomist.anatomy import DEFAULT_MEMORY_MARGIN
from anatomist.errors import InputError
from anatomist.recipe import ATTN_IMPLEMENTATIONS, LOAD_DTYPES, OFFLOADS, OPTIMS, PEFT_METHODS, QUANT_TYPES, Recipe

if TYPE_CHECKING:
    from anatomist.estimate.time import Calibration

_RECIPE_FLAGS: list[tuple[str, str, dict[str, Any]]] = [
    # (flag, field, kwargs)
    ("--per-device-train-batch-size", "per_device_train_batch_size", {"type": int, "metavar": "N"}),
    ("--dtype", "dtype", {"metavar": "|".join(LOAD_DTYPES),
                          "help": "load dtype, as from_pretrained(dtype=...); auto = the config's (default)"}),
    ("--gradient-accumulation-steps", "gradient_accumulation_steps", {"type": int, "metavar": "N"}),
    ("--optim", "optim", {"metavar": "NAME", "help": f"one of {', '.join(OPTIMS)}"}),
    ("--attn-implementation", "attn_implementation", {"metavar": "NAME", "help": f"one of {', '.join(ATTN_IMPLEMENTATIONS)}"}),
    ("--dataloader-num-workers", "dataloader_num_workers", {"type": int, "metavar": "N"}),
    ("--zero-stage", "zero_stage", {"type": int, "metavar": "0|1|2|3"}),
    ("--offload", "offload", {"metavar": "|".join(OFFLOADS)}),
    ("--max-grad-norm", "max_grad_norm", {"type": float, "metavar": "X"}),
    ("--peft", "peft", {"metavar": "|".join(PEFT_METHODS), "help": "LoRA adapters; qlora = 4-bit NF4 base + LoRA"}),
    ("--lora-r", "lora_r", {"type": int, "metavar": "N"}),
    ("--lora-alpha", "lora_alpha", {"type": int, "metavar": "N"}),
    ("--lora-dropout", "lora_dropout", {"type": float, "metavar": "P"}),
    ("--lora-target-modules", "lora_target_modules", {"metavar": "A,B|all-linear"}),
    ("--bnb-4bit-quant-type", "bnb_4bit_quant_type", {"metavar": "|".join(QUANT_TYPES)}),
    ("--bnb-4bit-compute-dtype", "bnb_4bit_compute_dtype", {"metavar": "float32|bfloat16|float16"}),
]
_BOOL_FLAGS = ["gradient_checkpointing", "fp16", "bf16", "tf32", "torch_compile", "dataloader_pin_memory",
               "load_in_4bit", "load_in_8bit", "bnb_4bit_use_double_quant"]


def add_recipe_flags(parser: argparse.ArgumentParser) -> None:
    """Every Recipe field as a kebab-case flag; `--recipe FILE` loads the rest."""
    group = parser.add_argument_group("recipe (TrainingArguments names)")
    group.add_argument("--recipe", metavar="FILE", help="YAML or JSON file with the same keys")
    for flag, field, kwargs in _RECIPE_FLAGS:
        aliases = [flag, "--batch-size"] if field == "per_device_train_batch_size" else [flag]
        group.add_argument(*aliases, dest=field, default=None, **kwargs)
    for field in _BOOL_FLAGS:
        flag = "--" + field.replace("_", "-")
        group.add_argument(flag, dest=field, action=argparse.BooleanOptionalAction, default=None)


def recipe_from_args(args: argparse.Namespace, base: dict[str, Any] | None = None) -> Recipe:
    """The recipe file (if any), else `base` over the defaults, overridden by the flags given."""
    start = Recipe.from_file(args.recipe) if getattr(args, "recipe", None) else Recipe(**(base or {}))
    changes: dict[str, Any] = {}
    for _, field, _ in _RECIPE_FLAGS:
        if getattr(args, field, None) is not None:
            changes[field] = getattr(args, field)
    for field in _BOOL_FLAGS:
        if getattr(args, field, None) is not None:
            changes[field] = getattr(args, field)
    return Recipe.from_dict({**start.to_dict(), **changes}, source="flags")


def add_model_flags(parser: argparse.ArgumentParser, *, model_required: bool = True) -> None:
    if model_required:
        parser.add_argument("model", metavar="MODEL", help="catalog name, Hub id in the local cache, or path")
    parser.add_argument("--seq-len", type=int, default=None, metavar="N", help="tokens per sample (default 512)")
    parser.add_argument("--task", default=None, choices=["sequence-classification", "causal-lm", "seq2seq-lm", "masked-lm"])
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code from the Hub")
    parser.add_argument("--allow-network", action="store_true", help="let transformers ask the Hub for the config")


def warn(message: str) -> None:
    """One line on stderr that does not stop the command."""
    print(f"anatomist: note: {message}", file=sys.stderr)


def note_missing_packages(recipe: Recipe) -> None:
    """A prediction needs none of the recipe's packages: say once what the training machine will."""
    missing = recipe.missing_packages()
    if missing:
        warn(f"training this recipe needs {', '.join(missing)}, not installed here "
             f"(pip install {' '.join(missing)} on the training machine); the prediction does not need it")


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def positive_int(name: str, value: int | None) -> int | None:
    if value is not None and value <= 0:
        raise InputError(f"{name} must be greater than 0, got {value}")
    return value


def add_cache_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-cache", action="store_true",
                   help="neither read nor write the on-disk trace cache (env ANATOMIST_NO_CACHE=1 does the same)")


def apply_cache_flag(args: argparse.Namespace) -> None:
    """Turn the disk trace cache off for this process when --no-cache was given."""
    if getattr(args, "no_cache", False):
        from anatomist.trace.cache import set_disk_cache

        set_disk_cache(False)


def add_margin_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-margin", type=float, default=DEFAULT_MEMORY_MARGIN, metavar="FRACTION",
                   help=f"share of GPU memory kept free when deciding what fits (default {DEFAULT_MEMORY_MARGIN})")


def add_calibration_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibration", metavar="FILE", default=None,
                   help="time-model factors fitted by `anatomist calibrate` (default: the shipped, uncalibrated ones)")


def calibration_from_args(args: argparse.Namespace) -> Calibration | None:
    """The Calibration of --calibration FILE, or None for the shipped factors."""
    if args.calibration is None:
        return None
    from anatomist.estimate.time import load_calibration

    return load_calibration(args.calibration)
