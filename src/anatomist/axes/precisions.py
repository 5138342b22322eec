"""The precisions a recipe trains in: the load dtype, autocast and TF32 together, one spec each.

A precision is not one Recipe field but four (`dtype`, `fp16`, `bf16`, `tf32`; plus the compute
dtype of a 4-bit base): each spec names the fields that make it, what the GPU needs for it, and
whether the plan searches it. Which precision a given recipe trains in, and the dtypes it computes
in, are read from its fields in `recipe/axis_values.py`.

fp32/tf32/fp16/bf16 keep fp32 master weights (loaded in float32; fp16/bf16 autocast per op);
bf16-weights loads the weights in bfloat16 and trains in pure bf16 (how most LLM checkpoints
load in transformers 5, with --bf16 on top as people run it): no fp32 master weights. fp16-weights is
LoRA's on a GPU without bf16 (a T4, a V100): the frozen base in float16, fp16 autocast, PEFT's fp32
adapters under the GradScaler; searched for adapters only, and like fp16 only where bf16 is not as fast. QLoRA's
nf4+bf16 / nf4+fp16 dequantize the 4-bit base to the autocast dtype for each product, the model
loaded in that dtype as TRL loads it (`prepare_model_for_kbit_training` then casts every
non-quantized parameter to fp32).

fp8 is accelerate's `mixed_precision="fp8"` with torchao's backend (AO): bf16 autocast, and the linear layers
converted to torchao's Float8Linear (accelerate's `convert_model_to_fp8_ao`: every nn.Linear whose sizes are
multiples of 16 but the model's first and last), whose matrix products run in FP8 with per-tensor
("tensorwise", accelerate's default) or per-row ("rowwise") scales. The plan searches it only when asked
(`--precisions fp8`): its time is not yet checked against a GPU run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from anatomist.errors import InputError

if TYPE_CHECKING:
    from anatomist.hardware import GPU

LoadDtype = Literal["auto", "float32", "bfloat16", "float16"]
"""`Recipe.dtype`: what from_pretrained(dtype=...) takes; "auto" is the checkpoint's own, settled per model."""
LOAD_DTYPES: tuple[str, ...] = get_args(LoadDtype)
WeightsDtype = Literal["float32", "bfloat16", "float16"]
Autocast = Literal["no", "fp16", "bf16"]
Fp8 = Literal["none", "tensorwise", "rowwise"]
"""`Recipe.fp8`: torchao's float8 training recipe (`Float8LinearConfig.from_recipe_name`), or none."""
FP8_RECIPES: tuple[str, ...] = get_args(Fp8)

AUTOCAST_DTYPES: dict[str, str] = {"fp16": "float16", "bf16": "bfloat16"}
"""torch dtype name of each autocast (`--fp16`, `--bf16`)."""
HALF_DTYPES: tuple[str, ...] = ("bfloat16", "float16")


@dataclass(frozen=True, slots=True, kw_only=True)
class PrecisionSpec:
    """One precision the plan can search."""

    name: str
    description: str
    weights_dtype: WeightsDtype
    """The load dtype (`from_pretrained(dtype=...)`)."""
    autocast: Autocast
    """The Trainer's `--fp16` / `--bf16` autocast."""
    tf32: bool
    """TF32 tensor cores for fp32 matrix products."""
    quantized_base: bool = False
    """QLoRA's: the base's linear weights are 4-bit, dequantized to the autocast dtype."""
    fp8: Fp8 = "none"
    """torchao's float8 linear layers on top of the autocast (accelerate's mixed_precision="fp8")."""
    searched: bool = True
    """Searched by `anatomist plan` (where the GPU supports it) unless --precisions says otherwise."""
    adapters_only: bool = False
    """Searched for LoRA only: a half-precision base that full fine-tuning cannot train (the GradScaler refuses to
    unscale fp16 gradients), while PEFT's adapters are fp32."""

    @property
    def fields(self) -> dict[str, object]:
        """The Recipe fields that make this precision."""
        fields: dict[str, object] = {"dtype": self.weights_dtype, "fp16": self.autocast == "fp16",
                                     "bf16": self.autocast == "bf16", "tf32": self.tf32, "fp8": self.fp8}
        if self.quantized_base:
            fields["bnb_4bit_compute_dtype"] = AUTOCAST_DTYPES[self.autocast]
        return fields

    def unsupported_reason(self, gpu: GPU) -> str | None:
        """Why `gpu` cannot run this precision (bf16 and TF32 need Ampere or newer); None where it can."""
        if (self.autocast == "bf16" or self.weights_dtype == "bfloat16") and not gpu.bf16:
            return f"bf16: {gpu.name} has no bf16 support (needs compute capability >= 8.0)"
        if self.tf32 and not gpu.tf32:
            return f"tf32: {gpu.name} has no TF32 tensor cores (compute capability {gpu.compute_capability})"
        if self.fp8 != "none" and not gpu.fp8:
            return f"fp8: {gpu.name} has no FP8 tensor cores (compute capability {gpu.compute_capability}; needs 8.9+)"
        return None


