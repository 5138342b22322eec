"""Recipe files read as strictly as their own tools read them, on real files (tests/data/README.md).

The truth for "strict" is the tool itself: accelerate's ClusterConfig.from_yaml_file and
DeepSpeed's pydantic section models are run on the same typo'd file and must refuse it too. The
truth for what a real file sets is the file, read here with yaml/json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from anatomist.errors import InputError
from anatomist.recipe_files import read_recipe_file

DATA = Path(__file__).parent / "data"


def _error(cli, path: Path) -> str:
    result = cli("estimate", "--recipe", str(path))
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("anatomist: error: "), line
    return line.removeprefix("anatomist: error: ")


def test_alignment_handbook_qlora_recipe_is_read_with_its_older_and_own_fields() -> None:
    path = DATA / "alignment-handbook/zephyr-7b-beta_sft_config_qlora.yaml"
    raw = yaml.safe_load(path.read_text())
    source = read_recipe_file(path)
    r = source.recipe
    assert (source.kind, source.model, source.seq_len) == ("TRL", raw["model_name_or_path"], raw["max_seq_length"])
    assert (r.per_device_train_batch_size, r.gradient_accumulation_steps) == (4, 2)
    assert r.gradient_checkpointing and r.bf16 and r.dtype == "bfloat16" and r.attn_implementation == "flash_attention_2"
    assert (r.peft, r.load_in_4bit, r.lora_r, r.lora_alpha, r.lora_dropout) == ("lora", True, 16, 16, 0.05)
    assert r.lora_target_modules == ",".join(raw["lora_target_modules"])
    # fields of older TrainingArguments (warmup_ratio, overwrite_output_dir) and the handbook's own script
    # arguments (chat_template, dataset_mixture): real fields, named as not modelled
    for name in ("warmup_ratio", "overwrite_output_dir", "chat_template", "dataset_mixture"):
        assert name in source.not_modelled, name


@pytest.mark.parametrize("name", ["zephyr-7b-beta_dpo_config_full.yaml", "smollm2_sft_config.yaml"])
def test_other_handbook_recipes_are_accepted(name: str) -> None:
    path = DATA / "alignment-handbook" / name
    raw = yaml.safe_load(path.read_text())
    source = read_recipe_file(path)
    assert source.model == raw["model_name_or_path"]
    assert source.recipe.per_device_train_batch_size == raw["per_device_train_batch_size"]
    assert source.recipe.gradient_accumulation_steps == raw["gradient_accumulation_steps"]
    assert "warmup_ratio" in source.not_modelled


@pytest.mark.parametrize(("name", "stage", "fsdp"), [
    ("alignment-handbook/accelerate_configs_zero3.yaml", 3, "none"),
    ("alignment-handbook/accelerate_configs_fsdp.yaml", 0, "full_shard"),
    ("trl/zero3.yaml", 3, "none"),
    ("trl/fsdp2.yaml", 0, "full_shard"),  # FSDP2: fsdp_reshard_after_forward true is full sharding
    ("peft/deepspeed_config_z3_qlora.yaml", 3, "none"),
])
def test_real_accelerate_configs(name: str, stage: int, fsdp: str) -> None:
    path = DATA / name
    raw = yaml.safe_load(path.read_text())
    source = read_recipe_file(path)
    assert source.kind == "accelerate" and source.num_gpus == raw["num_processes"]
    assert (source.recipe.zero_stage, source.recipe.fsdp) == (stage, fsdp)
    assert source.recipe.bf16 == (raw["mixed_precision"] == "bf16")


def test_accelerate_top_level_typo_is_refused_as_accelerate_refuses_it(cli, tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import ClusterConfig

    path = tmp_path / "zero3.yaml"
    path.write_text((DATA / "trl/zero3.yaml").read_text().replace("mixed_precision:", "mixed_precison:"))
    with pytest.raises(ValueError, match="unknown keys"):  # accelerate launch's own reading of the file
        ClusterConfig.from_yaml_file(str(path))
    assert _error(cli, path) == (f"{path}: unknown key mixed_precison (did you mean mixed_precision?): not a key of "
                                 "accelerate's config (ClusterConfig): accelerate launch refuses it too")


def test_accelerate_section_typo_is_refused(cli, tmp_path: Path) -> None:
    path = tmp_path / "fsdp2.yaml"
    path.write_text((DATA / "trl/fsdp2.yaml").read_text().replace("fsdp_reshard_after_forward", "fsdp_reshard_after_fwd"))
    assert _error(cli, path).startswith(f"{path}: unknown key fsdp_config.fsdp_reshard_after_fwd (did you mean "
                                        "fsdp_config.fsdp_reshard_after_forward?)")


def test_deepspeed_typos_are_refused_as_deepspeed_refuses_them(cli, tmp_path: Path) -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    config = json.loads((DATA / "llamafactory/examples/deepspeed/ds_z3_config.json").read_text())
    top = tmp_path / "top.json"
    top.write_text(json.dumps({**{k: v for k, v in config.items() if k != "zero_optimization"},
                               "zero_optimisation": config["zero_optimization"]}))
    assert _error(cli, top).startswith(f"{top}: unknown key zero_optimisation (did you mean zero_optimization?)")

    section = {**config["zero_optimization"], "stage3_prefetch_bucket_sise": 1}
    with pytest.raises(ValidationError, match="stage3_prefetch_bucket_sise"):  # DeepSpeed's own model
        DeepSpeedZeroConfig(**section)
    nested = tmp_path / "nested.json"
    nested.write_text(json.dumps({**config, "zero_optimization": section}))
    assert _error(cli, nested).startswith(f"{nested}: unknown key zero_optimization.stage3_prefetch_bucket_sise "
                                          "(did you mean zero_optimization.stage3_prefetch_bucket_size?)")


def test_training_arguments_typo_names_the_closest_field(cli, tmp_path: Path) -> None:
    path = tmp_path / "args.yaml"
    path.write_text("per_device_train_batch_size: 2\nwarmup_rato: 0.1\n")
    assert _error(cli, path).startswith(f"{path}: unknown key warmup_rato (did you mean warmup_ratio?)")


@pytest.mark.parametrize(("name", "text", "message"), [
    # line 3 `  b: 2` is indented under a scalar: PyYAML's mark points at its colon, column 4 (1-based)
    ("bad.yaml", "a: 1\nc: 2\n  b: 2\n", "{path}:3:4: recipe file is not valid YAML: mapping values are not allowed here"),
    # line 3, column 8: the value missing after "b":
    ("bad.json", '{\n  "a": 1,\n  "b": }\n', "{path}:3:8: recipe file is not valid JSON: Expecting value"),
    ("empty.yaml", "# nothing but a comment\n", "recipe file '{path}' is empty"),
    ("empty.json", "", "recipe file '{path}' is empty"),
])
def test_syntax_errors_say_file_line_and_column(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InputError) as error:
        read_recipe_file(path)
    assert str(error.value) == message.format(path=path)


def test_format_is_told_by_content_not_suffix(tmp_path: Path) -> None:
    json_in_yaml = tmp_path / "ds.yaml"
    shutil.copy(DATA / "axolotl/deepspeed_configs/zero3_bf16.json", json_in_yaml)
    yaml_in_txt = tmp_path / "accelerate.txt"
    shutil.copy(DATA / "trl/zero3.yaml", yaml_in_txt)
    assert read_recipe_file(json_in_yaml).recipe.zero_stage == 3
    assert read_recipe_file(yaml_in_txt).kind == "accelerate"


def _with(path: Path, target: Path, change: dict) -> Path:
    """`path`'s mapping with `change` merged in (one level deep), written to `target` in the same format."""
    data = yaml.safe_load(path.read_text())
    for key, value in change.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    target.write_text(json.dumps(data) if path.suffix == ".json" else yaml.safe_dump(data))
    return target


