"""`--recipe FILE` reads the configuration people already have, written here by the real libraries.

TrainingArguments.to_json_string(), TRL's SFTConfig/ModelConfig dumped as `trl sft --config`
reads them, accelerate's own ClusterConfig.to_yaml_file and write_basic_config, and the
DeepSpeed / accelerate / trainer files anatomist's `plan --emit` writes (emit.write). What a user
sees is checked through the CLI in-process: the exit code, the recipe in --json, the stderr line.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from anatomist.errors import InputError
from anatomist.plan.emit import write
from anatomist.recipe import Recipe
from anatomist.recipe.files import read_recipe_file
from anatomist.workload_loader import load_workload

A100 = ("--gpu", "A100-80GB")


def _note(stderr: str) -> str:
    """The one stderr line, which must be the recipe file's note."""
    (line,) = stderr.strip().splitlines()
    assert line.startswith("anatomist: note: "), line
    return line.removeprefix("anatomist: note: ")


@pytest.mark.slow
def test_training_arguments_json_as_transformers_writes_it(cli, tiny_model, tmp_path: Path) -> None:
    from transformers import TrainingArguments

    # disable_tqdm: __post_init__ sets it from the log level, which the tests raise to "error"
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=4, gradient_checkpointing=True, optim="adafactor",
                             learning_rate=3e-5, max_grad_norm=0.5, report_to="none", disable_tqdm=False)
    path = tmp_path / "training_args.json"
    path.write_text(args.to_json_string())

    result = cli("estimate", str(tiny_model("bert")), "--recipe", str(path), "--json")
    assert result.returncode == 0, result.stderr
    recipe = json.loads(result.stdout)["recipe"]
    assert (recipe["per_device_train_batch_size"], recipe["gradient_accumulation_steps"]) == (2, 4)
    assert recipe["gradient_checkpointing"] is True and recipe["optim"] == "adafactor"
    assert recipe["max_grad_norm"] == 0.5
    # Every other field set away from its default is named once; the ~100 at their defaults are counted.
    assert re.fullmatch(rf"{re.escape(str(path))} \(TrainingArguments\): not modelled: output_dir, learning_rate; "
                        r"\d+ more at their defaults", _note(result.stderr))


@pytest.mark.slow
def test_flags_given_override_the_file_and_flags_not_given_do_not(cli, tiny_model, tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("per_device_train_batch_size: 4\ngradient_checkpointing: true\nfsdp: shard_grad_op\n")
    result = cli("estimate", str(tiny_model("bert")), "--recipe", str(path), "--batch-size", "1",
                 "--no-gradient-checkpointing", "--json")
    assert result.returncode == 0, result.stderr
    recipe = json.loads(result.stdout)["recipe"]
    assert recipe["per_device_train_batch_size"] == 1 and recipe["gradient_checkpointing"] is False
    assert recipe["fsdp"] == "shard_grad_op"  # no --fsdp given: the file's stays
    assert result.stderr == ""  # anatomist's own keys: nothing left out, nothing said


@pytest.mark.slow
def test_trl_sft_config_yaml_names_the_model_and_sequence_length(cli, tiny_model, tmp_path: Path) -> None:
    """What `trl sft --config sft.yaml` reads: SFTConfig + ModelConfig fields; TRL's defaults where silent."""
    from trl import ModelConfig, SFTConfig

    model = tiny_model("llama")
    # bf16 is left unset: TRL turns it on (not fp16); use_cpu lets SFTConfig build on this CPU machine
    sft = SFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_length=64, use_cpu=True,
                    report_to="none")
    model_args = ModelConfig(model_name_or_path=str(model), dtype="bfloat16", use_peft=True, lora_r=8,
                             lora_target_modules=["q_proj", "v_proj"])
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({**sft.to_dict(), **dataclasses.asdict(model_args)}))

    result = cli("estimate", "--recipe", str(path), *A100, "--json")  # no MODEL: the file's
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["seq_len"] == 64 and out["trainable_parameters"] < out["parameters"]
    recipe = out["recipe"]
    assert recipe["peft"] == "lora" and recipe["lora_r"] == 8 and recipe["lora_target_modules"] == "q_proj,v_proj"
    assert recipe["dtype"] == "bfloat16" and recipe["bf16"] is True
    assert recipe["gradient_checkpointing"] is True  # SFTConfig's default, not TrainingArguments'
    assert recipe["lora_dropout"] == 0.05  # ModelConfig's default, not PEFT's 0
    note = _note(result.stderr)
    assert note.startswith(f"{path} (TRL): not modelled: ") and "use_cpu" in note and "output_dir" in note
    assert "model_name_or_path" not in note and "max_length" not in note


