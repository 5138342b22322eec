"""What the seeds' "Efficient Software Prebuilds" section cares about, read off this machine."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
from dataclasses import asdict, dataclass, field

from anatomist.hardware import detect_local_gpu

OPTIONAL_PACKAGES = ("bitsandbytes", "deepspeed", "flash_attn", "apex", "torchao")


@dataclass(kw_only=True, slots=True)
class Environment:
    python: str
    torch: str
    transformers: str
    cuda: str | None
    """CUDA version torch was built with (None: a CPU build)."""
    driver: str | None
    gpu: str | None
    bf16: bool | None
    tf32: bool | None
    packages: dict[str, str | None] = field(default_factory=dict)
    """Optional packages: version, or None when not importable."""
    advice: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _version(name: str) -> str | None:
    if importlib.util.find_spec(name) is None:
        return None
    dist = {"flash_attn": "flash-attn"}.get(name, name)
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "importable"


def read_environment() -> Environment:
    import torch
    import transformers

    driver = None
    try:
        import pynvml

        pynvml.nvmlInit()
        raw = pynvml.nvmlSystemGetDriverVersion()
        driver = raw.decode() if isinstance(raw, bytes) else raw
        pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVIDIA driver on this machine
        driver = None
    gpu = detect_local_gpu()
    env = Environment(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        cuda=torch.version.cuda,
        driver=driver,
        gpu=gpu.name if gpu else None,
        bf16=gpu.bf16 if gpu else None,
        tf32=gpu.tf32 if gpu else None,
        packages={name: _version(name) for name in OPTIONAL_PACKAGES},
    )
    env.advice = list(_advice(env))
    return env


def _advice(env: Environment):  # noqa: ANN202 - generator of str
    if env.cuda is None:
        yield "torch is a CPU build: `estimate` and `plan` work offline; `bench`/`profile` measure the CPU only"
    if env.gpu is None:
        yield "no NVIDIA GPU found through NVML: pass --gpu NAME to estimate for a catalog GPU"
    elif env.bf16:
        yield "this GPU supports bf16 and tf32: prefer --bf16 (no loss scaling) and --tf32 for fp32 matmuls"
    else:
        yield "this GPU has no bf16: use --fp16 for mixed precision"
    if env.packages.get("bitsandbytes") is None:
        yield "bitsandbytes is missing: adamw_bnb_8bit (8-bit Adam, ~2 B/param of state) needs `pip install bitsandbytes`"
    if env.packages.get("flash_attn") is None:
        yield "flash-attn is missing: use --attn-implementation sdpa (PyTorch's fused attention) instead of flash_attention_2"
    if env.packages.get("deepspeed") is None:
        yield "deepspeed is missing: ZeRO stages and offload need `pip install deepspeed`"
    if env.packages.get("apex") is None:
        yield "apex is not installed: not needed (its fused optimizers are in PyTorch: --optim adamw_torch_fused)"
