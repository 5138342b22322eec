"""Recipe files read as strictly as their own tools read them, on real files (tests/data/README.md).

The truth for "strict" is the tool itself: accelerate's ClusterConfig.from_yaml_file and
DeepSpeed's pydantic section models are run on the same typo'd file and must refuse it too. The
truth for what a real file sets is the file, read here with yaml/json.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from anatomist.errors import InputError
from anatomist.recipe.files import read_recipe_file
from anatomist.workload_loader import load_workload

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
    ClusterConfig.from_yaml_file(str(tp))  # a key accelerate reads: tensor parallel under its FSDP2 is refused
    assert _error(cli, tp).startswith(f"{tp}: tensor parallel 2 under accelerate's FSDP2 is not modelled")
    alone = _with(DATA / "accelerate/examples/config_yaml_templates/multi_gpu.yaml", tmp_path / "tp_alone.yaml",
                  {"parallelism_config": {"parallelism_config_tp_size": 2}})
    ClusterConfig.from_yaml_file(str(alone))
    assert (read_recipe_file(alone).recipe.tp_size, read_recipe_file(alone).recipe.fsdp) == (2, "none")
    dp_only = _with(DATA / "trl/fsdp2.yaml", tmp_path / "dp.yaml",
                    {"parallelism_config": {"parallelism_config_dp_shard_size": 8, "parallelism_config_tp_size": 1}})
    assert read_recipe_file(dp_only).recipe.fsdp == "full_shard"  # sizes of 1 turn nothing on


@pytest.mark.parametrize(("name", "text", "message"), [
    # TrainingArguments 4.57+'s parallelism_config (accelerate's ParallelismConfig sizes; tensor, context and sequence
    # parallel are modelled, not tensor parallel under accelerate's FSDP)
    ("args.yaml", "fsdp: full_shard\nparallelism_config:\n  tp_size: 2\n",
     "tensor parallel 2 under accelerate's FSDP2 is not modelled"),
    # axolotl's offload to disk (TRL's activation offloading is modelled: tests/test_activation_offloading.py)
    ("ax.yml", "base_model: x\ngradient_checkpointing: offload_disk\n",
     "gradient_checkpointing='offload_disk' is not modelled"),
    # TRL's selective checkpointing (SFTTrainer: the attention outputs kept)
    ("sft.yaml", "max_length: 512\ngradient_checkpointing: true\ngradient_checkpointing_kwargs:\n  selective: true\n",
     "gradient_checkpointing_kwargs.selective=True is not modelled yet"),
    ("ds.json", '{"zero_optimization": {"stage": 2}, "sequence_parallel_size": 4}', "sequence_parallel_size=4 is not"),
    ("ds.json", '{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true, "fp16_master_weights_and_grads": true}}',
     "fp16.fp16_master_weights_and_grads=True is not modelled yet"),
    # DeepSpeed's ZenFlow, and an optimizer of its own whose states are not Adam's
    ("ds.json", '{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": '
                '0.1}}}', "zero_optimization.zenflow={'topk_ratio': 0.1} is not modelled yet (DeepSpeed's ZenFlow"),
    ("ds.json", '{"optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 1}}',
     "optimizer.type='Lamb' is not modelled yet (an optimizer anatomist does not model"),
    # accelerate's FSDP ignored modules (kept whole on every rank)
    ("acc.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_ignored_modules: model.visual\n",
     "fsdp_config.fsdp_ignored_modules='model.visual' is not modelled yet (FSDP's ignored modules"),
    # axolotl: reward models, frozen subsets, LISA, modules trained beside the adapter, DoRA, BitNet, a GPTQ base
    ("ax.yml", "base_model: x\nreward_model: true\n", "reward_model=True is not modelled yet (reward modelling"),
    ("ax.yml", "base_model: x\nprocess_reward_model: true\n", "process_reward_model=True is not modelled yet (reward"),
    ("ax.yml", "base_model: x\nunfrozen_parameters: ['^lm_head.*']\n", "unfrozen_parameters=['^lm_head.*'] is not"),
    ("ax.yml", "base_model: x\nlisa_n_layers: 1\nlisa_step_interval: 20\n", "lisa_n_layers=1 is not modelled yet"),
    ("ax.yml", "base_model: x\nadapter: lora\nlora_modules_to_save: [lm_head]\n",
     "lora_modules_to_save=['lm_head'] is not modelled yet (whole modules trained beside the adapter"),
    ("ax.yml", "base_model: x\nadapter: lora\npeft_use_dora: true\n", "peft_use_dora=True is not modelled yet (DoRA"),
    ("ax.yml", "base_model: x\nuse_onebitllms: true\n", "use_onebitllms=True is not modelled yet (BitNet"),
    ("ax.yml", "base_model: x\ngptq: true\n", "gptq=True is not modelled yet (a base model quantized ahead"),
    ("ax.yml", "base_model: x\nplugins: [axolotl.integrations.llm_compressor.LLMCompressorPlugin]\n",
     "plugins='axolotl.integrations.llm_compressor.LLMCompressorPlugin' is not modelled yet (sparse fine-tuning"),
    # LLaMA-Factory: optimizers of its own, LLaMA Pro, DoRA, modules trained beside LoRA, fp8, Unsloth
    *[("lf.yaml", f"stage: sft\nfinetuning_type: full\n{key}: true\n", f"{key}=True is not modelled yet (an optimizer")
      for key in ("use_galore", "use_apollo", "use_badam", "use_adam_mini", "use_muon")],
    ("lf.yaml", "stage: sft\nfinetuning_type: lora\nuse_llama_pro: true\n", "use_llama_pro=True is not modelled yet"),
    ("lf.yaml", "stage: sft\nfinetuning_type: lora\nuse_dora: true\n", "use_dora=True is not modelled yet (DoRA"),
    ("lf.yaml", "stage: sft\nfinetuning_type: lora\nadditional_target: embed_tokens\n",
     "additional_target='embed_tokens' is not modelled yet (whole modules"),
    ("lf.yaml", "stage: sft\nfinetuning_type: lora\nfp8: true\n", "fp8=True is not modelled yet (FP8"),
    ("lf.yaml", "stage: sft\nfinetuning_type: lora\nuse_unsloth: true\n", "use_unsloth=True is not modelled yet"),
    # TRL's ModelConfig: modules trained beside the adapter, DoRA (read only with use_peft, as get_peft_config)
    ("sft.yaml", "max_length: 512\nuse_peft: true\nlora_modules_to_save: [lm_head]\n",
     "lora_modules_to_save=['lm_head'] is not modelled yet"),
    ("sft.yaml", "max_length: 512\nuse_peft: true\nuse_dora: true\n", "use_dora=True is not modelled yet (DoRA"),
])
def test_each_unmodelled_setting_is_one_line(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InputError) as error:
        read_recipe_file(path)
    assert str(error.value).startswith(f"{path}: {message}")


@pytest.mark.parametrize(("name", "text", "key"), [
    ("acc.yaml", "distributed_type: MULTI_GPU\nnum_processes: 2\nparallelism_config:\n  parallelism_config_tp_size: two\n",
     "parallelism_config.parallelism_config_tp_size"),
    ("args.yaml", "parallelism_config:\n  tp_size: -2\n", "parallelism_config.tp_size"),
])
def test_a_tensor_parallel_size_is_a_whole_number(tmp_path: Path, name: str, text: str, key: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InputError) as error:
        read_recipe_file(path)
    assert str(error.value).startswith(f"{path}: {key} must be a whole number of at least 1")


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
    option onto cpu_offload) turn on CPUOffloadPolicy, which trace/step/fsdp.py traces: offload="cpu"."""
    path = tmp_path / "args.yaml"
    path.write_text(text)
    r = read_recipe_file(path).recipe
    assert (r.fsdp, r.offload) == ("full_shard", "cpu")


