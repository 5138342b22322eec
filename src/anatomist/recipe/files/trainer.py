"""TrainingArguments fields, TRL's `trl sft --config` YAML, and anatomist's own Recipe keys.

One reader for the three: they share TrainingArguments' names. Which one a file is, is told by
its keys: only Recipe fields (anatomist's own), else TrainingArguments fields (with Recipe's
beside them), else TRL's: `trl sft` parses its YAML into ScriptArguments, SFTConfig (a
TrainingArguments), ModelConfig and DatasetMixtureConfig (trl/scripts/sft.py), and SFTConfig
and ModelConfig change some defaults: gradient checkpointing on, bf16 unless fp16, weights
loaded in ModelConfig.dtype (float32), LoRA dropout 0.05. Those apply where a TRL file is silent.

Field names and defaults are read from the installed transformers and trl; the names of the releases
of the last two years (a YAML written for transformers 4.46 sets `warmup_ratio`, one for the
alignment handbook `chat_template`, `dataset_mixture`) come from data/recipe_fields.json (known.py):
those are accepted and named as not modelled. A field that none of them has is refused with the
closest known name (a typo: HfArgumentParser refuses it too).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from functools import cache
from typing import Any

from anatomist.errors import InputError
from anatomist.recipe import Recipe
from anatomist.recipe.files.deepspeed import read_deepspeed
from anatomist.recipe.files.known import TRAINER_CLASSES, historical_fields, refuse_unknown
from anatomist.recipe.files.known import TRL_CLASSES as TRL_HISTORY
from anatomist.recipe.files.reading import (
    Reading,
    fsdp_mode,
    fsdp_offload,
    load_mapping,
    parallel_size,
    referenced_file,
)
from anatomist.recipe.files.unmodelled import TP_UNDER_ACCELERATE_FSDP, refuse_unmodelled

RECIPE_FIELDS = frozenset(f.name for f in dataclasses.fields(Recipe))
TRL_CLASSES = ("ScriptArguments", "SFTConfig", "ModelConfig", "DatasetMixtureConfig")
TRL_DPO_CLASSES = ("ScriptArguments", "DPOConfig", "ModelConfig", "DatasetMixtureConfig")
"""What `trl dpo --config` parses its YAML into (trl/scripts/dpo.py): DPOConfig in SFTConfig's place."""
TRL_LEGACY = {"max_seq_length": "max_length", "torch_dtype": "dtype"}
"""Names older TRL releases used, and what they are now."""
TRL_ENV = "env"
"""TrlParser sets the environment variables of a config's `env:` mapping."""

TRL_RECIPE_FIELDS = frozenset({"padding_free", "packing", "precompute_ref_log_probs", "activation_offloading"})
"""Recipe fields named as SFTConfig / DPOConfig name them, which TrainingArguments lacks: beside TrainingArguments'
keys, one of them makes the file TRL's (read with TRL's defaults and trainer), not the Trainer's."""

LISTS = ("lora_target_modules", "lora_target_parameters", "llm_int8_skip_modules")
"""Keys whose list (TRL ModelConfig's, BitsAndBytesConfig's) is a comma-separated Recipe field of the same name."""
DIRECT = RECIPE_FIELDS - {"gradient_checkpointing", "tf32", "fsdp", "tp_size", *LISTS}
"""Keys whose value is the Recipe field of the same name: TrainingArguments' (per_device_train_batch_size,
fp16, optim, ...), TRL ModelConfig's (dtype, attn_implementation, lora_r, load_in_4bit, ...) and anatomist's."""
DEEPSPEED_CHECKED = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_grad_norm", "fp16", "bf16")
"""The TrainingArguments values the Trainer fills DeepSpeed's "auto" with and checks the rest against."""
HANDLED = frozenset({"gradient_checkpointing", "activation_checkpointing", "gradient_checkpointing_kwargs", "tp_size",
                     "parallelism_config",
                     "activation_checkpointing_kwargs", "tf32", "fsdp", "fsdp_config",
                     "deepspeed", *LISTS, "use_peft", "use_bnb_nested_quant", "model_name_or_path",
                     "max_length", "model_init_kwargs", *TRL_LEGACY})


