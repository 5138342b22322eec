"""Read what the device (or, without a GPU, the process) holds right now.

The seeds' `print_gpu_utilization` reads NVML's "memory used" and their `print_summary`
the Trainer's runtime and throughput. This module makes that a small library:

- `device_snapshot()`: NVML device memory used and utilization of GPU 0 when there is one,
  else this process's resident memory from /proc (Linux) or `resource` — and `source` says
  which, so a CPU figure is never mistaken for a GPU one.
- `allocator_stats()`: the caching allocator's own counters (allocated, reserved, their
  peaks, allocation retries, OOMs) from `torch.cuda.memory_stats`; None without CUDA.
- `measure_cuda_context_bytes()`: memory the device holds once CUDA is initialised and
  before any tensor is allocated (the seeds' "kernels take 1.3 GB"); `outside_allocator_bytes()`
  the same at any later moment, once the step's kernels have loaded (`context_bytes_now`).
"""

from __future__ import annotations

import platform
import resource
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import torch

Source = Literal["nvml", "process"]


@dataclass(kw_only=True, slots=True)
class DeviceSnapshot:
    """Memory in use right now, and where the figure comes from."""

    source: Source
    """"nvml": device memory of GPU 0 (all processes); "process": this process's RSS (no GPU)."""
    used_bytes: int
    """NVML memory used, or the process's resident set size."""
    total_bytes: int | None
    """Device capacity (NVML); None for the process figure."""
    peak_bytes: int | None
    """The process's peak resident set (VmHWM) on CPU; None on NVML (NVML keeps no peak)."""
    utilization_pct: float | None
    """NVML GPU utilization over the last sample period; None on CPU."""
    name: str
    """GPU name as NVML reports it, or "cpu"."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True, slots=True)
class AllocatorStats:
    """torch.cuda.memory_stats() counters that matter for the anatomy (bytes, counts)."""

    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    alloc_retries: int
    """cudaMalloc retries after freeing the cache: a sign of memory pressure."""
    ooms: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _nvml_snapshot() -> DeviceSnapshot | None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver or library: fall back to the process
        return None
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device() if cuda_available() else 0)
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        raw = pynvml.nvmlDeviceGetName(handle)
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        return DeviceSnapshot(
            source="nvml", used_bytes=int(info.used), total_bytes=int(info.total), peak_bytes=None,
            utilization_pct=float(util.gpu), name=name,
        )
    finally:
        pynvml.nvmlShutdown()


def _proc_status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM) in bytes; None off Linux."""
    status = Path("/proc/self/status")
    if not status.is_file():
        return None
    for line in status.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def process_snapshot() -> DeviceSnapshot:
    """This process's resident memory: what a CPU run holds (there is no device to ask)."""
    rss = _proc_status_bytes("VmRSS")
    peak = _proc_status_bytes("VmHWM")
    if peak is None:  # macOS reports ru_maxrss in bytes, Linux in KiB
        scale = 1 if sys.platform == "darwin" else 1024
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return DeviceSnapshot(
        source="process", used_bytes=rss if rss is not None else peak, total_bytes=None, peak_bytes=peak,
        utilization_pct=None, name="cpu",
    )


def device_snapshot() -> DeviceSnapshot:
    """NVML figures when a GPU is visible to this process, else the process's own memory."""
    if cuda_available():
        snap = _nvml_snapshot()
        if snap is not None:
            return snap
    return process_snapshot()


def allocator_stats() -> AllocatorStats | None:
    """The caching allocator's counters on the current CUDA device; None without CUDA."""
    if not cuda_available():
        return None
    stats = torch.cuda.memory_stats()
    return AllocatorStats(
        allocated_bytes=int(stats.get("allocated_bytes.all.current", 0)),
        reserved_bytes=int(stats.get("reserved_bytes.all.current", 0)),
        peak_allocated_bytes=int(stats.get("allocated_bytes.all.peak", 0)),
        peak_reserved_bytes=int(stats.get("reserved_bytes.all.peak", 0)),
        alloc_retries=int(stats.get("num_alloc_retries", 0)),
        ooms=int(stats.get("num_ooms", 0)),
    )


def measure_cuda_context_bytes() -> int | None:
    """Bytes the device holds for this process's CUDA context and kernels, outside the allocator.

    Initialises CUDA with a 1-element tensor (as the seeds do to see "kernels take 1.3 GB"),
    then returns device memory used (torch.cuda.mem_get_info: total - free) minus what the
    allocator reserved. Call it before anything else runs on the GPU, on an otherwise idle
    device: other processes' memory would be counted. None without CUDA.
    """
    if not cuda_available():
        return None
    torch.ones((1,), device="cuda")
    return outside_allocator_bytes()


def outside_allocator_bytes() -> int | None:
    """Device memory in use (total - free) less what the caching allocator reserved, now; None without CUDA.

    It grows after CUDA's initialisation as kernels load lazily: an H200 (CUDA 13.0, torch 2.11) held 619 MiB
    once CUDA was up and 1,366-1,382 MiB after the seeds' Trainer steps (benchmarks/gpu/H200/bench.jsonl).
    """
    if not cuda_available():
        return None
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return int(total - free - torch.cuda.memory_reserved())


def context_bytes_now(at_start: int | None) -> int | None:
    """The context measured at the start (`measure_cuda_context_bytes`), grown to what lies outside the allocator
    now, once kernels have loaded; None where nothing was measured at the start (no CUDA)."""
    return None if at_start is None else max(at_start, outside_allocator_bytes() or 0)


def reset_peaks() -> None:
    """Reset the allocator's peak counters (no-op without CUDA)."""
    if cuda_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def versions() -> dict[str, str | None]:
    """The versions of the packages a measurement depends on (bench rows and run records keep them)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("anatomist", "torch", "transformers", "accelerate", "datasets", "peft", "bitsandbytes"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    if out["anatomist"] is None:  # run from a source tree through PYTHONPATH, not installed
        from anatomist import __version__

        out["anatomist"] = f"{__version__} (source tree)"
    out["cuda"] = torch.version.cuda
    return out


def device_info() -> dict[str, Any]:
    """The device a measurement ran on: GPU 0's name, memory, compute capability and driver, or the CPU."""
    if cuda_available():
        props = torch.cuda.get_device_properties(0)
        info: dict[str, Any] = {"name": props.name, "kind": "cuda", "memory_bytes": int(props.total_memory),
                                "compute_capability": f"{props.major}.{props.minor}"}
        try:
            import pynvml

            pynvml.nvmlInit()
            info["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - the driver version is informative only
            pass
        return info
    return {"name": "cpu", "kind": "cpu", "cpu": platform.processor() or platform.machine(),
            "note": "no GPU: CPU run of the suite's small configuration; no GPU figure was measured"}
