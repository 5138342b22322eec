"""The estimate says the whole recipe: its first line names precision, checkpointing, sharding, offload, PEFT and
the GPU count, and --json has num_gpus (what the reader gave, checked against the recipe file's own values)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

DATA = Path(__file__).parent / "data"


def _first_line(stdout: str) -> str:
    """The text before the memory table, unwrapped (rich wraps it at the console's width)."""
    return " ".join(stdout.split("Memory anatomy")[0].split())


def test_recipe_line_and_json_name_the_gpus_and_sharding(cli, tiny_model, tmp_path: Path) -> None:
    config = yaml.safe_load((DATA / "trl/zero3.yaml").read_text())
    config["num_processes"] = 4
    config["deepspeed_config"] |= {"offload_optimizer_device": "cpu", "offload_param_device": "cpu"}
    recipe = tmp_path / "zero3.yaml"
    recipe.write_text(yaml.safe_dump(config))
    model = str(tiny_model("llama"))
    text = cli("estimate", model, "--recipe", str(recipe), "--gpu", "A100-80GB", "--gradient-checkpointing")
    assert text.returncode == 0, text.stderr
    line = _first_line(text.stdout)
    assert "+ bf16 autocast" in line and "checkpointing on" in line
    assert "sharding zero3, offload to cpu" in line and "train on 4 x A100-80GB" in line
    result = cli("estimate", model, "--recipe", str(recipe), "--gpu", "A100-80GB", "--json")
    assert json.loads(result.stdout)["num_gpus"] == config["num_processes"]


def test_recipe_line_names_the_adapters_on_one_gpu(cli, tiny_model) -> None:
    result = cli("estimate", str(tiny_model("llama")), "--peft", "lora", "--lora-r", "8", "--gpu", "A100-80GB")
    assert result.returncode == 0, result.stderr
    line = _first_line(result.stdout)
    assert "lora (r=8)" in line and "checkpointing off" in line and "sharding none" in line
    assert "train on 1 x A100-80GB" in line
