"""How bitsandbytes stores a quantized base (`load_in_4bit` / `load_in_8bit`), in numbers.

Read by the tracer, which lays the base out this way (`trace/step/peft.py`), and by the
bytes-per-parameter rule (`estimate/rules.py`). Source: bitsandbytes 0.50 `Params4bit`
(`blocksize=64`), `quantize_4bit` with `compress_statistics` (the nested absmax), `Int8Params`.
"""

from __future__ import annotations

from typing import Literal, get_args

QuantType = Literal["nf4", "fp4"]
"""BitsAndBytesConfig.bnb_4bit_quant_type: QLoRA's NormalFloat or plain 4-bit floats (the same memory)."""
QUANT_TYPES: tuple[str, ...] = get_args(QuantType)

BLOCK_4BIT = 64
"""Elements per absmax block of bitsandbytes' 4-bit quantization (Params4bit's default blocksize)."""
NESTED_BLOCK = 256
"""Blocks per second-level absmax with double quantization (bitsandbytes' nested blocksize)."""