# -- DeepSpeed's bounds, as the installed DeepSpeed has them -----------------------------------------------------

def _live_models() -> dict[str, type]:
    import importlib

    from anatomist.deepspeed_bounds import MODELS

    return {section: getattr(importlib.import_module(module), name) for section, (module, name) in MODELS.items()}


def test_anatomist_s_deepspeed_bounds_are_the_installed_deepspeed_s_field_by_field() -> None:
    """Every bounded number of DeepSpeed's validated sections, read off its pydantic models' own metadata (not
    through anatomist's reader): the same key, type and limits in what anatomist checks against. A DeepSpeed release
    that moves a bound fails here until data/deepspeed_keys.json is written again (scripts/deepspeed_keys.py)."""
    import annotated_types
    import deepspeed

    from anatomist.deepspeed_bounds import deepspeed_bounds, shipped

    bounds = deepspeed_bounds()
    assert bounds.version == deepspeed.__version__
    for section, model in _live_models().items():
        expected = {}
        for name, info in model.model_fields.items():
            limits = tuple((limit, getattr(m, limit)) for m in info.metadata for limit in ("gt", "ge", "lt", "le")
                           if isinstance(m, getattr(annotated_types, limit.capitalize())))
            for key in {name, info.alias} - {None}:
                if limits:
                    expected[key] = ("int" if info.annotation is int else "float", limits)
        got = {key: (b.type, b.limits) for key, b in bounds.sections[section].items()}
        assert got == expected, section
    version, _ = shipped()
    assert version == deepspeed.__version__, "data/deepspeed_keys.json is another release's: run scripts/deepspeed_keys.py"


