"""The optimizer a Trainer would build for a recipe, as it behaves on CUDA, for tracing.

AdamW, fused AdamW, Adafactor and SGD are the real classes with the Trainer's own keyword
arguments (`Trainer.get_optimizer_cls_and_kwargs`). 8-bit Adam (bitsandbytes, torchao) and
bitsandbytes' paged AdamW run custom kernels that cannot execute on fake tensors, so
`BlockwiseAdamLayout` allocates exactly the state those libraries allocate and updates it
in place. Paged optimizers keep that state in CUDA unified memory: on the device while it
fits (counted there), paged out to host memory instead of failing when the GPU runs short.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from anatomist.recipe import Recipe

BLOCK_SIZE_8BIT = 256
"""Elements per quantisation block: bitsandbytes' blockwise 8-bit optimizers and torchao's AdamW8bit."""
MIN_8BIT_SIZE = 4096
"""Parameters with fewer elements keep 32-bit state (bitsandbytes `min_8bit_size`, torchao's check)."""


class BlockwiseAdamLayout(torch.optim.Optimizer):
    """AdamW whose two moments are stored as uint8 codes plus one fp32 scale per block (8 bits), or
    as fp32 (32 bits: bitsandbytes' paged_adamw_32bit), updated in place by fused kernels.

    Memory per large parameter of n elements: 2 x n bytes of codes + 2 x 4 x ceil(n/256)
    bytes of scales, about 2.03 B/param (the seeds' "2 bytes per parameter"). Smaller
    parameters keep fp32 moments (8 B/param), whatever the parameters' dtype (bitsandbytes'
    `Optimizer2State.init_state` allocates them as float32). The arithmetic is not that of
    8-bit Adam; only the memory is.
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, *, bits: int = 8) -> None:
        super().__init__(params, {"lr": lr})
        self.bits = bits
        """8: blockwise uint8 codes for large parameters; 32: fp32 moments for all (paged_adamw_32bit)."""

    # The ignore below: torch types step as overloads returning the closure's loss; this layout
    # takes no closure (the tracer's step has none) and returns nothing.
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # noqa: ARG002 - Optimizer API
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    n = p.numel()
                    if self.bits == 8 and n >= MIN_8BIT_SIZE:
                        blocks = -(-n // BLOCK_SIZE_8BIT)
                        state["state1"] = torch.zeros(n, dtype=torch.uint8)
                        state["state2"] = torch.zeros(n, dtype=torch.uint8)
                        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32)
                        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32)
                    else:
                        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    state["step"] = torch.zeros((), dtype=torch.float32)
                # The fused kernels update parameter and state in place: no temporaries.
                p.add_(p.grad, alpha=-group["lr"])


def build_optimizer(recipe: Recipe, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer of `recipe` over `params`, configured as Trainer configures it on CUDA.

    The classes and memory-relevant keyword arguments are those of
    `transformers.trainer_optimizer` (a test checks them against
    `Trainer.get_optimizer_cls_and_kwargs`); importing Trainer itself costs ~2 s, which the
    estimator avoids. `foreach=True` is passed explicitly because it is PyTorch's default on
    CUDA only (torch.optim.optimizer._default_to_fused_or_foreach).
    """
    lr = 5e-5  # TrainingArguments.learning_rate default; memory does not depend on it
    if recipe.optim in ("adamw_bnb_8bit", "adamw_torch_8bit", "paged_adamw_8bit"):
        return BlockwiseAdamLayout(params, lr=lr)
    if recipe.optim == "paged_adamw_32bit":
        return BlockwiseAdamLayout(params, lr=lr, bits=32)
    if recipe.optim == "adamw_torch":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, foreach=True)
    if recipe.optim == "adamw_torch_fused":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=True)
    if recipe.optim == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=True)
    if recipe.optim == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False)
    raise ValueError(f"no optimizer model for {recipe.optim!r}")
