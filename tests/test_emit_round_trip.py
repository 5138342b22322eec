"""What `plan --emit` writes reads back, through `--recipe`, as the recipe the plan chose, with its memory.

Each target holds what its format can say: TRL's YAML the whole recipe (SFTConfig / DPOConfig, ModelConfig and the
ds_config it names); the Trainer's JSON, for a recipe of TRL's trainers, SFTConfig's or DPOConfig's keyword
arguments with the model's load arguments (the adapters and quantization are its .lora.json / .bnb.json); a
DeepSpeed or accelerate config its library's settings only. What a target does not hold is given to `estimate`
as flags, as a user running that library's config gives it to their training script; the rest must come back
from the file as the plan had it, and the estimate must be the plan's within 1%.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from anatomist.plan.caveats import launch_warnings
from anatomist.plan.emit import launch_commands, render, trainer_snippet, write
from anatomist.recipe import Recipe
from anatomist.recipe.files import read_recipe_file
from anatomist.workload_loader import load_workload

ALL = frozenset(f.name for f in dataclasses.fields(Recipe))
ADAPTERS = frozenset({"peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit",
                      "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype"})
DEEPSPEED = frozenset({"per_device_train_batch_size", "gradient_accumulation_steps", "max_grad_norm", "fp16", "bf16",
                       "zero_stage", "offload", "reduce_bucket_size", "allgather_bucket_size",
                       "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                       "stage3_param_persistence_threshold"})
HOLDS = {
    "trl": ALL,
    "trainer": ALL - ADAPTERS,  # LoraConfig and BitsAndBytesConfig: the .lora.json and .bnb.json beside it
    "deepspeed": DEEPSPEED,
    "accelerate": frozenset({"fp16", "bf16", "zero_stage", "offload", "fsdp", "torch_compile"}),
}
"""The Recipe fields each target's file holds, for a recipe of TRL's trainers."""

RECIPES = {
    "dpo-full": Recipe.with_presets(trainer="dpo", dtype="bfloat16", bf16=True, per_device_train_batch_size=2,
                                    gradient_accumulation_steps=4, gradient_checkpointing=True),
    "dpo-lora-precomputed": Recipe.with_presets(trainer="dpo", peft="lora", lora_r=8, dtype="bfloat16", bf16=True,
                                                precompute_ref_log_probs=True, lora_target_modules="q_proj,v_proj"),
    "dpo-qlora-zero3": Recipe.with_presets(trainer="dpo", peft="qlora", zero_stage=3, bf16=True,
                                           activation_offloading=True),
    "dpo-zero2-offload": Recipe.with_presets(trainer="dpo", zero_stage=2, offload="cpu", bf16=True, optim="adamw_torch",
                                             reduce_bucket_size=1_000_000),
    "sft-packing-fsdp": Recipe.with_presets(trainer="sft", packing=True, attn_implementation="flash_attention_2",
                                            fsdp="full_shard", bf16=True, dtype="bfloat16", use_liger_kernel=True),
    "sft-lora-checkpoint-every-2": Recipe.with_presets(trainer="sft", peft="lora", checkpoint_every=2, fp16=True),
}


def _normal(recipe: Recipe, workload: Any) -> dict[str, Any]:
    """The recipe's resolved fields, as memory sees them: QLoRA is LoRA over a 4-bit base whichever way a file says
    it; TRL loads a 4-bit base in its compute dtype (the only dtype its YAML says) and prepare_model_for_kbit_training
    casts what is not quantized to fp32 whatever it was loaded in; adapter settings without adapters configure
    nothing. The estimates of plan and file are compared by `_round_trip`."""
    return _comparable(dataclasses.asdict(recipe.resolved(workload)))


def _comparable(fields: dict[str, Any]) -> dict[str, Any]:
    fields = dict(fields)
    if fields["peft"] == "qlora":
        fields["peft"] = "lora"
    if fields["load_in_4bit"]:
        fields.pop("dtype")
    if fields["peft"] == "none":
        for name in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"):
            fields.pop(name)
    return fields


def _file_name(target: str) -> str:
    return {"trl": "run.yaml", "trainer": "args.json", "deepspeed": "ds.json", "accelerate": "acc.yaml"}[target]


@pytest.fixture
def llama(tiny_model) -> Path:
    return tiny_model("llama", num_hidden_layers=3)


@pytest.mark.parametrize("target", ["trl", "trainer"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_a_trl_recipe_reads_back_as_itself(target: str, name: str, llama: Path, tmp_path: Path) -> None:
    recipe = RECIPES[name]
    written = write(recipe, target, tmp_path / _file_name(target), 2, model=str(llama), task="causal-lm", seq_len=64)
    source = read_recipe_file(written[0])
    assert source.kind == "TRL" and source.recipe.trainer == recipe.trainer
    assert source.seq_len == (None if recipe.padding_free and not recipe.packing else 64)
    assert source.model == (str(llama) if target == "trl" else None)  # the Trainer's snippet names it
    workload = load_workload(str(llama), seq_len=64)
    planned, read = _normal(recipe, workload), _normal(source.recipe, workload)
    held = {k for k in planned if k in HOLDS[target]}
    assert {k: read[k] for k in held} == {k: planned[k] for k in held}
    assert (recipe.zero_stage > 0) == any(p.name.endswith(".ds_config.json") for p in written)


@pytest.mark.parametrize("target", ["deepspeed", "accelerate"])
def test_a_library_config_of_a_trl_recipe_holds_its_settings_and_the_plan_says_the_rest_is_not_there(
        target: str, llama: Path, tmp_path: Path) -> None:
    recipe = RECIPES["dpo-zero2-offload"]
    source = read_recipe_file(write(recipe, target, tmp_path / _file_name(target), 2)[0])
    workload = load_workload(str(llama), seq_len=64)
    planned, read = _normal(recipe, workload), _normal(source.recipe, workload)
    assert {k: read[k] for k in HOLDS[target]} == {k: planned[k] for k in HOLDS[target]}
    assert source.recipe.trainer == "trainer"  # a DeepSpeed / accelerate config cannot say DPO ...
    (warning,) = launch_warnings(recipe, target)  # ... and the plan says where it is said
    assert "DPOTrainer" in warning and "--emit trl" in warning


def test_the_dpo_yaml_is_dpoconfig_as_trl_dpo_parses_it(tmp_path: Path) -> None:
    """The fields a DPO run is told by, read by TRL's own parser into DPOConfig: the loss anatomist computes (beta,
    loss_type: DPOConfig's defaults in trl 1.16), max_length, and how the reference model is held."""
    from trl import DPOConfig, ModelConfig, ScriptArguments, TrlParser

    recipe = RECIPES["dpo-full"]
    path = write(recipe, "trl", tmp_path / "dpo.yaml", model="Qwen/Qwen2.5-0.5B", seq_len=512, prompt_len=128)[0]
    text = path.read_text()
    assert text.splitlines()[0].startswith("# trl dpo --config dpo.yaml")
    assert "second copy of the weights" in text and "--prompt-len 128" in text
    _, args, model = TrlParser((ScriptArguments, DPOConfig, ModelConfig)).parse_args_and_config(
        args=["--config", str(path), "--use_cpu", "true"])
    defaults = DPOConfig(output_dir="x", use_cpu=True)
    assert (args.beta, args.loss_type) == (defaults.beta, defaults.loss_type)
    assert args.max_length == 512 and args.precompute_ref_log_probs is False
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    assert model.dtype == "bfloat16" and not model.use_peft
    assert "max_prompt_length" not in DPOConfig.__dataclass_fields__  # trl 1.0 removed it: nothing to write


