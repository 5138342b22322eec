"""`plan --recipe FILE`: the file fixes what it sets, the plan searches only what it leaves open and says so.

The expected sets are worked out from the space by hand: with checkpointing, optimizer and
micro-batch fixed, what is left on one A100 with --precisions bf16,fp32 is those two precisions
times the two single-GPU shardings (none; ZeRO-2 with CPU offload: axes/shardings.py), 4
candidates; with an accelerate ZeRO-3 config for 4 processes, the plan runs on 4 GPUs with ZeRO-3 only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.test_plan import TINY_BERT

DATA = Path(__file__).parent / "data"


def _plan(cli, tmp_path: Path, recipe: Path, *extra: str) -> dict:
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_BERT))
    proc = cli("plan", str(folder), "--seq-len", "64", "--gpu", "A100-80GB", "--no-compile", "--recipe", str(recipe),
               "--json", *extra)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_fields_the_file_sets_are_held_and_the_rest_searched(cli, tmp_path: Path) -> None:
    recipe = tmp_path / "args.yaml"
    recipe.write_text("per_device_train_batch_size: 2\ngradient_checkpointing: true\noptim: adafactor\n")
    data = _plan(cli, tmp_path, recipe, "--global-batch-size", "8", "--precisions", "bf16,fp32")
    chosen = [c["recipe"] for c in data["pareto"]] + [data["best"]["recipe"]]
    for r in chosen:
        assert (r["per_device_train_batch_size"], r["gradient_accumulation_steps"]) == (2, 4)  # 8 = 2 x 4 x 1 GPU
        assert r["gradient_checkpointing"] is True and r["optim"] == "adafactor"
    # left to vary: 2 precisions x 2 shardings; the batch is fixed, the accumulation follows from the global batch
    assert data["candidates"] == 4
    assert "held fixed by --recipe: per_device_train_batch_size=2, optim=adafactor, gradient_checkpointing=True" \
        in data["notes"]


@pytest.mark.slow
def test_an_accelerate_config_sets_the_gpus_and_the_sharding(cli, tmp_path: Path) -> None:
    config = yaml.safe_load((DATA / "trl/zero3.yaml").read_text())
    config["num_processes"] = 4
    recipe = tmp_path / "zero3.yaml"
    recipe.write_text(yaml.safe_dump(config))
    data = _plan(cli, tmp_path, recipe, "--optims", "adamw_torch_fused", "--precisions", "bf16",
                 "--global-batch-size", "8")
    assert data["num_gpus"] == 4
    for c in [*data["pareto"], data["best"]]:
        assert c["recipe"]["zero_stage"] == 3 and c["recipe"]["bf16"] is True


def test_a_file_whose_fields_leave_nothing_is_one_line(cli, tmp_path: Path) -> None:
    recipe = tmp_path / "args.yaml"
    recipe.write_text("per_device_train_batch_size: 3\n")  # 3 x accumulation x 1 GPU is never 8
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_BERT))
    proc = cli("plan", str(folder), "--seq-len", "64", "--gpu", "A100-80GB", "--recipe", str(recipe),
               "--global-batch-size", "8")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("anatomist: error: the fields the recipe file fixes (per_device_train_batch_size=3) "
                                   "leave no recipe to search on 1 x A100-80GB with a global batch of 8")
    recipe.write_text("fsdp: full_shard\n")  # FSDP held, and only ZeRO-3 searched
    proc = cli("plan", str(folder), "--seq-len", "64", "--gpu", "A100-80GB", "--gpus", "2", "--recipe", str(recipe),
               "--shardings", "zero3")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("anatomist: error: the fields the recipe file fixes (fsdp=full_shard) leave no recipe "
                                   "to search on 2 x A100-80GB and --shardings zero3")
