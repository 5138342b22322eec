"""`anatomist plan`: search the recipe space for the fastest recipe that fits, and write it out.

Names are imported on first use, so that the light modules (space, emit) load without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Candidate", "Plan", "SearchSpace", "plan"]
_HOME = {"Candidate": "search", "Plan": "search", "plan": "search", "SearchSpace": "space"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"anatomist.plan.{_HOME[name]}"), name)
    raise AttributeError(f"module 'anatomist.plan' has no attribute {name!r}")
