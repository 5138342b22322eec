"""A recipe is settled once, at the entry points: presets filled in where the user is silent, the
load dtype made concrete for the model, TrainingArguments' defaults read once per version."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from anatomist.errors import InputError
from anatomist.recipe import QLORA_PRESET, Recipe, ResolvedRecipe
from anatomist.workload_loader import load_workload


def test_a_recipe_never_rewrites_what_it_is_given() -> None:
    with pytest.raises(InputError, match=r"peft=qlora is LoRA on a 4-bit base: set load_in_4bit=True"):
        Recipe(peft="qlora")


def test_presets_fill_only_what_the_user_left_unset() -> None:
    qlora = Recipe.with_presets(peft="qlora")
    assert {name: getattr(qlora, name) for name in QLORA_PRESET} == QLORA_PRESET
    mine = Recipe.with_presets(peft="qlora", gradient_checkpointing=False, bnb_4bit_compute_dtype="float16")
    assert (mine.gradient_checkpointing, mine.bnb_4bit_compute_dtype, mine.load_in_4bit) == (False, "float16", True)


def test_the_command_line_keeps_an_explicit_flag_over_the_preset(cli) -> None:
    result = cli("estimate", "Qwen2.5-0.5B", "--peft", "qlora", "--no-gradient-checkpointing", "--seq-len", "64",
                 "--batch-size", "1", "--gpu", "A100-80GB", "--json")
    assert result.returncode == 0, result.stderr
    recipe = json.loads(result.stdout)["recipe"]
    assert (recipe["gradient_checkpointing"], recipe["load_in_4bit"], recipe["bnb_4bit_use_double_quant"]) == (
        False, True, True)


def test_resolving_makes_the_dtype_the_configs(tiny_model) -> None:
    workload = load_workload(str(tiny_model("llama", dtype="bfloat16")), seq_len=16)
    resolved = Recipe(bf16=True).resolved(workload)
    assert isinstance(resolved, ResolvedRecipe) and resolved.dtype == "bfloat16"
    assert Recipe(dtype="float32").resolved(workload).dtype == "float32"
    assert resolved.replace(per_device_train_batch_size=2).__class__ is ResolvedRecipe
    with pytest.raises(TypeError, match="concrete dtype"):
        ResolvedRecipe(dtype="auto")


def test_resolving_refuses_what_the_model_refuses(tiny_model) -> None:
    workload = load_workload(str(tiny_model("llama", dtype="float16")), seq_len=16)
    with pytest.raises(InputError, match="fp16 .GradScaler. cannot train float16-loaded weights"):
        Recipe(fp16=True).resolved(workload)


@pytest.mark.slow
def test_trainer_defaults_are_read_once_per_version(tmp_path) -> None:
    """The second process makes a Recipe from the file kept by the first, without importing transformers."""
    code = ("import sys; from anatomist.recipe import Recipe; r = Recipe(); "
            "print(r.optim, r.per_device_train_batch_size, 'transformers' in sys.modules, 'torch' in sys.modules)")
    env = {"ANATOMIST_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    optim, batch, transformers_first, _ = first.stdout.split()
    assert transformers_first == "True"  # read from TrainingArguments the first time
    assert second.stdout.split() == [optim, batch, "False", "False"]
    (kept,) = (tmp_path / "trainer-defaults").iterdir()
    assert json.loads(kept.read_text())["optim"] == optim
