"""`anatomist plan`: search, reasons, bad input and the emitted configs, on a tiny BERT (CPU, offline)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from anatomist.axes.shardings import shardings_for
from anatomist.errors import InputError
from anatomist.estimate.time.cluster import predict_time
from anatomist.estimate.time.collectives import parameter_count
from anatomist.estimate.time.device import estimate_time
from anatomist.hardware import get_gpu
from anatomist.plan import SearchSpace, plan
from anatomist.plan.candidates import SPEED_UP_ERROR, pareto_front
from anatomist.plan.reasons import most_sharded
from anatomist.recipe import Recipe
from anatomist.trace.depth.plan import model_plan
from anatomist.workload_loader import load_workload

TINY_BERT = {
    "model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 128,
    "type_vocab_size": 2, "pad_token_id": 0,
}
GIB = 2**30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("tiny-bert")
    (folder / "config.json").write_text(json.dumps(TINY_BERT))
    return load_workload(str(folder), seq_len=64)


def _small_gpu(limit_bytes: int):
    """A100 rates with a tiny memory and no CUDA context, so that the tiny model can not-fit; in no generation."""
    return replace(get_gpu("A100-80GB"), name="tiny-gpu", catalog_name="tiny-gpu", memory_bytes=limit_bytes, cuda_context_bytes=0)


def test_space_batch_options_form_the_global_batch() -> None:
    # 48 = 1x48, 2x24, 3x16 (3 is neither a power of two nor a multiple of 8: skipped), 4x12, 8x6, 16x3, 24x2, 48x1
    space = SearchSpace(global_batch_size=48)
    assert space.batch_options() == [(1, 48), (2, 24), (4, 12), (8, 6), (16, 3), (24, 2), (48, 1)]
    # 2 GPUs: 32 per device
    assert (32, 1) in SearchSpace(global_batch_size=64, num_gpus=2).batch_options()


def test_global_batch_that_cannot_be_split_is_input_error() -> None:
    with pytest.raises(InputError, match="cannot be split evenly over 3 GPUs"):
        SearchSpace(global_batch_size=64, num_gpus=3)
    with pytest.raises(InputError, match="greater than 0"):
        SearchSpace(global_batch_size=0)


def test_sharding_terms_of_the_time_model(tiny) -> None:
    gpu = get_gpu("A100-80GB")
    r = Recipe(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    one = estimate_time(tiny, r.resolved(tiny), gpu)
    # One device, no sharding: the estimator's step, nothing added.
    assert predict_time(tiny, r.resolved(tiny), gpu).step_s == pytest.approx(one.step_s)
    # ZeRO-Offload: the GPU optimizer step is replaced by PCIe traffic and CPU Adam (fp32: 4 B down, 4 B up).
    n = parameter_count(r.resolved(tiny), model_plan(tiny, r.resolved(tiny)).size)
    offloaded = predict_time(tiny, (r.replace(zero_stage=2, offload="cpu")).resolved(tiny), gpu)
    assert offloaded.phases_s["optimizer"] == 0
    assert offloaded.phases_s["offload"] == pytest.approx(n * 8 / 12e9 + n / 1e9)
    # Two devices: ZeRO-1 halves the optimizer step; the all-reduce moves 2 x 1/2 x fp32 gradients, over the
    # A100s' NVLink at the 230 GB/s plan_throughput.toml gives it.
    zero1 = predict_time(tiny, (r.replace(zero_stage=1)).resolved(tiny), gpu, num_gpus=2)
    assert zero1.phases_s["optimizer"] == pytest.approx(one.phases_s["optimizer"] / 2)
    assert zero1.phases_s["communication"] == pytest.approx(2 * 0.5 * n * 4 / 230e9)
    assert zero1.samples_per_second == pytest.approx(2 * 8 / zero1.step_s)
    zero3 = predict_time(tiny, (r.replace(zero_stage=3)).resolved(tiny), gpu, num_gpus=2)
    # ZeRO-3 gathers every weight before each micro-batch's forward and backward and reduce-scatters each
    # micro-batch's gradients: 2 x (1/2 + 1/2 + 1/2) x the fp32 bytes, 3x ZeRO-1's volume (1.5x per micro-batch),
    # of which the prefetched gathers and the reduce-scatter overlap the compute.
    moved = zero3.phases_s["communication"] + zero3.hidden_communication_s
    assert moved == pytest.approx(3 * zero1.phases_s["communication"])
    assert zero1.hidden_communication_s == 0  # ZeRO-1 reduces after the backward, then gathers after the step
    assert 0 < zero3.phases_s["communication"] < moved
    # ZeRO-3 with its parameters on the host too: each device also brings its fp32 shard of every weight up
    # before the forward and the backward all-gathers (2 x 1/2 x 4 B per parameter).
    stage3 = predict_time(tiny, (r.replace(zero_stage=3, offload="cpu")).resolved(tiny), gpu, num_gpus=2)
    stage2 = predict_time(tiny, (r.replace(zero_stage=2, offload="cpu")).resolved(tiny), gpu, num_gpus=2)
    assert stage3.phases_s["offload"] - stage2.phases_s["offload"] == pytest.approx(2 * 0.5 * n * 4 / 12e9)


@pytest.mark.slow
def test_plan_picks_fastest_that_fits_and_explains(tiny) -> None:
    gpu = _small_gpu(64 * 2**20)
    space = SearchSpace(global_batch_size=32, optims=("adamw_torch_fused", "adafactor"), compile_options=(False,))
    result = plan(tiny, gpu, space=space, margin=0.1)
    # 6 batch options x 2 ckpt x 4 precisions (fp32, tf32, bf16, bf16-weights) x 2 optims x 2 sharding = 192
    assert len(result.candidates) == 6 * 2 * 4 * 2 * len(shardings_for(1)) == 192
    limit = int(64 * 2**20 * 0.9)
    assert result.limit_bytes == limit
    assert all(c.fits == (c.device_total <= limit) for c in result.candidates)
    # The pick: of the recipes predicted within the time model's median held-out error of the fastest (tiny-gpu is
    # in no generation: "any"'s 13%), capped at the speed-up error measured side by side (10%), the most headroom at
    # the top of the memory interval, within 5% of the limit.
    fastest = max(c.samples_per_second for c in result.feasible)
    assert result.best.time.error_median_pct > 10 and result.speed_error == SPEED_UP_ERROR
    median = f"{result.best.time.error_median_pct:.0f}%"
    assert any(f"median held-out error is {median}, capped at" in note for note in result.notes), result.notes
    near = [c for c in result.feasible if c.samples_per_second >= fastest * (1 - result.speed_error)]
    assert result.best.fits and result.best in near
    assert result.best.device_total_high <= min(c.device_total_high for c in near) + 0.05 * limit
    # The Pareto front: sorted by memory, strictly faster each step, and nothing dominates it.
    front = result.pareto
    assert [c.device_total for c in front] == sorted(c.device_total for c in front)
    for c in front:
        assert not any(o.device_total <= c.device_total and o.samples_per_second > c.samples_per_second
                       for o in result.feasible)
    text = "\n".join(result.best.reasons)
    # Which methods the reasons name depends on the time model (estimate_time since the merge).
    assert "per-device batch" in text and "fit" in text
    d = result.to_dict()
    assert d["candidates"] == len(result.candidates) and d["feasible"] == len(result.feasible)
    assert set(d["best"]) == {"recipe", "memory", "time", "reasons"}


@pytest.mark.slow
def test_checkpointing_reason_is_computed_from_predictions(tiny) -> None:
    gpu = _small_gpu(8 * GIB)  # everything fits: checkpointing is off, and its cost is stated
    space = SearchSpace(global_batch_size=8, optims=("adamw_torch_fused",), compile_options=(False,))
    result = plan(tiny, gpu, space=space)
    best = result.best
    assert not best.recipe.gradient_checkpointing
    on = next(c for c in result.candidates if c.recipe == best.recipe.replace(gradient_checkpointing=True))
    slower = 1 - on.samples_per_second / best.samples_per_second
    line = next(r for r in best.reasons if r.startswith("gradient checkpointing off"))
    assert f"{slower:.0%} slower" in line


@pytest.mark.slow
def test_nothing_fits_says_what_is_short(tiny) -> None:
    # 16.25 MiB of every recipe are the two cuBLAS workspaces (forward and backward handles);
    # the smallest recipe needs 20.5 MiB, up to 23.2 MiB at the top of its memory interval (-11.3%: the full bf16
    # checkpointed step on the H200), which is what must fit
    # the 20.8 MiB. No number of GPUs is offered: ZeRO-3
    # (+ offload) on 2 devices needed 20.6 MiB before DeepSpeed's own buffers were counted; with them
    # (estimate/sharding.py) DeepSpeed keeps a model this small gathered from forward to backward
    # (stage3_max_reuse_distance 1e9 elements) beside its flat gradient partition and reduction bucket.
    gpu = _small_gpu(int(20.8 * 2**20))
    # fp32 master weights only: the figures above were worked out for those precisions
    space = SearchSpace(global_batch_size=8, optims=("adafactor",), compile_options=(False,),
                        precisions=("fp32", "tf32", "bf16"))
    with pytest.raises(InputError, match=r"no recipe fits tiny-gpu: the smallest of \d+ \(bs1 x8, bf16, adafactor, zero2\+offload\) needs 20\.5 MiB, up to 23\.2 MiB at the top of "
                       r"its interval .*short by 2\.4 MiB\. Would fit: a GPU with more memory \(T4, 15\.00 GiB\)$"):
        plan(tiny, gpu, space=space, margin=0.0)



def test_what_would_fit_on_more_gpus_keeps_to_the_shardings_allowed() -> None:
    """"Would fit: N GPUs with ..." names the sharding that keeps the least per device of those --shardings allows
    (ZeRO-3 + offload unless restricted), one that LoRA may use for adapters, and none where nothing allowed shards."""
    def named(shardings, adapters=False):
        spec = most_sharded(SearchSpace(global_batch_size=8, shardings=shardings), adapters)
        return spec.name if spec is not None else None

    assert named(None) == "zero3+offload"
    assert named(None, adapters=True) == "zero3"  # offload is not searched for adapters
    assert named(("fsdp_full_shard", "zero2")) == "fsdp_full_shard"
    assert named(("zero1", "fsdp_shard_grad_op")) == "fsdp_shard_grad_op"
    assert named(("none", "ddp")) is None

@pytest.mark.slow
def test_multi_gpu_considers_zero_and_fsdp(tiny) -> None:
    space = SearchSpace(global_batch_size=16, num_gpus=2, optims=("adamw_torch_fused",), compile_options=(False,),
                        checkpointing_options=(False,))
    result = plan(tiny, _small_gpu(8 * GIB), space=space)
    stages = {(c.recipe.zero_stage, c.recipe.fsdp) for c in result.candidates}
    assert {(0, "none"), (1, "none"), (2, "none"), (3, "none"), (0, "full_shard"), (0, "shard_grad_op")} <= stages
    by = {(c.recipe.zero_stage, c.recipe.fsdp, c.recipe.per_device_train_batch_size, c.recipe.bf16, c.recipe.dtype): c
          for c in result.candidates if c.recipe.offload == "none"}
    key = (8, True, "float32")  # fp32 weights, bf16 autocast
    ddp, z3, fsdp = by[0, "none", *key], by[3, "none", *key], by[0, "full_shard", *key]
    n = ddp.memory.parameters
    # DeepSpeed ZeRO-3 holds an fp32 partition of every trainable parameter and fp32 Adam states over it, flat
    # (12 B/param, no per-tensor step counters), halved on 2 devices (estimate/sharding.py); FSDP2, traced per
    # rank, holds half of the fp32 Adam states (each parameter's rows padded to the world size, the step counters
    # whole: 4% on this tiny BERT of many small tensors).
    assert z3.memory.anatomy.optimizer_states == 12 * n // 2
    assert fsdp.memory.anatomy.optimizer_states == pytest.approx(ddp.memory.anatomy.optimizer_states / 2, rel=0.05)


@pytest.mark.slow  # over 15 s on 2 cores
def test_shardings_limit_the_search_where_they_run(tiny) -> None:
    """--shardings: only the named options are searched, and a cluster size where none of them runs has none."""
    from anatomist.plan.clusters import plan_clusters
    from anatomist.plan.search import fastest_fitting
    from anatomist.recipe.axis_values import sharding_of

    gpu = get_gpu("A100-80GB")
    space = SearchSpace(global_batch_size=8, num_gpus=2, optims=("adamw_torch",), compile_options=(False,),
                        checkpointing_options=(False,), precisions=("bf16",), shardings=("zero3", "zero2+offload"))
    result = plan(tiny, gpu, space=space)
    assert {sharding_of(c.recipe, 2) for c in result.candidates} == {"zero3", "zero2+offload"}
    clusters, chosen = plan_clusters(replace(space, shardings=("zero3",)), [(1, 1), (2, 1)],
                                     lambda sized: plan(tiny, gpu, space=sized),
                                     lambda sized: fastest_fitting(tiny, gpu, space=sized))
    assert clusters[0].best is None and "none runs on 1 GPU(s)" in (clusters[0].why_not or "")
    assert chosen.num_gpus == 2 and sharding_of(chosen.best.recipe, 2) == "zero3"


def test_pareto_front_by_hand() -> None:
    class C:  # minimal stand-ins: (memory, speed)
        def __init__(self, m: int, s: float) -> None:
            self.device_total, self.samples_per_second = m, s

    a, b, c, d = C(1, 1.0), C(2, 3.0), C(3, 2.0), C(4, 5.0)
    assert pareto_front([d, c, b, a]) == [a, b, d]  # c is beaten by b (less memory, faster)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bert-base-uncased", "--gpu", "Z80"], "unknown GPU 'Z80'"),
        (["bert-base-uncased", "--gpu", "A100-80GB", "--global-batch-size", "10", "--gpus", "4"], "cannot be split"),
        (["bert-base-uncased", "--gpu", "A100-80GB", "--optims", "lion"], "unknown optimizer"),
        (["bert-base-uncased", "--gpu", "A100-80GB", "-o", "x.json"], "needs --emit"),
        (["bert-base-uncased", "--gpu", "A100-80GB", "--shardings", "zero4"], "--shardings: unknown sharding(s) zero4"),
        (["bert-base-uncased", "--gpu", "A100-80GB", "--gpus", "4", "--shardings", "none"],
         "--shardings none: none runs on 4 GPU(s) of 1 node(s), where the options are ddp, zero1"),
    ],
)
def test_cli_bad_input_exit_2(cli, args: list[str], message: str) -> None:
    proc = cli("plan", *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_cli_json_and_emit(cli, tiny, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_BERT))
    out = tmp_path / "ds.json"
    proc = cli("plan", str(folder), "--seq-len", "64", "--gpu", "T4", "--global-batch-size", "16", "--optims",
                "adamw_torch_fused", "--no-compile", "--json", "--emit", "deepspeed", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["candidates"] > 0 and data["feasible"] > 0 and data["best"]["memory"]["fits"]
    ds = json.loads(out.read_text())
    best = data["best"]["recipe"]
    assert ds["train_micro_batch_size_per_gpu"] == best["per_device_train_batch_size"]
    assert ds["train_batch_size"] == 16


@pytest.mark.slow
def test_bf16_weights_are_searched_where_the_gpu_has_bf16(tiny) -> None:
    space = SearchSpace(global_batch_size=8, optims=("adamw_torch_fused",), compile_options=(False,),
                        checkpointing_options=(False,))
    on_a100 = plan(tiny, get_gpu("A100-80GB"), space=space)
    assert {c.recipe.dtype for c in on_a100.candidates} == {"float32", "bfloat16"}
    on_v100 = plan(tiny, get_gpu("V100-16GB"), space=space)
    assert {c.recipe.dtype for c in on_v100.candidates} == {"float32"}
    only_bf16 = plan(tiny, get_gpu("A100-80GB"), space=replace(space, precisions=("bf16-weights",)))
    assert only_bf16.best.recipe.dtype == "bfloat16"
    assert any("no fp32 master copy" in r for r in only_bf16.best.reasons)


@pytest.mark.slow
@pytest.mark.parametrize("num_gpus", [2])
def test_the_fastest_fitting_recipe_is_the_plans_pick(tiny_model, num_gpus: int) -> None:
    """`fastest_fitting` predicts the memory of only the recipes fast enough to be picked (within the time model's
    error of the fastest that fits); it must pick what the full plan picks. The limit is set to the top of the
    device total's interval of the candidate a tenth up from the smallest, so that most do not fit and the partial and
    offloaded checkpointing variants are searched (at the median, since the memory intervals, none are)."""
    from anatomist.plan.search import fastest_fitting

    workload = load_workload(str(tiny_model("llama")), seq_len=64)
    gpu = get_gpu("A100-80GB")
    space = SearchSpace(global_batch_size=8, num_gpus=num_gpus, optims=("adamw_torch",),
                        compile_options=(False,), precisions=("bf16",))
    totals = sorted(c.device_total_high for c in plan(workload, gpu, space=space).candidates)  # what decides fitting
    margin = 1 - totals[len(totals) // 10] / gpu.memory_bytes
    full = plan(workload, gpu, space=space, margin=margin)
    assert 0 < len(full.feasible) < len(full.candidates)
    assert any(c.recipe.checkpoint_every > 1 or c.recipe.checkpoint_offload for c in full.candidates)
    pick = fastest_fitting(workload, gpu, space=space, margin=margin)
    assert pick.to_dict() == {**full.best.to_dict(), "reasons": []}


@pytest.mark.slow
def test_a_faster_recipe_inside_the_time_error_loses_to_more_headroom(tiny_model) -> None:
    """Two recipes predicted 2% apart, inside a 9% time error: the plan does not rank them, keeps the one with more
    headroom at the top of its memory interval, shows it on the Pareto front and says why. A time model stands in
    that makes batch 64 without checkpointing 2% faster than with it (the rest 50% slower), with a 9% median error."""
    from anatomist.anatomy import TimeAnatomy

    def two_percent(workload, recipe, gpu, *, num_gpus: int = 1, **cluster: object) -> TimeAnatomy:
        t = predict_time(workload, recipe, gpu, num_gpus=num_gpus, **cluster)
        speed = (100.0 if recipe.gradient_checkpointing else 102.0) if recipe.per_device_train_batch_size == 64 else 50.0
        return replace(t, samples_per_second=speed, error_median_pct=9.0)

    workload = load_workload(str(tiny_model("bert", num_hidden_layers=2)), seq_len=128)
    space = SearchSpace(global_batch_size=64, optims=("adamw_torch_fused",), compile_options=(False,),
                        precisions=("fp32",), shardings=("none",), partial_checkpointing=(), offload_checkpoints=False)
    result = plan(workload, _small_gpu(256 * 2**20), space=space, margin=0.0, time_model=two_percent)
    faster = next(c for c in result.candidates if c.recipe == result.best.recipe.replace(gradient_checkpointing=False))
    assert faster.fits and faster.samples_per_second > result.best.samples_per_second
    assert result.best.recipe.gradient_checkpointing and result.best.recipe.per_device_train_batch_size == 64
    # the headroom it keeps: at least HEADROOM_STEP (5%) of the 256 MiB limit = 12.8 MiB more
    roomier = faster.device_total_high - result.best.device_total_high
    assert roomier >= 0.05 * 256 * 2**20
    assert result.speed_error == pytest.approx(0.09)
    assert result.best in result.pareto
    line = next(r for r in result.best.reasons if r.startswith("gradient checkpointing on"))
    assert (f"the pick is 2% slower predicted than off, inside the +-9% time error: the pick keeps "
            f"{roomier / 2**20:.1f} MiB more headroom") in line
    without_error = plan(workload, _small_gpu(256 * 2**20), space=space, margin=0.0,
                         time_model=lambda *a, **k: replace(two_percent(*a, **k), error_median_pct=0.0))
    assert not without_error.best.recipe.gradient_checkpointing  # ranked on speed alone: the 2% faster one


def test_a_faster_alternative_beyond_the_time_error_is_said_to_be_untried() -> None:
    """An axis' alternative is made from the pick, so it can be a combination the search never enumerated; one predicted
    faster beyond the time error, and fitting, was no candidate (`choose` would have taken it), and is said so instead
    of 'inside the time error' (Qwen3-30B-A3B's expert parallel plan before its checkpointing was searched: 11%)."""
    from types import SimpleNamespace

    from anatomist.plan.reasons import _passed_over

    pick = SimpleNamespace(samples_per_second=9.9, device_total_high=40 * 2**30)
    near = SimpleNamespace(samples_per_second=10.5, device_total_high=41 * 2**30)
    far = SimpleNamespace(samples_per_second=11.2, device_total_high=58 * 2**30)
    limit = 72 * 2**30
    assert "the pick is 6% slower predicted than 1 in 2, inside the +-10% time error" in _passed_over(
        pick, "1 in 2", near, 0.10, limit)
    said = _passed_over(pick, "1 in 2", far, 0.10, limit)
    assert "inside" not in said and said.startswith("1 in 2 is predicted 12% faster than the pick (11.2 samples/s)")
    assert "a combination the search did not try" in said
