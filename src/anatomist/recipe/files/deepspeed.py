"""A DeepSpeed config (ds_config.json): its ZeRO stage and offload, precision, micro-batch and accumulation.

Key names are DeepSpeed's (deepspeed/runtime/constants.py, zero/config.py): "bfloat16" is its
older spelling of "bf16". A value "auto" leaves the setting to whoever fills it in (the
Trainer, from TrainingArguments; accelerate, from its config), so it sets nothing here. Read
from a TrainingArguments file (`deepspeed=`), every value must match the TrainingArguments'
own, defaults included: transformers' `HfTrainerDeepSpeedConfig.trainer_config_process`
refuses a mismatch, and so does this reader.

Read as strictly as DeepSpeed reads it, and no more: its sections (zero_optimization and its offload_param /
offload_optimizer, bf16, fp16, compile) are pydantic models that forbid extra keys and bound their numbers (the
installed deepspeed's bounds: deepspeed_bounds.py; "auto" is its default), the keys of features it removed it refuses
with a message of its own (`sparse_attention`), and a top-level key it never reads that is a typo of one it reads is
refused too (it would ignore `zero_optimisation`, and train without ZeRO); any other top-level key it ignores, and
it is named as not modelled; keys starting with "_" are comments (LLaMA-Factory's `_comment`). The keys are in
data/deepspeed_keys.json (known.py). bf16 master weights and optimizer states are read (ZeRO's partitions in
bf16: estimate/sharding.py); fp16 master weights, tensor and sequence parallel, ZenFlow and an optimizer of its own
other than Adam/AdamW change memory and are not modelled yet: refused (unmodelled.py).
"""

from __future__ import annotations

from typing import Any

from anatomist.axes.shardings import DEEPSPEED_SETTINGS
from anatomist.deepspeed_bounds import deepspeed_bounds
from anatomist.errors import InputError
from anatomist.recipe.files.known import (
    TYPO_RATIO,
    closest,
    deepspeed_keys,
    deepspeed_release,
    deepspeed_removed,
    refuse_unknown,
)
from anatomist.recipe.files.reading import Reading, zero_offload
from anatomist.recipe.files.unmodelled import refuse_unmodelled

MARKERS = ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "zero_allow_untested_optimizer")
"""Top-level keys only a DeepSpeed config has."""

SCALARS = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
}


PARALLEL = {"tensor_parallel": "tensor_parallel", "sequence_parallel_size": "sequence_parallel"}
"""Top-level keys that turn on a parallelism anatomist does not model (a size, or a section of sizes: autotp_size)."""
PRECISION_FIELDS = {"bf16": ("bf16_master_weights_and_grads", "bf16_optimizer_states"),
                    "bfloat16": ("bf16_master_weights_and_grads", "bf16_optimizer_states"), "fp16": ()}
"""Keys of the precision sections that change the bytes of ZeRO's master weights, gradients or optimizer states, read
into the Recipe fields of the same names."""
PRECISION_UNMODELLED = {"bf16": (), "bfloat16": (), "fp16": ("fp16_master_weights_and_grads",)}
"""Keys of the precision sections that change those bytes in a way not modelled."""


def _check_keys(data: dict[str, Any], file: str) -> None:
    """DeepSpeed's own refusals (a removed feature's key; pydantic's extra="forbid"), and a top-level key it never
    reads that is a typo of one it reads (it would ignore `zero_optimisation` and train without ZeRO); another key it
    never reads (`cuda_visible_devices`) it ignores, and so is named as not modelled."""
    for part, keys in (("top_level", data), ("zero_optimization", data.get("zero_optimization"))):
        for key, message in deepspeed_removed(part).items():
            if isinstance(keys, dict) and key in keys:
                where = key if part == "top_level" else f"{part}.{key}"
                raise InputError(f"{file}: {where}: {message} (deepspeed {deepspeed_release()} refuses it)")
    known = deepspeed_keys("top_level")
    for key in data:
        near = None if key in known or key.startswith("_") else closest(key, known, TYPO_RATIO)
        if near:
            raise InputError(f"{file}: unknown key {key} (did you mean {near}?): not a key of a DeepSpeed config "
                             f"(deepspeed {deepspeed_release()} reads no such key: it would ignore it)")
    sections = [(name, data.get(name)) for name in ("zero_optimization", "bf16", "bfloat16", "fp16", "compile")]
    zero = data.get("zero_optimization")
    if isinstance(zero, dict):
        sections += [(f"zero_optimization.{n}", zero.get(n)) for n in ("offload_param", "offload_optimizer")]
    for name, section in sections:
        if isinstance(section, dict):
            refuse_unknown(section, deepspeed_keys(name), file,
                           f"DeepSpeed's {name} section (deepspeed {deepspeed_release()} refuses it too)",
                           prefix=f"{name}.")
            _check_bounds("bf16" if name == "bfloat16" else name, section, file)


def _check_bounds(name: str, section: dict[str, Any], file: str) -> None:
    """A number outside the bounds the installed DeepSpeed's model for `name` puts on it: refused as DeepSpeed
    refuses it (deepspeed_bounds.py), whether anatomist models the key or not."""
    for key, value in section.items():
        refusal = deepspeed_bounds().refusal(name, key, value)
        if refusal:
            raise InputError(f"{file}: {name}.{key} {refusal}")