PEFT_UNMODELLED = {"lora_modules_to_save": "modules_to_save", "use_dora": "dora"}
"""TRL ModelConfig's LoRA settings that change memory in a way not modelled (get_peft_config passes them to
LoraConfig: modules_to_save, use_dora)."""


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return None
    return value.value if isinstance(value, enum.Enum) else value


@cache
def trainer_fields() -> dict[str, Any]:
    """TrainingArguments' fields and their defaults (enums as their values, as to_dict() writes them)."""
    from transformers import TrainingArguments
    from transformers.trainer_pt_utils import AcceleratorConfig

    defaults = {f.name: _default(f) for f in dataclasses.fields(TrainingArguments)}
    # __post_init__ turns None into AcceleratorConfig(), which to_dict() writes out in full
    defaults["accelerator_config"] = AcceleratorConfig().to_dict()
    return defaults


@cache
def trl_fields(script: str = "sft") -> dict[str, Any] | None:
    """The fields `trl sft --config` (or `trl dpo --config`) reads and their defaults (SFTConfig's or DPOConfig's
    over TrainingArguments'); None without trl."""
    try:
        import trl
    except ImportError:
        return None
    fields: dict[str, Any] = {}
    for name in TRL_CLASSES if script == "sft" else TRL_DPO_CLASSES:
        fields.update({f.name: _default(f) for f in dataclasses.fields(getattr(trl, name))})
    return fields


def _trl_script(keys: set[str], file: str) -> str:
    """sft or dpo: a file that sets a field only DPOConfig has is `trl dpo`'s (one with only shared fields, sft's)."""
    sft, dpo = trl_fields("sft") or {}, trl_fields("dpo") or {}
    dpo_only, sft_only = sorted(keys & (set(dpo) - set(sft))), sorted(keys & (set(sft) - set(dpo)))
    if dpo_only and sft_only:
        raise InputError(f"{file}: sets SFTConfig's {', '.join(sft_only[:3])} and DPOConfig's {', '.join(dpo_only[:3])}: "
                         "a TRL config is one trainer's (trl sft or trl dpo)")
    return "dpo" if dpo_only else "sft"


def read_trainer(data: dict[str, Any], reading: Reading, file: str) -> str:
    """Add the file's settings to `reading`; returns the kind: "anatomist", "TrainingArguments" or "TRL"."""
    trainer = trainer_fields()
    kind, schema = _kind(data, trainer, file)
    if kind == "TRL":
        _trl_defaults(data, schema, reading, file)
        script = "dpo" if "beta" in schema else "sft"  # DPOConfig.beta: the schema is trl dpo's
        if data.get("trainer") is None:
            reading.set_default("trainer", script, file, f"{script.upper()}Config", "TRL")
    for key, value in data.items():
        if key in DIRECT:
            if value is not None:
                reading.set(key, value, file, key)
        elif key not in HANDLED:
            reading.skip(key, value, schema.get(key))
    _unmodelled(data, file)
    _sizes(data, reading, file)
    _checkpointing(data, reading, file)
    if data.get("tf32") is not None:
        reading.set("tf32", data["tf32"], file, "tf32")
    _fsdp(data, reading, file)
    if (reading.get("tp_size") or 1) > 1 and reading.get("fsdp") not in (None, "none"):
        raise InputError(TP_UNDER_ACCELERATE_FSDP.format(file=file, tp=reading.get("tp_size")))
    _model_config(data, kind, reading, file)
    if data.get("deepspeed"):
        _deepspeed(data["deepspeed"], schema, reading, file)
    if reading.get("trainer") == "dpo":
        _dpo_length(data, file)
    return kind


