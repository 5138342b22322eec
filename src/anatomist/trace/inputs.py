"""The inputs of a traced (or measured) step: one micro-batch as the seeds' dataset gives it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from anatomist.workload import Workload


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
