"""GPU catalog (data/gpus.toml), looked up by the names people write and by the names NVML reports.

Three ways to name a GPU, three entry points:

- `get_gpu(name)`: what a user writes after `--gpu` ("4090", "a100 80gb", "H100-80GB",
  "rtx 6000 ada"); an ambiguous or unknown name is an InputError with the candidates.
- `match_catalog(nvml_name, total_bytes)`: what `nvmlDeviceGetName` returns ("NVIDIA H100 80GB
  HBM3", "Tesla V100-SXM2-16GB"), with the device's memory to tell apart variants whose name
  does not say their size.
- `detect_local_gpu()`: the GPU of this machine, through NVML, matched as above.

Both matchers work on the same word tokens (`name_tokens`), so "L4" never matches "L40S" and
"RTX A6000" never matches "RTX 6000 Ada Generation": words are compared whole, never as
substrings.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from typing import Literal

from anatomist.errors import InputError

Precision = Literal["fp32", "tf32", "fp16", "bf16", "fp8"]


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
    sm_count: int
    """Streaming multiprocessors: a matrix product's output tiles run on them in waves (`estimate.time.tiles`)."""
    cuda_context_bytes: int
    """Memory outside the caching allocator: CUDA context, kernels."""
    cuda_context_source: str
    source: str
    """Where every figure of the entry comes from (datasheet URL; dense or sparse)."""
    interconnect: str = ""
    """How GPUs of this model are joined in one host (a kind of plan_throughput.toml's [interconnect.kinds]; "": unknown)."""
    aliases: tuple[str, ...] = ()
    """Other names `get_gpu` accepts as they are (case, spaces and underscores aside)."""
    nvml_names: tuple[str, ...] = ()
    """What `nvmlDeviceGetName` returns for this GPU, exactly; `match_catalog` matches on these."""
    detected: bool = False
    """True when this entry describes the GPU found on this machine through NVML."""
    fp8_tflops: float = 0.0
    """Dense FP8 tensor-core peak with FP32 accumulation (torch._scaled_mm); 0 where the GPU has no FP8 (before Ada)."""
    catalog_name: str = ""
    """The catalog entry's name: what calibrations and generations are keyed by (`name` of a detected GPU also
    says what NVML calls it). Set by `__post_init__` where not given."""

    def __post_init__(self) -> None:
        if not self.catalog_name:
            object.__setattr__(self, "catalog_name", self.name)

    @property
    def tf32(self) -> bool:
        return self.tf32_tflops > 0

    @property
    def fp8(self) -> bool:
        """Whether the tensor cores multiply FP8 (Ada, Hopper, Blackwell: compute capability 8.9 and newer)."""
        return self.fp8_tflops > 0

    def peak_tflops(self, precision: Precision) -> float:
        """Dense peak for the matrix products of a run in `precision` (tf32 falls back to fp32)."""
        value = {
            "fp32": self.fp32_tflops,
            "tf32": self.tf32_tflops or self.fp32_tflops,
            "fp16": self.fp16_tflops,
            "bf16": self.bf16_tflops,
            "fp8": self.fp8_tflops,
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
            "fp8_tflops": self.fp8_tflops,
            "bf16": self.bf16,
            "compute_capability": self.compute_capability,
            "sm_count": self.sm_count,
            "cuda_context_bytes": self.cuda_context_bytes,
            "detected": self.detected,
        }


def cublas_workspace_bytes(compute_capability: str) -> int:
    """Bytes PyTorch's cuBLAS workspace takes from the caching allocator, per handle.

    Source: PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp `getChosenWorkspaceSize`: the
    default CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8" (4096 KiB x 2 + 16 KiB x 8) before Hopper,
    32 MiB on compute capability 9.0 and newer.
    """
    major = int(compute_capability.split(".")[0])
    if major >= 9:
        return 32 * 2**20
    return 4096 * 1024 * 2 + 16 * 1024 * 8



