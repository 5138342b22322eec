"""Unit tests with hand-worked numbers: allocator rules, bytes-per-param rule, recipe, catalog."""

from __future__ import annotations

import pytest

from anatomist.errors import InputError
from anatomist.estimate.rules import bytes_per_param_rule
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.recipe.spellings import training_arguments
from anatomist.trace.engine.allocator import CachingAllocator, round_size, segment_size
from anatomist.workload_loader import load_workload


def test_allocator_rounding_and_segments():
    assert round_size(1) == 512
    assert round_size(513) == 1024
    assert segment_size(512) == 2 << 20  # small pool: 2 MiB segments
    assert segment_size(3 << 20) == 20 << 20  # 1 MiB < size < 10 MiB: a 20 MiB segment
    assert segment_size((11 << 20) + 1) == 12 << 20  # >= 10 MiB: rounded up to 2 MiB


def test_allocator_reuses_cached_blocks_and_never_releases():
    a = CachingAllocator()
    small = a.malloc(100)  # 512 B out of a new 2 MiB segment
    big = a.malloc(3 << 20)  # 3 MiB out of a new 20 MiB segment
    assert (a.allocated, a.reserved) == (512 + (3 << 20), (2 << 20) + (20 << 20))
    a.free(big)
    a.malloc(5 << 20)  # fits the cached 20 MiB segment: nothing new reserved
    assert a.reserved == (22 << 20)
    a.free(small)
    assert a.reserved == (22 << 20)  # cached, not given back


def test_allocator_keeps_each_streams_cached_blocks_apart():
    """A block freed on one stream is not handed to a request of another (CUDACachingAllocator's pools are keyed
    by stream): the second stream reserves a segment of its own; the first reuses its block."""
    a = CachingAllocator()
    block = a.malloc(30 << 20)
    a.free(block)
    a.malloc(30 << 20, stream=1)
    assert a.reserved == 60 << 20
    a.malloc(30 << 20)
    assert a.reserved == 60 << 20 and a.allocated == 60 << 20


def test_allocator_releases_free_segments_before_oom():
    a = CachingAllocator(capacity_bytes=30 << 20)
    a.free(a.malloc(15 << 20))  # a 16 MiB segment, now free
    a.malloc(12 << 20)  # reuses it (split: 12 + 4)
    a.malloc(12 << 20)  # 16 + 12 + 12 > 30? no: 16 + 12 = 28 <= 30
    assert not a.oom
    a.malloc(12 << 20)
    assert a.oom


def test_bytes_per_param_rule_is_the_seeds():
    n = 1000
    mixed = bytes_per_param_rule(Recipe(fp16=True), n, "train")
    assert mixed.total_per_param == 18  # 6 + 8 + 4, the seeds' mixed-precision AdamW
    assert bytes_per_param_rule(Recipe(optim="adamw_bnb_8bit"), n, "train").total_per_param == 4 + 2 + 4
    assert bytes_per_param_rule(Recipe(optim="sgd"), n, "train").total_per_param == 4 + 4 + 4
    assert bytes_per_param_rule(Recipe(bf16=True), n, "inference").total_per_param == 6
    assert bytes_per_param_rule(Recipe(optim="adafactor"), n, "train").optimizer_per_param is None


def test_recipe_validation_names_field_and_value():
    with pytest.raises(InputError, match="gradient_accumulation_steps must be greater than 0, got -1"):
        Recipe(gradient_accumulation_steps=-1)
    with pytest.raises(InputError, match="field fp16 must be bool"):
        Recipe.from_dict({"fp16": "yes"})


def test_recipe_to_training_arguments_is_accepted_by_transformers(tmp_path):
    recipe = Recipe(per_device_train_batch_size=2, gradient_accumulation_steps=4, gradient_checkpointing=True, optim="adafactor")
    args = training_arguments(recipe, str(tmp_path), use_cpu=True, report_to="none")
    assert args.per_device_train_batch_size == 2
    assert args.gradient_accumulation_steps == 4
    assert args.optim == "adafactor"


def test_gpu_lookup_by_alias_and_suggestions():
    assert get_gpu("h100").name == "H100-SXM"
    assert get_gpu("A100_80GB").name == "A100-80GB"
    with pytest.raises(InputError, match="did you mean"):
        get_gpu("A100-90GB")