@pytest.mark.parametrize("name", ["dpo-full", "dpo-qlora-zero3", "sft-packing-fsdp"])
def test_the_trainer_json_of_a_trl_recipe_builds_its_config(name: str, tmp_path: Path) -> None:
    """The JSON is SFTConfig's / DPOConfig's keyword arguments; the snippet hands them and the model's name to
    SFTTrainer / DPOTrainer, with the LoRA and quantization configs as trl/scripts/dpo.py does."""
    import ast

    import trl

    recipe = RECIPES[name]
    path = write(recipe, "trainer", tmp_path / "args.json", 2, model="Qwen/Qwen2.5-0.5B", task="causal-lm")[0]
    kwargs = json.loads(path.read_text())
    config = getattr(trl, f"{recipe.trainer.upper()}Config")
    gpu_only = {"deepspeed", "fsdp", "fsdp_config"}  # they need a process group or DeepSpeed's accelerator here
    args = config(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                  **{k: v for k, v in kwargs.items() if k not in gpu_only})
    assert args.model_init_kwargs["dtype"] == kwargs["model_init_kwargs"]["dtype"]
    snippet = path.with_suffix(".py").read_text()
    tree = ast.parse(snippet)
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "").endswith("Trainer")]
    given = {k.arg for k in call.keywords}
    assert call.func.id == f"{recipe.trainer.upper()}Trainer"  # type: ignore[attr-defined]
    assert ("peft_config" in given) == (recipe.peft != "none")
    assert ("quantization_config" in given) == recipe.load_in_4bit
    assert (f"deepspeed={path.stem}.ds_config.json" in snippet.replace("'", "")) == bool(recipe.zero_stage)