PROBES = (-1, 0, 1, 2.5, 5e8, 1e9, True, False, "500", "5e8", " 7 ", "auto", None, [1])


@pytest.mark.parametrize("key", ["reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                                 "stage3_max_live_parameters", "stage3_max_reuse_distance",
                                 "stage3_param_persistence_threshold", "sub_group_size"])
def test_a_zero_value_is_taken_exactly_where_deepspeed_takes_it(key: str, tmp_path: Path) -> None:
    """DeepSpeed's own DeepSpeedZeroConfig against anatomist's reader, value by value: each accepts what the other
    does, and reads the same number (5e8 -> 500000000; "auto" is DeepSpeed's default, or the Trainer's fill)."""
    import deepspeed
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    path = tmp_path / "ds.json"
    for value in PROBES:
        try:
            taken = getattr(DeepSpeedZeroConfig(stage=3, **{key: value}), key.removeprefix("stage3_"))
        except ValidationError:
            taken = None
        path.write_text(json.dumps({"zero_optimization": {"stage": 3, key: value}}))
        try:
            read = read_recipe_file(path).recipe
        except InputError as error:
            assert taken is None, (key, value, str(error))
            assert str(error).startswith(f"{path}: zero_optimization.{key} must be ")
            assert f"(deepspeed {deepspeed.__version__} refuses {value!r})" in str(error)
            continue
        assert taken is not None, (key, value)
        if value != "auto" and hasattr(read, key):
            assert getattr(read, key) == taken, (key, value)


def test_offload_ratios_are_bounded_as_deepspeed_bounds_them(tmp_path: Path) -> None:
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        DeepSpeedZeroOffloadOptimizerConfig(device="cpu", ratio=1.5)
    DeepSpeedZeroOffloadOptimizerConfig(device="cpu", ratio=0.3)
    path = tmp_path / "ds.json"
    for ratio, refused in ((1.5, True), (0.3, False)):
        path.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                                           "ratio": ratio}}}))
        if refused:
            with pytest.raises(InputError, match=r"offload_optimizer.ratio must be a number >= 0 and <= 1"):
                read_recipe_file(path)
        else:
            assert read_recipe_file(path).recipe.offload == "cpu"


TRANSFORMERS_ZERO3 = DATA / "transformers/ds_config_zero3.json"


def test_transformers_zero3_config_is_refused_as_the_installed_deepspeed_refuses_it(cli, tiny_model) -> None:
    """transformers' own test config sets reduce_bucket_size 0, which deepspeed 0.19.8 refuses (gt=0): so does
    anatomist, naming the release; under a release without that bound the file is read (next test)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    zero = json.loads(TRANSFORMERS_ZERO3.read_text())["zero_optimization"]
    bound = DeepSpeedZeroConfig.model_fields["reduce_bucket_size"].metadata
    if not any(getattr(m, "gt", None) == 0 for m in bound):
        pytest.skip("this deepspeed takes reduce_bucket_size 0")
    with pytest.raises(ValidationError, match="reduce_bucket_size"):
        DeepSpeedZeroConfig(**zero)
    import deepspeed

    assert _error(cli, TRANSFORMERS_ZERO3) == (
        f"{TRANSFORMERS_ZERO3}: zero_optimization.reduce_bucket_size must be a whole number > 0 (deepspeed "
        f"{deepspeed.__version__} refuses 0)")
    result = cli("estimate", str(tiny_model("llama")), "--reduce-bucket-size", "0", "--zero-stage", "3", "--gpu",
                 "A100-80GB")
    assert result.returncode == 2 and "reduce_bucket_size must be a whole number > 0" in result.stderr


def test_under_a_deepspeed_that_takes_a_zero_reduce_bucket_there_is_no_bucket(
        tiny_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """deepspeed 0.19.5 declares reduce_bucket_size ge=0 (runtime/zero/config.py at tag v0.19.5). Its stage3.py
    then allocates the bucket as torch.empty(reduce_bucket_size) (no bytes) and, since no gradient fits in it
    (`__add_grad_to_ipg_bucket`), reduces each gradient on its own from its own storage once the next one arrives:
    the estimate holds no bucket. Here the installed release is taken to be 0.19.5, its bounds kept in the cache as
    deepspeed_bounds keeps an installed release's."""
    from anatomist import deepspeed_bounds as module
    from anatomist.anatomy import MemoryCategory
    from anatomist.estimate.memory import estimate_memory
    from anatomist.hardware import get_gpu

    monkeypatch.setenv("ANATOMIST_CACHE_DIR", str(tmp_path / "cache"))
    _, table = module.shipped()
    table["zero_optimization"]["reduce_bucket_size"] = {"type": "int", "limits": [["ge", 0]]}
    kept = tmp_path / "cache" / "deepspeed-bounds" / "deepspeed-0.19.5.json"
    kept.parent.mkdir(parents=True)
    kept.write_text(json.dumps(table))
    monkeypatch.setattr(module, "installed_version", lambda: "0.19.5")
    module.deepspeed_bounds.cache_clear()
    try:
        source = read_recipe_file(TRANSFORMERS_ZERO3)
        assert (source.recipe.zero_stage, source.recipe.reduce_bucket_size, source.recipe.offload) == (3, 0, "cpu")
        workload = load_workload(str(tiny_model("llama")), seq_len=32)

        def functionality(bucket: int) -> int:
            recipe = source.recipe.replace(reduce_bucket_size=bucket).resolved(workload)
            memory = estimate_memory(workload, recipe, get_gpu("A100-80GB"), num_gpus=2)
            return memory.anatomy.category_bytes(MemoryCategory.FUNCTIONALITY)

        # fp16: one bucket of 1,000 two-byte gradients more than none
        assert functionality(1_000) - functionality(0) == 1_000 * 2
    finally:
        module.deepspeed_bounds.cache_clear()


