"""axolotl and LLaMA-Factory configs, as their projects publish them (tests/data/README.md), read by `--recipe`.

The expected values are the files' own (read here with yaml) and the frameworks' documented
defaults, cited where used: LLaMA-Factory hparams/finetuning_args.py (lora_rank 8, lora_alpha =
2 x rank, lora_target "all"), hparams/data_args.py (cutoff_len 2048), model_args.py
(disable_gradient_checkpointing false); axolotl loaders/model.py (qlora: nf4, double quantization,
compute in the weights' dtype), utils/config resolve_dtype (bf16 -> weights loaded in bfloat16).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from anatomist.errors import InputError
from anatomist.recipe.files import read_recipe_file

DATA = Path(__file__).parent / "data"


def test_axolotl_qlora_example() -> None:
    path = DATA / "axolotl/qlora-1b.yml"
    raw = yaml.safe_load(path.read_text())
    source = read_recipe_file(path)
    r = source.recipe
    assert (source.kind, source.model, source.seq_len) == ("axolotl", raw["base_model"], raw["sequence_len"])
    assert (r.per_device_train_batch_size, r.gradient_accumulation_steps) == (raw["micro_batch_size"], 4)
    assert (r.peft, r.lora_r, r.lora_alpha, r.lora_dropout) == ("qlora", 32, 16, 0.05)
    assert r.lora_target_modules == ",".join(raw["lora_target_modules"])
    assert r.load_in_4bit and r.bnb_4bit_use_double_quant and r.bnb_4bit_quant_type == "nf4"
    # bf16: auto on a bf16 GPU: autocast, weights loaded in bfloat16, 4-bit layers computing in bfloat16
    assert r.bf16 and r.dtype == "bfloat16" and r.bnb_4bit_compute_dtype == "bfloat16"
    assert r.gradient_checkpointing and r.attn_implementation == "flash_attention_2"
    assert r.optim == "adamw_bnb_8bit"
    assert "learning_rate" in source.not_modelled
    # sample_packing under flash_attention_2: whole samples packed into rows of sequence_len, FlashAttention's varlen
    assert r.packing and r.padding_free and "sample_packing" not in source.not_modelled


def test_axolotl_lora_with_a_deepspeed_reference(tmp_path: Path) -> None:
    raw = yaml.safe_load((DATA / "axolotl/lora-1b.yml").read_text())
    (tmp_path / "deepspeed_configs").mkdir()
    (tmp_path / "deepspeed_configs/zero3_bf16.json").write_text(
        (DATA / "axolotl/deepspeed_configs/zero3_bf16.json").read_text())
    path = tmp_path / "lora-ds.yml"
    path.write_text(yaml.safe_dump({**raw, "deepspeed": "deepspeed_configs/zero3_bf16.json"}))
    r = read_recipe_file(path).recipe
    assert (r.peft, r.load_in_4bit, r.lora_r, r.zero_stage, r.offload, r.bf16) == ("lora", False, 16, 3, "none", True)
    assert r.optim == "adamw_bnb_8bit"  # axolotl's adamw_8bit: TrainingArguments' alias


@pytest.mark.parametrize("name", ["qlora-fsdp-70b.yaml", "fft-8b-liger-fsdp.yaml"])
def test_axolotl_fsdp_with_cpu_offload_is_fsdp_s_cpu_offload(name: str) -> None:
    r = read_recipe_file(DATA / "axolotl" / name).recipe
    assert (r.fsdp, r.offload) == ("full_shard", "cpu")  # fsdp_offload_params: CPUOffloadPolicy, traced


def test_axolotl_fsdp_without_offload(tmp_path: Path) -> None:
    raw = yaml.safe_load((DATA / "axolotl/qlora-fsdp-70b.yaml").read_text())
    raw["fsdp_config"]["fsdp_offload_params"] = False
    path = tmp_path / "qlora-fsdp.yaml"
    path.write_text(yaml.safe_dump(raw))
    source = read_recipe_file(path)
    r = source.recipe
    assert (r.fsdp, r.peft, r.lora_target_modules, r.lora_r) == ("full_shard", "qlora", "all-linear", 8)
    assert source.model == "casperhansen/llama-3-70b-fp16" and source.seq_len == 512


def test_axolotl_typo_is_refused_but_an_unknown_word_is_named(tmp_path: Path) -> None:
    path = tmp_path / "a.yml"
    path.write_text("base_model: x\nmicro_batch_sise: 2\n")
    with pytest.raises(InputError, match=r"unknown key micro_batch_sise \(did you mean micro_batch_size\?\)"):
        read_recipe_file(path)
    path.write_text("base_model: x\nmicro_batch_size: 2\nmy_own_note: hello\n")
    assert "my_own_note" in read_recipe_file(path).not_modelled


def test_axolotl_dpo_runs_trls_dpo_trainer() -> None:
    """axolotl's rl: dpo builds AxolotlDPOTrainer, TRL's DPOTrainer (core/builders/rl.py), with max_length =
    sequence_len; without an adapter it loads the model again as the reference (train.py setup_reference_model)."""
    from anatomist.trace.step.trainers import needs_reference_copy
    from anatomist.workload_loader import load_workload

    path = DATA / "axolotl/qwen2-dpo.yaml"
    raw = yaml.safe_load(path.read_text())
    source = read_recipe_file(path)
    r = source.recipe
    assert (raw["rl"], r.trainer, r.peft, source.seq_len) == ("dpo", "dpo", "none", raw["sequence_len"])
    assert (r.per_device_train_batch_size, r.gradient_accumulation_steps) == (2, 4)  # pairs per device
    assert "rl" not in source.not_modelled and not r.precompute_ref_log_probs
    assert needs_reference_copy(r.resolved(load_workload("Qwen2.5-0.5B", seq_len=source.seq_len)))


def test_axolotl_dpo_with_an_adapter_keeps_no_second_model() -> None:
    from anatomist.trace.step.trainers import needs_reference_copy
    from anatomist.workload_loader import load_workload

    r = read_recipe_file(DATA / "axolotl/instruct-dpo-lora-8b.yml").recipe
    assert (r.trainer, r.peft, r.load_in_8bit, r.lora_r) == ("dpo", "lora", True, 32)
    assert not needs_reference_copy(r.resolved(load_workload("Llama-3.1-8B", seq_len=4096)))


@pytest.mark.parametrize(("change", "expected"), [
    ({"rl": "ipo"}, ("dpo", False)),  # DPOTrainer with loss_type ipo (dpo/__init__.py)
    ({"precompute_ref_log_probs": True}, ("dpo", True)),
])
def test_axolotl_dpo_variants(tmp_path: Path, change: dict, expected: tuple) -> None:
    raw = {**yaml.safe_load((DATA / "axolotl/qwen2-dpo.yaml").read_text()), **change}
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(raw))
    r = read_recipe_file(path).recipe
    assert (r.trainer, r.precompute_ref_log_probs) == expected


def test_axolotl_preference_trainers_not_modelled_are_refused() -> None:
    with pytest.raises(InputError, match=r"rl='kto' is not modelled .* modelled: dpo, ipo"):
        read_recipe_file(DATA / "axolotl/qlora-1b-kto.yaml")


LIGER = {"plugins": ["axolotl.integrations.liger.LigerPlugin"], "liger_rope": True, "liger_rms_norm": True,
         "liger_glu_activation": True, "liger_fused_linear_cross_entropy": True}
"""axolotl's liger example (fft-8b-liger-fsdp.yaml): the kernels TrainingArguments.use_liger_kernel applies."""


