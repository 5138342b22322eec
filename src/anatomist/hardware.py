"""GPU catalog (data/gpus.toml) and detection of the local GPU through NVML."""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Literal

from anatomist.errors import InputError

Precision = Literal["fp32", "tf32", "fp16", "bf16"]


@dataclass(kw_only=True, slots=True, frozen=True)
class GPU:
    """One GPU model: capacity, dense peak rates and where those figures come from."""

    name: str
    memory_bytes: int
    """Total device memory as NVML reports it (or the nominal capacity)."""
    bandwidth_gbps: float
    """Peak memory bandwidth, GB/s (10**9 bytes per second)."""
    fp32_tflops: float
    tf32_tflops: float
    fp16_tflops: float
    bf16_tflops: float
    """Dense peak TFLOP/s per dtype (no structured sparsity)."""
    bf16: bool
    """Whether the tensor cores support bf16 (Ampere or newer)."""
    compute_capability: str
    cuda_context_bytes: int
    """Memory outside the caching allocator: CUDA context, kernels."""
    cuda_context_source: str
    source: str
    aliases: tuple[str, ...] = ()
    detected: bool = False
    """True when this entry describes the GPU found on this machine through NVML."""

    @property
    def tf32(self) -> bool:
        return self.tf32_tflops > 0

    def peak_tflops(self, precision: Precision) -> float:
        """Dense peak for the matrix products of a run in `precision` (tf32 falls back to fp32)."""
        value = {
            "fp32": self.fp32_tflops,
            "tf32": self.tf32_tflops or self.fp32_tflops,
            "fp16": self.fp16_tflops,
            "bf16": self.bf16_tflops,
        }[precision]
        return value

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "bandwidth_gbps": self.bandwidth_gbps,
            "fp32_tflops": self.fp32_tflops,
            "tf32_tflops": self.tf32_tflops,
            "fp16_tflops": self.fp16_tflops,
            "bf16_tflops": self.bf16_tflops,
            "bf16": self.bf16,
            "compute_capability": self.compute_capability,
            "cuda_context_bytes": self.cuda_context_bytes,
            "detected": self.detected,
        }


@cache
def catalog() -> dict[str, GPU]:
    """All GPUs of the shipped catalog, by canonical name."""
    raw = tomllib.loads(resources.files("anatomist.data").joinpath("gpus.toml").read_text())
    defaults = raw["defaults"]
    gpus = {}
    for name, spec in raw["gpus"].items():
        spec = {**spec}
        spec.setdefault("cuda_context_bytes", defaults["cuda_context_bytes"])
        spec.setdefault("cuda_context_source", defaults["cuda_context_source"])
        spec["aliases"] = tuple(spec.get("aliases", ()))
        gpus[name] = GPU(name=name, **spec)
    return gpus


def _key(name: str) -> str:
    return name.lower().replace("_", "-").replace(" ", "-")


def get_gpu(name: str) -> GPU:
    """Look a GPU up by name or alias, case-insensitively; `local` means the detected GPU.

    Raises:
        InputError: unknown name (with the closest known names).
    """
    if _key(name) in ("local", "auto"):
        local = detect_local_gpu()
        if local is None:
            raise InputError("--gpu local: no NVIDIA GPU found through NVML on this machine; name one (see `anatomist gpus`)")
        return local
    by_key = {}
    for gpu in catalog().values():
        by_key[_key(gpu.name)] = gpu
        for alias in gpu.aliases:
            by_key[_key(alias)] = gpu
    if _key(name) in by_key:
        return by_key[_key(name)]
    close = difflib.get_close_matches(_key(name), list(by_key), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(by_key[c].name for c in close)}?" if close else ""
    raise InputError(f"unknown GPU {name!r}{hint} (known: {', '.join(catalog())})")


def detect_local_gpu() -> GPU | None:
    """The local GPU via NVML (nvidia-ml-py), matched to the catalog by name; None without one."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no library: no GPU
        return None
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        raw_name = pynvml.nvmlDeviceGetName(handle)
        name = raw_name.decode() if isinstance(raw_name, bytes) else raw_name
        total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    finally:
        pynvml.nvmlShutdown()
    match = match_catalog(name, total)
    if match is None:
        return None
    return GPU(**{**_fields(match), "name": f"{match.name} ({name})", "memory_bytes": total, "detected": True})


def _fields(gpu: GPU) -> dict[str, object]:
    return {f: getattr(gpu, f) for f in GPU.__slots__}  # type: ignore[attr-defined]


def match_catalog(nvml_name: str, total_bytes: int) -> GPU | None:
    """Map an NVML name such as 'NVIDIA H100 80GB HBM3' to the closest catalog entry."""
    lowered = nvml_name.lower()
    candidates = []
    for gpu in catalog().values():
        family = gpu.name.split("-")[0].lower().replace("rtx", "")
        if family and family in lowered.replace("rtx ", ""):
            candidates.append(gpu)
    if "pcie" in lowered:
        candidates = [g for g in candidates if "pcie" in g.name.lower()] or candidates
    elif candidates:
        candidates = [g for g in candidates if "pcie" not in g.name.lower()] or candidates
    if not candidates:
        return None
    return min(candidates, key=lambda g: abs(g.memory_bytes - total_bytes))