def test_catalog_models_resolve_with_their_hub_names():
    assert load_workload("google-bert/bert-large-uncased").config.hidden_size == 1024
    assert load_workload("mistralai/Mixtral-8x7B").is_moe
    assert load_workload("meta-llama/Llama-3.2-1B").config.num_key_value_heads == 8


def test_optimizer_choice_matches_the_trainer(tmp_path):
    """Our optimizer construction (no Trainer import) must match Trainer.get_optimizer_cls_and_kwargs."""
    import torch
    from transformers import Trainer, TrainingArguments

    from anatomist.trace.step.optimizer_build import build_optimizer

    params = [torch.nn.Parameter(torch.zeros(4))]
    for optim in ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd"):
        args = TrainingArguments(output_dir=str(tmp_path), optim=optim, use_cpu=True, report_to="none",
                                 optim_args="momentum=0.9" if optim == "sgd" else None)
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
        ours = build_optimizer(Recipe(optim=optim), params)
        assert type(ours) is cls
        assert bool(ours.defaults.get("fused")) == bool(kwargs.get("fused"))
        if optim == "sgd":
            assert ours.defaults["momentum"] == kwargs["momentum"]


def test_categories_add_up_to_peak_and_device_total():
    """bert-base fp32 once broke this identity through rounding after extrapolation."""
    from anatomist.anatomy import TENSOR_CATEGORIES, MemoryCategory
    from anatomist.estimate.memory import estimate_memory

    anatomy = estimate_memory(load_workload("bert-base-uncased", seq_len=128), Recipe(per_device_train_batch_size=8).resolved(load_workload("bert-base-uncased", seq_len=128)),
                              get_gpu("A100-80GB")).anatomy
    assert sum(anatomy.category_bytes(c) for c in TENSOR_CATEGORIES) == anatomy.peak_allocated
    assert sum(anatomy.category_bytes(c) for c in MemoryCategory) == anatomy.device_total


@pytest.mark.slow
def test_the_load_dtype_follows_the_config_unless_given(tiny_model):
    """transformers 5 loads a checkpoint in its config's dtype (`dtype="auto"`): a bf16 config
    trains in pure bf16 (weights, gradients and AdamW moments at 2 B/param each); --dtype
    float32 gives fp32 master weights (4 B/param) that fp16 autocast casts per op (SDPA too:
    rotary embeddings leave Llama's q and k in fp32)."""
    from anatomist.estimate.memory import estimate_memory
    from anatomist.estimate.time.ops import step_ops

    workload = load_workload(str(tiny_model("llama", dtype="bfloat16", torch_dtype="bfloat16")), seq_len=32)
    gpu = get_gpu("A100-80GB")
    auto = estimate_memory(workload, Recipe(per_device_train_batch_size=2, optim="adamw_torch").resolved(workload), gpu)
    # 512-byte rounding per tensor weighs on a tiny model: 2%
    assert auto.anatomy.weights == pytest.approx(2 * auto.parameters, rel=0.02)
    # 2 moments x 2 B, plus AdamW's fp32 `step` counter per parameter tensor (512 B each, rounded)
    tensors = 3 + 9 * 4  # embeddings, final norm, lm_head + 9 per block x 4 blocks
    assert auto.anatomy.optimizer_states == pytest.approx(4 * auto.parameters + 512 * tensors, rel=0.01)
    assert auto.rule.total_per_param == 2 + 2 + 4
    fp32 = estimate_memory(workload, Recipe(per_device_train_batch_size=2, dtype="float32").resolved(workload), gpu)
    assert fp32.anatomy.weights == pytest.approx(4 * fp32.parameters, rel=0.01)
    fp16 = step_ops(workload, Recipe(per_device_train_batch_size=2, dtype="float32", fp16=True).resolved(workload))
    # transformers < 5.19 computes the rotary angles with autocast off: one fp32 product of
    # inv_freq [8, 1] by the positions [1, 32] = 2 * 8 * 32 = 512 FLOPs; every other product is fp16
    full_precision = [r for r in fp16.records if r.flops > 0 and r.dtype != "float16"]
    assert sum(r.flops * r.count for r in full_precision) in (0, 512)