def _dpo_length(data: dict[str, Any], file: str) -> None:
    """A DPO file must bound its sequences: DPOTrainer pads each batch of pairs to its longest, truncated to
    max_length (prompt and completion together: trl 1.0 removed max_prompt_length); null truncates nothing."""
    for key in ("max_length", "max_seq_length"):
        if key in data and data[key] is None:
            raise InputError(f"{file}: {key}: null leaves DPO's sequence length to the data (DPOTrainer pads each "
                             "batch of pairs to its longest): set max_length, the tokens of prompt and completion it "
                             "keeps")


def _kind(data: dict[str, Any], trainer: dict[str, Any], file: str) -> tuple[str, dict[str, Any]]:
    """Which format the keys say; a key of none of them is refused, naming the closest known one."""
    keys = set(data)
    if keys <= RECIPE_FIELDS and not keys <= set(trainer):
        return "anatomist", {}
    trainer_known = set(trainer) | historical_fields(TRAINER_CLASSES)
    trl_only = keys & TRL_RECIPE_FIELDS - trainer_known
    if keys <= RECIPE_FIELDS | trainer_known and not (trl_only and keys - RECIPE_FIELDS):
        return "TrainingArguments", trainer
    trl = trl_fields()
    if trl is not None:
        trl = trl_fields(_trl_script(keys, file))
    known = (RECIPE_FIELDS | trainer_known | set(trl or {}) | historical_fields(TRL_HISTORY)
             | set(TRL_LEGACY) | {TRL_ENV})
    refuse_unknown(data, known, file, "anatomist's Recipe, nor of TrainingArguments, TRL's SFTConfig, DPOConfig, "
                   "ModelConfig or ScriptArguments or the alignment handbook's arguments in any release since 2024")
    if trl is None:
        raise InputError(f"{file}: {', '.join(sorted(keys - trainer_known - RECIPE_FIELDS | trl_only))} are TRL fields: "
                         "pip install trl to read this file")
    return "TRL", {**trainer, **trl}


def _trl_defaults(data: dict[str, Any], schema: dict[str, Any], reading: Reading, file: str) -> None:
    """Where a TRL file is silent, TRL's defaults: not TrainingArguments' nor anatomist's."""
    bf16 = not data.get("fp16", False)  # trl/trainer/base_config.py: bf16 = not fp16 when unset
    for name, value, key in (("gradient_checkpointing", schema["gradient_checkpointing"], "gradient_checkpointing"),
                             ("bf16", bf16 if schema["bf16"] is None else schema["bf16"], "bf16"),
                             ("dtype", schema["dtype"], "dtype"), ("lora_dropout", schema["lora_dropout"], "lora_dropout"),
                             ("lora_r", schema["lora_r"], "lora_r"), ("lora_alpha", schema["lora_alpha"], "lora_alpha")):
        reading.set_default(name, value, file, key, "TRL")
    if schema.get("max_length") is not None and not {"max_length", "max_seq_length"} & set(data):
        reading.set_default("seq_len", schema["max_length"], file, "max_length", "TRL")


READ_SIZES = ("tp_size", "dp_replicate_size", "cp_size", "sp_size")
"""The ParallelismConfig sizes read as the recipe's fields of the same names (tensor parallel; HSDP's replicas;
context parallel; DeepSpeed's sequence parallel)."""