@cache
def catalog() -> dict[str, GPU]:
    """All GPUs of the shipped catalog, by canonical name.

    Raises:
        ValueError: the data file is inconsistent: two entries that NVML would name alike have
            the same memory, so nothing could tell them apart (a bug in gpus.toml, not user input).
    """
    raw = tomllib.loads(resources.files("anatomist.data").joinpath("gpus.toml").read_text())
    defaults = raw["defaults"]
    gpus = {}
    for name, spec in raw["gpus"].items():
        spec = {**spec}
        spec.setdefault("cuda_context_bytes", defaults["cuda_context_bytes"])
        spec.setdefault("cuda_context_source", defaults["cuda_context_source"])
        spec["aliases"] = tuple(spec.get("aliases", ()))
        spec["nvml_names"] = tuple(spec.get("nvml_names", ()))
        gpus[name] = GPU(name=name, **spec)
    seen: dict[tuple[frozenset[str], int], str] = {}
    for gpu in gpus.values():
        for nvml_name in gpu.nvml_names:
            key = (nvml_identity(nvml_name), gpu.memory_bytes)
            if seen.setdefault(key, gpu.name) != gpu.name:
                raise ValueError(f"gpus.toml: {seen[key]} and {gpu.name} have the same NVML identity and memory")
    return gpus


# --- names -------------------------------------------------------------------------------------

_BRANDS = frozenset({"nvidia", "geforce", "tesla"})
"""Words that do not tell GPUs apart (drivers have written "Tesla" and "NVIDIA" for the same card)."""
_MEMORY_TYPES = frozenset({"hbm2", "hbm2e", "hbm3", "hbm3e", "gddr6", "gddr6x", "gddr7"})
_FORMS = frozenset({"pcie", "nvl"})
"""Form factors that must be asked for by name: without one, a name means the SXM part."""
_SIZE = re.compile(r"\d+gb")


def name_tokens(name: str) -> tuple[str, ...]:
    """The words of a GPU name, normalized so that the ways people and drivers write one name agree.

    Lower case; split at anything that is not a letter or digit; brand words dropped; a size
    written "80GB", "80 GB", "80GiB" or "144G" becomes "80gb"/"144gb"; "sxm2"/"sxm4"/"sxm5"
    become "sxm". Example: "NVIDIA A100-SXM4-80GB" -> ("a100", "sxm", "80gb").
    """
    text = re.sub(r"(?<![a-z0-9])(\d+)\s*(?:gib|gb|g)(?![a-z0-9])", r"\1gb", name.lower())
    tokens = []
    for token in re.split(r"[^a-z0-9]+", text):
        if not token or token in _BRANDS:
            continue
        tokens.append("sxm" if re.fullmatch(r"sxm\d*", token) else token)
    return tuple(tokens)


def nvml_identity(nvml_name: str) -> frozenset[str]:
    """The words of an NVML name that say which product it is, without size, memory type or SXM.

    "NVIDIA A100-SXM4-40GB" and "NVIDIA A100-SXM4-80GB" share the identity {"a100"} (memory
    tells them apart); "NVIDIA A100-PCIE-40GB" is {"a100", "pcie"}; "NVIDIA L40S" is {"l40s"},
    never {"l4"}.
    """
    return frozenset(
        t for t in name_tokens(nvml_name) if t != "sxm" and t not in _MEMORY_TYPES and not _SIZE.fullmatch(t)
    )


@cache
def _vocabulary() -> dict[str, frozenset[str]]:
    """Every word each catalog GPU is known by: its name, its aliases and its NVML names."""
    return {
        gpu.name: frozenset(t for n in (gpu.name, *gpu.aliases, *gpu.nvml_names) for t in name_tokens(n))
        for gpu in catalog().values()
    }


def _key(name: str) -> str:
    return name.lower().replace("_", "-").replace(" ", "-")