def test_axolotl_sample_packing_is_packing_under_flash_attention_only(tmp_path: Path) -> None:
    """Under SDPA axolotl keeps packed samples apart by a 4D mask, not modelled: named, and the rows read unpacked."""
    sdpa = read_recipe_file(_axolotl(tmp_path, "qlora-1b.yml", {"sdp_attention": True}, drop=("attn_implementation",)))
    assert sdpa.recipe.attn_implementation == "sdpa" and not sdpa.recipe.packing
    assert "sample_packing" in sdpa.not_modelled
    unpacked = read_recipe_file(_axolotl(tmp_path, "qlora-1b.yml", {"sample_packing": False}))
    assert not unpacked.recipe.packing and "sample_packing" not in unpacked.not_modelled
    with pytest.raises(InputError, match="axolotl refuses packing for RLHF"):
        read_recipe_file(_axolotl(tmp_path, "qwen2-dpo.yaml", {"sample_packing": True}))


def _axolotl(tmp_path: Path, base: str, change: dict, drop: tuple[str, ...] = ()) -> Path:
    raw = {k: v for k, v in {**yaml.safe_load((DATA / "axolotl" / base).read_text()), **change}.items() if k not in drop}
    path = tmp_path / "axolotl.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_axolotl_liger_plugin_with_the_trainer_s_four_kernels_is_use_liger_kernel(tmp_path: Path) -> None:
    source = read_recipe_file(DATA / "axolotl/fft-8b-liger-fsdp.yaml")
    assert source.recipe.use_liger_kernel
    assert not [key for key in source.not_modelled if key.startswith("liger") or key == "plugins"]
    # liger_swiglu is liger_glu_activation's old name (args.py check_deprecated_swiglu); token scaling only weights
    # the loss, and liger_layer_norm has no argument in the apply functions of the models Liger is modelled on
    renamed = {**LIGER, "liger_swiglu": True, "liger_use_token_scaling": True, "liger_layer_norm": True}
    path = _axolotl(tmp_path, "lora-1b.yml", renamed, drop=("liger_glu_activation",))
    assert read_recipe_file(path).recipe.use_liger_kernel


