"""Low-bit Adam as its library lays out its state, for tracing.

bitsandbytes' and torchao's 8-bit and 4-bit AdamW run custom kernels (CUDA, or torch.compile'd
tensor subclasses) that cannot execute on fake tensors. `QuantizedAdamLayout` allocates exactly
the state those libraries allocate (`axes.optimizers.QuantizedState` says how) and updates the
parameters in place, as their fused kernels do. Paged optimizers keep that state in CUDA unified
memory: on the device while it fits (counted there), paged out to host memory instead of failing
when the GPU runs short. The arithmetic is not that of Adam; only the memory is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from anatomist.axes.optimizers import QuantizedState


class QuantizedAdamLayout(torch.optim.Optimizer):
    """AdamW whose two moments take the memory `state` describes (tests/test_optimizer_layouts.py
    compares it with bitsandbytes' and torchao's own optimizers, stepped on this CPU)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, *, state: QuantizedState) -> None:
        super().__init__(params, {"lr": lr})
        self.layout = state
        self._shared_tables_made = False

    def _moment(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """One moment of `p`: codes, scales and maybe a code table; or an unquantized tensor."""
        layout, n = self.layout, p.numel()
        if not layout.quantizes(n):
            dtype = p.dtype if layout.small_dtype == "param" and layout.bits < 32 else torch.float32
            return {"": torch.zeros(n, dtype=dtype)}
        moment = {"codes": torch.zeros(n * layout.bits // 8, dtype=torch.uint8),
                  "scale": torch.zeros(-(-n // layout.block_size), dtype=torch.float32)}
        if layout.code_table_entries:
            moment["code_table"] = torch.zeros(layout.code_table_entries, dtype=torch.float32)
        return moment

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
                    for moment in ("exp_avg", "exp_avg_sq"):
                        for part, tensor in self._moment(p).items():
                            state[f"{moment}.{part}" if part else moment] = tensor
                    if "exp_avg.codes" in state and not self._shared_tables_made:
                        # bitsandbytes' qmaps: every quantized state refers to the same tables; kept
                        # here in the first one's state, so that they are counted once
                        for i in range(self.layout.shared_code_tables):
                            state[f"code_table{i}"] = torch.zeros(self.layout.shared_table_entries, dtype=torch.float32)
                        self._shared_tables_made = True
                    if self.layout.step_tensor:
                        state["step"] = torch.zeros((), dtype=torch.float32)
                # The fused kernels update parameter and state in place: no temporaries.
                p.add_(p.grad, alpha=-group["lr"])
