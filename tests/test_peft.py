"""LoRA and QLoRA: trainable counts are PEFT's own, a LoRA step matches PyTorch's accounting, bad input is refused."""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest
import torch
from memtracker_step import count_as_on_cuda, measure_step

from anatomist.bench.worker import training_model
from anatomist.errors import InputError
from anatomist.estimate.memory import estimate_memory
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.workload_loader import load_workload

GPU = get_gpu("A100-80GB")


class _NoHooks(dict):
    """A hooks dict a RemovableHandle can point to (it keeps a weak reference)."""


@pytest.mark.parametrize(("model", "targets"), [("llama", None), ("llama", "q_proj,k_proj,v_proj,o_proj"),
                                                 ("bert", None), ("gpt2", None)])
def test_trainable_parameters_are_peft_s_own(tiny_model, model, targets):
    workload = load_workload(str(tiny_model(model, num_hidden_layers=5, n_layer=5)), seq_len=32)
    recipe = Recipe(per_device_train_batch_size=2, peft="lora", lora_r=4,
                                            lora_target_modules=targets).resolved(workload)
    trainable, total = training_model(workload, recipe).get_nb_trainable_parameters()
    predicted = estimate_memory(workload, recipe.resolved(workload), GPU)
    assert predicted.trainable_parameters == trainable
    assert predicted.parameters == total


@pytest.mark.slow
def test_qlora_counts_the_base_as_its_authors_do(tiny_model):
    """4-bit codes pack 2 parameters a byte; the count stays the model's (as print_trainable_parameters)."""
    workload = load_workload(str(tiny_model("llama", num_hidden_layers=5)), seq_len=32)
    lora = estimate_memory(workload, Recipe(per_device_train_batch_size=2, peft="lora").resolved(workload), GPU)
    qlora = estimate_memory(workload, Recipe.with_presets(per_device_train_batch_size=2, peft="qlora").resolved(workload), GPU)
    assert qlora.parameters == lora.parameters and qlora.trainable_parameters == lora.trainable_parameters
    assert qlora.anatomy.optimizer_states == lora.anatomy.optimizer_states  # the same fp32 adapters
    assert qlora.rule.frozen_weights_per_param == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256))


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_lora_step_matches_pytorchs_accounting(tiny_model, monkeypatch, model):
    """A real LoRA step (bf16 base, fp32 adapters, AdamW over the adapters) of the model the bench
    trains (`training_model`: get_peft_model with a LoraConfig) measured by MemTracker, counted
    with the CUDA allocator's 512-byte rounding (see test_estimate_accuracy.py)."""
    count_as_on_cuda(monkeypatch)
    # MemTracker hooks every parameter's gradient, which torch refuses on a frozen one; a frozen
    # base parameter never has a gradient, so its hooks are skipped.
    for name in ("register_hook", "register_post_accumulate_grad_hook"):
        original = getattr(torch.Tensor, name)

        def only_if_trainable(self, hook, _original=original):
            return _original(self, hook) if self.requires_grad else torch.utils.hooks.RemovableHandle(_NoHooks())

        monkeypatch.setattr(torch.Tensor, name, only_if_trainable)
    workload = load_workload(str(tiny_model(model, num_hidden_layers=5, n_layer=5)), seq_len=64)
    recipe = Recipe(per_device_train_batch_size=5, peft="lora", dtype="bfloat16").resolved(workload)
    predicted = estimate_memory(workload, recipe.resolved(workload), GPU).anatomy
    torch.manual_seed(0)
    kinds, after = measure_step(workload, recipe, training_model(workload, recipe), 5)
    assert predicted.peak_allocated - predicted.functionality == pytest.approx(kinds["Total"], rel=0.05)
    assert predicted.weights == pytest.approx(kinds["PARAM"] + kinds["BUFFER"], rel=0.05)
    assert predicted.optimizer_states == pytest.approx(after["OPT"], rel=0.05)


@pytest.mark.parametrize(("recipe", "message"), [
    ({"load_in_4bit": True}, "a quantized base cannot be trained itself: add adapters with --peft lora"),
    ({"peft": "lora", "lora_r": 0}, "lora_r must be greater than 0, got 0"),
    ({"peft": "lora", "load_in_4bit": True, "load_in_8bit": True}, "load_in_4bit and load_in_8bit are exclusive"),
])
def test_bad_peft_recipes(recipe, message):
    with pytest.raises(InputError, match=message):
        Recipe(**recipe)


def test_target_modules_that_match_nothing_name_the_linear_layers(tiny_model):
    workload = load_workload(str(tiny_model("llama")), seq_len=16)
    recipe = Recipe(per_device_train_batch_size=2, peft="lora", lora_target_modules="query,value")
    with pytest.raises(InputError, match=r"--lora-target-modules: .*this model's linear layers: .*q_proj"):
        estimate_memory(workload, recipe.resolved(workload), GPU)


@pytest.mark.slow
def test_qlora_with_a_paged_optimizer_names_bitsandbytes_once(cli):
    """QLoRA's usual optimizer (paged 8-bit AdamW): 2 B per trainable parameter, like 8-bit Adam;
    the note names the one package the training machine needs once."""
    proc = cli("estimate", "Qwen2.5-0.5B", "--peft", "qlora", "--optim", "paged_adamw_8bit", "--seq-len", "128",
               "--batch-size", "1", "--gpu", "A100-80GB", "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("bitsandbytes") == (0 if find_spec("bitsandbytes") else 2)  # "needs X (pip install X)"
    data = json.loads(proc.stdout)
    rule = data["bytes_per_param_rule"]
    assert rule["optimizer_per_param"] == 2
