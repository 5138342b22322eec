"""The inputs of a traced (or measured) step: one micro-batch as the seeds' dataset gives it."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from anatomist.recipe import ResolvedRecipe
    from anatomist.workload import Workload

IGNORE_INDEX = -100
"""The label a loss does not score (PyTorch's cross_entropy default, which transformers, TRL, Liger and Cut
Cross-Entropy keep)."""

CACHE_FIELDS = ("cache", "past_key_values")
"""The field of a model's output that holds its KV cache, which the next step's input takes back: `cache` from
transformers 5.24, `past_key_values` before (still read there, with a deprecation warning)."""


def cache_field(output: Any) -> str | None:
    """The name of the KV-cache field (`CACHE_FIELDS`) of a model output, or of its dataclass; None where it has none."""
    if not dataclasses.is_dataclass(output):
        return None
    return next((f.name for f in dataclasses.fields(output) if f.name in CACHE_FIELDS), None)


def loss_from_hidden_states(model: Any, input_ids: torch.Tensor | None, labels: torch.Tensor | None,
                            kwargs: dict[str, Any], loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
    """A causal LM's forward as a fused loss patches it (Liger's `lce_forward`, Cut Cross-Entropy's `cce_forward`): in
    training with labels, the backbone, then `loss_of(last hidden states, labels)`, no logits; else the model's own."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if not (model.training and labels is not None):
        return type(model).forward(model, input_ids=input_ids, labels=labels, **kwargs)
    kwargs.pop("num_items_in_batch", None)
    outputs = model.model(input_ids=input_ids, **kwargs)
    cache = cache_field(CausalLMOutputWithPast)
    assert cache is not None  # a causal LM's output has one
    return CausalLMOutputWithPast(loss=loss_of(outputs[0], labels), logits=None, **{cache: getattr(outputs, cache)})


def make_batch(workload: Workload, batch_size: int) -> dict[str, torch.Tensor]:
    """Random token ids of `workload.seq_len` tokens per sample, and labels for the task: a class per
    sample for sequence classification, the ids themselves for the language-model heads."""
    shape = (batch_size, workload.seq_len)
    ids = torch.randint(100, 30000, shape) if workload.config.vocab_size > 30000 else torch.randint(
        0, workload.config.vocab_size, shape
    )
    if workload.task == "sequence-classification":
        return {"input_ids": ids, "labels": torch.zeros(batch_size, dtype=torch.long)}
    return {"input_ids": ids, "labels": ids.clone()}


@contextlib.contextmanager
def rows_not_packed(recipe: ResolvedRecipe) -> Iterator[None]:
    """Within: transformers' test of whether a batch's rows are packed sequences answers "no" on fake tensors as it
    does on the real batch (`make_batch`'s rows are one sequence each).

    Without a cache (training under gradient checkpointing, which turns the cache off) transformers reads the
    position ids for restarts (`masking_utils.find_packed_sequence_indices`); fake tensors have no values to read, so it
    would keep a packed-sequence mask and build a full [batch, 1, seq, seq] attention mask where the real step
    passes none (SDPA's is_causal). A padding-free recipe's rows are packed: left to transformers. So are context
    parallel's position ids: torch's load balancing gives the traced rank (0) two parts of each sequence, whose
    positions jump between them (the mask transformers then builds, accelerate's hooks drop).
    """
    from transformers import masking_utils

    if recipe.padding_free or recipe.cp_size > 1:
        yield
        return
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original
