"""The optimizers a recipe can name (`TrainingArguments.optim`), one spec each.

A spec says what the Trainer builds for that name (`transformers.trainer_optimizer`; a test checks
the classes and memory-relevant arguments against `Trainer.get_optimizer_cls_and_kwargs`), what
the optimizer keeps per parameter (the seeds' bytes-per-parameter rule and, for the quantized
ones, the exact layout their library allocates), which package training needs, and whether the
plan searches it by default.

To add an optimizer: one `OptimizerSpec` in `OPTIMIZERS` below. It is data only: the class the
Trainer builds and its arguments where that class runs on fake tensors, else the `QuantizedState`
its library lays out (the trace builds either: `trace/step/optimizer_build.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from anatomist.errors import InputError

LEARNING_RATE = 5e-5
"""TrainingArguments.learning_rate's default; no optimizer's memory depends on it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class QuantizedState:
    """How a low-bit Adam stores its two moments, as its library allocates them.

    A parameter of n elements with n >= `min_elements` (and, where `whole_blocks`, n a multiple
    of `block_size`) keeps per moment n x bits / 8 bytes of codes, one fp32 scale per block and,
    where `code_table_entries`, its own fp32 table of code values; a smaller one keeps its moments
    unquantized, in `small_dtype`.
    """

    bits: Literal[4, 8, 32]
    """Bits per moment element (32: unquantized fp32 moments for every parameter)."""
    block_size: int = 256
    """Elements per quantization block (one fp32 scale each)."""
    min_elements: int = 4096
    """Smaller parameters keep unquantized moments (bitsandbytes' `min_8bit_size`, torchao's check)."""
    whole_blocks: bool = False
    """Quantize only when n is a multiple of `block_size` (torchao); else the last block is partial (bitsandbytes)."""
    code_table_entries: int = 0
    """fp32 entries of the code table each quantized moment keeps (torchao: 2**bits); 0 where one table is shared."""
    shared_code_tables: int = 0
    """Code tables of 256 fp32 entries the optimizer keeps once for all parameters (bitsandbytes: 2)."""
    small_dtype: Literal["float32", "param"] = "float32"
    """What unquantized moments are stored in: fp32 (bitsandbytes), or the parameter's dtype (torchao)."""
    step_tensor: bool = False
    """Whether the step counter is an fp32 tensor per parameter (torchao) rather than a Python int (bitsandbytes)."""
    shared_table_entries: int = 256
    """fp32 values of each shared code table (bitsandbytes' `name2qmap`)."""

    def quantizes(self, numel: int) -> bool:
        """Whether a parameter of `numel` elements keeps quantized moments (else unquantized ones)."""
        return self.bits < 32 and numel >= self.min_elements and (
            not self.whole_blocks or numel % self.block_size == 0)

    def state_bytes(self, numel: int, element_bytes: int) -> int:
        """Bytes of the state of one parameter of `numel` elements of `element_bytes` each: its two moments and
        their scales and tables, its step tensor, and the shared code tables (counted with it: they exist once per
        optimizer as soon as one parameter is quantized)."""
        if not self.quantizes(numel):
            moment = numel * (element_bytes if self.small_dtype == "param" and self.bits < 32 else 4)
            shared = 0
        else:
            moment = numel * self.bits // 8 + 4 * -(-numel // self.block_size) + 4 * self.code_table_entries
            shared = 4 * self.shared_table_entries * self.shared_code_tables
        return 2 * moment + shared + (4 if self.step_tensor else 0)



