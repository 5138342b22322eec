"""The constants of the multi-device time terms: data/plan_throughput.toml (offload's PCIe and CPU Adam, the
interconnects within a node, the networks between nodes), each with its source."""

from __future__ import annotations

import tomllib
from functools import cache
from importlib import resources
from typing import Any


@cache
def constants() -> dict[str, Any]:
    return tomllib.loads(resources.files("anatomist.data").joinpath("plan_throughput.toml").read_text())
