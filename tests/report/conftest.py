"""Shared paths for the report tests: the fixtures in tests/fixtures (see its README)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture
def estimate_json() -> dict:
    """Real `anatomist estimate bert-large-uncased --json` output."""
    return json.loads((FIXTURES / "estimate_bert-large-uncased.json").read_text())