@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerSpec:
    """One value of `TrainingArguments.optim` as anatomist models it."""

    name: str
    """TrainingArguments' name (`--optim NAME`)."""
    description: str
    optimizer_class: str | None
    """The class the Trainer builds, by its import path, where it runs on fake tensors (its module is imported
    before the traced step: a module's first import runs its top-level code, and tensors made there under the
    tracer, as transformers.optimization's imports of peft and bitsandbytes make, would count as the step's
    allocations); None where it does not: the tracer lays out `quantized_state` instead."""
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """What the Trainer passes `optimizer_class` beside the parameters and LEARNING_RATE, as it does on CUDA."""
    state_bytes_per_param: float | None
    """The seeds' rule for fp32 weights (None: no per-parameter figure, Adafactor's factored moments)."""
    half_state_bytes_per_param: float | None
    """The same with bf16/fp16 weights: torch's optimizers keep their moments in the weights' dtype."""
    package: str | None = None
    """What training needs beyond torch (the prediction needs none)."""
    searched: bool = False
    """Searched by `anatomist plan` unless --optims says otherwise."""
    trainer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """TrainingArguments fields beyond `optim` that make the Trainer build this optimizer."""
    quantized_state: QuantizedState | None = None
    """The low-bit layout of its moments, where it has one."""
    runs_on_fsdp2: bool = True
    """Whether its step runs on FSDP2's sharded parameters (DTensors). transformers' Adafactor does not: its
    factored moments are plain tensors, and its step mixes them with the DTensor gradients, which PyTorch refuses
    (seen tracing its real step under `fully_shard`)."""
    flat_moments: int = 2
    """Moments the optimizer keeps per element of a one-dimensional parameter, in the parameter's dtype, where it
    keeps unquantized ones: DeepSpeed ZeRO hands it one flat partition per parameter group (estimate/sharding.py).
    AdamW 2; SGD with momentum 1; transformers' Adafactor 1 (a 1-D parameter's second moment is not factored,
    `Adafactor._get_options`, and beta1 is None by default, so no first moment)."""
    fp32_moments: bool = False
    """Whether it keeps its unquantized moments in fp32 whatever the parameter's dtype (transformers' Adafactor casts
    half-precision gradients to fp32 and keeps its state so), rather than in the parameter's."""

    def flat_state_bytes(self, numel: int, element_bytes: int) -> int:
        """Bytes of the state this optimizer keeps for one flat 1-D parameter of `numel` elements of `element_bytes`
        each: what it holds over a DeepSpeed ZeRO partition. A step counter that is a 0-d tensor (fused AdamW's) is
        left out: 4 bytes per parameter group."""
        if self.quantized_state is not None:
            return self.quantized_state.state_bytes(numel, element_bytes)
        return self.flat_moments * numel * (4 if self.fp32_moments else element_bytes)


ADAMW_ARGUMENTS = {"betas": (0.9, 0.999), "eps": 1e-8}
"""torch.optim.AdamW's arguments as the Trainer passes them (TrainingArguments' adam_beta1/2, adam_epsilon)."""


BNB_8BIT = QuantizedState(bits=8, shared_code_tables=2)
"""bitsandbytes' blockwise 8-bit Adam (bitsandbytes 0.50 `Optimizer2State.init_state`): uint8 codes,
fp32 absmax per 256 elements (the last block partial), fp32 moments under 4096 elements, `step` a
Python int, and the `dynamic`/`udynamic` code tables of 256 fp32 once per optimizer."""


def _torchao(bits: Literal[4, 8]) -> QuantizedState:
    """torchao's AdamW8bit / AdamW4bit as the Trainer builds them (transformers `_get_torchao_optimizer`
    passes block_size=256 to both): torchao 0.18 `optim/subclass_{8,4}bit.py` `zeros` and
    `optim/adam.py` `_new_buffer` (quantized only when n >= 4096 and n % block_size == 0, else
    `zeros_like(p)`), a code table of 2**bits fp32 per moment, an fp32 `step` tensor."""
    return QuantizedState(bits=bits, whole_blocks=True, code_table_entries=2**bits, small_dtype="param",
                          step_tensor=True)


