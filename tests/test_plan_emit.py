"""The emitted configs are accepted by the real libraries: transformers, accelerate, DeepSpeed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from anatomist.errors import InputError
from anatomist.plan.emit import accelerate_config, deepspeed_config, render, trainer_snippet, write
from anatomist.recipe import Recipe

RECIPES = {
    "plain": Recipe(per_device_train_batch_size=8, gradient_accumulation_steps=4),
    "fp16-ckpt-adafactor": Recipe(per_device_train_batch_size=4, fp16=True, gradient_checkpointing=True, optim="adafactor"),
    "bf16-zero2-offload": Recipe(bf16=True, zero_stage=2, offload="cpu"),
    "zero3-compile": Recipe(zero_stage=3, torch_compile=True, fp16=True),
    "fsdp": Recipe(fsdp="full_shard", bf16=True),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_trainer_kwargs_construct_training_arguments(name: str, tmp_path: Path) -> None:
    from transformers import TrainingArguments

    recipe = RECIPES[name]
    path = tmp_path / "args.json"
    write(recipe, "trainer", path)
    kwargs = json.loads(path.read_text())
    assert set(kwargs) <= set(TrainingArguments.__dataclass_fields__)
    # fp16/bf16/tf32/compile/fsdp/deepspeed need a GPU (or a process group) to construct: check those by
    # value, and construct the rest for real on this CPU-only machine.
    gpu_only = {"fp16", "bf16", "tf32", "torch_compile", "fsdp", "deepspeed"}
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             **{k: v for k, v in kwargs.items() if k not in gpu_only})
    assert args.per_device_train_batch_size == recipe.per_device_train_batch_size
    assert args.gradient_accumulation_steps == recipe.gradient_accumulation_steps
    assert args.gradient_checkpointing == recipe.gradient_checkpointing
    assert args.optim.value == recipe.optim
    assert kwargs["fp16"] == recipe.fp16 and kwargs["bf16"] == recipe.bf16
    snippet = path.with_suffix(".py").read_text()
    compile(snippet, "snippet.py", "exec")  # valid Python
    assert ("deepspeed=" in snippet) == bool(recipe.zero_stage)
    if recipe.zero_stage:  # the ds_config written beside, and named by both
        ds = path.with_name("args.ds_config.json")
        assert kwargs["deepspeed"] == ds.name and f"deepspeed={ds.name!r}" in snippet
        assert json.loads(ds.read_text())["zero_optimization"]["stage"] == recipe.zero_stage


@pytest.mark.parametrize("recipe", [Recipe(fsdp="full_shard", bf16=True),
                                    Recipe(fsdp="shard_grad_op", bf16=True, offload="cpu"),
                                    Recipe(fsdp="full_shard", bf16=True, peft="lora")],
                         ids=["full_shard", "shard_grad_op+offload", "full_shard+lora"])
def test_trainer_fsdp_arguments_make_the_fsdp2_anatomist_traces(recipe: Recipe, tmp_path: Path) -> None:
    """The installed transformers turns the emitted `fsdp` / `fsdp_config` into the FSDP plugin arguments of the
    step anatomist traces: FSDP2 (the Trainer's default before 5.10 is FSDP1), each decoder block its own unit (the
    transformer-based wrap: before 5.10 only with "auto_wrap"), resharding after forward for full_shard only, CPU
    offload where asked; PEFT's cpu_ram_efficient_loading for adapters."""
    from transformers import TrainingArguments

    kwargs = json.loads(render(recipe, "trainer"))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", fsdp=kwargs["fsdp"],
                             fsdp_config=kwargs["fsdp_config"])
    plugin = args.fsdp_plugin_args
    assert plugin["fsdp_version"] == 2
    assert plugin["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert plugin["reshard_after_forward"] is (recipe.fsdp == "full_shard")
    assert plugin.get("cpu_offload", False) is (recipe.offload == "cpu")
    assert plugin["cpu_ram_efficient_loading"] is (recipe.peft != "none")


def test_trainer_fsdp_arguments_before_transformers_5_10_are_a_string_of_options() -> None:
    from anatomist.axes.shardings import trainer_fsdp_arguments

    assert trainer_fsdp_arguments("shard_grad_op", offload=True, adapters=False, transformers_version="5.4.0") == \
        {"fsdp": "shard_grad_op auto_wrap offload", "fsdp_config": {"version": 2}}
    assert trainer_fsdp_arguments("full_shard", offload=False, adapters=False, transformers_version="5.10.0") == \
        {"fsdp": True, "fsdp_config": {"version": 2, "reshard_after_forward": True}}


@pytest.mark.parametrize("name", list(RECIPES))
def test_accelerate_config_loads_with_accelerate(name: str, tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    recipe = RECIPES[name]
    path = tmp_path / "accelerate.yaml"
    write(recipe, "accelerate", path, num_gpus=2)
    config = load_config_from_file(str(path))
    assert config.num_processes == 2
    assert config.mixed_precision == recipe.mixed_precision
    expected = "DEEPSPEED" if recipe.zero_stage else "FSDP" if recipe.fsdp != "none" else "MULTI_GPU"
    assert str(config.distributed_type).endswith(expected)
    if recipe.zero_stage:
        assert config.deepspeed_config["zero_stage"] == recipe.zero_stage
        assert config.deepspeed_config["offload_optimizer_device"] == recipe.offload
    if recipe.fsdp != "none":
        assert config.fsdp_config["fsdp_version"] == 2


@pytest.mark.parametrize("name", list(RECIPES))
def test_deepspeed_config_accepted_by_deepspeed(name: str) -> None:
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    recipe = RECIPES[name]
    ds = DeepSpeedConfig(json.loads(render(recipe, "deepspeed", num_gpus=1)))
    # 8 x 4 x 1 GPU = 32 (plain); 4 x 1 x 1 = 4 (the others)
    assert ds.train_batch_size == recipe.per_device_train_batch_size * recipe.gradient_accumulation_steps
    assert ds.zero_optimization_stage == recipe.zero_stage
    assert ds.fp16_enabled == recipe.fp16 if hasattr(ds, "fp16_enabled") else ds.float16_config.enabled == recipe.fp16
    if recipe.offload != "none":
        assert ds.zero_config.offload_optimizer.device == "cpu"


def test_transformers_reads_the_deepspeed_config() -> None:
    pytest.importorskip("deepspeed")
    from transformers.integrations import HfDeepSpeedConfig

    config = HfDeepSpeedConfig(deepspeed_config(RECIPES["zero3-compile"], num_gpus=2))
    assert config.is_zero3() and not config.is_offload()
    assert HfDeepSpeedConfig(deepspeed_config(RECIPES["bf16-zero2-offload"])).is_offload()


def test_emit_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="unknown --emit target"):
        render(Recipe(), "megatron")
    with pytest.raises(InputError, match="does not exist"):
        write(Recipe(), "deepspeed", tmp_path / "no" / "ds.json")


def test_snippet_and_configs_by_hand() -> None:
    recipe = Recipe(per_device_train_batch_size=16, gradient_accumulation_steps=2, zero_stage=2, offload="cpu", fp16=True)
    ds = deepspeed_config(recipe, num_gpus=4)
    assert ds["train_batch_size"] == 16 * 2 * 4  # = 128
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert accelerate_config(recipe, 4)["deepspeed_config"]["gradient_accumulation_steps"] == 2
    assert "per_device_train_batch_size=16" in trainer_snippet(recipe)


def test_the_snippet_loads_the_model_in_the_planned_dtype(tmp_path: Path) -> None:
    """The load dtype is a from_pretrained argument: the snippet says it, whatever the precision."""
    import ast

    for dtype in ("bfloat16", "float32"):
        recipe = Recipe(per_device_train_batch_size=4, dtype=dtype, bf16=True)
        text = trainer_snippet(recipe, model="meta-llama/Llama-3.1-8B", task="causal-lm")
        calls = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Call)
                 and getattr(n.func, "attr", "") == "from_pretrained"]
        assert len(calls) == 1
        kwargs = {k.arg: ast.literal_eval(k.value) for k in calls[0].keywords}
        assert kwargs == {"dtype": dtype}  # attention unset: transformers' own choice, as the recipe leaves it
        resolved = trainer_snippet(recipe.replace(attn_implementation="sdpa"), model="m", task="causal-lm")
        assert 'attn_implementation="sdpa"' in resolved
        assert ast.literal_eval(calls[0].args[0]) == "meta-llama/Llama-3.1-8B"
        assert "AutoModelForCausalLM" in text