def test_memory_settings_not_modelled_yet_are_refused_never_predicted_as_something_else(cli, tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import ClusterConfig

    # PEFT's FSDP + QLoRA example offloads parameters to the CPU: FSDP's CPUOffloadPolicy, which is modelled
    assert read_recipe_file(DATA / "peft/fsdp_config_qlora.yaml").recipe.offload == "cpu"
    # LLaMA-Factory's DeepSpeed AutoTP config: tensor parallel over 2 ranks
    autotp = DATA / "llamafactory/examples/deepspeed/ds_z2_autotp_config.json"
    assert _error(cli, autotp).startswith(f"{autotp}: tensor_parallel.autotp_size=2 is not modelled yet (tensor "
                                          "parallel: it would be predicted as plain data parallel)")
    fp16_master = _with(DATA / "axolotl/deepspeed_configs/zero3_bf16.json", tmp_path / "ds.json",
                        {"bf16": {"enabled": False}, "fp16": {"enabled": True, "fp16_master_weights_and_grads": True}})
    assert _error(cli, fp16_master).startswith(f"{fp16_master}: fp16.fp16_master_weights_and_grads=True is not "
                                               "modelled yet")
    tp = _with(DATA / "trl/fsdp2.yaml", tmp_path / "tp.yaml",
               {"parallelism_config": {"parallelism_config_dp_shard_size": 4, "parallelism_config_tp_size": 2}})
    ClusterConfig.from_yaml_file(str(tp))  # a key accelerate reads
    assert _error(cli, tp).startswith(f"{tp}: parallelism_config.parallelism_config_tp_size=2 is not modelled yet")
    dp_only = _with(DATA / "trl/fsdp2.yaml", tmp_path / "dp.yaml",
                    {"parallelism_config": {"parallelism_config_dp_shard_size": 8, "parallelism_config_tp_size": 1}})
    assert read_recipe_file(dp_only).recipe.fsdp == "full_shard"  # sizes of 1 turn nothing on


@pytest.mark.parametrize(("name", "text", "message"), [
    # TrainingArguments 4.50's tp_size and 4.57+'s parallelism_config (accelerate's ParallelismConfig sizes)
    ("args.yaml", "tp_size: 2\n", "tp_size=2 is not modelled yet (tensor parallel"),
    ("args.yaml", "parallelism_config:\n  cp_size: 2\n", "parallelism_config.cp_size=2 is not modelled yet (context"),
    # axolotl's offload to disk (TRL's activation offloading is modelled: tests/test_activation_offloading.py)
    ("ax.yml", "base_model: x\ngradient_checkpointing: offload_disk\n",
     "gradient_checkpointing='offload_disk' is not modelled"),
    # TRL's selective checkpointing (SFTTrainer: the attention outputs kept)
    ("sft.yaml", "max_length: 512\ngradient_checkpointing: true\ngradient_checkpointing_kwargs:\n  selective: true\n",
     "gradient_checkpointing_kwargs.selective=True is not modelled yet"),
    ("ds.json", '{"zero_optimization": {"stage": 2}, "sequence_parallel_size": 4}', "sequence_parallel_size=4 is not"),
    ("ds.json", '{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true, "fp16_master_weights_and_grads": true}}',
     "fp16.fp16_master_weights_and_grads=True is not modelled yet"),
])
def test_each_unmodelled_setting_is_one_line(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InputError) as error:
        read_recipe_file(path)
    assert str(error.value).startswith(f"{path}: {message}")


@pytest.mark.parametrize(("name", "text", "every", "offload"), [
    # transformers 5.23's activation_checkpointing_kwargs (and the deprecated gradient_checkpointing_kwargs alias)
    ("args.yaml", "activation_checkpointing: true\nactivation_checkpointing_kwargs:\n  every_n_layers: 2\n", 2, False),
    ("args.yaml", "gradient_checkpointing: true\ngradient_checkpointing_kwargs: '{\"offload\": true}'\n", 1, True),
    ("args.yaml", "gradient_checkpointing: false\ngradient_checkpointing_kwargs:\n  every_n_layers: 2\n", 1, False),
    # axolotl's hidden_states offload and LLaMA-Factory's Unsloth checkpointing: the checkpoints' inputs on the host
    ("ax.yml", "base_model: x\ngradient_checkpointing: true\nactivation_offloading: hidden_states\n", 1, True),
    ("lf.yaml", "stage: sft\nfinetuning_type: lora\nuse_unsloth_gc: true\n", 1, True),
])
def test_partial_and_offloaded_checkpointing_are_read(tmp_path: Path, name: str, text: str, every: int,
                                                      offload: bool) -> None:
    path = tmp_path / name
    path.write_text(text)
    r = read_recipe_file(path).recipe
    assert (r.checkpoint_every, r.checkpoint_offload) == (every, offload)
    assert r.gradient_checkpointing == ("false" not in text)


@pytest.mark.parametrize("text", ["fsdp: full_shard offload auto_wrap\n",
                                  "fsdp: full_shard\nfsdp_config:\n  offload_params: true\n",
                                  "fsdp: full_shard\nfsdp_config:\n  cpu_offload: true\n"])
def test_fsdp_offload_in_training_arguments_is_fsdp_s_cpu_offload(text: str, tmp_path: Path) -> None:
    """TrainingArguments' "offload" option and fsdp_config's offload_params / cpu_offload (transformers 5 maps the
    option onto cpu_offload) turn on CPUOffloadPolicy, which trace/sharded.py traces: offload="cpu"."""
    path = tmp_path / "args.yaml"
    path.write_text(text)
    r = read_recipe_file(path).recipe
    assert (r.fsdp, r.offload) == ("full_shard", "cpu")
