"""The Workload and Recipe of a run about to start, read from what it holds: the live model (its
config, weights dtype, PEFT adapters and quantization) and its `TrainingArguments`.

The arguments are read as `--recipe` reads a TrainingArguments or TRL file (`recipe/files`, on
`args.to_dict()`); what the model object says wins over them, since it is what will train: the
dtype its floating weights are in, its LoRA config (`model.peft_config`) and its bitsandbytes
quantization (`model.config.quantization_config`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from anatomist.errors import InputError
from anatomist.recipe import Recipe
from anatomist.workload import Task, Workload
from anatomist.workload_loader import workload_from_config

TASK_SUFFIXES: dict[str, Task] = {
    "ForSequenceClassification": "sequence-classification",
    "ForCausalLM": "causal-lm",
    "ForConditionalGeneration": "seq2seq-lm",
    "ForSeq2SeqLM": "seq2seq-lm",
    "ForMaskedLM": "masked-lm",
    "LMHeadModel": "causal-lm",
}
"""The head a transformers model class trains, told by its name (the Auto classes' naming)."""
DTYPES = ("float32", "bfloat16", "float16")
"""The weights dtypes a Recipe takes (`Recipe.dtype`)."""


def base_model(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (the model itself otherwise)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def live_workload(model: Any, *, seq_len: int) -> Workload:
    """The Workload of the live `model` at `seq_len` tokens per sample.

    Raises:
        InputError: a model class whose head anatomist does not model, or what `workload_from_config` raises.
    """
    base = base_model(model)
    cls = type(base).__name__
    task = next((t for suffix, t in TASK_SUFFIXES.items() if cls.endswith(suffix)), None)
    if task is None:
        raise InputError(f"{cls}: anatomist predicts the heads {', '.join(TASK_SUFFIXES)}, not this one")
    config = base.config
    name = getattr(config, "_name_or_path", None) or config.model_type
    return workload_from_config(config, name=name, task=task, seq_len=seq_len,
                                num_labels=getattr(config, "num_labels", 2) or 2)


def live_recipe(args: Any, model: Any) -> tuple[Recipe, int | None]:
    """The Recipe of `args` (TrainingArguments or a TRL config) run on `model`, and the tokens per
    sample the arguments name (TRL's max_length; None for TrainingArguments).

    Raises:
        InputError: a setting anatomist cannot model (as `--recipe` says it).
    """
    from anatomist.recipe.files import read_recipe_mapping

    source = read_recipe_mapping(args.to_dict(), f"{type(args).__name__}")
    return source.recipe.replace(**model_fields(model)), source.seq_len


def model_fields(model: Any) -> dict[str, Any]:
    """The Recipe fields the model object decides: weights dtype, LoRA, 4/8-bit base."""
    fields: dict[str, Any] = {}
    dtype = weights_dtype(model)
    if dtype is not None:
        fields["dtype"] = dtype
    quant = getattr(base_model(model).config, "quantization_config", None)
    if quant is not None and not isinstance(quant, dict):
        quant = quant.to_dict()
    four_bit = bool(quant and quant.get("load_in_4bit"))
    eight_bit = bool(quant and quant.get("load_in_8bit"))
    if four_bit:
        assert quant is not None
        fields.update(load_in_4bit=True, bnb_4bit_quant_type=quant.get("bnb_4bit_quant_type", "nf4"),
                      bnb_4bit_use_double_quant=bool(quant.get("bnb_4bit_use_double_quant")))
        compute = str(quant.get("bnb_4bit_compute_dtype") or "float32").removeprefix("torch.")
        if compute in DTYPES:
            fields["bnb_4bit_compute_dtype"] = compute
    elif eight_bit:
        fields["load_in_8bit"] = True
    lora = _lora_config(model)
    if lora is not None:
        targets = lora.target_modules
        fields.update(peft="qlora" if four_bit else "lora", lora_r=lora.r, lora_alpha=int(lora.lora_alpha),
                      lora_dropout=float(lora.lora_dropout),
                      lora_target_modules=targets if isinstance(targets, str) or targets is None
                      else ",".join(sorted(targets)))
    return fields


def weights_dtype(model: Any) -> str | None:
    """The dtype most of the model's floating-point parameters are in (quantized storage aside)."""
    counts: Counter[str] = Counter()
    for p in model.parameters():
        if p.is_floating_point():
            counts[str(p.dtype).removeprefix("torch.")] += p.numel()
    dtype = counts.most_common(1)[0][0] if counts else None
    return dtype if dtype in DTYPES else None


def _lora_config(model: Any) -> Any:
    """The active LoRA config of a PEFT model (None without one; another PEFT method is refused)."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    config = configs.get(getattr(model, "active_adapter", "default")) or next(iter(configs.values()))
    if type(config).__name__ != "LoraConfig":
        raise InputError(f"{type(config).__name__}: anatomist models LoRA adapters only")
    return config