@pytest.mark.parametrize("recipe", [Recipe(fsdp="full_shard", bf16=True, gradient_checkpointing=True),
                                    Recipe(fsdp="shard_grad_op", bf16=True),
                                    Recipe(fsdp="full_shard", bf16=True, offload="cpu")],
                         ids=["full_shard+checkpointing", "shard_grad_op", "full_shard+offload"])
def test_an_fsdp_config_launches_the_fsdp2_anatomist_traces(recipe: Recipe, tmp_path: Path) -> None:
    """`accelerate launch --config_file` turns the config into FSDP_* variables (prepare_multi_gpu_env) from which
    the script's FullyShardedDataParallelPlugin is built: FSDP2 (accelerate's own default is FSDP1), resharding
    after forward for full_shard and not for shard_grad_op, CPUOffloadPolicy with offload."""
    from unittest import mock

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env
    from torch.distributed.fsdp import CPUOffloadPolicy

    if "fsdp_version" not in FullyShardedDataParallelPlugin.__dataclass_fields__:  # accelerate < 1.6 (the floor: 1.3)
        pytest.skip("this accelerate has no FSDP2: its launcher would run FSDP1 whatever the config says")
    path = tmp_path / "accelerate.yaml"
    write(recipe, "accelerate", path, num_gpus=2)
    args, *_ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "train.py"]))
    with mock.patch.dict(os.environ, prepare_multi_gpu_env(args)):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is (recipe.fsdp == "full_shard")
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) == (recipe.offload == "cpu")
    assert plugin.activation_checkpointing == recipe.gradient_checkpointing