def test_axolotl_liger_flags_without_the_plugin_change_nothing_and_are_named(tmp_path: Path) -> None:
    path = _axolotl(tmp_path, "fft-8b-liger-fsdp.yaml", {}, drop=("plugins",))
    source = read_recipe_file(path)
    assert not source.recipe.use_liger_kernel  # axolotl loads LigerArgs only with the plugin: the flags are dropped
    assert {"liger_rope", "liger_fused_linear_cross_entropy"} <= set(source.not_modelled)
    other = _axolotl(tmp_path, "lora-1b.yml", {"plugins": ["axolotl.integrations.swanlab.SwanLabPlugin"]})
    assert "plugins" in read_recipe_file(other).not_modelled
    # a plugin whose module only begins with liger's name is another plugin: the flags beside it are dropped too
    alike = _axolotl(tmp_path, "fft-8b-liger-fsdp.yaml", {"plugins": ["axolotl.integrations.liger_x.Plugin"]})
    assert not read_recipe_file(alike).recipe.use_liger_kernel


@pytest.mark.parametrize("change", [
    {"liger_fused_linear_cross_entropy": False},  # the logits' kernel alone left out
    {"liger_fused_linear_cross_entropy": False, "liger_cross_entropy": True},
])
def test_axolotl_another_set_of_liger_kernels_is_refused(tmp_path: Path, change: dict) -> None:
    path = _axolotl(tmp_path, "lora-1b.yml", {**LIGER, **change})
    with pytest.raises(InputError, match="Liger flags .* are not modelled as a set"):
        read_recipe_file(path)


@pytest.mark.parametrize(("plugin", "setting"), [
    ("axolotl.integrations.spectrum.SpectrumPlugin", "Spectrum"),
    ("axolotl.integrations.kd.KDPlugin", "knowledge distillation"),
    ("axolotl.integrations.grokfast.GrokfastPlugin", "Grokfast"),
])
def test_axolotl_plugins_that_change_memory_are_refused(tmp_path: Path, plugin: str, setting: str) -> None:
    with pytest.raises(InputError, match=f"plugins='{plugin}' is not modelled yet \\({setting}"):
        read_recipe_file(_axolotl(tmp_path, "lora-1b.yml", {"plugins": [plugin]}))


def test_llamafactory_enable_liger_kernel_is_use_liger_kernel(tmp_path: Path) -> None:
    # model/model_utils/liger_kernel.py: apply_liger_kernel_to_<model type>() with its defaults in the sft stage
    text = (DATA / "llamafactory/qwen3_lora_sft.yaml").read_text()
    path = tmp_path / "lf.yaml"
    path.write_text(text + "\nenable_liger_kernel: true\n")
    source = read_recipe_file(path)
    assert source.recipe.use_liger_kernel and "enable_liger_kernel" not in source.not_modelled
    assert not read_recipe_file(DATA / "llamafactory/qwen3_lora_sft.yaml").recipe.use_liger_kernel


def test_llamafactory_lora_defaults() -> None:
    path = DATA / "llamafactory/qwen3_lora_sft.yaml"
    raw = yaml.safe_load(path.read_text())
    source = read_recipe_file(path)
    r = source.recipe
    assert (source.kind, source.model, source.seq_len) == ("LLaMA-Factory", raw["model_name_or_path"], 2048)
    assert (r.peft, r.lora_r, r.lora_alpha, r.lora_dropout, r.lora_target_modules) == ("lora", 8, 16, 0.0, "all-linear")
    assert (r.per_device_train_batch_size, r.gradient_accumulation_steps) == (1, 8)
    assert r.gradient_checkpointing  # LLaMA-Factory's default: on unless disable_gradient_checkpointing
    assert r.bf16 and r.dtype == "bfloat16" and not r.load_in_4bit
    for name in ("warmup_ratio", "overwrite_output_dir", "template", "dataset"):
        assert name in source.not_modelled, name


def test_llamafactory_qlora_and_deepspeed() -> None:
    qlora = read_recipe_file(DATA / "llamafactory/qwen3_lora_sft_otfq.yaml").recipe
    assert (qlora.load_in_4bit, qlora.bnb_4bit_quant_type, qlora.bnb_4bit_use_double_quant) == (True, "nf4", True)
    assert qlora.bnb_4bit_compute_dtype == "bfloat16" and qlora.peft == "lora"
    ds = json.loads((DATA / "llamafactory/examples/deepspeed/ds_z3_config.json").read_text())
    # its YAML names examples/deepspeed/ds_z3_config.json: found beside the YAML, as vendored
    full = read_recipe_file(DATA / "llamafactory/qwen3_full_sft.yaml")
    r = full.recipe
    assert r.zero_stage == ds["zero_optimization"]["stage"] == 3 and r.peft == "none"
    assert r.dtype == "float32" and r.bf16  # full fine-tuning: float32 trainable weights, bf16 autocast
    assert "zero_optimization.overlap_comm" not in full.not_modelled  # false: DeepSpeed's default


@pytest.mark.parametrize(("text", "message"), [
    ("stage: dpo\nmodel_name_or_path: x\n", "stage='dpo' is not modelled"),
    ("finetuning_type: freeze\nmodel_name_or_path: x\n", "finetuning_type='freeze' is not modelled"),
    ("finetuning_type: lora\nlora_rnk: 8\n", r"unknown key lora_rnk \(did you mean lora_rank\?\)"),
    ("finetuning_type: lora\nquantization_bit: 4\nquantization_method: hqq\n", "quantization_method='hqq' is not"),
])
def test_llamafactory_refusals(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "lf.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match=message):
        read_recipe_file(path)
