"""The loss of one micro-batch as each trainer computes it: transformers' Trainer, TRL's SFTTrainer and DPOTrainer.

- trainer: `model(**batch).loss` (the model's own head and loss: the logits exist).
- sft (trl 1.16 SFTTrainer.compute_loss): the fused LM head (`trl_head`) with log-probabilities, entropy
  and top-1 flags; the loss is the mean negative log-probability of the scored tokens; the entropy and
  accuracy metrics are read without gradients.
- dpo (trl 1.16 DPOTrainer._compute_loss, loss_type "sigmoid"): chosen and rejected sequences
  concatenated into one batch of twice the pairs; the policy's forward first (its activations kept),
  then, without gradients and without gradient checkpointing, the reference's: a second copy of the
  model (`reference_model`), or, for a PEFT policy, the same model with its adapters disabled, or
  none with `precompute_ref_log_probs` (the reference log-probabilities come with the batch); the
  loss is -logsigmoid(beta x the difference of the log-ratios).

Nothing here imports trl: the prediction does not need it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from anatomist.axes.methods import DPO_BETA
from anatomist.recipe import ResolvedRecipe
from anatomist.trace.standins.trl_head import DPO_OUTPUTS, SFT_OUTPUTS, add_fused_lm_head
from anatomist.trace.step import context_parallel
from anatomist.trace.step.inputs import IGNORE_INDEX, make_batch
from anatomist.workload import Workload


def prepare(model: torch.nn.Module, recipe: ResolvedRecipe) -> None:
    """What the trainer does to the model before training: TRL's trainers add their fused LM head."""
    if recipe.trainer == "sft":
        add_fused_lm_head(model, SFT_OUTPUTS)
    elif recipe.trainer == "dpo":
        add_fused_lm_head(model, DPO_OUTPUTS)


def needs_reference_copy(recipe: ResolvedRecipe) -> bool:
    """DPO holds a second copy of the model unless the policy is a PEFT model (its base is the reference) or
    the reference log-probabilities are precomputed (dpo_trainer.py: `self.ref_model = None` then)."""
    return recipe.trainer == "dpo" and recipe.peft == "none" and not recipe.precompute_ref_log_probs


def prepare_reference(reference: torch.nn.Module) -> None:
    """The reference model as DPOTrainer keeps it: frozen, in eval mode (dropout off), its own fused head."""
    reference.requires_grad_(False)
    reference.eval()
    add_fused_lm_head(reference, ("log_probs",))


def step_loss(model: torch.nn.Module, reference: torch.nn.Module | None, workload: Workload, recipe: ResolvedRecipe,
              batch_size: int) -> torch.Tensor:
    """The loss of one micro-batch of `batch_size` samples (DPO: pairs) under the recipe's trainer."""
    if recipe.trainer == "trainer":
        batch = make_batch(workload, batch_size)
        return model(**(context_parallel.as_the_trainer_gives_it(batch) if recipe.sequence_parts > 1 else batch)).loss
    if recipe.trainer == "sft":
        batch = make_batch(workload, batch_size)
        outputs = model(input_ids=batch["input_ids"], labels=batch["labels"], fused_lm_head=True)
        loss = (-outputs.log_probs).sum() / outputs.label_mask.sum().clamp(min=1)
        with torch.no_grad():  # the trainer's metrics: mean entropy and token accuracy
            mask = outputs.label_mask
            _ = (outputs.entropy * mask).sum() / mask.sum(), (outputs.is_top1 & mask).sum() / mask.sum()
        return loss
    return _dpo_loss(model, reference, workload, recipe, batch_size)


def _dpo_loss(model: torch.nn.Module, reference: torch.nn.Module | None, workload: Workload, recipe: ResolvedRecipe,
              pairs: int) -> torch.Tensor:
    batch = make_batch(workload, 2 * pairs)  # [chosen; rejected]
    ids = batch["input_ids"]
    labels = ids.masked_fill(torch.zeros_like(ids, dtype=torch.bool), IGNORE_INDEX)  # TRL: ids.masked_fill(completion_mask == 0, -100)
    labels[:, :workload.prompt_len] = IGNORE_INDEX
    del batch
    scored = {"anatomist_prompt_tokens": workload.prompt_len}  # the prompt's labels: not scored
    outputs: Any = model(input_ids=ids, labels=labels, fused_lm_head=True, **scored)
    logps = outputs.log_probs.sum(dim=1)
    chosen, rejected = logps.chunk(2, dim=0)
    if recipe.precompute_ref_log_probs:
        ref_chosen, ref_rejected = torch.zeros(pairs), torch.zeros(pairs)  # read from the dataset
    else:
        with torch.no_grad(), _without_checkpointing(model):
            if reference is None:  # a PEFT policy: its base, adapters disabled
                wrapper: Any = model
                with wrapper.disable_adapter():
                    ref_outputs: Any = model(input_ids=ids, labels=labels, fused_lm_head=True, **scored)
            else:
                ref_outputs = reference(input_ids=ids, labels=labels, fused_lm_head=True, **scored)
            ref_chosen, ref_rejected = ref_outputs.log_probs.sum(dim=1).chunk(2, dim=0)
            del ref_outputs
    delta = (chosen - ref_chosen) - (rejected - ref_rejected)
    return -torch.nn.functional.logsigmoid(DPO_BETA * delta).mean()


@contextlib.contextmanager
def _without_checkpointing(model: torch.nn.Module) -> Any:
    """DPOTrainer's disable_gradient_checkpointing around the reference forward (trl/trainer/utils.py)."""
    modules = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    for m in modules:
        m.gradient_checkpointing = False  # type: ignore[assignment]
    try:
        yield
    finally:
        for m in modules:
            m.gradient_checkpointing = True  # type: ignore[assignment]
