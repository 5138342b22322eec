"""A LLaMA-Factory training YAML (`llamafactory-cli train FILE`), read as YAML: LLaMA-Factory is not a dependency.

Field names and defaults are LLaMA-Factory's (hiyouga/LLaMA-Factory src/llamafactory/hparams/,
at the commit data/framework_fields.json names): its ModelArguments, DataArguments and
FinetuningArguments beside transformers' Seq2SeqTrainingArguments, all parsed by HfArgumentParser,
which refuses a key none of them has; so does this reader. What LLaMA-Factory does with them:
- finetuning_type (default lora): lora trains adapters of rank lora_rank (8), alpha lora_alpha
  (default 2 x rank), dropout lora_dropout (0), on lora_target ("all": every linear layer);
  full trains every weight in float32 (model/adapter.py: cast_trainable_params_to_fp32, unless pure_bf16;
  under ZeRO-3 DeepSpeed keeps the fp32 copy itself); freeze and oft are not modelled;
- the model is loaded in the compute dtype: bfloat16 with bf16 or pure_bf16, float16 with fp16
  (hparams/parser.py);
- quantization_bit 4/8 with quantization_method bnb (the default) is bitsandbytes QLoRA, nf4
  (quantization_type) with double_quantization (default true);
- gradient checkpointing is on unless disable_gradient_checkpointing (model/model_utils/checkpointing.py);
- flash_attn: auto (the model's default), disabled (eager), sdpa, fa2;
- cutoff_len (2048) is the tokens per sample; deepspeed names a ds_config, read as the Trainer reads it;
- GaLore, APOLLO, BAdam, Adam-mini, Muon, LLaMA Pro, DoRA, additional_target, fp8 and Unsloth change memory in ways
  not modelled: refused (UNMODELLED_KEYS);
- enable_liger_kernel (model/model_utils/liger_kernel.py) calls Liger's apply_liger_kernel_to_<model type>() with
  its defaults in the sft and pt stages (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy): what
  TrainingArguments.use_liger_kernel applies.
"""

from __future__ import annotations

from typing import Any

from anatomist.errors import InputError
from anatomist.recipe.files.known import TRAINER_CLASSES, framework_fields, historical_fields, refuse_unknown
from anatomist.recipe.files.reading import Reading
from anatomist.recipe.files.unmodelled import refuse_unmodelled

MARKERS = ("finetuning_type", "stage", "template", "cutoff_len", "lora_target", "quantization_bit")
"""Keys only a LLaMA-Factory file has (neither TrainingArguments nor TRL nor axolotl names them)."""
OWN = {"model_name_or_path", "finetuning_type", "stage", "lora_rank", "lora_alpha", "lora_dropout", "lora_target",
       "cutoff_len", "quantization_bit", "quantization_method", "quantization_type", "double_quantization",
       "disable_gradient_checkpointing", "use_unsloth_gc", "flash_attn", "pure_bf16", "enable_liger_kernel"}
"""The LLaMA-Factory keys read here; its TrainingArguments keys go to the TrainingArguments reader."""
ATTENTION = {"auto": None, "disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2"}
"""flash_attn (extras/constants.py AttentionFunction) -> Recipe.attn_implementation (None: the model's default)."""
UNMODELLED_KEYS = {"use_galore": "optimizer", "use_apollo": "optimizer", "use_badam": "optimizer",
                   "use_adam_mini": "optimizer", "use_muon": "optimizer", "use_llama_pro": "partial_training",
                   "use_dora": "dora", "additional_target": "modules_to_save", "fp8": "fp8", "use_unsloth": "unsloth"}
"""Keys that change memory in a way not modelled -> the `unmodelled` setting they turn on (hparams/finetuning_args.py:
GaLore, APOLLO, BAdam, Adam-mini and Muon replace the optimizer; LLaMA Pro trains only its expanded blocks;
additional_target trains whole modules beside LoRA; model_args.py / training_args.py: Unsloth's model, fp8)."""
STAGES = ("sft", "pt")
"""Stages trained as one causal-LM model, through the Trainer's loss."""
OTHER_STAGES = {"rm": "a value head scoring pairs of sequences (train/rm)",
                "ppo": "generation with a value head, a reward and a reference model (train/ppo)",
                "dpo": "its own DPO trainer: every logit upcast to fp32 and a reference model's log-probabilities "
                       "(train/dpo)",
                "kto": "its own KTO trainer: every logit upcast to fp32 and a reference model's log-probabilities "
                       "(train/kto)"}
"""The other stages (hparams/finetuning_args.py `stage`) and what their trainers add that is not modelled."""


def looks_like_llamafactory(data: dict[str, Any]) -> bool:
    return any(key in data for key in MARKERS)


