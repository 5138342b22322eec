"""DeepSpeed ZeRO's master weights and optimizer states as DeepSpeed allocates them (estimate/sharding.py).

Every ZeRO stage hands the optimizer flat fp32 partitions of the trainable parameters, whatever the load dtype:
master weights 4 B and, for AdamW, two fp32 moments 8 B per trainable parameter and device. The fast tests work
the bytes out by hand and check each optimizer's state over one flat tensor against the real optimizer stepped on
this CPU; tests/test_deepspeed_accuracy.py checks whole steps against DeepSpeed itself.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from anatomist.anatomy import Phase
from anatomist.axes.optimizers import OPTIMIZERS, optimizer
from anatomist.estimate.memory import estimate_memory
from anatomist.estimate.sharding import zero_optimizer_bytes
from anatomist.hardware import get_gpu
from anatomist.plan.emit import deepspeed_config
from anatomist.recipe import Recipe
from anatomist.recipe.files import read_recipe_file
from anatomist.trace.step.optimizer_build import build_optimizer
from anatomist.workload_loader import load_workload

GPU = get_gpu("H100")


def test_master_weights_and_adamw_states_are_fp32_whatever_the_load_dtype():
    recipe = Recipe(zero_stage=2, bf16=True, optim="adamw_torch_fused")
    assert zero_optimizer_bytes(recipe, 1000) == 4 * 1000 + 8 * 1000  # fp32 master + exp_avg + exp_avg_sq
    both = recipe.replace(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    assert zero_optimizer_bytes(both, 1000) == 2 * 1000 + 4 * 1000  # the same in bf16
    assert zero_optimizer_bytes(recipe.replace(optim="adafactor"), 1000) == 4 * 1000 + 4 * 1000  # 1-D: unfactored
    assert zero_optimizer_bytes(recipe.replace(optim="sgd"), 1000) == 4 * 1000 + 4 * 1000  # momentum
    # bitsandbytes 8-bit: uint8 codes + an fp32 absmax per 256 elements, per moment, + its two 256-entry tables
    assert zero_optimizer_bytes(recipe.replace(optim="adamw_bnb_8bit"), 8192) == (
        4 * 8192 + 2 * (8192 + 4 * 32) + 2 * 256 * 4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_estimate_holds_twelve_bytes_per_trainable_parameter_and_device(tiny_model, dtype, stage):
    workload = load_workload(str(tiny_model("llama")), seq_len=32)
    recipe = Recipe(zero_stage=stage, bf16=True, dtype=dtype, optim="adamw_torch").resolved(workload)
    estimate = estimate_memory(workload, recipe, GPU, num_gpus=8)
    assert estimate.anatomy.optimizer_states == 12 * math.ceil(estimate.trainable_parameters / 8)


def _real_state_bytes(name: str, numel: int, dtype: torch.dtype) -> int:
    flat = torch.nn.Parameter(torch.zeros(numel, dtype=dtype))
    flat.grad = torch.ones_like(flat)
    stepper = build_optimizer(Recipe(optim=name), [flat])
    stepper.step()
    return sum(v.numel() * v.element_size() for state in stepper.state.values() for v in state.values()
               if torch.is_tensor(v) and v.dim() > 0)


@pytest.mark.parametrize("name", [n for n, spec in OPTIMIZERS.items() if spec.quantized_state is None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_optimizers_state_over_a_flat_partition_is_the_real_optimizers(name, dtype):
    """The real torch / transformers optimizer stepped on one flat 1-D tensor, as ZeRO hands it its partition."""
    numel = 3000
    assert optimizer(name).flat_state_bytes(numel, dtype.itemsize) == _real_state_bytes(name, numel, dtype)


@pytest.mark.parametrize(("flags", "message"), [
    (["--zero-stage", "2", "--bf16", "--bf16-optimizer-states"],
     "bf16_optimizer_states needs bf16_master_weights_and_grads=True too"),
    (["--zero-stage", "2", "--bf16", "--bf16-master-weights-and-grads"],
     "bf16_master_weights_and_grads with fp32 optimizer states runs only with ZeRO-Offload"),
    (["--zero-stage", "2", "--bf16-master-weights-and-grads", "--bf16-optimizer-states"],
     "bf16_master_weights_and_grads is a setting of DeepSpeed ZeRO's bf16 mode: it needs zero_stage 1, 2 or 3 and "
     "bf16=True"),
    (["--bf16", "--bf16-master-weights-and-grads", "--bf16-optimizer-states"],
     "bf16_master_weights_and_grads is a setting of DeepSpeed ZeRO's bf16 mode"),
])
def test_a_bf16_option_deepspeed_refuses_is_one_line(cli, tiny_model, flags, message):
    result = cli("estimate", str(tiny_model("llama")), "--gpus", "2", *flags)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert message in line


def test_the_bf16_options_are_read_from_a_deepspeed_file_and_written_back(tmp_path: Path):
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2},
                                "bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                         "bf16_optimizer_states": True}}))
    recipe = read_recipe_file(path).recipe
    assert recipe.bf16 and recipe.bf16_master_weights_and_grads and recipe.bf16_optimizer_states
    written = deepspeed_config(recipe, num_gpus=2)["bf16"]
    assert written == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    DeepSpeedBF16Config(**written)  # DeepSpeed's own model of the section takes it


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("offload", ["none", "cpu"])
@pytest.mark.parametrize("phase", [Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER])
def test_the_peak_s_shares_are_what_shard_keeps(stage, offload, phase):
    """`counted_shares`, which picks a phase's peak point, says of each category what `shard` keeps of it: between any
    two points, the sharded totals differ by the categories' differences weighed by the shares (to the bytes that
    shard's whole-number divisions round away). The two are written apart; this keeps them one rule."""
    import random

    from anatomist.anatomy import TENSOR_CATEGORIES
    from anatomist.estimate.sharding import ZeroSize, counted_shares, shard
    from anatomist.recipe import Recipe
    from anatomist.trace.engine.records import PhasePeak

    if offload != "none" and stage == 1:
        pytest.skip("DeepSpeed offloads from ZeRO-2 on")
    recipe = Recipe(zero_stage=stage, offload=offload, bf16=True, dtype="bfloat16", reduce_bucket_size=1 << 20,
                    stage3_prefetch_bucket_size=1 << 20, stage3_max_reuse_distance=1 << 20)
    size = ZeroSize(parameters=10**8, trainable=10**8, block=10**6, trainable_bytes=2 * 10**8,
                    parameter_bytes=2 * 10**8)
    shares = counted_shares(recipe, size, 4, "train", phase)
    rng = random.Random(stage * 10 + len(offload))

    def point() -> PhasePeak:
        categories = {c: rng.randrange(10**6, 10**9) for c in TENSOR_CATEGORIES}
        return PhasePeak(allocated=sum(categories.values()), reserved=sum(categories.values()), categories=categories)

    for _ in range(5):
        a, b = point(), point()
        weighed = sum((a.categories[c] - b.categories[c]) * s for c, s in zip(TENSOR_CATEGORIES, shares, strict=True))
        sharded = shard(a, recipe, size, 4, "train", phase).allocated - shard(b, recipe, size, 4, "train", phase).allocated
        assert sharded == pytest.approx(weighed, abs=16)