def looks_like_deepspeed(data: dict[str, Any]) -> bool:
    return any(key in data for key in MARKERS) or any(
        isinstance(data.get(key), dict) for key in ("fp16", "bf16", "bfloat16"))


def read_deepspeed(data: dict[str, Any], reading: Reading, file: str, *, match_defaults: bool = False) -> None:
    """Add a ds_config's settings to `reading` (`match_defaults`: under TrainingArguments, whose defaults count)."""

    def put(name: str, value: Any, key: str) -> None:
        reading.set(name, value, file, key, match_defaults=match_defaults)

    _check_keys(data, file)
    for key, value in data.items():
        if key in SCALARS:
            if value != "auto":
                put(SCALARS[key], value, key)
        elif key in ("fp16", "bf16", "bfloat16"):
            _precision(key, value, reading, file, put)
        elif key == "zero_optimization":
            _zero(value, reading, file, put)
        elif key in PARALLEL:
            _parallel(key, value, file)
            reading.skip(key, value)
        elif key == "optimizer":
            _optimizer(value, file)
            reading.skip(key, value)
        elif key != "train_batch_size" and not key.startswith("_"):
            reading.skip(key, value)
    if "train_batch_size" in data:
        _world_size(data["train_batch_size"], reading, file)


ADAM = ("adam", "adamw")
"""DeepSpeed's optimizers whose states are Adam's, as it names them (lower case: runtime/config.py get_optimizer_name;
FusedAdam, or DeepSpeedCPUAdam under offload): what ZeRO's optimizer step is modelled as (estimate/sharding.py)."""


def _optimizer(section: Any, file: str) -> None:
    """DeepSpeed's own optimizer, which the Trainer then uses in the place of its `optim`: Adam or AdamW is read as the
    ZeRO step's Adam; another (Lamb, OneBitAdam, Adagrad, Lion, Muon, a torch.optim class) is refused."""
    kind = section.get("type") if isinstance(section, dict) else None
    if kind is not None and str(kind).lower() not in ADAM:
        refuse_unmodelled("optimizer", file, "optimizer.type", kind, size=False)


def _parallel(key: str, value: Any, file: str) -> None:
    """A size above 1, or in a section (tensor_parallel.autotp_size, .tp.tp_size) any size above 1: refused."""
    if not isinstance(value, dict):
        refuse_unmodelled(PARALLEL[key], file, key, value)
        return
    for name, item in value.items():
        if isinstance(item, dict):
            _parallel(key, {f"{name}.{k}": v for k, v in item.items()}, file)
        elif name.endswith("size"):
            refuse_unmodelled(PARALLEL[key], file, f"{key}.{name}", item)


def _precision(key: str, section: Any, reading: Reading, file: str, put: Any) -> None:
    if not isinstance(section, dict):
        raise InputError(f"{file}: {key} must be a mapping such as {{\"enabled\": true}}, got {section!r}")
    enabled = section.get("enabled", False)
    if enabled != "auto":
        put("bf16" if key in ("bf16", "bfloat16") else "fp16", bool(enabled), f"{key}.enabled")
    if enabled:  # a disabled section's other keys do nothing
        for name in PRECISION_UNMODELLED[key]:
            refuse_unmodelled(name, file, f"{key}.{name}", section.get(name))
        for name in PRECISION_FIELDS[key]:
            if name in section:
                if not isinstance(section[name], bool):
                    raise InputError(f"{file}: {key}.{name} must be true or false, got {section[name]!r}")
                put(name, section[name], f"{key}.{name}")
        reading.skip_all(key, section, keep=("enabled", *PRECISION_FIELDS[key]))


def _zero(section: Any, reading: Reading, file: str, put: Any) -> None:
    if not isinstance(section, dict):
        raise InputError(f"{file}: zero_optimization must be a mapping, got {section!r}")
    stage = section.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise InputError(f"{file}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    put("zero_stage", stage, "zero_optimization.stage")
    refuse_unmodelled("zenflow", file, "zero_optimization.zenflow", section.get("zenflow"), size=False)
    optimizer, param = section.get("offload_optimizer") or {}, section.get("offload_param") or {}
    keys = ("zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device")
    put("offload", zero_offload(stage, optimizer.get("device"), param.get("device"), file, keys), keys[0])
    for name, sub in (("offload_optimizer", optimizer), ("offload_param", param)):
        if name == "offload_param" and stage != 3:
            reading.skip(f"zero_optimization.{name}", sub)  # DeepSpeed reads it at stage 3 only
        else:
            reading.skip_all(f"zero_optimization.{name}", sub, keep=("device",))
    for name, setting in DEEPSPEED_SETTINGS.items():  # the buffer sizes: "auto" is the Trainer's to fill
        if stage == 0 or name.startswith("stage3_") and stage != 3:
            # a buffer of ZeRO (stage3_*: of stage3.py) at a stage without it: left unset, as plan --emit leaves it
            if name in section:
                reading.skip(f"zero_optimization.{name}", section[name], setting.default)
            continue
        value = section.get(name, setting.default)  # left out: DeepSpeed's default
        if value == "auto":  # the Trainer fills it from the hidden size, else DeepSpeed drops it: its default
            continue  # Recipe.resolved does the same
        bound = deepspeed_bounds().get("zero_optimization", name)  # 5e8 -> 500000000 as DeepSpeed reads it
        put(name, bound.check(value) if bound else value, f"zero_optimization.{name}")  # refused: _check_bounds
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
