"""DeepSpeed ZeRO's own buffers, sized from the config values that set them (estimate/sharding.py).

The values are checked against the libraries that set them: transformers' `HfTrainerDeepSpeedConfig`
fills "auto" in the config `plan --emit deepspeed` writes, DeepSpeed's `DeepSpeedZeroConfig` gives the
defaults of what a file leaves out. The buffer bytes are DeepSpeed 0.19's allocations as its code makes
them (stage_1_and_2.py `setup_buckets`: one reduction bucket, two with overlap_comm). ZeRO-3's
partitioned optimizer state is checked against the traced FSDP2 step (trace/step/fsdp.py), where the
two engines hold the same thing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from anatomist.anatomy import MemoryCategory
from anatomist.axes.shardings import DEEPSPEED_SETTINGS
from anatomist.estimate.memory import estimate_memory
from anatomist.hardware import get_gpu
from anatomist.plan.emit import deepspeed_config
from anatomist.recipe import Recipe
from anatomist.recipe.files import read_recipe_file
from anatomist.workload_loader import load_workload

GPU = get_gpu("A100-80GB")


@pytest.mark.parametrize("stage", [2, 3])
def test_auto_is_filled_as_the_trainer_fills_it(tiny_model, tmp_path: Path, stage: int):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    workload = load_workload(str(tiny_model("llama", hidden_size=96)), seq_len=32)
    recipe = Recipe(zero_stage=stage, bf16=True)
    written = deepspeed_config(recipe, num_gpus=1)  # this process is the world DeepSpeed checks the batch against
    model = workload.build_model()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    config = HfTrainerDeepSpeedConfig(json.loads(json.dumps(written)))  # at ZeRO-3 a process-wide setting
    try:
        config.trainer_config_finalize(args, model, 10)  # the Trainer's own "auto" filling
    finally:
        unset_hf_deepspeed_config()
    zero = config.config["zero_optimization"]
    resolved = recipe.resolved(workload)
    for name in DEEPSPEED_SETTINGS:
        if name in zero:
            assert zero[name] == getattr(resolved, name), name
    assert zero["reduce_bucket_size"] == 96 * 96
    assert len(zero) > 3 and not any(v == "auto" for v in zero.values())
    DeepSpeedZeroConfig(**zero)  # and DeepSpeed accepts what the Trainer then hands it


def test_what_a_deepspeed_file_leaves_out_is_deepspeeds_default(tmp_path: Path):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}))
    recipe = read_recipe_file(path).recipe
    defaults = DeepSpeedZeroConfig(stage=3).model_dump(by_alias=True)
    for name in DEEPSPEED_SETTINGS:
        assert getattr(recipe, name) == defaults[name], name


def test_auto_where_the_trainer_does_not_fill_it_is_deepspeeds_default(tiny_model, tmp_path: Path):
    """The Trainer fills "auto" only for the hidden-size values; DeepSpeed's own models drop any other "auto"
    (config_utils.DeepSpeedConfigModel) and take their default: read so, not refused."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "allgather_bucket_size": "auto"}}))
    workload = load_workload(str(tiny_model("llama")), seq_len=32)
    recipe = read_recipe_file(path).recipe.resolved(workload)
    assert recipe.allgather_bucket_size == DeepSpeedZeroConfig(stage=2, allgather_bucket_size="auto").allgather_bucket_size


@pytest.mark.parametrize(("stage", "buckets"), [(1, 1), (2, 2), (3, 1)])
def test_the_reduction_buckets(tiny_model, stage: int, buckets: int):
    """reduce_bucket_size elements in the bf16 gradient dtype: one bucket, a second with overlap_comm at
    stage 2 (what `plan --emit deepspeed` writes); stage 3 has one per gradient dtype."""
    workload = load_workload(str(tiny_model("llama")), seq_len=32)

    def functionality(bucket: int) -> int:
        recipe = Recipe(zero_stage=stage, bf16=True, reduce_bucket_size=bucket).resolved(workload)
        return estimate_memory(workload, recipe, GPU, num_gpus=4).anatomy.category_bytes(MemoryCategory.FUNCTIONALITY)

    assert functionality(3_000_000) - functionality(1_000_000) == buckets * 2_000_000 * 2
    assert deepspeed_config(Recipe(zero_stage=stage), 4)["zero_optimization"].get("overlap_comm", False) == (
        stage >= 2)  # stage 3's single bucket is overlapped too (stage3.py: one `ipg_buckets` buffer per dtype)


@pytest.mark.slow
def test_zero3_optimizer_state_is_fsdp2s(tiny_model):
    """fp32 AdamW over 8 devices: the traced FSDP2 rank holds its shard of the two moments; ZeRO-3 holds those and its
    fp32 partition of the weights beside them (DeepSpeed always builds one: 12 B per parameter over 8, not 8), so
    1.5 times FSDP2's (FSDP2 pads each parameter's rows to the world size and keeps the step counters whole: 1%)."""
    workload = load_workload(str(tiny_model("llama", hidden_size=256, intermediate_size=512)), seq_len=64)

    def states(recipe: Recipe) -> int:
        anatomy = estimate_memory(workload, recipe.resolved(workload), GPU, num_gpus=8).anatomy
        return anatomy.category_bytes(MemoryCategory.OPTIMIZER_STATES)

    common = {"dtype": "float32", "optim": "adamw_torch"}
    fsdp, zero = states(Recipe(fsdp="full_shard", **common)), states(Recipe(zero_stage=3, **common))
    assert zero == pytest.approx(1.5 * fsdp, rel=0.01)
    parameters = sum(p.numel() for p in workload.build_model().parameters())
    assert zero == pytest.approx(12 * parameters / 8, rel=0.01)  # fp32 partition and Adam's two moments, an eighth each