def test_hand_written_trl_yaml_with_qlora(tmp_path: Path) -> None:
    path = tmp_path / "sft.yaml"
    path.write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\ndataset_name: trl-lib/Capybara\nlearning_rate: 2.0e-4\n"
                    "use_peft: true\nload_in_4bit: true\nuse_bnb_nested_quant: true\nlora_target_modules: all-linear\n")
    source = read_recipe_file(path)
    assert (source.kind, source.model, source.seq_len) == ("TRL", "Qwen/Qwen2.5-0.5B", 1024)  # SFTConfig.max_length
    r = source.recipe
    assert r.peft == "lora" and r.load_in_4bit and r.bnb_4bit_use_double_quant
    # trl's get_quantization_config computes in ModelConfig.dtype, whose default is float32
    assert r.dtype == "float32" and r.bnb_4bit_compute_dtype == "float32" and r.bf16
    assert source.not_modelled == ("dataset_name", "learning_rate")


@pytest.mark.slow
def test_accelerate_config_written_by_accelerate(cli, tiny_model, tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import ComputeEnvironment, DistributedType

    path = tmp_path / "accelerate.yaml"
    ClusterConfig(compute_environment=ComputeEnvironment.LOCAL_MACHINE, distributed_type=DistributedType.DEEPSPEED,
                  mixed_precision="bf16", use_cpu=False, debug=False, num_processes=4,
                  deepspeed_config={"zero_stage": 3, "offload_optimizer_device": "none", "offload_param_device": "none",
                                    "gradient_accumulation_steps": 2, "zero3_init_flag": True}).to_yaml_file(path)

    result = cli("estimate", str(tiny_model("llama")), "--recipe", str(path), *A100, "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    recipe = out["recipe"]
    assert (recipe["zero_stage"], recipe["offload"], recipe["bf16"], recipe["gradient_accumulation_steps"]) == (
        3, "none", True, 2)
    # num_processes is the number of devices ZeRO-3 shards across: DeepSpeed's bf16 weights, 2 B x the
    # partition of the parameters over 4 devices and the gathered ones (up to stage3_max_live_parameters, 1e9: all
    # here), both flat buffers, plus those it keeps whole (at most 10 x hidden = 640 elements: the norms), each a
    # tensor of its own that the caching allocator rounds up to 512 B
    import math

    import torch

    with torch.device("meta"):
        numels = [p.numel() for p in load_workload(str(tiny_model("llama"))).build_model().parameters()]
    persistent = [n for n in numels if n <= 640]
    partitioned = sum(numels) - sum(persistent)
    kept_whole = sum(math.ceil(2 * n / 512) * 512 for n in persistent)
    assert out["memory"]["weights"] == 2 * (math.ceil(partitioned / 4) + partitioned) + kept_whole
    assert _note(result.stderr) == f"{path} (accelerate): not modelled: deepspeed_config.zero3_init_flag; " \
                                   f"{_count_at_default(path)} more at their defaults"


def _count_at_default(path: Path) -> int:
    return read_recipe_file(path).at_default


def test_accelerate_default_config_of_this_machine(tmp_path: Path) -> None:
    """`accelerate config default` on a machine without a GPU writes use_cpu: true, which is named."""
    from accelerate.utils import write_basic_config

    path = tmp_path / "default_config.json"
    write_basic_config(mixed_precision="fp16", save_location=str(path))
    source = read_recipe_file(path)
    assert source.kind == "accelerate" and source.recipe.fp16 and not source.recipe.bf16
    assert source.num_gpus == json.loads(path.read_text())["num_processes"]
    expected = ("use_cpu",) if json.loads(path.read_text())["use_cpu"] else ()
    assert source.not_modelled == expected


# The recipes test_plan_emit.py writes for each library, and what each format carries of them.
EMITTED = {
    "plain": Recipe(per_device_train_batch_size=8, gradient_accumulation_steps=4),
    "fp16-ckpt-adafactor": Recipe(per_device_train_batch_size=4, fp16=True, gradient_checkpointing=True,
                                  optim="adafactor"),
    "bf16-zero2-offload": Recipe(bf16=True, zero_stage=2, offload="cpu", gradient_accumulation_steps=2),
    "zero3-compile": Recipe(zero_stage=3, torch_compile=True, fp16=True, per_device_train_batch_size=2),
    "fsdp": Recipe(fsdp="full_shard", bf16=True, gradient_checkpointing=True),
}
CARRIED = {
    "deepspeed": ("per_device_train_batch_size", "gradient_accumulation_steps", "max_grad_norm", "fp16", "bf16",
                  "zero_stage", "offload"),
    "accelerate": ("fp16", "bf16", "zero_stage", "offload", "fsdp", "torch_compile"),
    "trainer": ("per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "fp16", "bf16",
                "optim", "torch_compile", "dataloader_num_workers", "dataloader_pin_memory", "max_grad_norm", "fsdp"),
}


@pytest.mark.parametrize("target", list(CARRIED))
@pytest.mark.parametrize("name", list(EMITTED))
def test_what_plan_emits_reads_back_as_the_same_recipe(target: str, name: str, tmp_path: Path) -> None:
    recipe = EMITTED[name]
    path = tmp_path / ("ds_config.json" if target == "deepspeed" else f"{target}.{'yaml' if target == 'accelerate' else 'json'}")
    write(recipe, target, path, num_gpus=2)
    source = read_recipe_file(path)
    assert source.kind == {"deepspeed": "DeepSpeed", "accelerate": "accelerate", "trainer": "TrainingArguments"}[target]
    for field in CARRIED[target]:
        assert getattr(source.recipe, field) == getattr(recipe, field), field
    if target != "trainer":
        assert source.num_gpus == 2
    if target == "accelerate" and recipe.zero_stage:  # its deepspeed_config carries the accumulation
        assert source.recipe.gradient_accumulation_steps == recipe.gradient_accumulation_steps


def test_deepspeed_auto_values_come_from_the_training_arguments(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    }))
    path = tmp_path / "args.yaml"
    path.write_text("per_device_train_batch_size: 4\nbf16: true\nnum_train_epochs: 1\ndeepspeed: ds.json\n")
    source = read_recipe_file(path)  # ds.json is found beside args.yaml
    r = source.recipe
    assert (r.per_device_train_batch_size, r.bf16, r.zero_stage, r.offload) == (4, True, 3, "cpu")
    assert source.not_modelled == ("num_train_epochs",)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"args.yaml": "per_device_train_batch_size: 4\ndeepspeed: ds.json\n",
          "ds.json": '{"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}}'},
         "{ds.json}: train_micro_batch_size_per_gpu=8 conflicts with {args.yaml}'s per_device_train_batch_size=4"),
        ({"args.yaml": "deepspeed: ds.json\n", "ds.json": '{"fp16": {"enabled": true}}'},
         "{ds.json}: fp16.enabled=True conflicts with {args.yaml}'s fp16=False (TrainingArguments' default"),
        ({"ds.json": '{"zero_optimization": {"stage": 4}}'}, "{ds.json}: zero_optimization.stage must be 0, 1, 2 or 3"),
        ({"ds.json": '{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}'},
         "{ds.json}: zero_optimization.offload_optimizer.device='cpu' with zero_optimization.offload_param.device="
         "'none' is not modelled"),
        ({"ds.json": '{"train_micro_batch_size_per_gpu": 0, "zero_optimization": {"stage": 1}}'},
         "{ds.json}: per_device_train_batch_size must be greater than 0, got 0 (from train_micro_batch_size_per_gpu)"),
        ({"ds.json": '{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 12}'},
         "{ds.json}: train_batch_size=12 is not a multiple of micro-batch 4 x accumulation 2"),
        ({"acc.yaml": "distributed_type: MULTI_GPU\nmixed_precision: fp8\nfp8_config:\n  backend: MSAMP\n"},
         "{acc.yaml}: fp8_config.backend=MSAMP is not modelled"),
        ({"acc.yaml": "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n"},
         "{acc.yaml}: fsdp_config.fsdp_sharding_strategy='HYBRID_SHARD' is not a sharding anatomist models"),
        ({"args.yaml": "optim: lion_32bit\n"}, "{args.yaml}: unknown optim 'lion_32bit'"),
        ({"args.yaml": "fp16: true\nbf16: true\n"}, "{args.yaml}: fp16 and bf16 are mutually exclusive"),
        ({"args.yaml": "per_device_train_batch_size: 2\nlearning_rte: 3\n"}, "{args.yaml}: unknown key learning_rte (did you mean learning_rate?)"),
        ({"args.yaml": "lora_r: eight\n"}, "{args.yaml}: field lora_r must be int, got 'eight'"),
        ({"args.yaml": "deepspeed: missing.json\n"}, "{args.yaml}: deepspeed names 'missing.json', which does not exist"),
    ],
    ids=["batch-mismatch", "precision-mismatch", "stage-4", "stage3-offload-half", "micro-0", "world-size",
         "fp8", "hybrid-shard", "optim", "fp16-bf16", "typo", "type", "missing-deepspeed-file"],
)
def test_bad_or_conflicting_values_exit_2_naming_the_file_and_field(cli, tmp_path: Path, files: dict, message: str):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    first = tmp_path / next(iter(files))
    result = cli("estimate", "--recipe", str(first))
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    expected = message
    for name in files:
        expected = expected.replace("{" + name + "}", str(tmp_path / name))
    assert line.startswith(f"anatomist: error: {expected}"), line


