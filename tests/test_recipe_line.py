"""The estimate says the whole recipe: its first line names precision, checkpointing, sharding, offload, PEFT and
the GPU count, and --json has num_gpus (what the reader gave, checked against the recipe file's own values)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

DATA = Path(__file__).parent / "data"


def _first_line(stdout: str) -> str:
    """The text before the memory table, unwrapped (rich wraps it at the console's width)."""
    return " ".join(stdout.split("Memory anatomy")[0].split())


@pytest.mark.slow
def test_recipe_line_and_json_name_the_gpus_and_sharding(cli, tiny_model, tmp_path: Path) -> None:
    config = yaml.safe_load((DATA / "trl/zero3.yaml").read_text())
    config["num_processes"] = 4
    config["deepspeed_config"] |= {"offload_optimizer_device": "cpu", "offload_param_device": "cpu"}
    recipe = tmp_path / "zero3.yaml"
    recipe.write_text(yaml.safe_dump(config))
    args = (str(tiny_model("bert")), "--recipe", str(recipe), "--gpu", "A100-80GB", "--gradient-checkpointing")
    text = cli("estimate", *args)
    assert text.returncode == 0, text.stderr
    line = _first_line(text.stdout)
    assert "+ bf16 autocast, checkpointing on" in line
    assert "sharding zero3, offload to cpu" in line and "train on 4 x A100-80GB" in line
    result = cli("estimate", *args, "--json")  # the same trace, from the cache
    assert json.loads(result.stdout)["num_gpus"] == config["num_processes"]