def _sizes(data: dict[str, Any], reading: Reading, file: str) -> None:
    """The tensor parallel degree: TrainingArguments' tp_size (4.50-4.51, 0 when unset) or its parallelism_config's
    (4.57+, accelerate's ParallelismConfig); and that config's HSDP replicas (dp_replicate_size)."""
    config = data.get("parallelism_config")
    given = [("tp_size", "tp_size", data.get("tp_size"))]
    if isinstance(config, dict):
        # beside DeepSpeed's sequence parallel, dp_replicate_size counts its data parallel ranks: no HSDP
        fields = [f for f in READ_SIZES if f != "dp_replicate_size" or (config.get("sp_size") or 1) == 1]
        given += [(field, f"parallelism_config.{field}", config.get(field)) for field in fields]
    for field, key, value in given:
        if value not in (None, 0):
            parallel_size(reading, field, value, file, key)
    if "parallelism_config" in data:
        rest = {k: v for k, v in config.items() if k not in READ_SIZES} if isinstance(config, dict) else config
        reading.skip("parallelism_config", rest, {})


def _unmodelled(data: dict[str, Any], file: str) -> None:
    if data.get("use_peft"):
        for key, setting in PEFT_UNMODELLED.items():
            refuse_unmodelled(setting, file, key, data.get(key), size=False)


CHECKPOINTING_KWARGS = {"every_n_layers": "checkpoint_every", "offload": "checkpoint_offload"}
"""The keys of TrainingArguments' activation_checkpointing_kwargs that transformers takes for itself (5.23:
`activation_checkpointing_enable`); the others go to torch.utils.checkpoint (use_reentrant: no memory change)."""


def _checkpointing(data: dict[str, Any], reading: Reading, file: str) -> None:
    """activation_checkpointing(_kwargs) are TrainingArguments' new names (5.x); gradient_checkpointing(_kwargs) the
    old ones, used when the new one is unset (training_args.py). The kwargs count only with checkpointing on, as
    in transformers; TRL's `selective` key is refused: the attention outputs it saves are not modelled."""
    for key in ("activation_checkpointing", "gradient_checkpointing"):
        if data.get(key) is not None:
            reading.set("gradient_checkpointing", bool(data[key]), file, key)
            break
    if not reading.get("gradient_checkpointing"):
        return
    for key in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        if data.get(key):
            read_checkpointing_kwargs(data[key], reading, file, key)
            return


def read_checkpointing_kwargs(kwargs: Any, reading: Reading, file: str, key: str) -> None:
    """TrainingArguments' (activation|gradient)_checkpointing_kwargs, a mapping or its JSON string, with
    checkpointing on: `every_n_layers` and `offload` set their Recipe fields, TRL's `selective` is refused, the
    rest (use_reentrant) is torch.utils.checkpoint's and changes no memory. axolotl passes its own through."""
    if isinstance(kwargs, str):  # TrainingArguments takes the dict as a JSON string too (command lines)
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError as exc:
            raise InputError(f"{file}: {key} is not a JSON mapping: {exc.msg}") from None
    if not isinstance(kwargs, dict):
        raise InputError(f"{file}: {key} must be a mapping, got {kwargs!r}")
    refuse_unmodelled("selective_checkpointing", file, f"{key}.selective", kwargs.get("selective"))
    for name, field_name in CHECKPOINTING_KWARGS.items():
        if kwargs.get(name) is not None:
            reading.set(field_name, kwargs[name], file, f"{key}.{name}")


def _fsdp(data: dict[str, Any], reading: Reading, file: str) -> None:
    """TrainingArguments.fsdp: True (the strategy in fsdp_config), or the older "full_shard auto_wrap" / list."""
    value, config = data.get("fsdp"), data.get("fsdp_config") or {}
    if isinstance(config, str):
        config = load_mapping(referenced_file(config, file, "fsdp_config"), "fsdp_config file")
    config = {k.removeprefix("fsdp_"): v for k, v in config.items()}
    if value in (None, False, "", [], "none"):
        if config:
            reading.skip("fsdp_config", config)  # read only when fsdp is on
        return
    items = value.split() if isinstance(value, str) else list(value) if isinstance(value, list) else []
    strategies = [i for i in items if i not in ("auto_wrap", "offload")]
    fsdp_offload(reading, "offload" in items, file, "fsdp")
    for key in ("offload_params", "cpu_offload"):
        fsdp_offload(reading, config.get(key), file, f"fsdp_config.{key}")
    if len(strategies) > 1:
        raise InputError(f"{file}: fsdp={value!r} names more than one sharding strategy")
    if strategies:
        mode = fsdp_mode(strategies[0], file, "fsdp")
    else:
        mode = fsdp_mode(config.get("reshard_after_forward", True), file, "fsdp_config.reshard_after_forward")
    reading.set("fsdp", mode, file, "fsdp")
    if config.get("activation_checkpointing"):
        reading.set("gradient_checkpointing", True, file, "fsdp_config.activation_checkpointing")
    reading.skip_all("fsdp_config", config, keep=("reshard_after_forward", "activation_checkpointing", "version"))