def test_recipe_files_own_keys_keep_working(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"per_device_train_batch_size": 2, "peft": "qlora", "lora_target_modules": "q_proj,v_proj",
                                "zero_stage": 0, "dtype": "bfloat16"}))
    source = read_recipe_file(path)
    assert source.kind == "anatomist" and source.note() is None
    assert source.recipe == Recipe.with_presets(per_device_train_batch_size=2, peft="qlora",
                                                lora_target_modules="q_proj,v_proj", dtype="bfloat16")


def test_unreadable_file_is_one_input_error(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("- a list\n- not a mapping\n")
    with pytest.raises(InputError, match=r"must hold a mapping of fields, not list"):
        read_recipe_file(path)


def test_a_recipe_is_read_from_a_pipe(tmp_path: Path):
    """`--recipe <(...)` hands the shell's pipe: read as a file is."""
    import os
    import threading

    fifo = tmp_path / "recipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_text, args=("gradient_checkpointing: true\nbf16: true\n",))
    writer.start()
    recipe = read_recipe_file(fifo)
    writer.join()
    assert recipe.fields == {"gradient_checkpointing": True, "bf16": True}


def test_a_refusal_names_the_file_s_own_key_not_a_field_its_name_spells(tmp_path: Path) -> None:
    """The line adds the file's own key for a Recipe field the message names (axolotl's optimizer for optim); a field
    whose name the file's name happens to hold (fsdp in muon-pretrain-fsdp2.yaml) is not named by the message."""
    path = tmp_path / "muon-pretrain-fsdp2.yaml"
    path.write_text("base_model: x\noptimizer: muon\nfsdp_version: 2\nfsdp_config:\n  reshard_after_forward: true\n")
    with pytest.raises(InputError) as error:
        read_recipe_file(path)
    assert str(error.value).startswith(f"{path}: unknown optim 'muon'")
    assert str(error.value).endswith("(from optimizer)")
