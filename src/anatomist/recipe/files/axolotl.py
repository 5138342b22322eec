"""An axolotl config (`axolotl train FILE`), read as YAML: axolotl is not a dependency.

Field names and meanings are axolotl's schema (axolotl-ai-cloud/axolotl src/axolotl/utils/schemas/:
config.py AxolotlInputConfig, peft.py LoraConfig, fsdp.py FSDPConfig; at the commit
data/framework_fields.json names) and what its loader does with them:
- base_model; sequence_len (tokens per sample); micro_batch_size (per device), gradient_accumulation_steps;
- adapter lora / qlora: lora_r, lora_alpha, lora_dropout, lora_target_modules or lora_target_linear
  (every linear layer); qlora loads the base with load_in_4bit as nf4 with double quantization,
  computing in the weights' dtype (loaders/model.py);
- precision (utils/config/__init__.py resolve_dtype): bf16 true or "auto" (read as true: an Ampere
  or newer GPU, where axolotl turns it on) is bf16 autocast, and the weights are loaded in
  bfloat16 (also with bfloat16: true, without autocast); fp16 / float16 / load_in_8bit load float16;
  else float32;
- attention: attn_implementation, or the older flash_attention / sdp_attention / eager_attention;
- gradient_checkpointing, with gradient_checkpointing_kwargs passed to TrainingArguments (read as it reads them);
  activation_offloading "hidden_states" keeps each checkpointed layer's input on the host (`checkpoint_offload`,
  monkeypatch/activation_offload_checkpoint.py); true runs TRL's activation offloader with its streams
  (core/trainers/mixins/activation_checkpointing.py: `activation_offloading`) on layers it checkpoints itself
  (loaders/model.py: "keep recompute and offload only the checkpoint boundaries"), but with an adapter axolotl's
  own variant, which offloads views of the parameters and replaces recomputation (refused, as are "legacy",
  without streams, and "disk");
  gradient_checkpointing "offload" and "offload_disk" are activation_offloading true and "disk"
  (utils/schemas/validation.py; before 0.12 "offload" was Unsloth's checkpointing);
- deepspeed (a ds_config path or mapping, read as the Trainer reads it), fsdp (a strategy list) with
  fsdp_config (keys with or without "fsdp_"), fsdp_version;
- dp_replicate_size: the recipe's (HSDP, as accelerate's FSDP2 runs it);
- tensor_parallel_size, context_parallel_size above 1, qat (torchao's fake quantization), and
  UNMODELLED_KEYS (reward models, frozen subsets, LISA, modules trained beside an adapter, DoRA, BitNet, a GPTQ
  base): not modelled, refused;
- fp8 and fp8_enable_fsdp_float8_all_gather: torchao's tensorwise float8 layers (`_fp8`);
- rl: dpo and ipo run TRL's DPOTrainer (core/builders/rl.py; AxolotlDPOTrainer changes no memory: tokenizing, an
  empty_cache after each step), read as trainer dpo with precompute_ref_log_probs; with an adapter the policy with
  its adapters disabled is the reference (train.py setup_reference_model: rl_adapter_ref_model, which docs/rlhf.qmd
  offers to load a second model, is no schema key, so validate_config drops it). The other trainers (orpo, kto,
  simpo, grpo, gdpo, ebft) are refused: their reference, pairing or generation are not modelled.
- plugins: the CutCrossEntropyPlugin is cut_cross_entropy (`_cut_cross_entropy`); the other memory-changing ones
  (PLUGINS: Spectrum, knowledge distillation, Grokfast, expert parallel, LLM Compressor's sparsity) are refused, any other named as not
  modelled; axolotl.integrations.liger.LigerPlugin
  (integrations/liger/plugin.py) passes each liger_* flag to Liger's apply_liger_kernel_to_<model type>;
  liger_rope, liger_rms_norm, liger_glu_activation (or its old name liger_swiglu) and
  liger_fused_linear_cross_entropy all true is what TrainingArguments.use_liger_kernel applies, read as it;
  another set is refused. liger_layer_norm and liger_rms_norm_gated change nothing on the
  models anatomist runs Liger on (their apply functions take no such argument), liger_use_token_scaling only
  weights the loss. Without the plugin axolotl drops the flags.
- sample_packing with flash_attention_2: packing (`_packing`); with another attention, named as not modelled.
axolotl's pydantic models ignore a key they do not declare; here a key close to a declared one is
refused as a typo, any other is named as not modelled.
"""

from __future__ import annotations

from typing import Any

