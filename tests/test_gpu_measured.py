"""Predictions against the Trainer steps a real GPU ran: the seeds' bert-large rows and five Llama-3.2-1B recipes in bf16
on two lent H200s (benchmarks/gpu/H200/bench.jsonl, `anatomist bench` through benchmarks/gpu/validate.sh, 2026-11-28;
the CUDA allocator's counters and NVML), predicted again by this tree offline (benchmarks/gpu/repredict.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "benchmarks" / "gpu" / "H200"
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

from repredict import measured, predicted  # noqa: E402


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], dict[str, float]]]:
    """Row name -> (predicted, measured)."""
    out = {}
    for line in (H200 / "bench.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("status") == "ok":
            out[row["name"]] = (predicted(row, tmp_path_factory.mktemp("row")), measured(row))
    return out


LLAMA_ROWS = ("full-bf16", "full-bf16+checkpointing", "lora-bf16", "lora-bf16+checkpointing", "full-bf16+liger")


@pytest.mark.slow  # eight bert-large and five Llama-3.2-1B recipes traced: minutes cold
def test_memory_on_the_h200(rows: dict[str, tuple[dict[str, Any], dict[str, float]]]) -> None:
    """The allocated peak within 1% on every row (-0.6% to -0.0% today). The device total, nvidia-smi's figure, from
    -12% to +11% (-11.3% to +10.5% today): on the safe side but for Llama's full bf16 step with checkpointing, whose
    allocator reserved 3.5 GiB beyond its allocated peak where the allocator model keeps 1.4 GiB. This bounds what
    the memory interval takes from these rows (data/memory_accuracy.toml), so that it cannot grow unseen."""
    assert len(rows) >= 13 and set(LLAMA_ROWS) <= set(rows)
    for name, (p, m) in rows.items():
        assert abs(p["peak_allocated"] / m["peak_allocated"] - 1) < 0.01, name
        assert -0.12 < p["device_total"] / m["device_total"] - 1 < 0.11, name


@pytest.mark.slow
def test_grouped_query_attention_on_the_h200(rows: dict[str, tuple[dict[str, Any], dict[str, float]]]) -> None:
    """Llama-3.2-1B's 32 query heads share 8 key/value heads. CUDA's flash kernel keeps the 8 for backward, so
    without checkpointing the allocated peak is within 0.1% (-0.03% to -0.00% today). A trace that kept them
    repeated per query head was +1.9% (full), +2.8% (LoRA) and +3.7% (Liger): 16 layers x 24 MiB too many."""
    for name in ("full-bf16", "lora-bf16", "full-bf16+liger"):
        p, m = rows[name]
        assert abs(p["peak_allocated"] / m["peak_allocated"] - 1) < 0.001, name


@pytest.mark.slow
def test_what_checkpointing_costs_on_the_h200(rows: dict[str, tuple[dict[str, Any], dict[str, float]]]) -> None:
    """Where the host bounds the step (one sample per micro-batch), checkpointing's cost is its recomputed forward
    issued again through non-reentrant checkpoint's hooks (`roofline.RECOMPUTE_HOST_WEIGHT`): measured 1.92x the
    step without it in fp32, and 7.67x from fp16 at batch 4 to fp16 at 1 x 4 with checkpointing; predicted within
    10% (1.90x and 7.95x; time model 5 said 1.22x and 4.76x). This host is slower than the published runs' (every
    step time is 20-49% too fast), so the ratios are what is checked."""

    def ratio(slow: str, fast: str, source: dict[str, float] | dict[str, Any]) -> float:
        return float(source[slow]["step_s"] / source[fast]["step_s"])

    pred = {name: p for name, (p, _) in rows.items()}
    meas = {name: m for name, (_, m) in rows.items()}
    for slow, fast in (("grad-accum+checkpointing", "grad-accum"), ("fp16+accum+checkpointing", "fp16")):
        assert ratio(slow, fast, pred) == pytest.approx(ratio(slow, fast, meas), rel=0.1), (slow, fast)


@pytest.mark.slow
def test_what_liger_changes_on_the_h200(rows: dict[str, tuple[dict[str, Any], dict[str, float]]]) -> None:
    """Liger's step against the same step without it (Llama-3.2-1B, full bf16, 4 x 1,024 tokens): measured 1.026x,
    predicted 0.989x, within 5%. Its fused loss runs 32 chunks that each read the 525 MB head weight twice and its
    gradient once each way; priced as one pass in all, the prediction was 0.787x (-23%)."""
    (p_liger, m_liger), (p_plain, m_plain) = rows["full-bf16+liger"], rows["full-bf16"]
    predicted = p_liger["step_s"] / p_plain["step_s"]
    assert predicted == pytest.approx(m_liger["step_s"] / m_plain["step_s"], rel=0.05)