@pytest.mark.parametrize("target", ["accelerate", "trainer"])
def test_an_fsdp_config_warns_exactly_where_accelerate_would_run_fsdp1(target: str) -> None:
    """The warning stands where the installed accelerate's own plugin has no `fsdp_version` (FSDP2 came in 1.6): the
    floor venv (accelerate 1.3) sees it, the main one not; never for a recipe without FSDP."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from anatomist.plan.caveats import launch_warnings

    without_fsdp2 = "fsdp_version" not in FullyShardedDataParallelPlugin.__dataclass_fields__
    warnings = launch_warnings(Recipe(fsdp="full_shard", bf16=True), target)
    assert bool(warnings) == without_fsdp2
    assert all("FSDP1" in w for w in warnings)
    assert launch_warnings(Recipe(bf16=True), target) == []


def test_an_fsdp_config_warns_under_an_accelerate_before_1_6(monkeypatch: pytest.MonkeyPatch) -> None:
    from anatomist.plan import caveats

    monkeypatch.setattr(caveats, "installed", lambda package: "1.3.0")
    (warning,) = caveats.launch_warnings(Recipe(fsdp="shard_grad_op"), "accelerate")
    assert warning.startswith("accelerate 1.3.0 here has no FSDP2")
    assert caveats.launch_warnings(Recipe(fsdp="shard_grad_op"), "deepspeed") == []


def test_an_hsdp_config_warns_under_an_accelerate_before_1_10(monkeypatch: pytest.MonkeyPatch) -> None:
    """accelerate 1.9 has FSDP2 but no ParallelismConfig: an HSDP config would shard over every GPU there."""
    from anatomist.plan import caveats

    monkeypatch.setattr(caveats, "installed", lambda package: "1.9.0")
    (warning,) = caveats.launch_warnings(Recipe(fsdp="full_shard", dp_replicate_size=2), "accelerate")
    assert warning.startswith("accelerate 1.9.0 here has no ParallelismConfig")
    assert caveats.launch_warnings(Recipe(fsdp="full_shard"), "accelerate") == []
    monkeypatch.setattr(caveats, "installed", lambda package: "1.10.0")
    assert caveats.launch_warnings(Recipe(fsdp="full_shard", dp_replicate_size=2), "accelerate") == []


@pytest.mark.parametrize(("recipe", "gpus", "nodes", "sizes", "warning"), [
    (Recipe(fsdp="full_shard", bf16=True, dp_replicate_size=2), 16, 2, (2, 8, 1, 1, 1), "HSDP (2 replicas"),
    (Recipe(fsdp="full_shard", bf16=True, cp_size=4), 8, 1, (1, 2, 1, 4, 1), "context parallel 4 is accelerate's"),
    (Recipe(zero_stage=3, bf16=True, sp_size=4), 8, 1, (2, 1, 1, 1, 4), "sequence parallel 4 is accelerate's"),
], ids=["hsdp", "context-parallel", "sequence-parallel"])
def test_a_parallelism_config_launches_accelerate_s_and_reads_back(tmp_path: Path, recipe: Recipe, gpus: int,
                                                                    nodes: int, sizes: tuple[int, ...],
                                                                    warning: str) -> None:
    """HSDP on 2 nodes of 8 (the plan's `hsdp`: 2 replicas of shard groups of 8), context parallel 4 on 8 GPUs
    (dp_shard 2 x cp 4, FSDP2 over both) and DeepSpeed's sequence parallel 4 on 8 (2 groups of 4, ZeRO over all):
    accelerate's launcher turns the config's parallelism_config into the PARALLELISM_CONFIG_* variables from which the
    script's ParallelismConfig is built, with these (dp_replicate, dp_shard, tp, cp, sp) sizes (and for sequence
    parallel the DeepSpeedSequenceParallelConfig DeepSpeed needs: SDPA, any length); `--recipe` reads the layout back;
    the trainer's .py builds the same ParallelismConfig, and its JSON, which cannot hold one, says so."""
    from unittest import mock

    ParallelismConfig = pytest.importorskip("accelerate.parallelism_config", reason="accelerate < 1.10 (the floor "
                                            "venv): the warning's test above covers it").ParallelismConfig
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    from anatomist.plan.caveats import launch_warnings
    from anatomist.recipe.files import read_recipe_file

    def layout(c: Any) -> tuple[int, ...]:
        return (c.dp_replicate_size, c.dp_shard_size, c.tp_size, c.cp_size, c.sp_size)

    path = tmp_path / "accelerate.yaml"
    write(recipe, "accelerate", path, num_gpus=gpus, nodes=nodes)
    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path),
                                                                                      "train.py"]))
    if recipe.zero_stage:  # as launch_command does before deepspeed_launcher
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    env = prepare_deepspeed_cmd_env(args)[1] if recipe.zero_stage else prepare_multi_gpu_env(args)
    with mock.patch.dict(os.environ, env):
        assert os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
        config = ParallelismConfig()
    assert layout(config) == sizes
    if recipe.sp_size > 1:
        assert (config.sp_backend, config.sp_handler.sp_attn_implementation) == ("deepspeed", "sdpa")
    read = read_recipe_file(path).recipe
    assert (read.dp_replicate_size, read.cp_size, read.sp_size) == (recipe.dp_replicate_size, recipe.cp_size,
                                                                    recipe.sp_size)
    snippet = trainer_snippet(recipe, gpus, model="m", task="causal-lm")
    built = eval(snippet.split("parallelism_config=")[1].splitlines()[0].rstrip(","),
                 {"ParallelismConfig": ParallelismConfig, "DeepSpeedSequenceParallelConfig": DeepSpeedSequenceParallelConfig})
    assert layout(built) == sizes
    assert "from accelerate import ParallelismConfig" in snippet
    assert any(warning in w and "ParallelismConfig" in w for w in launch_warnings(recipe, "trainer"))
    assert not any("ParallelismConfig" in w for w in launch_warnings(recipe, "accelerate"))