from anatomist.errors import InputError
from anatomist.recipe.files.known import closest, framework_fields
from anatomist.recipe.files.reading import (
    Reading,
    fsdp_mode,
    fsdp_offload,
    load_mapping,
    parallel_size,
    referenced_file,
)
from anatomist.recipe.files.unmodelled import refuse_unmodelled

MARKERS = ("base_model", "micro_batch_size", "sequence_len", "adapter")
"""Keys only an axolotl config has."""
DIRECT = {"micro_batch_size": "per_device_train_batch_size", "gradient_accumulation_steps": "gradient_accumulation_steps",
          "max_grad_norm": "max_grad_norm", "optimizer": "optim", "lora_r": "lora_r", "lora_alpha": "lora_alpha",
          "lora_dropout": "lora_dropout", "load_in_4bit": "load_in_4bit", "load_in_8bit": "load_in_8bit",
          "tf32": "tf32"}
"""axolotl key -> Recipe field of the same meaning."""
ATTENTION_FLAGS = {"flash_attention": "flash_attention_2", "sdp_attention": "sdpa", "eager_attention": "eager"}
PARALLEL = {"tensor_parallel_size": "tensor_parallel", "context_parallel_size": "ring_flash_attention",
            "sequence_parallel_degree": "ring_flash_attention"}
REPLICAS = "dp_replicate_size"
"""HSDP's replicas of FSDP's shard groups: axolotl hands it to accelerate's ParallelismConfig, read as the recipe's."""
OFFLOADING = {"offload": True, "offload_disk": "disk"}
"""gradient_checkpointing's deprecated values -> the activation_offloading axolotl runs for them (validation.py)."""
UNMODELLED_KEYS = {"reward_model": "reward_model", "process_reward_model": "reward_model",
                   "unfrozen_parameters": "partial_training", "lora_modules_to_save": "modules_to_save",
                   "peft_use_dora": "dora", "use_onebitllms": "bitnet", "gptq": "prequantized"}
"""Keys that change memory in a way not modelled -> the `unmodelled` setting they turn on: reward_model and
process_reward_model train a sequence/token classification head on pairs (core/builders: RewardTrainer, PRMTrainer);
unfrozen_parameters freezes every parameter but those it matches (train.py freeze_layers_except); lora_modules_to_save
trains whole copies of the modules it names; peft_use_dora is PEFT's use_dora; use_onebitllms swaps the linear layers for onebitllms' BitNet ones (loaders/model.py); gptq
loads a GPTQ-quantized base."""
PREFERENCE = {"dpo": "dpo", "ipo": "dpo"}
"""axolotl's rl -> the trainer that runs it (IPO: DPOTrainer with loss_type ipo, a loss of the same memory)."""
LIGER_PLUGIN = "axolotl.integrations.liger"
CCE_PLUGIN = "axolotl.integrations.cut_cross_entropy"
PLUGINS = {"axolotl.integrations.spectrum": "spectrum",
           "axolotl.integrations.kd": "knowledge_distillation", "axolotl.integrations.grokfast": "grokfast",
           "axolotl.integrations.expert_parallel": "expert_parallel",
           "axolotl.integrations.llm_compressor": "sparse_masks"}
"""axolotl's plugins (integrations/) that change memory in a way not modelled -> the `unmodelled` setting they are."""
LIGER_FLAGS = ("liger_rope", "liger_rms_norm", "liger_rms_norm_gated", "liger_layer_norm", "liger_swiglu",
               "liger_glu_activation", "liger_cross_entropy", "liger_fused_linear_cross_entropy", "liger_use_token_scaling")
"""LigerArgs (integrations/liger/args.py); liger_swiglu is liger_glu_activation's old name."""
LIGER_AS_TRAINER = ("liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy")
"""The Liger flags that, all true and with no other, are TrainingArguments.use_liger_kernel's kernels."""
LIGER_NO_CHANGE = ("liger_layer_norm", "liger_rms_norm_gated", "liger_use_token_scaling")
"""Liger flags that change nothing anatomist models (module docstring)."""
READ = {"base_model", "sequence_len", "adapter", "bf16", "fp16", "bfloat16", "float16", "attn_implementation",
        "gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_offloading", "lora_target_modules",
        "lora_target_linear", "deepspeed", "fsdp", "fsdp_config", "fsdp_version", "torch_compile", "rl",
        "precompute_ref_log_probs", "plugins", "sample_packing", "cut_cross_entropy", "fp8",
        "fp8_enable_fsdp_float8_all_gather", *DIRECT, *ATTENTION_FLAGS,
        *PARALLEL, REPLICAS, *LIGER_FLAGS}