def test_an_installed_deepspeed_of_another_release_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from anatomist import deepspeed_bounds as module

    shipped = module.deepspeed_bounds().sections
    monkeypatch.setenv("ANATOMIST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(module, "installed_version", lambda: "0.0.0+other")
    module.deepspeed_bounds.cache_clear()
    try:
        bounds = module.deepspeed_bounds()  # read off the installed models (the same classes as the shipped table's)
        assert bounds.version == "0.0.0+other" and bounds.sections == shipped
        kept = tmp_path / "deepspeed-bounds" / "deepspeed-0.0.0+other.json"
        assert kept.is_file()
        module.deepspeed_bounds.cache_clear()
        monkeypatch.setattr(module, "_read_installed", lambda: pytest.fail("read again"))
        assert module.deepspeed_bounds().sections == shipped  # from the file kept
    finally:
        module.deepspeed_bounds.cache_clear()


@pytest.mark.parametrize("version", [3, "two"])
def test_an_fsdp_version_is_taken_exactly_where_accelerate_takes_it(version, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """accelerate launch hands fsdp_version to its plugin through FSDP_VERSION, read with int(): 3 is taken (and
    runs FSDP1's code, as any version but 2), "two" stops it. anatomist takes and refuses the same."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = tmp_path / "fsdp.yaml"
    path.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP",
                                    "num_processes": 2, "fsdp_config": {"fsdp_version": version,
                                                                        "fsdp_reshard_after_forward": "FULL_SHARD"}}))
    args, *_ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    for key, value in prepare_multi_gpu_env(args).items():
        monkeypatch.setenv(key, value)
    try:
        taken = FullyShardedDataParallelPlugin().fsdp_version
    except ValueError:
        taken = None
    if taken is None:
        with pytest.raises(InputError, match="fsdp_config.fsdp_version must be a whole number"):
            read_recipe_file(path)
    else:
        assert taken == version and read_recipe_file(path).recipe.fsdp == "full_shard"


# -- DeepSpeed's top level and compile section, as DeepSpeed reads them -------------------------------------------

def _deepspeed_takes(config: dict) -> bool:
    import contextlib
    import io

    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            DeepSpeedConfig(config)
    except Exception:  # DeepSpeedConfigError, pydantic's ValidationError
        return False
    return True


def test_the_removed_features_are_the_installed_deepspeed_s() -> None:
    """DeepSpeed refuses the keys of features it removed with a message of its own (runtime/config.py); the table
    anatomist keeps (scripts/deepspeed_keys.py) is the installed release's, message for message less the link."""
    import deepspeed
    from deepspeed.runtime import config as runtime_config

    from anatomist.recipe.files.known import deepspeed_release, deepspeed_removed

    if deepspeed.__version__ != deepspeed_release():
        pytest.skip(f"the table is deepspeed {deepspeed_release()}'s")
    for section, name in (("top_level", "_REMOVED_TOP_LEVEL_CONFIG_KEYS"), ("zero_optimization", "_REMOVED_ZERO_CONFIG_KEYS")):
        live = getattr(runtime_config, name)
        assert deepspeed_removed(section) == {key: message.split(" See http")[0].strip() for key, message in live.items()}


@pytest.mark.parametrize(("config", "key"), [
    ({"train_micro_batch_size_per_gpu": 1, "sparse_attention": {"mode": "fixed"}}, "sparse_attention"),
    ({"train_micro_batch_size_per_gpu": 1, "amp": {"enabled": True}}, "amp"),
    ({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "mics_shard_size": 8}},
     "zero_optimization.mics_shard_size"),
])
def test_a_removed_feature_is_refused_as_deepspeed_refuses_it(tmp_path: Path, config: dict, key: str) -> None:
    assert not _deepspeed_takes(config)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.raises(InputError, match=rf"^{re.escape(str(path))}: {re.escape(key)}: .* has been removed.* "
                                         r"\(deepspeed [\d.]+ refuses it\)$"):
        read_recipe_file(path)


def test_a_top_level_key_deepspeed_ignores_is_named_and_only_a_typo_refused(tmp_path: Path) -> None:
    """DeepSpeed reads its top level key by key and ignores the rest: a key it ignores is named as not modelled (the
    ImageNet example's cuda_visible_devices), one a letter or two off a key it reads is refused, for DeepSpeed would
    ignore it and train without what was meant."""
    path = tmp_path / "ds.json"
    ignored = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, "cuda_visible_devices": 1,
               "monitor_config": {"enabled": True}}
    assert _deepspeed_takes(ignored)
    path.write_text(json.dumps(ignored))
    source = read_recipe_file(path)
    assert source.recipe.zero_stage == 1
    assert {"cuda_visible_devices", "monitor_config"} <= set(source.not_modelled)
    path.write_text(json.dumps({**ignored, "optimiser": {"type": "AdamW"}}))
    with pytest.raises(InputError, match=r"unknown key optimiser \(did you mean optimizer\?\).*it would ignore it"):
        read_recipe_file(path)