def get_gpu(name: str) -> GPU:
    """Look a GPU up by the name a user writes; `local` (or `auto`) means the detected GPU.

    The rule, in order:

    1. A catalog name or alias, case, spaces and underscores aside ("A100_80GB", "rtx4090").
    2. Otherwise the words of `name` (see `name_tokens`) must all be words of exactly one
       entry's names, aliases or NVML names: "4090" -> RTX-4090, "rtx 6000 ada" ->
       RTX-6000-Ada, "a100 80gb" -> A100-80GB, "NVIDIA H100 80GB HBM3" -> H100-SXM.
    3. PCIe and NVL parts are only chosen when the name says "pcie" or "nvl": a bare "h100"
       is the H100 SXM 80GB (the one clouds rent most), "h100 pcie" and "h100 nvl" the others;
       likewise "a100 80gb" is the SXM part.

    Raises:
        InputError: the name fits several entries ("ambiguous GPU 'a100': A100-40GB,
            A100-80GB; say which") or none (with the closest names).
    """
    if _key(name) in ("local", "auto"):
        local = detect_local_gpu()
        if local is None:
            raise InputError("--gpu local: no NVIDIA GPU found through NVML on this machine; name one (see `anatomist gpus`)")
        return local
    gpus = catalog()
    for gpu in gpus.values():
        if _key(name) in {_key(n) for n in (gpu.name, *gpu.aliases)}:
            return gpu
    words = set(name_tokens(name))
    vocabulary = _vocabulary()
    fits = [
        g for g in gpus.values()
        if words and words <= vocabulary[g.name] and (vocabulary[g.name] & _FORMS) <= words
    ]
    if len(fits) == 1:
        return fits[0]
    if fits:
        raise InputError(f"ambiguous GPU {name!r}: {', '.join(g.name for g in fits)}; say which")
    raise InputError(f"unknown GPU {name!r}{_suggestion(name, words)}")


def _suggestion(name: str, words: set[str]) -> str:
    """'; did you mean A, B? (all: `anatomist gpus`)' or, with nothing close, the whole catalog."""
    vocabulary = _vocabulary()
    product_words = {w for w in words if not _SIZE.fullmatch(w)}
    close = [g for g, vocab in vocabulary.items() if product_words & vocab - {"rtx", "sxm"}]
    if not close:
        keys = {_key(n): g.name for g in catalog().values() for n in (g.name, *g.aliases)}
        close = list(dict.fromkeys(keys[k] for k in difflib.get_close_matches(_key(name), list(keys), n=3, cutoff=0.5)))
    if close:
        return f"; did you mean {', '.join(close)}? (all: `anatomist gpus`)"
    return f" (known: {', '.join(catalog())})"


def match_catalog(nvml_name: str, total_bytes: int) -> GPU | None:
    """The catalog entry for a device NVML names `nvml_name` with `total_bytes` of memory, or None.

    The NVML name's identity (`nvml_identity`) must equal the identity of one of an entry's
    `nvml_names`: words are compared whole, so "NVIDIA L40S" is not the L4 and "NVIDIA GeForce
    RTX 4090 D" is not the 4090. Where several entries share the identity (A100 40GB and 80GB,
    GH200 96GB and 144GB), a size written in the name decides ("A100-SXM4-80GB"), else the
    entry whose memory is nearest `total_bytes`.

    Known limitations: a GPU, or a spelling, that no entry lists returns None rather than a
    guess; add its NVML name to `nvml_names` in data/gpus.toml.
    """
    identity = nvml_identity(nvml_name)
    same = [g for g in catalog().values() if identity in {nvml_identity(n) for n in g.nvml_names}]
    sizes = {t for t in name_tokens(nvml_name) if _SIZE.fullmatch(t)}
    if sizes:
        vocabulary = _vocabulary()
        same = [g for g in same if sizes <= vocabulary[g.name]] or same
    return min(same, key=lambda g: abs(g.memory_bytes - total_bytes), default=None)


# --- detection ---------------------------------------------------------------------------------


def detect_local_gpu() -> GPU | None:
    """The local GPU via NVML (nvidia-ml-py), matched to the catalog (`match_catalog`); None
    without an NVIDIA GPU or when the catalog does not know it. The entry keeps its catalog
    figures but takes NVML's total memory, and its name says both ("H100-SXM (NVIDIA H100 80GB HBM3)")."""
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
    return replace(match, name=f"{match.name} ({name})", memory_bytes=total, detected=True, catalog_name=match.name)
