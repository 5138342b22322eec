"""The kernels a recipe can pick for attention and for a Mixture of Experts, as from_pretrained names them."""

from __future__ import annotations

from typing import Literal, get_args

AttnImplementation = Literal["eager", "sdpa", "flash_attention_2"]
"""from_pretrained(attn_implementation=...): eager keeps the [b, heads, s, s] probabilities, the others do not."""
ATTN_IMPLEMENTATIONS: tuple[str, ...] = get_args(AttnImplementation)
ExpertsImplementation = Literal["grouped_mm", "batched_mm", "eager"]
"""from_pretrained(experts_implementation=...): how a Mixture-of-Experts layer runs its routed tokens."""
EXPERTS_IMPLEMENTATIONS: tuple[str, ...] = get_args(ExpertsImplementation)