def read_llamafactory(data: dict[str, Any], reading: Reading, file: str) -> None:
    """Add the file's settings to `reading`; its TrainingArguments keys through `read_trainer`."""
    from anatomist.recipe.files.trainer import read_trainer, trainer_fields

    training = set(trainer_fields()) | historical_fields(TRAINER_CLASSES)
    refuse_unknown(data, framework_fields("LLaMA-Factory") | training, file,
                   "LLaMA-Factory's arguments (HfArgumentParser refuses it too)")
    stage = data.get("stage", "sft")
    if stage not in STAGES:
        what = OTHER_STAGES.get(stage, "a stage LLaMA-Factory does not have")
        raise InputError(f"{file}: stage={stage!r} is not modelled ({what}); modelled: {', '.join(STAGES)}")
    method = data.get("finetuning_type", "lora")
    if method not in ("lora", "full"):
        raise InputError(f"{file}: finetuning_type={method!r} is not modelled; modelled: lora, full")
    for key, value in data.items():
        if key in UNMODELLED_KEYS:
            refuse_unmodelled(UNMODELLED_KEYS[key], file, key, value, size=False)
    read_trainer({k: v for k, v in data.items() if k in training and k not in OWN}, reading, file)
    if data.get("model_name_or_path"):
        reading.set("model", data["model_name_or_path"], file, "model_name_or_path")
    reading.set("seq_len", data.get("cutoff_len", 2048), file, "cutoff_len")
    if "gradient_checkpointing" not in reading.values:
        reading.set("gradient_checkpointing", not data.get("disable_gradient_checkpointing", False), file,
                    "disable_gradient_checkpointing")
    if data.get("use_unsloth_gc") and reading.get("gradient_checkpointing"):
        # Unsloth's checkpointing: each checkpointed layer's input hidden states on the host (model_utils/checkpointing.py)
        reading.set("checkpoint_offload", True, file, "use_unsloth_gc")
    attention = data.get("flash_attn", "auto")
    if attention not in ATTENTION:
        raise InputError(f"{file}: flash_attn={attention!r} is not modelled; modelled: {', '.join(ATTENTION)}")
    if ATTENTION[attention]:
        reading.set("attn_implementation", ATTENTION[attention], file, "flash_attn")
    _precision(data, method, reading, file)
    if data.get("enable_liger_kernel"):
        reading.set("use_liger_kernel", True, file, "enable_liger_kernel")
    if method == "lora":
        _lora(data, reading, file)
    for key, value in data.items():
        if key not in OWN and key not in training:
            reading.skip(key, value)


def _precision(data: dict[str, Any], method: str, reading: Reading, file: str) -> None:
    pure = bool(data.get("pure_bf16"))
    compute = "bfloat16" if reading.get("bf16") or pure else "float16" if reading.get("fp16") else None
    if pure:
        reading.set("bf16", False, file, "pure_bf16")  # bf16 weights, no autocast
    if method == "full" and not pure:
        dtype = "float32"  # trainable parameters in float32: upcast (model/adapter.py), or ZeRO-3's own fp32 copy
    else:
        dtype = compute or "auto"
    reading.set("dtype", dtype, file, "pure_bf16" if pure else "bf16" if compute else "finetuning_type")


def _lora(data: dict[str, Any], reading: Reading, file: str) -> None:
    rank = data.get("lora_rank", 8)
    reading.set("peft", "lora", file, "finetuning_type")
    reading.set("lora_r", rank, file, "lora_rank")
    reading.set("lora_alpha", data.get("lora_alpha") or 2 * rank, file, "lora_alpha")
    reading.set("lora_dropout", data.get("lora_dropout", 0.0), file, "lora_dropout")
    target = data.get("lora_target", "all")
    reading.set("lora_target_modules", "all-linear" if target == "all" else str(target), file, "lora_target")
    bits = data.get("quantization_bit")
    if bits is None:
        return
    if data.get("quantization_method", "bnb") != "bnb" or bits not in (4, 8):
        raise InputError(f"{file}: quantization_bit={bits!r} with quantization_method="
                         f"{data.get('quantization_method', 'bnb')!r} is not modelled; modelled: bnb with 4 or 8 bits")
    if bits == 8:
        reading.set("load_in_8bit", True, file, "quantization_bit")
        return
    reading.set("load_in_4bit", True, file, "quantization_bit")
    reading.set("bnb_4bit_quant_type", data.get("quantization_type", "nf4"), file, "quantization_type")
    reading.set("bnb_4bit_use_double_quant", data.get("double_quantization", True), file, "double_quantization")
    compute = reading.get("dtype")
    reading.set("bnb_4bit_compute_dtype", compute if compute != "auto" else "float32", file, "quantization_bit")