_SPECS = (
    PrecisionSpec(name="fp32", description="fp32 weights, no autocast", weights_dtype="float32", autocast="no",
                  tf32=False),
    PrecisionSpec(name="tf32", description="fp32 weights, TF32 matrix products", weights_dtype="float32",
                  autocast="no", tf32=True),
    PrecisionSpec(name="bf16", description="fp32 master weights, bf16 autocast, TF32 for what stays fp32",
                  weights_dtype="float32", autocast="bf16", tf32=True),
    PrecisionSpec(name="bf16-weights", description="weights loaded in bf16, pure bf16 training (no master copy)",
                  weights_dtype="bfloat16", autocast="bf16", tf32=False),
    PrecisionSpec(name="fp16", description="fp32 master weights, fp16 autocast + GradScaler",
                  weights_dtype="float32", autocast="fp16", tf32=False),
    PrecisionSpec(name="fp16-weights", description="LoRA: the frozen base loaded in fp16, fp16 autocast + GradScaler "
                  "(the adapters fp32, as PEFT makes them)", weights_dtype="float16", autocast="fp16", tf32=False,
                  adapters_only=True),
    PrecisionSpec(name="fp8", description="fp32 master weights, bf16 autocast, FP8 linear layers (torchao, tensorwise)",
                  weights_dtype="float32", autocast="bf16", tf32=True, fp8="tensorwise", searched=False),
    PrecisionSpec(name="fp8-bf16-weights", description="weights loaded in bf16, bf16 autocast, FP8 linear layers "
                  "(torchao, tensorwise)", weights_dtype="bfloat16", autocast="bf16", tf32=False, fp8="tensorwise",
                  searched=False),
    PrecisionSpec(name="nf4+bf16", description="QLoRA: 4-bit base dequantized to bf16", weights_dtype="bfloat16",
                  autocast="bf16", tf32=False, quantized_base=True),
    PrecisionSpec(name="nf4+fp16", description="QLoRA: 4-bit base dequantized to fp16", weights_dtype="float16",
                  autocast="fp16", tf32=False, quantized_base=True),
)
PRECISIONS: dict[str, PrecisionSpec] = {spec.name: spec for spec in _SPECS}
"""The precisions the plan can search, by name (`plan --precisions`), in search order."""
FULL_PRECISIONS: tuple[str, ...] = tuple(n for n, s in PRECISIONS.items() if not s.quantized_base)
"""What a full or LoRA fine-tune can be searched in (`plan --precisions`)."""


def precision(name: str) -> PrecisionSpec:
    """The spec of `name`.

    Raises:
        InputError: a name not in PRECISIONS.
    """
    try:
        return PRECISIONS[name]
    except KeyError:
        raise InputError(f"unknown precision {name!r}; known: {', '.join(PRECISIONS)}") from None


def searchable_on(gpu: GPU) -> tuple[list[str], list[str]]:
    """(full-precision names the plan searches on `gpu`, in PRECISIONS' order; notes on those left out).

    fp16 is left out where bf16 has the same dense peak: same memory and speed, and bf16
    needs no loss scaling (seeds: "bf16 ... no need for loss scaling").
    """
    searched: list[str] = []
    notes: list[str] = []
    for spec in PRECISIONS.values():
        if spec.quantized_base or not spec.searched:
            continue
        reason = spec.unsupported_reason(gpu)
        if reason is None and spec.autocast == "fp16" and gpu.bf16 and gpu.fp16_tflops <= gpu.bf16_tflops:
            reason = (f"fp16: not searched; bf16 has the same dense peak on {gpu.name} ({gpu.bf16_tflops:g} TFLOP/s) "
                      "and needs no loss scaling")
        if reason is None and (spec.autocast != "fp16" or gpu.fp16_tflops > 0):
            searched.append(spec.name)
        elif reason is not None and reason not in notes:
            notes.append(reason)
    return searched, notes


def qlora_precision(gpu: GPU) -> str:
    """QLoRA's one precision on `gpu`: bf16 where it has it, else fp16."""
    return "nf4+bf16" if gpu.bf16 else "nf4+fp16"
