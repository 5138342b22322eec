"""The GPU catalog: local detection maps NVML names to the right entry, `--gpu` takes the names
people write, and `anatomist gpus` lists what the catalog holds."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from anatomist.cli import main
from anatomist.errors import InputError
from anatomist.hardware import catalog, detect_local_gpu, get_gpu, match_catalog, name_tokens

MIB = 2**20

# (what nvmlDeviceGetName returns, total memory NVML reports in MiB, catalog entry or None).
# Names: NVIDIA/open-gpu-kernel-modules README ("Compatible GPUs") and nvidia-smi output.
NVML_CASES = [
    ("Tesla V100-SXM2-16GB", 16160, "V100-16GB"),
    ("Tesla V100-SXM2-32GB", 32510, "V100-32GB"),
    ("Tesla V100-PCIE-16GB", 16384, "V100-PCIe-16GB"),
    ("Tesla V100-PCIE-32GB", 32768, "V100-PCIe-32GB"),
    ("Tesla T4", 15360, "T4"),
    ("NVIDIA A10G", 23028, "A10G"),
    ("NVIDIA A10", 23028, "A10"),
    ("NVIDIA L4", 23034, "L4"),
    ("NVIDIA L40", 46068, "L40"),
    ("NVIDIA L40S", 46068, "L40S"),
    ("NVIDIA RTX A6000", 49140, "RTX-A6000"),
    ("NVIDIA RTX 6000 Ada Generation", 49140, "RTX-6000-Ada"),
    ("NVIDIA RTX 6000 Ada Generation", 46068, "RTX-6000-Ada"),  # ECC on
    ("NVIDIA GeForce RTX 3090", 24576, "RTX-3090"),
    ("NVIDIA GeForce RTX 4090", 24564, "RTX-4090"),
    ("NVIDIA GeForce RTX 5090", 32607, "RTX-5090"),
    ("NVIDIA A100-SXM4-40GB", 40536, "A100-40GB"),
    ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
    ("NVIDIA A100-PCIE-40GB", 40960, "A100-PCIe-40GB"),
    ("NVIDIA A100 80GB PCIe", 81920, "A100-PCIe-80GB"),
    ("NVIDIA H100 80GB HBM3", 81559, "H100-SXM"),
    ("NVIDIA H100 PCIe", 81559, "H100-PCIe"),
    ("NVIDIA H100 NVL", 95830, "H100-NVL"),
    ("NVIDIA H200", 143771, "H200"),
    ("NVIDIA GH200 480GB", 97871, "GH200-96GB"),
    ("NVIDIA GH200 144G HBM3e", 146831, "GH200-144GB"),
    ("NVIDIA B200", 183359, "B200"),
    # near misses: a GPU the catalog does not hold is None, never its neighbour
    ("NVIDIA GeForce RTX 4090 D", 24564, None),
    ("NVIDIA GeForce RTX 3090 Ti", 24564, None),
    ("Quadro RTX 6000", 24576, None),  # Turing, not the RTX 6000 Ada
    ("NVIDIA RTX A5000", 24564, None),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887, None),
    ("NVIDIA H200 NVL", 143771, None),
    ("NVIDIA H800", 81559, None),
    ("NVIDIA L20", 46068, None),
    ("NVIDIA A10M", 23028, None),
]


@pytest.mark.parametrize(("nvml_name", "total_mib", "expected"), NVML_CASES)
def test_nvml_name_matches_its_catalog_entry(nvml_name: str, total_mib: int, expected: str | None) -> None:
    match = match_catalog(nvml_name, total_mib * MIB)
    assert (match.name if match else None) == expected


@pytest.mark.parametrize(
    ("nvml_name", "total_mib", "expected"),
    [
        # one name, two memories: memory decides
        ("NVIDIA A100-SXM4-40GB", 0, "A100-40GB"),  # the size in the name wins over an unknown total
        ("NVIDIA A100-SXM4-80GB", 0, "A100-80GB"),
        ("NVIDIA GH200 120GB", 97871, "GH200-96GB"),  # a spelling not listed: same identity, nearest memory
        ("NVIDIA GH200 120GB", 146831, "GH200-144GB"),
        ("NVIDIA H100", 65536, "H100-SXM"),  # the SXM5 64GB part reports just "NVIDIA H100"
        ("NVIDIA V100-PCIE-32GB", 32768, "V100-PCIe-32GB"),  # "Tesla" or "NVIDIA" prefix alike
    ],
)
def test_memory_and_name_size_tell_variants_apart(nvml_name: str, total_mib: int, expected: str) -> None:
    assert match_catalog(nvml_name, total_mib * MIB).name == expected


def test_every_catalog_entry_is_found_by_its_own_nvml_names() -> None:
    for gpu in catalog().values():
        assert gpu.nvml_names, f"{gpu.name} has no nvml_names: local detection can never find it"
        for nvml_name in gpu.nvml_names:
            assert match_catalog(nvml_name, gpu.memory_bytes) is gpu, (gpu.name, nvml_name)


def test_every_entry_says_where_its_figures_come_from() -> None:
    for gpu in catalog().values():
        assert "http" in gpu.source, gpu.name
        assert gpu.cuda_context_source, gpu.name
        assert gpu.bf16 == (gpu.bf16_tflops > 0), gpu.name
        # tensor-core rates are at least the CUDA-core fp32 rate where the GPU has them
        assert gpu.fp16_tflops >= gpu.fp32_tflops and (not gpu.tf32 or gpu.tf32_tflops >= gpu.fp32_tflops), gpu.name
    # the new entries keep the CUDA-context assumption of [defaults], said as such
    assert catalog()["L40S"].cuda_context_bytes == catalog()["H200"].cuda_context_bytes  # the H200's measurement
    assert catalog()["L40S"].cuda_context_source.startswith("assumption")


def test_name_tokens_compare_whole_words() -> None:
    assert name_tokens("NVIDIA A100-SXM4-80GB") == ("a100", "sxm", "80gb")
    assert name_tokens("NVIDIA GH200 144G HBM3e") == ("gh200", "144gb", "hbm3e")
    assert name_tokens("a100 80 GB") == ("a100", "80gb")
    assert name_tokens("NVIDIA A10G") == ("a10g",)  # not "a10" + "gb"


def _fake_pynvml(name: str, total_bytes: int) -> types.ModuleType:
    """A stand-in for nvidia-ml-py with one device: what detect_local_gpu reads, nothing else."""
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None
    nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetCount = lambda: 1
    nvml.nvmlDeviceGetHandleByIndex = lambda index: object()
    nvml.nvmlDeviceGetName = lambda handle: name.encode()  # older nvidia-ml-py returns bytes
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(total=total_bytes)
    return nvml


@pytest.mark.parametrize(
    ("nvml_name", "expected"),
    [("NVIDIA L40S", "L40S"), ("NVIDIA GeForce RTX 4090", "RTX-4090"), ("NVIDIA RTX 6000 Ada Generation", "RTX-6000-Ada")],
)
def test_detect_local_gpu_through_nvml(monkeypatch: pytest.MonkeyPatch, nvml_name: str, expected: str) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(nvml_name, 12345 * MIB))
    gpu = detect_local_gpu()
    assert gpu is not None and gpu.detected
    assert gpu.name == f"{expected} ({nvml_name})"
    assert gpu.catalog_name == expected
    assert gpu.memory_bytes == 12345 * MIB  # what this device has, not the catalog's figure
    assert gpu.bf16_tflops == catalog()[expected].bf16_tflops


def test_detect_local_gpu_unknown_to_the_catalog_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml("NVIDIA GeForce RTX 4090 D", 24564 * MIB))
    assert detect_local_gpu() is None


# --- --gpu NAME -----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ("4090", "RTX-4090"),
        ("rtx 4090", "RTX-4090"),
        ("RTX-4090", "RTX-4090"),
        ("a100 80gb", "A100-80GB"),
        ("A100_80GB", "A100-80GB"),
        ("a100 40GB pcie", "A100-PCIe-40GB"),
        ("h100", "H100-SXM"),  # bare: the SXM 80GB part
        ("H100-80GB", "H100-SXM"),
        ("h100 pcie", "H100-PCIe"),
        ("h100 nvl", "H100-NVL"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),  # what nvidia-smi prints works too
        ("rtx 6000 ada", "RTX-6000-Ada"),
        ("a6000", "RTX-A6000"),
        ("rtx a6000", "RTX-A6000"),
        ("l4", "L4"),
        ("L40", "L40"),
        ("l40s", "L40S"),
        ("a10", "A10"),
        ("a10g", "A10G"),
        ("5090", "RTX-5090"),
        ("b200", "B200"),
        ("gh200 144gb", "GH200-144GB"),
        ("t4", "T4"),
        ("V100-16GB", "V100-16GB"),
    ],
)
def test_gpu_names_as_people_write_them(written: str, expected: str) -> None:
    assert get_gpu(written).name == expected


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ("a100", r"^ambiguous GPU 'a100': A100-40GB, A100-80GB; say which$"),
        ("v100", r"^ambiguous GPU 'v100': V100-16GB, V100-32GB; say which$"),
        ("gh200", r"^ambiguous GPU 'gh200': GH200-96GB, GH200-144GB; say which$"),
        ("A100-90GB", r"^unknown GPU 'A100-90GB'; did you mean A100-40GB, A100-80GB, A100-PCIe-40GB, A100-PCIe-80GB\?"),
        ("4090 d", r"^unknown GPU '4090 d'; did you mean RTX-4090\?"),
        ("Z80", r"^unknown GPU 'Z80' \(known: V100-16GB, .*, B200\)$"),
    ],
)
def test_ambiguous_or_unknown_gpu_says_which_exist(written: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        get_gpu(written)


def test_cli_ambiguous_gpu_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--gpu", "a100"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "anatomist: error: ambiguous GPU 'a100': A100-40GB, A100-80GB; say which\n"


def test_cli_estimate_on_a_gpu_named_loosely(tiny_model, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    folder: Path = tiny_model("bert", num_hidden_layers=2)
    assert main(["estimate", str(folder), "--seq-len", "32", "--gpu", "rtx 6000 ada", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["gpu"]["name"] == "RTX-6000-Ada"
    assert printed["gpu"]["memory_bytes"] == 49140 * MIB


# --- anatomist gpus -------------------------------------------------------------------------------

NEW_ENTRIES = ["L40S", "L40", "RTX-A6000", "RTX-6000-Ada", "RTX-5090", "H100-NVL", "B200", "GH200-96GB", "GH200-144GB", "A10"]


def test_gpus_json_lists_the_catalog_with_sources(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("anatomist.hardware.detect_local_gpu", lambda: None)
    assert main(["gpus", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {g["name"]: g for g in data["gpus"]}
    assert set(NEW_ENTRIES) <= set(rows)
    assert rows["L40S"]["nvml_names"] == ["NVIDIA L40S"]
    assert rows["L40S"]["bf16_tflops"] == 362.05 and "l40s-datasheet" in rows["L40S"]["source"]
    assert data["detected"] is None


def test_gpus_table_lists_the_new_entries(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("anatomist.hardware.detect_local_gpu", lambda: None)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["gpus"]) == 0
    out = capsys.readouterr().out
    names = [line.split()[0] for line in out.splitlines() if line.strip()]  # piped: plain columns, name first
    assert set(NEW_ENTRIES) <= set(names)
    assert "No NVIDIA GPU detected here (NVML)." in out
    assert "* CUDA context assumed, not measured" in out


def test_a_detected_gpu_takes_its_generations_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found on a real H200: its name also says NVML's ("H200 (NVIDIA H200)"), and its time is still
    predicted with the H100 generation's factors, not the pooled ones of a GPU in no generation."""
    from anatomist.calibration.lookup import calibration_for

    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml("NVIDIA H200", 143771 * MIB))
    gpu = detect_local_gpu()
    assert gpu is not None and gpu.name == "H200 (NVIDIA H200)"
    assert calibration_for(gpu) == calibration_for(get_gpu("H200"))
    assert "H100 generation" in calibration_for(gpu).describe()
