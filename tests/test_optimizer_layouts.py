"""The low-bit optimizers' state, as anatomist lays it out, against the libraries' own optimizers.

bitsandbytes' AdamW8bit and torchao's AdamW8bit / AdamW4bit run on this CPU: each is built as the
Trainer builds it (`Trainer.get_optimizer_cls_and_kwargs`), stepped once in a fresh interpreter
(tests/truth/optimizer_state.py), and its state tensors listed by dtype and size. anatomist's
`QuantizedAdamLayout` (what the tracer steps on fake tensors) must allocate the same tensors.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from anatomist.recipe import Recipe

TRUTH = Path(__file__).parent / "truth" / "optimizer_state.py"
sys.path.insert(0, str(TRUTH.parent))
from optimizer_state import parameters, state_tensors  # noqa: E402

CASES = [("adamw_bnb_8bit", "bitsandbytes"), ("adamw_torch_8bit", "torchao"), ("adamw_torch_4bit", "torchao")]
DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def library_states() -> dict[str, list[tuple[str, int]]]:
    """Every case's state from the libraries, stepped in one fresh interpreter."""
    cases = [f"{optim}:{dtype}" for optim, package in CASES if importlib.util.find_spec(package) for dtype in DTYPES]
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run([sys.executable, str(TRUTH), *cases], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {case: [tuple(t) for t in tensors] for case, tensors in json.loads(proc.stdout).items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("optim", "package"), CASES)
def test_layout_allocates_what_the_library_allocates(library_states, optim: str, package: str, dtype: str) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (pip install -e '.[dev]' installs it)")
    from anatomist.trace.step.optimizer_build import build_optimizer

    params = parameters(dtype)
    ours = build_optimizer(Recipe(optim=optim), params)
    for p in params:
        p.grad = p.detach().clone()
    ours.step()
    assert state_tensors(ours) == library_states[f"{optim}:{dtype}"]