def test_defaults_are_the_trainers_own():
    """Every Recipe field TrainingArguments has defaults to TrainingArguments' own value."""
    import dataclasses

    from transformers import TrainingArguments

    trainer = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    recipe = Recipe()
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "fp16", "bf16", "optim",
                 "torch_compile", "dataloader_num_workers", "dataloader_pin_memory", "max_grad_norm"):
        assert getattr(recipe, name) == trainer[name], name
    assert recipe.gradient_checkpointing is bool(trainer["gradient_checkpointing"])
    assert recipe.dtype == "auto"


@pytest.mark.parametrize(("recipe", "message"), [
    ({"dtype": "float16", "fp16": True}, "PyTorch refuses to unscale fp16 gradients"),
    ({"dtype": "int8"}, "unknown dtype 'int8'; known: auto, float32, bfloat16, float16"),
])
def test_refused_dtype_combinations(recipe, message):
    with pytest.raises(InputError, match=message):
        Recipe(**recipe)


@pytest.mark.parametrize(("stage", "per_param"), [(1, 4 + 12 / 4), (2, 2 + 14 / 4), (3, 16 / 4)])
def test_deepspeed_mixed_precision_is_the_zero_papers_arithmetic(stage, per_param):
    """ZeRO paper, Figure 1 (K = 12, N = 4 devices): stage 1 2+2+K/N, stage 2 2+(2+K)/N,
    stage 3 (2+2+K)/N bytes per parameter, from the traced peak of the step as DeepSpeed's bf16 mode runs it
    (`sharding.as_deepspeed_runs`: pure bf16 weights 2 B, gradients 2 B, AdamW moments 4 B): K is DeepSpeed's fp32
    master weights and moments whatever the trace's moments were."""
    from anatomist.anatomy import MemoryCategory as C
    from anatomist.anatomy import Phase
    from anatomist.estimate.sharding import ZeroSize, shard
    from anatomist.trace.engine.records import PhasePeak

    n = 1 << 20
    traced = {C.WEIGHTS: 2 * n, C.GRADIENTS: 2 * n, C.OPTIMIZER_STATES: 4 * n, C.ACTIVATIONS: 123,
              C.TEMPORARY: 0, C.FUNCTIONALITY: 0}
    peak = PhasePeak(allocated=sum(traced.values()), reserved=sum(traced.values()) + 1000, categories=traced)
    size = ZeroSize(parameters=n, trainable=n)  # no parameter kept whole, none gathered: the paper's model
    out = shard(peak, Recipe(zero_stage=stage, bf16=True), size, 4, "train", Phase.BACKWARD)
    states = out.categories[C.WEIGHTS] + out.categories[C.GRADIENTS] + out.categories[C.OPTIMIZER_STATES]
    assert states == per_param * n
    assert out.categories[C.ACTIVATIONS] == 123 and out.allocated == states + 123
    assert out.reserved == round(out.allocated * peak.reserved / peak.allocated)  # the reserve keeps its ratio
    if stage >= 2:  # ZeRO-Offload: master weights, moments and gradient partitions live on the host
        offloaded = shard(peak, Recipe(zero_stage=stage, bf16=True, offload="cpu"), size, 4, "train", Phase.BACKWARD)
        assert offloaded.categories[C.OPTIMIZER_STATES] == offloaded.categories[C.GRADIENTS] == 0
        assert offloaded.categories[C.WEIGHTS] == (0 if stage == 3 else 2 * n)  # stage 3 offloads parameters too


def test_nccl_buffers_are_on_the_device_of_every_rank_of_several():
    """https://github.com/NVIDIA/nccl/issues/964 (4 x A100, NVLink, through PyTorch): 544 MB for a group of 2, 688 MB for more."""
    from anatomist.estimate.memory import outside_allocator_bytes
    from anatomist.hardware import get_gpu

    gpu = get_gpu("A100-80GB")
    assert outside_allocator_bytes(gpu, 1) == gpu.cuda_context_bytes
    assert outside_allocator_bytes(gpu, 2) == gpu.cuda_context_bytes + 544 * 2**20
    assert outside_allocator_bytes(gpu, 16) == gpu.cuda_context_bytes + 688 * 2**20