def _fp8(data: dict[str, Any], reading: Reading, file: str) -> None:
    """fp8: accelerate's mixed precision fp8 with AORecipeKwargs(config=Float8LinearConfig(...)) (core/trainers/base.py
    additional_accelerator_args): torchao's default recipe, tensorwise, its weights gathered in float8 under FSDP where
    fp8_enable_fsdp_float8_all_gather is true (off by default, unlike accelerate's own default). axolotl also sets
    force_recompute_fp8_weight_in_bwd with it, which is not traced (trace/step/fp8.py), and leaves pad_inner_dim off,
    which changes nothing where the tokens of a micro-batch are a multiple of 16."""
    if data.get("fp8") is not True:
        return
    reading.set("fp8", "tensorwise", file, "fp8")
    gathered = data.get("fp8_enable_fsdp_float8_all_gather") is True
    reading.set("fp8_all_gather", gathered, file, "fp8_enable_fsdp_float8_all_gather" if gathered else "fp8")


def looks_like_axolotl(data: dict[str, Any]) -> bool:
    return any(key in data for key in MARKERS)


def read_axolotl(data: dict[str, Any], reading: Reading, file: str) -> None:
    known = framework_fields("axolotl")
    for key, value in data.items():
        if key not in known:
            near = closest(key, known)
            if near:
                raise InputError(f"{file}: unknown key {key} (did you mean {near}?): not a key of axolotl's config "
                                 "(axolotl would ignore it)")
        if key in PARALLEL:
            refuse_unmodelled(PARALLEL[key], file, key, value)
        if key == REPLICAS and value is not None:
            parallel_size(reading, REPLICAS, value, file, key)
        if key in UNMODELLED_KEYS:
            refuse_unmodelled(UNMODELLED_KEYS[key], file, key, value, size=False)
        if key == "lisa_n_layers" and data.get("lisa_step_interval"):  # LISA: a few layers trained at a time
            refuse_unmodelled("partial_training", file, key, value, size=False)
        if key == "qat" and value:
            raise InputError(f"{file}: qat is not modelled yet (quantization-aware training: torchao's fake-quantized "
                             "copies of the weights and activations, which backward keeps, would be predicted "
                             "without them); remove it to estimate without it")
        if key in DIRECT and value is not None:
            reading.set(DIRECT[key], value, file, key)
        elif key not in READ:
            reading.skip(key, value)
    if data.get("base_model"):
        reading.set("model", data["base_model"], file, "base_model")
    if data.get("sequence_len") is not None:
        reading.set("seq_len", data["sequence_len"], file, "sequence_len")
    _precision(data, reading, file)
    _fp8(data, reading, file)
    _attention(data, reading, file)
    _checkpointing(data, reading, file)
    if data.get("torch_compile") is True:  # "auto": axolotl decides by the torch version; read as off
        reading.set("torch_compile", True, file, "torch_compile")
    _adapter(data, reading, file)
    _sharding(data, reading, file)
    _preference(data, reading, file)
    _packing(data, reading, file)
    _plugins(data, reading, file)


def _plugins(data: dict[str, Any], reading: Reading, file: str) -> None:
    """The plugins: those in PLUGINS refused, the Liger flags read where the LigerPlugin is listed, any other named as
    not modelled."""
    plugins = [str(plugin) for plugin in data.get("plugins") or []]
    for plugin in plugins:
        for prefix, setting in PLUGINS.items():
            if plugin.startswith(prefix + "."):
                refuse_unmodelled(setting, file, "plugins", plugin)
    if any(plugin.startswith(CCE_PLUGIN + ".") for plugin in plugins):
        _cut_cross_entropy(data, reading, file)
    elif "cut_cross_entropy" in data:  # axolotl loads the plugin's arguments only with the plugin: dropped
        reading.skip("cut_cross_entropy", data["cut_cross_entropy"], default=None)
    others = [plugin for plugin in plugins if not plugin.startswith((LIGER_PLUGIN + ".", CCE_PLUGIN + "."))]
    if others:
        reading.skip("plugins", others, default=[])
    if len(others) == len(plugins):
        for key in LIGER_FLAGS:
            if key in data:
                reading.skip(key, data[key], default=None)  # axolotl drops them
        return
    on = {"liger_glu_activation" if key == "liger_swiglu" else key for key in LIGER_FLAGS if data.get(key)}
    on -= set(LIGER_NO_CHANGE)
    if not on:
        return
    if on != set(LIGER_AS_TRAINER):
        raise InputError(f"{file}: the Liger flags {', '.join(sorted(on))} are not modelled as a set; modelled: "
                         f"{', '.join(LIGER_AS_TRAINER)} all true (what TrainingArguments.use_liger_kernel applies), "
                         "or none")
    reading.set("use_liger_kernel", True, file, "plugins")


