"""The seeds' bytes-per-parameter rule, and where the traced figures differ from it.

From "Model training anatomy" (Hugging Face Transformers docs):
  weights    4 B/param (fp32 training), 6 B/param (mixed precision: fp32 + half copy)
  optimizer  8 B/param (AdamW), 2 B/param (8-bit AdamW), 4 B/param (SGD with momentum)
  gradients  4 B/param (always fp32)
so mixed-precision AdamW needs 18 B/param, and mixed-precision inference 6 B/param,
plus activations.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from anatomist.anatomy import GIB, MemoryAnatomy, Phase
from anatomist.recipe import Recipe

OPTIMIZER_BYTES_PER_PARAM: dict[str, float | None] = {
    "adamw_torch": 8,
    "adamw_torch_fused": 8,
    "adamw_bnb_8bit": 2,
    "adamw_torch_8bit": 2,
    "sgd": 4,
    "adafactor": None,  # factored second moment: not in the seeds' rule
}


@dataclass(kw_only=True, slots=True)
class BytesPerParamRule:
    """The rule's figures for one recipe; None where the rule says nothing."""

    parameters: int
    weights_per_param: float
    optimizer_per_param: float | None
    gradients_per_param: float
    total_per_param: float | None

    @property
    def weights_bytes(self) -> int:
        return round(self.weights_per_param * self.parameters)

    @property
    def optimizer_bytes(self) -> int | None:
        return None if self.optimizer_per_param is None else round(self.optimizer_per_param * self.parameters)

    @property
    def gradients_bytes(self) -> int:
        return round(self.gradients_per_param * self.parameters)

    def explain(self, traced: MemoryAnatomy) -> Iterator[str]:
        """One line per component where the trace at the peak differs from the rule by > 5%."""

        def differs(rule: int, got: int) -> bool:
            return abs(got - rule) > 0.05 * max(rule, 1)

        if differs(self.weights_bytes, traced.weights):
            if traced.weights < self.weights_bytes and self.weights_per_param == 6:
                why = (
                    "autocast keeps half-precision copies only of weights used in matrix products "
                    "(embeddings, norms stay fp32), and only until backward has used them"
                )
                if traced.peak_phase is Phase.OPTIMIZER:
                    why = "the peak is in the optimizer step, when the half-precision copies are already freed"
            elif traced.weights < self.weights_bytes:
                why = "ZeRO-3 shards the weights across devices"
            else:
                why = "buffers (position ids, masks) and rounding to 512-byte blocks add to the parameters"
            yield f"weights: rule {self.weights_per_param:g} B/param = {self.weights_bytes / GIB:.2f} GiB, traced {traced.weights / GIB:.2f} GiB at the peak: {why}"
        if self.optimizer_bytes is not None and differs(self.optimizer_bytes, traced.optimizer_states):
            if traced.optimizer_states == 0:
                why = f"the peak is in the first step's {traced.peak_phase}, before the optimizer has made its state"
            elif self.optimizer_per_param == 2 and traced.optimizer_states > self.optimizer_bytes:
                why = "8-bit optimizers keep fp32 state for parameters under 4096 elements and an fp32 scale per 256-element block"
            else:
                why = "ZeRO shards or offloads the optimizer state"
            yield f"optimizer states: rule {self.optimizer_per_param:g} B/param = {self.optimizer_bytes / GIB:.2f} GiB, traced {traced.optimizer_states / GIB:.2f} GiB"+ f": {why}"
        elif self.optimizer_bytes is None:
            yield (
                f"optimizer states: the rule gives no figure for this optimizer; traced {traced.optimizer_states / GIB:.2f} GiB "
                "(Adafactor keeps row and column factors of each matrix, not a full second moment)"
            )
        if self.gradients_per_param and differs(self.gradients_bytes, traced.gradients):
            if traced.gradients < self.gradients_bytes and traced.peak_phase is not Phase.OPTIMIZER:
                why = f"at the peak ({traced.peak_phase}) gradients exist only for the layers backward has reached (set_to_none frees them each step)"
            else:
                why = "ZeRO-2/3 shards the gradients across devices"
            yield f"gradients: rule 4 B/param = {self.gradients_bytes / GIB:.2f} GiB, traced {traced.gradients / GIB:.2f} GiB: {why}"


def bytes_per_param_rule(recipe: Recipe, parameters: int, mode: str) -> BytesPerParamRule:
    mixed = recipe.fp16 or recipe.bf16
    weights = 6.0 if mixed else 4.0
    if mode == "inference":
        return BytesPerParamRule(
            parameters=parameters, weights_per_param=weights, optimizer_per_param=0.0,
            gradients_per_param=0.0, total_per_param=weights,
        )
    optimizer = OPTIMIZER_BYTES_PER_PARAM[recipe.optim]
    total = None if optimizer is None else weights + optimizer + 4.0
    return BytesPerParamRule(
        parameters=parameters, weights_per_param=weights, optimizer_per_param=optimizer,
        gradients_per_param=4.0, total_per_param=total,
    )
