"""LoRA and QLoRA on the traced model: the real `peft` library over a base laid out as
bitsandbytes lays it out.

On the meta model, before its tensors become fake:
1. quantization (`load_in_4bit` / `load_in_8bit`): every nn.Linear but the output head (what
   transformers' bitsandbytes integration replaces; the recipe's llm_int8_skip_modules instead where it names
   them; a Mixture of Experts' fused 3D experts are no nn.Linear and stay in the load dtype, as transformers 5
   leaves them) becomes a `QuantizedLinearLayout` holding
   what bitsandbytes keeps on the device. 4-bit (`Params4bit`, blocks of 64): the packed codes,
   2 per byte, and per block an fp32 absmax; with double quantization the absmax is uint8 with
   an fp32 absmax per 256 blocks and a 256-entry fp32 code; a 16-entry fp32 code per layer.
   8-bit (`Int8Params`, LLM.int8): int8 codes and an fp32 scale per output row. Each forward
   dequantizes the weight to a full-size temporary for the product, and so does each
   backward (bitsandbytes' MatMul4Bit saves only the codes): charged as the temporaries they are.
2. `peft.prepare_model_for_kbit_training` (quantized bases, as QLoRA users call it): the
   non-quantized parameters to fp32, input gradients, gradient checkpointing; under Cut Cross-Entropy the norms,
   embeddings and head then back in the weights' dtype, as axolotl's loader turns them (`_half_head_for_cce`).
3. `peft.get_peft_model` with a real `LoraConfig`: which modules (and, with target_parameters, which fused expert
   weights: lora.ParamWrapper) are targeted, the adapters' shapes and dtypes and which parameters are trainable are
   PEFT's own. A target parameter the model lacks is refused first (PEFT skips it where another matches).

Known limitations: the dequantization kernels' own workspaces are not modelled; 8-bit
training is laid out as LLM.int8's storage but its outlier decomposition (a few columns kept
in half precision per forward) is not modelled.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from anatomist.axes.quantization import BLOCK_4BIT, NESTED_BLOCK
from anatomist.errors import InputError
from anatomist.recipe import ResolvedRecipe
from anatomist.recipe.spellings import lora_config_kwargs
from anatomist.workload import PEFT_TASK_TYPES

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _DequantizedMatmul(torch.autograd.Function):
    """out = x @ dequant(W).T + b, saving nothing but the codes (as bitsandbytes' MatMul4Bit)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codes: torch.Tensor, bias: torch.Tensor | None,
                shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        weight = torch.empty(shape, dtype=dtype)  # the dequantized weight: a temporary
        ctx.save_for_backward(codes)
        ctx.shape, ctx.dtype = shape, dtype
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        weight = torch.empty(ctx.shape, dtype=ctx.dtype)  # dequantized again for the input's gradient
        return grad_out @ weight.to(grad_out.dtype), None, None, None, None


class QuantizedLinearLayout(torch.nn.Linear):
    """A bitsandbytes linear layer's device memory, with its dequantize-per-product behaviour.

    A subclass of nn.Linear so that PEFT wraps it as it wraps a linear layer (in_features,
    out_features and a non-floating `weight`: adapters are made in fp32, as over Params4bit).
    """

    def __init__(self, linear: torch.nn.Linear, recipe: ResolvedRecipe) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        n = self.in_features * self.out_features
        self.original_dtype = linear.weight.dtype
        self.compute_dtype = _DTYPES[recipe.bnb_4bit_compute_dtype] if recipe.load_in_4bit else self.original_dtype
        if recipe.load_in_4bit:
            codes = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8)
            blocks = math.ceil(n / BLOCK_4BIT)
            if recipe.bnb_4bit_use_double_quant:
                self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8))
                self.register_buffer("nested_absmax", torch.empty(math.ceil(blocks / NESTED_BLOCK), dtype=torch.float32))
                self.register_buffer("nested_code", torch.empty(256, dtype=torch.float32))
                self.register_buffer("offset", torch.empty((), dtype=torch.float32))
            else:
                self.register_buffer("absmax", torch.empty(blocks, dtype=torch.float32))
            self.register_buffer("code", torch.empty(16, dtype=torch.float32))
        else:  # LLM.int8: int8 codes, one fp32 scale per output row (SCB)
            codes = torch.empty((self.out_features, self.in_features), dtype=torch.int8)
            self.register_buffer("SCB", torch.empty(self.out_features, dtype=torch.float32))
        self.weight = torch.nn.Parameter(codes, requires_grad=False)
        self.bias = linear.bias

    @property
    def original_numel(self) -> int:
        return self.in_features * self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x = x.to(self.compute_dtype)
        bias = self.bias.to(self.compute_dtype) if self.bias is not None else None
        out = _DequantizedMatmul.apply(x, self.weight, bias, (self.out_features, self.in_features), self.compute_dtype)
        return out.to(in_dtype)