def _preference(data: dict[str, Any], reading: Reading, file: str) -> None:
    rl = data.get("rl")
    if not rl:
        return
    if rl not in PREFERENCE:
        raise InputError(f"{file}: rl={rl!r} is not modelled (its trainer's reference model, pairing or generation); "
                         f"modelled: {', '.join(PREFERENCE)} (TRL's DPOTrainer), or no rl (supervised fine-tuning)")
    reading.set("trainer", PREFERENCE[rl], file, "rl")
    if data.get("precompute_ref_log_probs") is not None:
        reading.set("precompute_ref_log_probs", bool(data["precompute_ref_log_probs"]), file, "precompute_ref_log_probs")


def _packing(data: dict[str, Any], reading: Reading, file: str) -> None:
    """sample_packing under flash_attention_2 is packing as anatomist models TRL's: axolotl's multipack sampler fills
    each row of a micro-batch with whole samples up to sequence_len (pad_to_sequence_len, on by default, pads the
    rest), position_ids restart per sample and FlashAttention's varlen kernel keeps the samples apart. Under another
    attention axolotl keeps them apart by a 4D mask, not modelled: named as such."""
    if not data.get("sample_packing"):
        if "sample_packing" in data:
            reading.skip("sample_packing", data["sample_packing"], default=False)
        return
    if data.get("rl"):
        raise InputError(f"{file}: sample_packing: true with rl={data['rl']!r}: axolotl refuses packing for RLHF "
                         "training")
    if reading.get("attn_implementation") != "flash_attention_2":
        reading.skip("sample_packing", True, default=False)
        return
    reading.set("packing", True, file, "sample_packing")
    reading.set("padding_free", True, file, "sample_packing")


def _cut_cross_entropy(data: dict[str, Any], reading: Reading, file: str) -> None:
    """The CutCrossEntropyPlugin (integrations/cut_cross_entropy): its cut_cross_entropy defaults to true, and
    axolotl refuses it without fp16/bf16 training or beside chunked_cross_entropy (args.py)."""
    if data.get("cut_cross_entropy", True) is False:
        return
    if not (data.get("bf16") or data.get("fp16")):
        raise InputError(f"{file}: the CutCrossEntropyPlugin needs bf16 or fp16 training (axolotl refuses it without: "
                         "Cut Cross-Entropy's backward takes half-precision tensors)")
    if data.get("chunked_cross_entropy"):
        raise InputError(f"{file}: the CutCrossEntropyPlugin with chunked_cross_entropy: axolotl refuses the two "
                         "together")
    reading.set("cut_cross_entropy", True, file, "plugins")


def _checkpointing(data: dict[str, Any], reading: Reading, file: str) -> None:
    checkpointing = data.get("gradient_checkpointing")
    if isinstance(checkpointing, str):
        if checkpointing not in OFFLOADING:
            raise InputError(f"{file}: gradient_checkpointing={checkpointing!r} is not one of axolotl's values: true, "
                             f"false, {', '.join(OFFLOADING)}")
        offloading, key = OFFLOADING[checkpointing], "gradient_checkpointing"
    else:
        offloading, key = data.get("activation_offloading"), "activation_offloading"
    if offloading == "hidden_states":
        reading.set("checkpoint_offload", True, file, key)
    elif offloading is True and not data.get("adapter"):  # checkpointed too: ac_wrap_hf_model (loaders/model.py)
        reading.set("activation_offloading", True, file, key)
        reading.set("gradient_checkpointing", True, file, key)
        checkpointing = None
    elif offloading is True:
        raise InputError(f"{file}: {key}={data.get(key)!r} with an adapter runs axolotl's own variant of TRL's offloader "
                         "(get_lora_act_offloading_ctx_manager: views of the frozen weights leave too), not modelled "
                         "yet; use activation_offloading: hidden_states or remove it to estimate without it")
    else:
        refuse_unmodelled("activation_offload", file, key, data.get(key), instead="activation_offloading: "
                          "hidden_states (only each checkpointed layer's input on the host)")
    if checkpointing is not None:
        reading.set("gradient_checkpointing", bool(checkpointing), file, "gradient_checkpointing")
    if reading.get("gradient_checkpointing") and data.get("gradient_checkpointing_kwargs"):
        from anatomist.recipe.files.trainer import read_checkpointing_kwargs

        read_checkpointing_kwargs(data["gradient_checkpointing_kwargs"], reading, file, "gradient_checkpointing_kwargs")


