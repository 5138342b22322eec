"""Prediction vs PyTorch's MemTracker on real steps of TRL's own SFTTrainer (padding-free) and DPOTrainer.

The measured side is trl_steps.py: the trainer built as a user builds it, one steady-state step measured
by `torch.distributed._tools.mem_tracker.MemTracker`, with the GPU's kernels stood in for by code that
keeps what they keep (TRL's fused head on its CUDA path, flash-attn's varlen kernel); counted with the CUDA
allocator's 512-byte rounding (as test_estimate_accuracy.py). The prediction extrapolates 2- and 3-block
fake traces at batch 2 and 3 to 5 blocks at the test's batch.
"""

from __future__ import annotations

import pytest
import torch
from memtracker_step import count_as_on_cuda
from trl_steps import VARLEN, cuda_trl_paths, measure_trainer_step, register_varlen_attention, tokenizer

from anatomist.estimate.memory import estimate_memory
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.recipe.spellings import lora_config_kwargs
from anatomist.workload_loader import load_workload

trl = pytest.importorskip("trl")

GPU = get_gpu("A100-80GB")
LLAMA = {"num_hidden_layers": 5, "num_key_value_heads": 4, "max_position_embeddings": 256}
"""Tiny Llama (conftest.py) at 5 blocks, with as many key/value heads as query heads: flash-attn takes
grouped heads as they are, where the CPU kernels that stand in for it would need them repeated."""
LENGTHS = [40, 48, 56, 64, 32]
"""One micro-batch of 5 examples, 240 tokens: a mean of 48."""


def _dataset(lengths: list[int], vocab: int):
    import datasets

    g = torch.Generator().manual_seed(0)
    return datasets.Dataset.from_dict({"input_ids": [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]})


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_sft_padding_free_step_matches_pytorchs_accounting(tiny_model, tmp_path, monkeypatch, checkpointing):
    from transformers import AutoModelForCausalLM

    count_as_on_cuda(monkeypatch)
    register_varlen_attention()
    path = tiny_model("llama", **LLAMA)
    workload = load_workload(str(path), seq_len=64, avg_seq_len=48)
    recipe = Recipe.with_presets(per_device_train_batch_size=5, trainer="sft", padding_free=True,
                                 attn_implementation="flash_attention_2", dtype="float32", optim="adamw_torch",
                                 gradient_checkpointing=checkpointing).resolved(workload)
    predicted = estimate_memory(workload.for_recipe(recipe), recipe, GPU).anatomy

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(workload.config, attn_implementation=VARLEN, dtype=torch.float32)
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=5, max_length=None, padding_free=True,
                         gradient_checkpointing=checkpointing, bf16=False, use_cpu=True, report_to=[], optim="adamw_torch",
                         save_strategy="no")
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=_dataset(LENGTHS, 1000),
                             processing_class=tokenizer(1000))
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape == (1, sum(LENGTHS))  # one row, no padding
    with cuda_trl_paths(monkeypatch):
        measured, after = measure_trainer_step(trainer, batch)
    workspaces = predicted.functionality  # the two cuBLAS workspaces: nothing on a CPU
    assert predicted.peak_allocated - workspaces == pytest.approx(measured["Total"], rel=0.05), measured
    assert predicted.optimizer_states == pytest.approx(after["OPT"], rel=0.05)


class _NoHooks(dict):
    """A hooks dict a RemovableHandle can point to (it keeps a weak reference)."""


def _hooks_on_trainable_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """MemTracker hooks every parameter's gradient, which torch refuses on a frozen one (a PEFT base, a
    reference model); a frozen parameter never has a gradient, so its hooks are skipped (as test_peft.py)."""
    for name in ("register_hook", "register_post_accumulate_grad_hook"):
        original = getattr(torch.Tensor, name)

        def only_if_trainable(self, hook, _original=original):
            return _original(self, hook) if self.requires_grad else torch.utils.hooks.RemovableHandle(_NoHooks())

        monkeypatch.setattr(torch.Tensor, name, only_if_trainable)


def _without_module_stats(monkeypatch: pytest.MonkeyPatch) -> None:
    """MemTracker's per-module statistics refuse a module run twice in one step (the PEFT policy, then its base as
    the reference). The totals compared here do not need them: only the split of the live bytes between ACT and
    TEMP comes from those hooks; parameters, buffers, gradients and optimizer states are tracked without them."""
    from torch.distributed._tools.mem_tracker import MemTracker

    for name in ("_pre_fw_hook", "_post_fw_hook", "_pre_bw_hook", "_post_bw_hook"):
        monkeypatch.setattr(MemTracker, name, lambda self, *args: None)


def _text(n: int, g: torch.Generator) -> str:
    return " ".join(f"t{int(i)}" for i in torch.randint(3, 1000, (n,), generator=g))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "lora"])
def test_dpo_step_matches_pytorchs_accounting(tiny_model, tmp_path, monkeypatch, method):
    """3 pairs of a 16-token prompt and 48-token completions, max_length 64: one batch of 6 x 64 tokens, the
    completions scored; full fine-tuning holds a reference copy, LoRA disables its adapters for the reference."""
    import datasets
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    count_as_on_cuda(monkeypatch)
    _hooks_on_trainable_only(monkeypatch)
    if method == "lora":
        _without_module_stats(monkeypatch)
    path = tiny_model("llama", **LLAMA)
    workload = load_workload(str(path), seq_len=64, prompt_len=16)
    peft = {"peft": "lora"} if method == "lora" else {}
    recipe = Recipe.with_presets(per_device_train_batch_size=3, trainer="dpo", dtype="float32", optim="adamw_torch",
                                 **peft).resolved(workload)
    predicted = estimate_memory(workload, recipe, GPU).anatomy

    torch.manual_seed(0)
    folder = tmp_path / "model"
    AutoModelForCausalLM.from_config(workload.config, dtype=torch.float32).save_pretrained(folder)
    tokenizer(1000).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_dict({"prompt": [_text(16, g) + " " for _ in range(3)], "chosen": [_text(48, g) for _ in range(3)],
                                       "rejected": [_text(48, g) for _ in range(3)]})
    args = trl.DPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=3, max_length=64,
                         gradient_checkpointing=False, bf16=False, use_cpu=True, report_to=[], optim="adamw_torch",
                         save_strategy="no")
    adapters = LoraConfig(**lora_config_kwargs(recipe, "CAUSAL_LM")) if method == "lora" else None
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer(1000),
                             peft_config=adapters)
    assert (trainer.ref_model is None) == (method == "lora")
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape == (6, 64)  # chosen and rejected of 3 pairs, one forward
    extra = (trainer.ref_model,) if trainer.ref_model is not None else ()
    with cuda_trl_paths(monkeypatch):
        measured, after = measure_trainer_step(trainer, batch, extra)
    workspaces = predicted.functionality
    assert predicted.peak_allocated - workspaces == pytest.approx(measured["Total"], rel=0.05), (predicted, measured)
    assert predicted.weights == pytest.approx(measured["PARAM"] + measured["BUFFER"], rel=0.05)
    assert predicted.optimizer_states == pytest.approx(after["OPT"], rel=0.05)