def _quantize(model: Any, recipe: ResolvedRecipe) -> None:
    """Replace by its bitsandbytes layout, in place, every nn.Linear of `model` (a transformers model)
    that transformers' bitsandbytes quantizer converts: not the output head, tied or last modules
    (`get_keys_to_not_convert`) or, where the recipe names them, its llm_int8_skip_modules instead, nor the model's
    `_keep_in_fp32_modules` (T5's `wo`). Only nn.Linear (`replace_with_bnb_linear`): a Mixture of Experts' fused 3D
    expert weights are nn.Parameters of their own module and stay in the load dtype (transformers 5.x)."""
    from transformers.quantizers.base import _assign_is_quantized, get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    given = [n.strip() for n in (recipe.llm_int8_skip_modules or "").split(",") if n.strip()]
    # given skip modules replace transformers' own (get_modules_to_not_convert without add_default_skips)
    skipped = [*(given or get_keys_to_not_convert(model)), *(getattr(model, "_keep_in_fp32_modules", None) or ())]
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and should_convert_module(f"{path}.{name}" if path else name, skipped):
                setattr(module, name, QuantizedLinearLayout(child, recipe))
    model.is_loaded_in_4bit = recipe.load_in_4bit  # what prepare_model_for_kbit_training checks
    model.is_loaded_in_8bit = recipe.load_in_8bit
    _assign_is_quantized(model)  # as transformers' quantizer marks a loaded model: flash_attention_2 casts by it


def apply_peft(model: torch.nn.Module, recipe: ResolvedRecipe, task: str) -> torch.nn.Module:
    """The model as `recipe` trains it: quantized base, kbit preparation, LoRA adapters (on meta)."""
    if recipe.peft == "none":
        return model
    import peft

    if recipe.quantized:
        _quantize(model, recipe)
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=recipe.gradient_checkpointing)
        if recipe.cut_cross_entropy:
            _half_head_for_cce(model, recipe.dtype)
    config = peft.LoraConfig(**lora_config_kwargs(recipe, PEFT_TASK_TYPES.get(task)))
    _check_target_parameters(model, config.target_parameters or [])
    try:
        return peft.get_peft_model(model, config)
    except ValueError as exc:
        said = str(exc).splitlines()[0]
        if config.target_parameters:
            raise InputError(f"--lora-target-parameters: {said}; {_fused_parameters(model)}") from None
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise InputError(f"--lora-target-modules: {said}; this model's linear layers: {', '.join(linear)} "
                         "(or all-linear)") from None


def _check_target_parameters(model: torch.nn.Module, named: list[str]) -> None:
    """Refuse a target parameter that names none of the model's (PEFT matches a parameter's full name or its end
    after a dot, and skips a name that matches nothing where another does).

    Raises:
        InputError: naming the missing ones and the fused parameters the model has.
    """
    names = [n for n, _ in model.named_parameters()]
    lacking = [t for t in named if not any(n == t or n.endswith("." + t) for n in names)]
    if lacking:
        raise InputError(f"--lora-target-parameters: the model has no parameter {', '.join(lacking)}; "
                         f"{_fused_parameters(model)}")


def _fused_parameters(model: torch.nn.Module) -> str:
    """The model's 3D parameters (Mixture-of-Experts' fused experts) as a target names them: after the layer index."""
    fused = sorted({in_layer(n) for n, p in model.named_parameters() if p.dim() == 3})
    return f"its fused 3D parameters: {', '.join(fused)}" if fused else "it has no fused 3D parameters (no experts to target)"


def in_layer(name: str) -> str:
    """`model.layers.3.mlp.experts.down_proj` -> `mlp.experts.down_proj` (a name without an index stays whole)."""
    parts = name.split(".")
    index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return ".".join(parts[index + 1:]) if index is not None else name


def _half_head_for_cce(model: torch.nn.Module, dtype: str) -> None:
    """What axolotl's loader does after prepare_model_for_kbit_training where Cut Cross-Entropy is on (its backward
    takes a half-precision head: `ModelLoader._convert_embedding_modules_dtype`): the norms, the embeddings and the
    output head back in the weights' dtype."""
    for name, module in model.named_modules():
        if "norm" in name or (any(m in name for m in ("embed_tokens", "lm_head")) and hasattr(module, "weight")):
            module.to(getattr(torch, dtype))


def counted_parameters(model: torch.nn.Module) -> int:
    """Parameters as the model's authors count them: a quantized weight counts its original elements."""
    total = sum(p.numel() for p in model.parameters())
    return total + sum(m.original_numel - m.weight.numel() for m in model.modules()
                       if isinstance(m, QuantizedLinearLayout))