def _precision(data: dict[str, Any], reading: Reading, file: str) -> None:
    fp16 = bool(data.get("fp16"))
    autocast_bf16 = data.get("bf16") is True or (data.get("bf16") == "auto" and not fp16)
    fp8 = data.get("fp8") is True  # accelerate's mixed precision fp8 autocasts to bf16 (`_fp8`)
    reading.set("bf16", autocast_bf16 or fp8, file, "fp8" if fp8 and not autocast_bf16 else "bf16")
    reading.set("fp16", fp16 and not autocast_bf16, file, "fp16")
    if autocast_bf16 or data.get("bfloat16"):
        dtype, key = "bfloat16", "bf16" if autocast_bf16 else "bfloat16"
    elif data.get("load_in_8bit") or fp16 or data.get("float16"):
        dtype, key = "float16", "fp16"
    else:
        dtype, key = "float32", "bf16"
    reading.set("dtype", dtype, file, key)


def _attention(data: dict[str, Any], reading: Reading, file: str) -> None:
    if data.get("attn_implementation"):
        reading.set("attn_implementation", data["attn_implementation"], file, "attn_implementation")
        return
    for key, implementation in ATTENTION_FLAGS.items():
        if data.get(key):
            reading.set("attn_implementation", implementation, file, key)
            return
    if data.get("xformers_attention"):
        raise InputError(f"{file}: xformers_attention is not modelled; modelled: flash_attention, sdp_attention, "
                         "eager_attention")


def _adapter(data: dict[str, Any], reading: Reading, file: str) -> None:
    adapter = data.get("adapter")
    if not adapter:
        return
    if adapter not in ("lora", "qlora"):
        raise InputError(f"{file}: adapter={adapter!r} is not modelled; modelled: lora, qlora")
    reading.set("peft", adapter, file, "adapter")
    if data.get("lora_target_linear"):
        reading.set("lora_target_modules", "all-linear", file, "lora_target_linear")
    elif data.get("lora_target_modules"):
        targets = data["lora_target_modules"]
        reading.set("lora_target_modules", ",".join(targets) if isinstance(targets, list) else str(targets), file,
                    "lora_target_modules")
    if adapter == "qlora":  # loaders/model.py: nf4, double quantization, computing in the weights' dtype
        reading.set("load_in_4bit", True, file, "adapter")
        reading.set("bnb_4bit_use_double_quant", True, file, "adapter")
        reading.set("bnb_4bit_compute_dtype", reading.get("dtype"), file, "adapter")
        if "gradient_checkpointing" not in reading.values:
            reading.set("gradient_checkpointing", False, file, "gradient_checkpointing")  # axolotl's default: off


def _sharding(data: dict[str, Any], reading: Reading, file: str) -> None:
    if data.get("deepspeed"):
        from anatomist.recipe.files.trainer import read_deepspeed_reference

        read_deepspeed_reference(data["deepspeed"], reading, file, tool="axolotl")
    config = data.get("fsdp_config") or {}
    if isinstance(config, str):
        config = load_mapping(referenced_file(config, file, "fsdp_config"), "fsdp_config file")
    config = {k.removeprefix("fsdp_"): v for k, v in config.items()}
    strategies = [s for s in (data.get("fsdp") or []) if s not in ("auto_wrap", "offload")]
    if not strategies and not config:
        return
    fsdp_offload(reading, config.get("offload_params"), file, "fsdp_config.fsdp_offload_params")
    fsdp_offload(reading, "offload" in (data.get("fsdp") or []), file, "fsdp")
    if strategies:
        mode, key = fsdp_mode(strategies[0], file, "fsdp"), "fsdp"
    elif "sharding_strategy" in config:
        mode, key = fsdp_mode(config["sharding_strategy"], file, "fsdp_config.sharding_strategy"), "fsdp_config"
    else:
        key = "fsdp_config.reshard_after_forward"
        mode = fsdp_mode(config.get("reshard_after_forward", True), file, key)
    reading.set("fsdp", mode, file, key)
    if config.get("activation_checkpointing"):
        reading.set("gradient_checkpointing", True, file, "fsdp_config.activation_checkpointing")
    reading.skip_all("fsdp_config", config, keep=("reshard_after_forward", "sharding_strategy", "activation_checkpointing",
                                                  "offload_params", "version"))