_SPECS = (
    OptimizerSpec(name="adamw_torch", description="torch.optim.AdamW (foreach)", optimizer_class="torch.optim.AdamW",
                  optimizer_kwargs={**ADAMW_ARGUMENTS, "foreach": True},
                  state_bytes_per_param=8, half_state_bytes_per_param=4),
    OptimizerSpec(name="adamw_torch_fused", description="torch.optim.AdamW(fused=True): one kernel per step",
                  optimizer_class="torch.optim.AdamW", optimizer_kwargs={**ADAMW_ARGUMENTS, "fused": True},
                  state_bytes_per_param=8, half_state_bytes_per_param=4, searched=True),
    OptimizerSpec(name="adafactor", description="transformers' Adafactor: factored second moment",
                  optimizer_class="transformers.optimization.Adafactor",
                  optimizer_kwargs={"scale_parameter": False, "relative_step": False}, state_bytes_per_param=None,
                  half_state_bytes_per_param=None, searched=True, runs_on_fsdp2=False, flat_moments=1, fp32_moments=True),
    OptimizerSpec(name="adamw_bnb_8bit", description="bitsandbytes AdamW8bit: blockwise 8-bit moments",
                  optimizer_class=None, state_bytes_per_param=2, half_state_bytes_per_param=2,
                  package="bitsandbytes", searched=True, quantized_state=BNB_8BIT),
    OptimizerSpec(name="adamw_torch_8bit", description="torchao AdamW8bit: blockwise 8-bit moments",
                  optimizer_class=None, state_bytes_per_param=2, half_state_bytes_per_param=2,
                  package="torchao", quantized_state=_torchao(8)),
    OptimizerSpec(name="adamw_torch_4bit", description="torchao AdamW4bit: blockwise 4-bit moments",
                  optimizer_class=None, state_bytes_per_param=1, half_state_bytes_per_param=1,
                  package="torchao", quantized_state=_torchao(4)),
    OptimizerSpec(name="paged_adamw_8bit", description="bitsandbytes PagedAdamW8bit: 8-bit moments in unified memory",
                  optimizer_class=None, state_bytes_per_param=2, half_state_bytes_per_param=2,
                  package="bitsandbytes", quantized_state=BNB_8BIT),
    OptimizerSpec(name="paged_adamw_32bit", description="bitsandbytes PagedAdamW32bit: fp32 moments in unified memory",
                  optimizer_class=None, state_bytes_per_param=8, half_state_bytes_per_param=8,
                  package="bitsandbytes", quantized_state=QuantizedState(bits=32)),
    OptimizerSpec(name="sgd", description="torch.optim.SGD with momentum 0.9", optimizer_class="torch.optim.SGD",
                  # foreach: PyTorch's default on CUDA only (torch.optim.optimizer._default_to_fused_or_foreach)
                  optimizer_kwargs={"momentum": 0.9, "foreach": True}, flat_moments=1,
                  state_bytes_per_param=4, half_state_bytes_per_param=2, trainer_kwargs={"optim_args": "momentum=0.9"}),
)
OPTIMIZERS: dict[str, OptimizerSpec] = {spec.name: spec for spec in _SPECS}
"""Every optimizer anatomist models, by TrainingArguments name, in the order `--help` lists them."""

def runs_with(optim: str, fsdp: str) -> bool:
    """Whether `optim` runs with `TrainingArguments.fsdp` = `fsdp` (`OptimizerSpec.runs_on_fsdp2`)."""
    return fsdp == "none" or optimizer(optim).runs_on_fsdp2


DEFAULT_SEARCH: tuple[str, ...] = tuple(name for name, spec in OPTIMIZERS.items() if spec.searched)
"""What `anatomist plan` searches by default: fused AdamW and the seeds' two memory-saving optimizers
(SGD is left out: it changes the optimisation algorithm, not just its cost)."""


def optimizer(name: str) -> OptimizerSpec:
    """The spec of `name`.

    Raises:
        InputError: an optimizer anatomist does not model (naming those it does).
    """
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise InputError(f"unknown optim {name!r}; known: {', '.join(OPTIMIZERS)}") from None
