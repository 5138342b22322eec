"""A trace does not depend on what the process ran before it.

An Adafactor optimizer trace imports transformers.optimization, which imports peft and
bitsandbytes. Where that first import happened under the tracer (in a process whose recipe
defaults came from their cache file, so that TrainingArguments had not imported them), their
module-level constant tensors counted as 4 allocations of the step: 2,048 B more in the first
such trace of the process (bert-large, fp16, checkpointing, Adafactor: 250,165,248 B of
temporaries instead of 250,163,200), and the trace cache kept whichever came first.

One side runs in a fresh interpreter, because process history is the point: this test session
has long imported them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from anatomist.recipe import Recipe
from anatomist.trace.step.driver import trace_step
from anatomist.workload import Workload
from anatomist.workload_loader import load_workload

_FRESH = """
import json, sys
from anatomist.recipe import Recipe
from anatomist.workload_loader import load_workload
from tests.test_trace_determinism import curves

workload = load_workload(sys.argv[1], seq_len=16)
print(json.dumps([curves(workload, Recipe(**fields)) for fields in json.loads(sys.argv[2])]))
"""
"""Trace the optimizer part of each recipe (Recipe fields) in turn, in a fresh interpreter; print the curves."""


def curves(workload: Workload, recipe: Recipe) -> list[list[int]]:
    """The live bytes of the optimizer part's trace, in total and by category, after each allocation."""
    trace = trace_step(workload, recipe.resolved(workload), depth=2, batch_size=1, compute_capability="8.0",
                       part="optimizer")
    return [trace.curves.allocated.tolist(), trace.curves.categories.tolist()]


@pytest.mark.slow
def test_a_trace_is_the_same_first_in_a_process_or_after_others(tiny_model, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from anatomist.trainer_defaults import trainer_defaults

    monkeypatch.setenv("ANATOMIST_CACHE_DIR", str(tmp_path / "cache"))
    trainer_defaults.__wrapped__()  # their file written: the fresh process never imports TrainingArguments
    model = tiny_model("bert", num_hidden_layers=2)
    fp16 = {"optim": "adafactor", "fp16": True, "gradient_checkpointing": True}
    fp32 = {"optim": "adafactor"}
    root = Path(__file__).parent.parent
    fresh = subprocess.Popen([sys.executable, "-c", _FRESH, str(model), json.dumps([fp16, fp32])],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root,
                             env={**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}"})
    workload = load_workload(str(model), seq_len=16)
    here = [curves(workload, Recipe(**fields)) for fields in (fp32, fp16)]  # the other order, after all else
    out, err = fresh.communicate(timeout=300)
    assert fresh.returncode == 0, err[-2000:]
    fresh_fp16, fresh_fp32 = json.loads(out.splitlines()[-1])
    assert fresh_fp16 == here[1]
    assert fresh_fp32 == here[0]
