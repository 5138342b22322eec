"""What the readers of each format share: the values read so far, where each came from, and what is left out."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anatomist.errors import InputError

WORKLOAD_KEYS = ("model", "seq_len", "num_gpus", "nodes")
"""What a file can say beyond the Recipe: the model, the tokens per sample, the devices."""

OPTIMIZER_ALIASES = {"adamw_8bit": "adamw_bnb_8bit"}
"""TrainingArguments' other spellings of an optimizer (transformers training_args.py OptimizerNames:
ADAMW_8BIT = "adamw_8bit", "just an alias for adamw_bnb_8bit"); axolotl's examples use it."""

UNKNOWN: Any = object()
"""The default of a key no dataclass describes."""
OFF_VALUES = (None, False, "", "none", "no", "auto", "default")
"""Values that leave a setting to its tool ("auto" in DeepSpeed and accelerate), or turn it off."""


def is_off(value: Any) -> bool:
    """True for a value that sets nothing: None, False, 0, "", "none", "auto", an empty or all-off container."""
    if isinstance(value, dict):
        return all(is_off(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(is_off(v) for v in value)
    if isinstance(value, str):
        return value.strip().lower() in OFF_VALUES
    return value is None or value is False or (isinstance(value, (int, float)) and value == 0)


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a value came from: a key of a file, or a tool's default that the file left alone."""

    file: str
    key: str
    default_of: str | None = None
    """The tool whose default this is ("TrainingArguments"), None for a value the file sets."""

    def describe(self, value: Any) -> str:
        """`file`'s key=value, saying whose default it is where the file left it unset."""
        default = f" ({self.default_of}' default: {self.file} leaves it unset)" if self.default_of else ""
        return f"{self.file}'s {self.key}={value!r}{default}"


@dataclass(slots=True)
class Reading:
    """The values the files read so far set: Recipe fields and WORKLOAD_KEYS, each with its origin.

    A field set twice to different values (a DeepSpeed micro-batch that is not the
    TrainingArguments' batch) is an InputError naming both: the real tools refuse it too.
    """

    values: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, Origin] = field(default_factory=dict)
    defaults: dict[str, tuple[Any, Origin]] = field(default_factory=dict)
    """The format's own defaults for fields the file leaves unset (TRL's differ from TrainingArguments')."""
    not_modelled: list[str] = field(default_factory=list)
    at_default: int = 0

    def set(self, name: str, value: Any, file: str, key: str, *, match_defaults: bool = False) -> None:
        """Set `name` from `file`'s `key`; with `match_defaults`, a differing default of the other tool conflicts too."""
        if name in self.values:
            if self.values[name] != value:
                raise InputError(f"{file}: {key}={value!r} conflicts with {self.origins[name].describe(self.values[name])}")
            return
        if match_defaults and name in self.defaults and self.defaults[name][0] != value:
            default, origin = self.defaults[name]
            raise InputError(f"{file}: {key}={value!r} conflicts with {origin.describe(default)}; "
                             "set them alike (the Trainer refuses the mismatch too)")
        self.values[name] = value
        self.origins[name] = Origin(file, key)

    def set_default(self, name: str, value: Any, file: str, key: str, tool: str) -> None:
        """The value `tool` takes for `name` when the file does not set it."""
        self.defaults[name] = (value, Origin(file, key, default_of=tool))

    def get(self, name: str) -> Any:
        """The value set, else the format's default, else None."""
        if name in self.values:
            return self.values[name]
        return self.defaults[name][0] if name in self.defaults else None

    def skip(self, key: str, value: Any, default: Any = UNKNOWN) -> None:
        """A key anatomist does not model: named when the file moves it off its default, else counted.

        With no known default (a nested DeepSpeed or FSDP key), an off value (is_off) counts as the default.
        """
        at_default = _at_default(value, default) or _masked(key, value)
        if at_default:
            self.at_default += 1
        else:
            self.not_modelled.append(key)

    def skip_all(self, prefix: str, section: dict[str, Any], keep: tuple[str, ...] = ()) -> None:
        """Every key of a nested `section` but `keep`, as skip() with no default."""
        for key, value in section.items():
            if key not in keep:
                self.skip(f"{prefix}.{key}", value)

    def merged(self) -> dict[str, Any]:
        """The defaults, then the values set: what the files say, all told."""
        return {**{k: v for k, (v, _) in self.defaults.items()}, **self.values}

    def origin_of(self, name: str) -> Origin | None:
        if name in self.origins:
            return self.origins[name]
        return self.defaults[name][1] if name in self.defaults else None


def _at_default(value: Any, default: Any) -> bool:
    """value == default, reading any two off values as equal, and a mapping key by key (a key it leaves
    out keeps its default)."""
    if default is UNKNOWN:
        return is_off(value)
    if isinstance(value, dict) and isinstance(default, dict):
        return all(_at_default(v, default.get(k, UNKNOWN)) for k, v in value.items())
    return value == default or (is_off(value) and is_off(default))


def _masked(key: str, value: Any) -> bool:
    """TrainingArguments.to_dict() writes every *_token field as "<KEY>", set or not."""
    return key.endswith("_token") and value == f"<{key.upper()}>"


def load_mapping(path: Path, what: str = "recipe file") -> dict[str, Any]:
    """A file holding a mapping, in JSON or YAML told apart by its content, not its suffix: text that opens with
    "{" is JSON (DeepSpeed's, accelerate's JSON; a YAML flow mapping at the top is not read), anything else YAML.

    Raises:
        InputError: missing, empty, not parsable (with the line and column of the error), or not a mapping.
    """
    if not path.exists():
        raise InputError(f"{what} {str(path)!r} does not exist")
    if path.is_dir():
        raise InputError(f"{what} {str(path)!r} is a folder, not a file")
    try:  # not only a regular file: a pipe (`--recipe <(...)`) reads as well
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{what} {str(path)!r} cannot be read: {exc}") from None
    data = _parse(text, path, what)
    if data is None:
        raise InputError(f"{what} {str(path)!r} is empty")
    if not isinstance(data, dict):
        raise InputError(f"{what} {str(path)!r} must hold a mapping of fields, not {type(data).__name__}")
    return data


def _parse(text: str, path: Path, what: str) -> Any:
    import yaml

    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{exc.lineno}:{exc.colno}: {what} is not valid JSON: {exc.msg}") from None
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = ": ".join(p for p in (exc.context, exc.problem) if p)
        raise InputError(f"{where}: {what} is not valid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: {what} is not valid YAML: {str(exc).splitlines()[0]}") from None


def referenced_file(value: str, file: str, key: str) -> Path:
    """A file another file names (a DeepSpeed config in TrainingArguments): from the working directory as the
    tool opens it, else beside the file that names it."""
    path = Path(value).expanduser()
    if path.is_file():
        return path
    beside = Path(file).parent / path
    if not path.is_absolute() and beside.is_file():
        return beside
    raise InputError(f"{file}: {key} names {value!r}, which does not exist (neither here nor beside {file})")


FSDP_STRATEGIES = {"full_shard": "full_shard", "shard_grad_op": "shard_grad_op", "no_shard": "none"}
"""FSDP sharding strategies anatomist models, as Recipe.fsdp names them (no_shard is plain data parallel)."""
FSDP1_STRATEGY_NUMBERS = {1: "full_shard", 2: "shard_grad_op", 3: "no_shard", 4: "hybrid_shard", 5: "hybrid_shard_zero2"}
"""torch.distributed.fsdp.ShardingStrategy's values, which older accelerate configs write."""


def fsdp_mode(strategy: Any, file: str, key: str) -> str:
    """Recipe.fsdp for a sharding strategy as the tools write it: a name in any case, FSDP1's number,
    or FSDP2's reshard_after_forward (True: full_shard, False: shard_grad_op)."""
    if isinstance(strategy, bool):
        return "full_shard" if strategy else "shard_grad_op"
    name = FSDP1_STRATEGY_NUMBERS.get(strategy, strategy) if isinstance(strategy, int) else str(strategy).lower()
    if name in ("true", "false"):
        return "full_shard" if name == "true" else "shard_grad_op"
    if name not in FSDP_STRATEGIES:
        raise InputError(f"{file}: {key}={strategy!r} is not a sharding anatomist models; "
                         f"known: {', '.join(FSDP_STRATEGIES)}")
    return FSDP_STRATEGIES[name]


def parallel_size(reading: Reading, field: str, value: Any, file: str, key: str) -> None:
    """`value`, a file's parallel size under `key` (accelerate's or TrainingArguments' parallelism_config, the
    Trainer's tp_size, axolotl's dp_replicate_size), as the recipe's `field` (tp_size, dp_replicate_size).

    Raises:
        InputError: it is not a whole number of at least 1.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{file}: {key} must be a whole number of at least 1, got {value!r}")
    reading.set(field, value, file, key)


def fsdp_offload(reading: Reading, value: Any, file: str, key: str) -> None:
    """FSDP's CPU offload (parameters, gradients and optimizer state on the host: `CPUOffloadPolicy`, traced by
    trace/step/fsdp.py) where `value` turns it on."""
    if not is_off(value):
        reading.set("offload", "cpu", file, key)


def zero_offload(stage: int, optimizer_device: str | None, param_device: str | None, file: str,
                 keys: tuple[str, str]) -> str:
    """Recipe.offload for DeepSpeed's two offload devices: the optimizer's, and at stage 3 the parameters' too.

    anatomist models stage-3 offload as both on one device (sharding.py); the parameters' device
    below stage 3 is ignored by DeepSpeed, and so here.
    """
    optimizer_device, param_device = optimizer_device or "none", param_device or "none"
    for key, device in zip(keys, (optimizer_device, param_device), strict=True):
        if device not in ("none", "cpu", "nvme"):
            raise InputError(f"{file}: {key}={device!r}; known: none, cpu, nvme")
    if stage == 3 and optimizer_device != param_device:
        raise InputError(f"{file}: {keys[0]}={optimizer_device!r} with {keys[1]}={param_device!r} is not modelled: "
                         "at ZeRO stage 3 anatomist offloads optimizer states and parameters to the same device")
    return optimizer_device
