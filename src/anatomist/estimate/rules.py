"""The seeds' bytes-per-parameter rule, and where the traced figures differ from it.

From "Model training anatomy" (Hugging Face Transformers docs), for fp32-loaded weights:
  weights    4 B/param (fp32 training), 6 B/param (mixed precision: fp32 + half copy)
  optimizer  8 B/param (AdamW), 2 B/param (8-bit AdamW), 4 B/param (SGD with momentum)
             (each optimizer's figures: axes/optimizers.py)
  gradients  4 B/param (always fp32)
so mixed-precision AdamW needs 18 B/param, and mixed-precision inference 6 B/param,
plus activations.

The rows the seeds (2022) do not have: weights loaded in bf16/fp16 (transformers 5's
`dtype="auto"` for most LLM checkpoints) train in pure half precision: weights 2, gradients 2
(in the parameters' dtype), AdamW 4 (both moments in the parameters' dtype), SGD 2; 8-bit
AdamW stays 2 (uint8 codes). So bf16 AdamW is 2 + 2 + 4 = 8 B/param, with or without
`--bf16` autocast on top (no half copies to make: the weights already are).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from anatomist.anatomy import GIB, MemoryAnatomy, Phase
from anatomist.axes.optimizers import optimizer as optimizer_spec
from anatomist.axes.quantization import BLOCK_4BIT, NESTED_BLOCK
from anatomist.recipe import ResolvedRecipe


@dataclass(kw_only=True, slots=True)
class BytesPerParamRule:
    """The rule's figures for one recipe; None where the rule says nothing.

    Without PEFT every parameter is trained and the per-parameter rates apply to all. With
    LoRA/QLoRA the frozen base costs `frozen_weights_per_param` per parameter and only the
    trainable (adapter) parameters carry weights, gradients and optimizer states at the rates.
    """

    parameters: int
    weights_per_param: float
    optimizer_per_param: float | None
    gradients_per_param: float
    total_per_param: float | None
    trainable_parameters: int | None = None
    """The adapters' parameters under PEFT; None: every parameter is trained."""
    frozen_weights_per_param: float | None = None
    """Bytes per frozen base parameter under PEFT (2 for a bf16 base, ~0.52 for NF4 + double quant)."""

    @property
    def trained(self) -> int:
        return self.parameters if self.trainable_parameters is None else self.trainable_parameters

    @property
    def weights_bytes(self) -> int:
        frozen = self.parameters - self.trained
        return round(self.weights_per_param * self.trained + (self.frozen_weights_per_param or 0) * frozen)

    @property
    def optimizer_bytes(self) -> int | None:
        return None if self.optimizer_per_param is None else round(self.optimizer_per_param * self.trained)

    @property
    def gradients_bytes(self) -> int:
        return round(self.gradients_per_param * self.trained)

    @property
    def total_bytes(self) -> int | None:
        if self.optimizer_bytes is None:
            return None
        return self.weights_bytes + self.optimizer_bytes + self.gradients_bytes

    def describe(self, category: str) -> str:
        """The rule's figure for `category` (weights, optimizer_states, gradients), as printed."""
        from anatomist.anatomy import GIB

        trainable = " x trainable" if self.trainable_parameters is not None else ""
        if category == "weights":
            if self.frozen_weights_per_param is not None:
                return (f"{self.frozen_weights_per_param:.3g} B x frozen + {self.weights_per_param:g} B x trainable "
                        f"= {self.weights_bytes / GIB:.2f} GiB")
            return f"{self.weights_per_param:g} B/param = {self.weights_bytes / GIB:.2f} GiB"
        if category == "optimizer_states":
            if self.optimizer_bytes is None:
                return "-"
            return f"{self.optimizer_per_param:g} B{trainable or '/param'} = {self.optimizer_bytes / GIB:.2f} GiB"
        if category == "gradients" and self.gradients_per_param:
            return f"{self.gradients_per_param:g} B{trainable or '/param'} = {self.gradients_bytes / GIB:.2f} GiB"
        return "-" if category == "gradients" else ""

    def explain(self, traced: MemoryAnatomy, recipe: ResolvedRecipe) -> Iterator[str]:
        """One line per component where the trace at the peak differs from the rule by > 5%,
        with the reason; a method the recipe does not use is never the reason."""

        def differs(rule: int, got: int) -> bool:
            return abs(got - rule) > 0.05 * max(rule, 1)

        if differs(self.weights_bytes, traced.weights):
            if recipe.quantized and traced.weights > self.weights_bytes:
                why = ("only the blocks' linear layers are quantized; prepare_model_for_kbit_training keeps the "
                       "embeddings, norms and output head in fp32" if not recipe.cut_cross_entropy else
                       "only the blocks' linear layers are quantized; the embeddings, norms and output head stay in "
                       f"{recipe.dtype} (axolotl turns them back for Cut Cross-Entropy)")
            elif traced.weights < self.weights_bytes and self.weights_per_param == 6:
                why = (
                    "autocast keeps half-precision copies only of weights used in matrix products "
                    "(embeddings, norms stay fp32), and only until backward has used them"
                )
                if traced.peak_phase is Phase.OPTIMIZER:
                    why = "the peak is in the optimizer step, when the half-precision copies are already freed"
            elif traced.weights < self.weights_bytes and recipe.tp_size > 1:
                why = _split(recipe, "weights")
            elif traced.weights < self.weights_bytes and recipe.sharding_stage >= 3:
                why = "ZeRO-3 / FSDP full_shard shards the weights across devices"
            elif traced.weights < self.weights_bytes and recipe.zero_stage and recipe.mixed_precision != "no":
                why = "DeepSpeed casts the model to half precision (the fp32 master copy is in the optimizer states)"
            else:
                why = "buffers (position ids, masks) and rounding to 512-byte blocks add to the parameters"
            yield f"weights: rule {self.describe('weights')}, traced {traced.weights / GIB:.2f} GiB at the peak: {why}"
        if self.optimizer_bytes is not None and differs(self.optimizer_bytes, traced.optimizer_states):
            if traced.optimizer_states == 0:
                why = f"the peak is in the first step's {traced.peak_phase}, before the optimizer has made its state"
            elif self.optimizer_per_param == 2 and traced.optimizer_states > self.optimizer_bytes:
                why = "8-bit optimizers keep fp32 state for parameters under 4096 elements and an fp32 scale per 256-element block"
            elif recipe.zero_stage and recipe.mixed_precision != "no" and traced.optimizer_states > self.optimizer_bytes:
                why = "DeepSpeed keeps fp32 master weights (4 B/param) with the optimizer states"
            elif recipe.tp_size > 1 and traced.optimizer_states < self.optimizer_bytes:
                why = _split(recipe, "optimizer states")
            elif recipe.sharding_stage >= 1 or recipe.offload != "none":
                why = "ZeRO / FSDP shards or offloads the optimizer state"
            else:
                why = "step counters and buffers kept per parameter tensor, rounded to 512-byte blocks"
            yield f"optimizer states: rule {self.describe('optimizer_states')}, traced {traced.optimizer_states / GIB:.2f} GiB: {why}"
        elif self.optimizer_bytes is None:
            yield (
                f"optimizer states: the rule gives no figure for this optimizer; traced {traced.optimizer_states / GIB:.2f} GiB "
                "(Adafactor keeps row and column factors of each matrix, not a full second moment)"
            )
        if self.gradients_per_param and differs(self.gradients_bytes, traced.gradients):
            if traced.gradients < self.gradients_bytes and traced.peak_phase is not Phase.OPTIMIZER:
                why = f"at the peak ({traced.peak_phase}) gradients exist only for the layers backward has reached (set_to_none frees them each step)"
            elif recipe.tp_size > 1 and traced.gradients < self.gradients_bytes:
                why = _split(recipe, "gradients")
            elif recipe.sharding_stage >= 2 or recipe.offload != "none":
                why = "ZeRO-2/3 / FSDP shards (or offloads) the gradients"
            elif recipe.zero_stage and recipe.mixed_precision != "no":
                why = "DeepSpeed keeps the gradients in half precision"
            else:
                why = "gradients of frozen or tied parameters are not kept, and sizes round to 512-byte blocks"
            yield f"gradients: rule {self.describe('gradients')}, traced {traced.gradients / GIB:.2f} GiB: {why}"


