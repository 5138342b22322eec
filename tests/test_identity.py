"""Estimates of 12 recipes across 6 model families, compared with the ones kept in
tests/fixtures/identity/ (made by the code before issue 25's restructuring): a change of structure
must not change a prediction. A deliberate change of a prediction regenerates the files
(`python tests/fixtures/identity/cases.py`) in the same commit, which says why."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "fixtures" / "identity"
sys.path.insert(0, str(HERE))
from cases import CASES, PLAN_CASES  # noqa: E402

FAST = ("bert-seeds", "gpt2-fp16-zero2", "qwen3-inference")
"""Run by default (a few seconds each, cold); the rest are marked slow."""


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_estimate_is_unchanged(cli, name: str) -> None:
    result = cli("estimate", *CASES[name], "--json")
    assert result.returncode == 0, result.stderr
    kept = json.loads((HERE / f"{name}.json").read_text())
    got = json.loads(result.stdout)
    assert got == kept


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLAN_CASES))
def test_plan_is_unchanged(cli, name: str) -> None:
    result = cli("plan", *PLAN_CASES[name], "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == json.loads((HERE / f"{name}.json").read_text())