@pytest.mark.parametrize(("compile_section", "taken"), [({"deepcompile": False}, True),
                                                        ({"disable": False, "backend": "inductor"}, False)])
def test_the_compile_section_is_held_to_deepspeed_s_model(tmp_path: Path, compile_section: dict, taken: bool) -> None:
    """deepspeed 0.19's CompileConfig forbids keys it lacks: the `disable`/`backend` of older releases (axolotl's
    zero1_torch_compile.json) are refused by it and by anatomist."""
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, "compile": compile_section}
    assert _deepspeed_takes(config) == taken
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    if taken:
        assert read_recipe_file(path).recipe.zero_stage == 1
    else:
        with pytest.raises(InputError, match=r"unknown key compile.disable: not a key of DeepSpeed's compile section"):
            read_recipe_file(path)


@pytest.mark.parametrize(("kind", "read"), [("AdamW", True), ("Adam", True), ("adamw", True), ("OneBitAdam", False),
                                            ("Lamb", False), ("Adagrad", False)])
def test_a_deepspeed_optimizer_is_read_only_where_its_states_are_adam_s(tmp_path: Path, kind: str, read: bool) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": kind, "params": {"lr": 1e-5}}, "zero_optimization": {"stage": 2}}))
    if read:
        assert read_recipe_file(path).recipe.zero_stage == 2
    else:
        with pytest.raises(InputError, match=f"optimizer.type={kind!r} is not modelled yet"):
            read_recipe_file(path)


def test_an_fsdp_key_accelerate_reads_without_a_launch_option_is_known(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """accelerate launch has no --fsdp_ignored_modules option, but the environment it prepares reads the key from the
    config (utils/launch.py: FSDP_IGNORED_MODULES): no typo. Unset, it reads; set, the modules stay whole on every
    rank, which is not modelled."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = tmp_path / "fsdp.yaml"
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_processes": 2,
              "fsdp_config": {"fsdp_version": 2, "fsdp_ignored_modules": "model.visual"}}
    path.write_text(yaml.safe_dump(config))
    args, *_ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    assert prepare_multi_gpu_env(args)["FSDP_IGNORED_MODULES"] == "model.visual"
    with pytest.raises(InputError, match="fsdp_config.fsdp_ignored_modules='model.visual' is not modelled yet"):
        read_recipe_file(path)
    config["fsdp_config"]["fsdp_ignored_modules"] = None
    path.write_text(yaml.safe_dump(config))
    assert read_recipe_file(path).recipe.fsdp == "full_shard"