def _model_config(data: dict[str, Any], kind: str, reading: Reading, file: str) -> None:
    """TRL's ModelConfig: the model, LoRA (use_peft) and bitsandbytes; SFTConfig's max_length."""
    if data.get("model_name_or_path"):
        reading.set("model", data["model_name_or_path"], file, "model_name_or_path")
    for key in ("max_length", "max_seq_length"):
        if data.get(key) is not None:
            reading.set("seq_len", data[key], file, key)
    if data.get("torch_dtype") is not None:
        reading.set("dtype", data["torch_dtype"], file, "torch_dtype")
    kwargs = data.get("model_init_kwargs") or {}
    read = {"dtype": "dtype", "torch_dtype": "dtype", "attn_implementation": "attn_implementation",
            "experts_implementation": "experts_implementation"}
    for key, name in read.items():
        if kwargs.get(key) is not None:
            reading.set(name, kwargs[key], file, f"model_init_kwargs.{key}")
    reading.skip_all("model_init_kwargs", kwargs, keep=tuple(read))
    if data.get("use_peft"):
        reading.set("peft", "lora", file, "use_peft")
    for key in LISTS:
        names = data.get(key)
        if names is not None:
            reading.set(key, ",".join(names) if isinstance(names, list) else names, file, key)
    if data.get("use_bnb_nested_quant") is not None:
        reading.set("bnb_4bit_use_double_quant", data["use_bnb_nested_quant"], file, "use_bnb_nested_quant")
    if kind == "TRL" and data.get("load_in_4bit") and "bnb_4bit_compute_dtype" not in data:
        dtype = reading.get("dtype")  # trl's get_quantization_config: compute dtype = ModelConfig.dtype
        if dtype in ("float32", "bfloat16", "float16"):
            reading.set_default("bnb_4bit_compute_dtype", dtype, file, "dtype", "TRL")


def _deepspeed(value: Any, schema: dict[str, Any], reading: Reading, file: str) -> None:
    read_deepspeed_reference(value, reading, file, tool="TRL" if "max_length" in schema else "TrainingArguments",
                             schema=schema)


def read_deepspeed_reference(value: Any, reading: Reading, file: str, *, tool: str,
                             schema: dict[str, Any] | None = None) -> None:
    """A `deepspeed` key (TrainingArguments', axolotl's, LLaMA-Factory's): a ds_config path or mapping, whose values
    must match the Trainer's (`schema`'s defaults, TrainingArguments' by default, where the file is silent)."""
    if isinstance(value, str):
        path = referenced_file(value, file, "deepspeed")
        data, where = load_mapping(path, "DeepSpeed config"), str(path)
    elif isinstance(value, dict):
        data, where = value, f"{file}: deepspeed"
    else:
        raise InputError(f"{file}: deepspeed must be a path or a mapping, got {value!r}")
    schema = trainer_fields() if schema is None else schema
    for name in DEEPSPEED_CHECKED:  # the Trainer fills "auto" with its own values and checks the rest against them
        if name not in reading.defaults and schema.get(name) is not None:
            reading.set_default(name, schema[name], file, name, tool)
    read_deepspeed(data, reading, where, match_defaults=True)