def _split(recipe: ResolvedRecipe, what: str) -> str:
    """Why a rank of tensor parallel holds less of `what` than the rule says."""
    again = ", which FSDP shards again" if recipe.fsdp != "none" else ""
    return (f"tensor parallel splits the linear layers and embeddings {recipe.tp_size} ways: a rank keeps the {what} "
            f"of its part{again}")


def frozen_bytes_per_param(recipe: ResolvedRecipe) -> float:
    """Bytes of one frozen base parameter: the load dtype's, or bitsandbytes' packed storage
    (4-bit: half a byte plus an fp32 absmax per block; with double quantization a uint8 absmax
    per block and an fp32 one per NESTED_BLOCK blocks, as trace/step/peft.py lays them out)."""
    if recipe.load_in_4bit:
        scales = 1 / BLOCK_4BIT + 4 / (BLOCK_4BIT * NESTED_BLOCK) if recipe.bnb_4bit_use_double_quant else 4 / BLOCK_4BIT
        return 0.5 + scales
    if recipe.load_in_8bit:
        return 1.0
    return 2.0 if recipe.half_weights else 4.0


def bytes_per_param_rule(recipe: ResolvedRecipe, parameters: int, mode: str, trainable: int | None = None) -> BytesPerParamRule:
    """The rule's bytes per parameter for `recipe` (its `dtype` resolved: not "auto");
    `trainable`: the adapters' parameters under PEFT."""
    spec = optimizer_spec(recipe.optim)
    if recipe.peft != "none" and mode == "train":
        # PEFT makes the adapters in fp32 (autocast_adapter_dtype): the fp32 rule applies to them.
        optimizer = spec.state_bytes_per_param
        return BytesPerParamRule(
            parameters=parameters, weights_per_param=4.0, optimizer_per_param=optimizer, gradients_per_param=4.0,
            total_per_param=None, trainable_parameters=trainable, frozen_weights_per_param=frozen_bytes_per_param(recipe),
        )
    if recipe.half_weights:  # torch's optimizers keep their moments in the weights' dtype (8-bit codes stay 1 B)
        weights, gradients, optimizer = 2.0, 2.0, spec.half_state_bytes_per_param
    else:
        weights = 6.0 if recipe.mixed_precision != "no" else 4.0
        gradients, optimizer = 4.0, spec.state_bytes_per_param
    if mode == "inference":
        return BytesPerParamRule(
            parameters=parameters, weights_per_param=weights, optimizer_per_param=0.0,
            gradients_per_param=0.0, total_per_param=weights,
        )
    total = None if optimizer is None else weights + optimizer + gradients
    return BytesPerParamRule(
        parameters=parameters, weights_per_param=weights, optimizer_per_param=optimizer,
        gradients_per_param=gradients, total_per_param=total,
    )
