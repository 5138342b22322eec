"""Which device and software a validation run measured, read WITHOUT creating a CUDA context.

The driver process must not hold a CUDA context: part a measures the context of a fresh
process against the device's memory before it starts, and a context of ours (hundreds of MiB)
would be counted in. So the GPU is read through NVML, and torch is not even imported.
"""

from __future__ import annotations

import importlib.util
import platform
import re
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("anatomist", "torch", "transformers", "accelerate", "datasets", "bitsandbytes", "liger-kernel", "peft",
            "nvidia-ml-py")


@dataclass(kw_only=True, slots=True, frozen=True)
class Device:
    """The GPU as NVML names it, or the CPU of a dry run."""

    name: str
    """NVML's name ("NVIDIA H100 80GB HBM3"), or "cpu"."""
    slug: str
    """Folder name for its results: "H100-80GB-HBM3", "cpu-dry-run"."""
    memory_bytes: int | None
    """NVML's total memory; None for the CPU."""
    driver: str | None
    """NVIDIA driver version; None for the CPU."""
    catalog_name: str | None
    """The entry of anatomist's GPU catalog it matches (data/gpus.toml), None if none does."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def slug(nvml_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100-80GB-HBM3': a folder name that says which card."""
    name = re.sub(r"^nvidia\s+", "", nvml_name.strip(), flags=re.IGNORECASE)
    name = re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-")
    return name or "unknown-gpu"


def nvml_device() -> Device | None:
    """GPU 0 through NVML (no CUDA context); None without a driver or a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no library or no driver: no GPU here
        return None
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        raw = pynvml.nvmlDeviceGetName(handle)
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        raw_driver = pynvml.nvmlSystemGetDriverVersion()
        driver = raw_driver.decode() if isinstance(raw_driver, bytes) else str(raw_driver)
    finally:
        pynvml.nvmlShutdown()
    from anatomist.hardware import match_catalog

    match = match_catalog(name, total)
    return Device(name=name, slug=slug(name), memory_bytes=total, driver=driver,
                  catalog_name=match.name if match else None)


def cpu_device() -> Device:
    return Device(name="cpu", slug="cpu-dry-run", memory_bytes=None, driver=None, catalog_name=None)


def torch_cuda_version() -> str | None:
    """`torch.version.cuda`, read from torch/version.py without importing torch (seconds on a
    small CPU, twice per dry run); None for a CPU build or where the file says otherwise."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    version_file = Path(spec.submodule_search_locations[0]) / "version.py"
    match = re.search(r"^cuda\b[^=]*=\s*['\"]([^'\"]+)['\"]", version_file.read_text(), flags=re.MULTILINE) \
        if version_file.is_file() else None
    return match.group(1) if match else None


def versions() -> dict[str, str | None]:
    """Python, the packages that shape a measurement, and torch's CUDA (no device is touched)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    if out["anatomist"] is None:  # validate.sh runs the working tree through PYTHONPATH: nothing is installed
        from anatomist import __version__

        out["anatomist"] = f"{__version__} (source tree)"
    out["cuda"] = torch_cuda_version()
    return out
