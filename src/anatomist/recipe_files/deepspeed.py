"""A DeepSpeed config (ds_config.json): its ZeRO stage and offload, precision, micro-batch and accumulation.

Key names are DeepSpeed's (deepspeed/runtime/constants.py, zero/config.py): "bfloat16" is its
older spelling of "bf16". A value "auto" leaves the setting to whoever fills it in (the
Trainer, from TrainingArguments; accelerate, from its config), so it sets nothing here. Read
from a TrainingArguments file (`deepspeed=`), every value must match the TrainingArguments'
own, defaults included: transformers' `HfTrainerDeepSpeedConfig.trainer_config_process`
refuses a mismatch, and so does this reader.
"""

from __future__ import annotations

from typing import Any

from anatomist.axes.shardings import DEEPSPEED_SETTINGS
from anatomist.errors import InputError
from anatomist.recipe_files.reading import Reading, zero_offload

MARKERS = ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "zero_allow_untested_optimizer")
"""Top-level keys only a DeepSpeed config has."""

SCALARS = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
}


def looks_like_deepspeed(data: dict[str, Any]) -> bool:
    return any(key in data for key in MARKERS) or any(
        isinstance(data.get(key), dict) for key in ("fp16", "bf16", "bfloat16"))


def read_deepspeed(data: dict[str, Any], reading: Reading, file: str, *, match_defaults: bool = False) -> None:
    """Add a ds_config's settings to `reading` (`match_defaults`: under TrainingArguments, whose defaults count)."""

    def put(name: str, value: Any, key: str) -> None:
        reading.set(name, value, file, key, match_defaults=match_defaults)

    for key, value in data.items():
        if key in SCALARS:
            if value != "auto":
                put(SCALARS[key], value, key)
        elif key in ("fp16", "bf16", "bfloat16"):
            _precision(key, value, reading, file, put)
        elif key == "zero_optimization":
            _zero(value, reading, file, put)
        elif key != "train_batch_size":
            reading.skip(key, value)
    if "train_batch_size" in data:
        _world_size(data["train_batch_size"], reading, file)


def _precision(key: str, section: Any, reading: Reading, file: str, put: Any) -> None:
    if not isinstance(section, dict):
        raise InputError(f"{file}: {key} must be a mapping such as {{\"enabled\": true}}, got {section!r}")
    enabled = section.get("enabled", False)
    if enabled != "auto":
        put("bf16" if key in ("bf16", "bfloat16") else "fp16", bool(enabled), f"{key}.enabled")
    if enabled:  # a disabled section's other keys do nothing
        reading.skip_all(key, section, keep=("enabled",))


def _zero(section: Any, reading: Reading, file: str, put: Any) -> None:
    if not isinstance(section, dict):
        raise InputError(f"{file}: zero_optimization must be a mapping, got {section!r}")
    stage = section.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise InputError(f"{file}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    put("zero_stage", stage, "zero_optimization.stage")
    optimizer, param = section.get("offload_optimizer") or {}, section.get("offload_param") or {}
    keys = ("zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device")
    put("offload", zero_offload(stage, optimizer.get("device"), param.get("device"), file, keys), keys[0])
    for name, sub in (("offload_optimizer", optimizer), ("offload_param", param)):
        if name == "offload_param" and stage != 3:
            reading.skip(f"zero_optimization.{name}", sub)  # DeepSpeed reads it at stage 3 only
        else:
            reading.skip_all(f"zero_optimization.{name}", sub, keep=("device",))
    for name, setting in DEEPSPEED_SETTINGS.items():  # the buffer sizes: "auto" is the Trainer's to fill
        value = section.get(name, setting.default)  # left out: DeepSpeed's default
        if value == "auto" and setting.auto:
            continue  # Recipe.resolved fills it as the Trainer does
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
            auto = ' or "auto"' if setting.auto else ' (the Trainer fills "auto" only for the hidden-size ones)'
            raise InputError(f"{file}: zero_optimization.{name} must be a whole number of elements{auto}, got {value!r}")
        put(name, int(value), f"zero_optimization.{name}")
    reading.skip_all("zero_optimization", section,
                     keep=("stage", "offload_optimizer", "offload_param", *DEEPSPEED_SETTINGS))


def _world_size(value: Any, reading: Reading, file: str) -> None:
    """train_batch_size = micro-batch x accumulation x devices (DeepSpeed's rule): the number of devices."""
    if value == "auto":
        return
    micro, accumulation = reading.get("per_device_train_batch_size"), reading.get("gradient_accumulation_steps")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InputError(f"{file}: train_batch_size must be a positive integer or \"auto\", got {value!r}")
    if not isinstance(micro, int) or not isinstance(accumulation, int):
        reading.skip("train_batch_size", value)  # the rest is "auto": DeepSpeed derives it
        return
    devices, rest = divmod(value, micro * accumulation)
    if rest or not devices:
        raise InputError(f"{file}: train_batch_size={value} is not a multiple of micro-batch {micro} x "
                         f"accumulation {accumulation}; DeepSpeed needs train_batch_size = micro x accumulation x GPUs")
    reading.set("num_gpus", devices, file, "train_batch_size")