@pytest.mark.parametrize(("gpus", "nodes"), [(1, 1), (4, 1), (8, 2)])
def test_the_run_command_is_what_trl_s_cli_launches(gpus: int, nodes: int, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`trl dpo --config FILE [accelerate launch's options]`: TRL's own CLI (trl/cli/main.py) parses the YAML as
    DPOConfig and hands the rest to `accelerate launch` with trl/scripts/dpo.py; the launch is stopped there."""
    from trl.cli import accelerate_launcher
    from trl.cli.main import main

    folder = tmp_path / "out"
    folder.mkdir()
    path = write(RECIPES["dpo-zero2-offload"], "trl", folder / "dpo.yaml", gpus, model="m", seq_len=64, nodes=nodes)[0]
    commands = launch_commands(RECIPES["dpo-zero2-offload"], "trl", path, gpus, nodes)
    assert len(commands) == nodes
    launched: list[Any] = []
    launch = accelerate_launcher.launch_training_script
    monkeypatch.setattr(accelerate_launcher, "launch_training_script",
                        lambda *args, **kwargs: launch(*args, **kwargs, launch_command_fn=launched.append))
    for command in commands:
        cd, run = command.split(" && ")
        monkeypatch.chdir(shlex.split(cd)[1])  # the ds_config is named from the YAML's folder, as TRL opens it
        words = shlex.split(run)
        assert words[:4] == ["trl", "dpo", "--config", "dpo.yaml"]
        assert main([*words[1:], "--use_cpu", "true"]) == 0
    assert [Path(a.training_script).name for a in launched] == ["dpo.py"] * nodes
    assert {a.num_processes for a in launched} == ({gpus} if gpus > 1 else {None})
    if nodes > 1:
        assert [(a.machine_rank, a.num_machines) for a in launched] == [(rank, nodes) for rank in range(nodes)]


def test_a_dpo_file_that_does_not_bound_its_sequences_is_one_line(cli, llama: Path, tmp_path: Path) -> None:
    path = tmp_path / "dpo.yaml"
    path.write_text(f"model_name_or_path: {llama}\nbeta: 0.1\nmax_length: null\n")
    result = cli("estimate", "--recipe", str(path), "--gpu", "A100-80GB")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line == (f"anatomist: error: {path}: max_length: null leaves DPO's sequence length to the data "
                    "(DPOTrainer pads each batch of pairs to its longest): set max_length, the tokens of prompt and "
                    "completion it keeps")
    path.write_text(f"model_name_or_path: {llama}\nmax_length: null\nper_device_train_batch_size: 2\n")
    assert read_recipe_file(path).recipe.trainer == "sft"  # SFT: padding-free runs take no max_length


def test_a_trainer_recipe_written_for_trl_says_it_becomes_sft() -> None:
    (warning,) = launch_warnings(Recipe(bf16=True), "trl")
    assert "SFTTrainer" in warning and "--trainer sft" in warning
    assert launch_warnings(RECIPES["dpo-full"], "trl") == launch_warnings(RECIPES["dpo-full"], "trainer") == []
    assert "--trainer" not in render(Recipe(), "trainer") and "Trainer(" not in trainer_snippet(Recipe())


# -- plan -> emit -> estimate --recipe, through the CLI ------------------------------------------------------------

def _flags(recipe: dict[str, Any], held: frozenset[str]) -> list[str]:
    """The recipe flags for the fields a target's file does not hold: what its user tells the training script."""
    flags = []
    for name, value in recipe.items():
        if name in held or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        flags += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
    return flags


def _round_trip(cli, plan_args: list[str], estimate_args: list[str], tmp_path: Path,
                targets: tuple[str, ...] = ("trl", "trainer", "deepspeed", "accelerate")) -> None:
    proc = cli("plan", *plan_args, "--json")
    assert proc.returncode == 0, proc.stderr
    best = json.loads(proc.stdout)["best"]
    planned = best["memory"]["device_total"]
    for target in targets:
        path = tmp_path / _file_name(target)
        emitted = cli("plan", *plan_args, "--emit", target, "-o", str(path))
        assert emitted.returncode == 0, emitted.stderr
        flags = _flags(best["recipe"], HOLDS[target])
        result = cli("estimate", *estimate_args, "--recipe", str(path), *flags, "--json")
        assert result.returncode == 0, (target, result.stderr)
        out = json.loads(result.stdout)
        assert _comparable(out["recipe"]) == _comparable(best["recipe"]), target
        assert out["memory"]["device_total"] == pytest.approx(planned, rel=0.01), target


@pytest.mark.slow
def test_a_dpo_plan_emitted_for_each_target_estimates_as_planned(cli, llama: Path, tmp_path: Path) -> None:
    """Full fine-tuning DPO on 2 GPUs under ZeRO-3 (the reference a second, sharded copy), prompts of 16 tokens."""
    common = ["--seq-len", "64", "--prompt-len", "16", "--gpu", "A100-80GB", "--gpus", "2"]
    plan_args = [str(llama), *common, "--global-batch-size", "8", "--trainer", "dpo", "--shardings", "zero3",
                 "--optims", "adamw_torch_fused", "--no-compile", "--precisions", "bf16-weights", "--no-liger-kernel"]
    _round_trip(cli, plan_args, [str(llama), *common], tmp_path)


@pytest.mark.slow
def test_an_sft_plan_with_lora_emitted_for_each_target_estimates_as_planned(cli, llama: Path, tmp_path: Path) -> None:
    common = ["--seq-len", "64", "--gpu", "A100-80GB"]
    plan_args = [str(llama), *common, "--global-batch-size", "4", "--trainer", "sft", "--peft", "qlora",
                 "--optims", "adamw_torch_fused", "--no-compile", "--no-liger-kernel"]
    _round_trip(cli, plan_args, [str(llama), *common], tmp_path)


@pytest.mark.slow
def test_a_catalog_dpo_plan_written_for_trl_estimates_as_planned(cli, tmp_path: Path) -> None:
    """Qwen2.5-0.5B, DPO with LoRA on one card: the YAML alone (and the prompt length) gives the plan's figure."""
    plan_args = ["Qwen2.5-0.5B", "--seq-len", "512", "--prompt-len", "128", "--gpu", "A10G", "--global-batch-size",
                 "8", "--trainer", "dpo", "--peft", "lora", "--optims", "adamw_torch_fused", "--no-compile",
                 "--no-liger-kernel", "--precisions", "bf16-weights"]
    _round_trip(cli, plan_args, ["--gpu", "A10G", "--prompt-len", "128"], tmp_path, targets=("trl",))
