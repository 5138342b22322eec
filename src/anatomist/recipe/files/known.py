"""The key names each format may hold, and the one error for a key none of them has.

A tool's file is read as strictly as the tool reads it: accelerate refuses a top-level key its
ClusterConfig lacks (config_args.py `from_yaml_file`: "had unknown keys"), DeepSpeed's sections
are pydantic models that forbid extra keys, HfArgumentParser (TrainingArguments, TRL, LLaMA-Factory)
refuses a key no dataclass has. A key anatomist does not model is named as not modelled; a key
no version of the tool knows is a typo, refused with the closest known key (difflib, as argparse
suggests a choice).

The tables of names that are not read from installed packages live in data/:
- recipe_fields.json: TrainingArguments, TRL's SFTConfig/DPOConfig/ORPOConfig/ModelConfig/ScriptArguments
  and the alignment handbook's argument classes, as released over the last two years
  (scripts/historical_fields.py reads them from the wheels and the handbook's history);
- deepspeed_keys.json: the keys of a ds_config and those of the features DeepSpeed removed and refuses
  (scripts/deepspeed_keys.py, from deepspeed 0.19);
- framework_fields.json: axolotl's and LLaMA-Factory's config keys (scripts/framework_fields.py, from their
  schemas at a named commit: neither is a dependency).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from functools import cache
from importlib import resources
from typing import Any

from anatomist.errors import InputError

TRAINER_CLASSES = ("TrainingArguments", "Seq2SeqTrainingArguments")
"""transformers' classes in recipe_fields.json: a file of only these (and Recipe's) fields is a TrainingArguments file."""
TRL_CLASSES = ("SFTConfig", "DPOConfig", "ORPOConfig", "ModelConfig", "ScriptArguments", "DatasetMixtureConfig",
               "ModelArguments", "DataArguments")
"""TRL's and the alignment handbook's (ModelArguments, DataArguments: its configs.py before TRL's parsers) classes."""


@cache
def _table(name: str) -> dict[str, Any]:
    return json.loads(resources.files("anatomist.data").joinpath(name).read_text())


def historical_fields(classes: Iterable[str]) -> frozenset[str]:
    """The field names of `classes` in any release recipe_fields.json covers."""
    table = _table("recipe_fields.json")
    return frozenset(name for cls in classes for name in table.get(cls, {}))


def deepspeed_keys(section: str) -> frozenset[str]:
    """The keys DeepSpeed reads at the top level ("top_level") or in a section it validates ("zero_optimization",
    "zero_optimization.offload_param", "bf16", ...); empty for a section it does not validate."""
    return frozenset(_table("deepspeed_keys.json").get(section, ()))


def deepspeed_removed(section: str) -> dict[str, str]:
    """The keys of removed features DeepSpeed refuses at the top level ("top_level") or in "zero_optimization", each
    with DeepSpeed's own message (runtime/config.py _reject_removed_config_keys)."""
    return dict(_table("deepspeed_keys.json").get("removed", {}).get(section, {}))


def deepspeed_release() -> str:
    """The deepspeed release data/deepspeed_keys.json was read from."""
    return str(_table("deepspeed_keys.json")["_source"]).rsplit(" ", 1)[-1]


TYPO_RATIO = 0.85
"""difflib's ratio from which an unknown key is a typo of a known one where the tool would ignore it silently: one or
two letters off a long name (zero_optimisation: 0.94, optimiser: 0.89), not another word (comms_config against
ds_config: 0.76)."""


def closest(key: str, known: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The known key nearest `key` (difflib's ratio >= `cutoff`, by default 0.6, argparse's own), or None."""
    matches = difflib.get_close_matches(key, list(known), n=1, cutoff=cutoff)
    return matches[0] if matches else None


def refuse_unknown(keys: Iterable[str], known: Iterable[str], file: str, what: str, prefix: str = "") -> None:
    """InputError naming the first of `keys` not in `known` (and the closest known one): `what` says whose key it is not."""
    known = frozenset(known)
    unknown = [key for key in keys if key not in known]
    if not unknown:
        return
    key = unknown[0]
    near = closest(key, known)
    hint = f" (did you mean {prefix}{near}?)" if near else ""
    more = f" (and {len(unknown) - 1} more: {', '.join(prefix + k for k in unknown[1:])})" if len(unknown) > 1 else ""
    raise InputError(f"{file}: unknown key {prefix}{key}{hint}: not a key of {what}{more}")


def framework_fields(tool: str) -> frozenset[str]:
    """The config keys `tool` ("axolotl", "LLaMA-Factory") accepts, from its schema at the commit
    data/framework_fields.json names (scripts/framework_fields.py)."""
    return frozenset(_table("framework_fields.json")[tool]["fields"])
