"""One time model: `estimate` and `plan` give the same step time for the same recipe on the same number of
GPUs (estimate/time/cluster.py `predict_time`), communication included."""

from __future__ import annotations

import dataclasses

import pytest

from anatomist.estimate.predict import estimate
from anatomist.hardware import get_gpu
from anatomist.plan import SearchSpace, plan
from anatomist.recipe import Recipe
from anatomist.workload_loader import load_workload

GPU = get_gpu("A100-80GB")


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["zero3", "fsdp_full_shard", "ddp"])
def test_estimate_and_plan_give_one_step_time(tiny_model, sharding: str):
    workload = load_workload(str(tiny_model("gpt2")), seq_len=64)
    space = SearchSpace(num_gpus=4, global_batch_size=16, shardings=(sharding,), optims=("adamw_torch",),
                        compile_options=(False,), checkpointing_options=(False,), precisions=("bf16",))
    best = plan(workload, GPU, space=space).best
    recipe = Recipe(**{f.name: getattr(best.recipe, f.name) for f in dataclasses.fields(Recipe)})
    time = estimate(workload, recipe, GPU, num_gpus=4).time
    assert time is not None
    assert time.step_s == best.time.step_s
    assert time.phases_s["communication"] > 0  # 4 devices exchange gradients (and weights when sharded)
