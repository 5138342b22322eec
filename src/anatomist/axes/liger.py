"""Liger Kernel (`use_liger_kernel`): which models it patches and with what, as data.

Read from `data/liger.toml` (transcribed from liger-kernel's own `MODEL_TYPE_TO_APPLY_LIGER_FN`,
version and file named there), so the prediction never needs liger-kernel installed. Two lists:
the model types Liger patches at all, and the ones whose patches anatomist traces (`trace/standins/liger_kernels.py`:
Llama's set, rope + RMSNorm + SwiGLU + fused linear cross-entropy). Recipe validation, the plan's
search space and the tracer all ask here.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from anatomist.errors import InputError


@dataclass(frozen=True, slots=True, kw_only=True)
class LigerTable:
    """What data/liger.toml says."""

    version: str
    """The liger-kernel release the table was read from."""
    supported: tuple[str, ...]
    """Every model_type Liger patches (its MODEL_TYPE_TO_APPLY_LIGER_FN keys)."""
    modelled: dict[str, str]
    """model_type -> the transformers module whose `apply_rotary_pos_emb` Liger replaces, for the models
    whose patches anatomist traces."""
    rms_norm_backward_rows: int
    """Rows of the fp32 buffer RMSNorm's backward reduces the weight gradient through (an SM count)."""


@cache
def liger_table() -> LigerTable:
    raw: dict[str, Any] = tomllib.loads(resources.files("anatomist.data").joinpath("liger.toml").read_text())
    return LigerTable(version=raw["version"], supported=tuple(raw["supported"]),
                      modelled={name: entry["modeling"] for name, entry in raw["models"].items()},
                      rms_norm_backward_rows=int(raw["rms_norm_backward_rows"]))


def liger_modelled(model_type: str, task: str) -> bool:
    """Whether anatomist traces Liger's kernels for this model and task (the plan searches it only then)."""
    return task == "causal-lm" and model_type in liger_table().modelled


def check_liger(model_type: str, task: str, name: str) -> None:
    """Refuse use_liger_kernel where Liger does not patch the model, or patches it in a way anatomist does not trace.

    Raises:
        InputError: one line naming the model type and what would work.
    """
    table = liger_table()
    modelled = ", ".join(sorted(table.modelled))
    if task != "causal-lm":
        raise InputError(f"{name}: use_liger_kernel patches causal language models (AutoLigerKernelForCausalLM); "
                         f"this is a {task} model")
    if model_type not in table.supported:
        raise InputError(f"{name}: Liger Kernel {table.version} does not support model_type={model_type!r} "
                         f"(it patches {len(table.supported)} model types; anatomist models {modelled})")
    if model_type not in table.modelled:
        raise InputError(f"{name}: Liger Kernel patches model_type={model_type!r} with kernels anatomist does not "
                         f"trace yet; anatomist models Liger for {modelled}")


def flce_chunk_tokens(batch: int, seq_len: int, hidden: int, vocab: int) -> int:
    """Tokens of the fused linear + cross-entropy's chunk as the trace runs it: batch x ceil(seq / ceil(V / H)),
    affine in the batch as every traced figure must be (`trace/standins/liger_kernels.py`)."""
    return batch * math.ceil(seq_len / math.ceil(vocab / hidden))


def liger_chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens of Liger's own chunk: next_power_of_2(ceil(tokens / ceil(V / H))), at most every token
    (ops/fused_linear_cross_entropy.py, chunk_mem_const 1)."""
    rows = math.ceil(tokens / math.ceil(vocab / hidden))
    return min(1 << (rows - 1).bit_length(), tokens)


def liger_chunks(tokens: int, hidden: int, vocab: int) -> int:
    """How many chunks Liger's fused linear + cross-entropy runs `tokens` in (each reads the head's weight)."""
    return math.ceil(tokens / liger_chunk_tokens(tokens, hidden, vocab))


def liger_note(batch: int, seq_len: int, hidden: int, vocab: int, logits_bytes: int) -> str:
    """What the estimate of a Liger recipe says of the fused cross-entropy's chunk (`logits_bytes`: bytes per
    logit, the product's dtype)."""
    traced = flce_chunk_tokens(batch, seq_len, hidden, vocab)
    real = liger_chunk_tokens(batch * seq_len, hidden, vocab)
    missing = max(0, real - traced) * vocab * logits_bytes
    gap = (f"; Liger rounds the chunk up to {real:,} tokens: {missing / 2**20:,.1f} MiB more at the loss, not in the "
           "figure" if missing else "")
    return (f"Liger Kernel {liger_table().version}: stand-ins of its Triton kernels (RMSNorm, SwiGLU, RoPE, fused "
            f"linear + cross-entropy) allocate and save what Liger's own do; the loss never holds the logits, only a "
            f"chunk of {traced:,} tokens x {vocab:,} vocabulary at a time{gap}")
