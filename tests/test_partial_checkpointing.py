"""Partial and offloaded activation checkpointing: transformers' activation_checkpointing_kwargs every_n_layers
(`Recipe.checkpoint_every`) and offload (`Recipe.checkpoint_offload`).

Partial: the measured side is PyTorch's MemTracker over a real steady-state step of the full-depth model on the
CPU (memtracker_step.py), checkpointed by transformers itself: `activation_checkpointing_enable(every_n_layers=N)`
picks the layers. The prediction traces cuts of the model with a checkpointed and a plain layer (a kind each) and
extrapolates them to 16 layers at batch 5: it never traced that depth nor that batch.

Offload: transformers wraps each checkpoint in torch's save_on_cpu, which on a CPU moves nothing, so MemTracker
cannot see it here. The measured side is what transformers offloads in a real step: every storage its
save_on_cpu is handed (recorded by a pass-through hook in its place). At the end of forward none of those is
needed on the device, so the predicted forward peak must drop by their bytes; the two differ by the rotary
cos/sin tables (2 x 4 KiB here), which the prediction keeps on the device.
"""

from __future__ import annotations

import pytest
import torch
from memtracker_step import count_as_on_cuda, measure_step, round_to_block
from transformers import modeling_utils

from anatomist.estimate.memory import estimate_memory
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.trace.depth.plan import model_plan
from anatomist.trace.step.inputs import make_batch
from anatomist.workload_loader import load_workload

GPU = get_gpu("A100-80GB")
BATCH = 5
LAYERS = 16  # deep enough that cuts by kind cost less than the full model: extrapolated, not traced whole


@pytest.fixture
def workload(tiny_model):
    return load_workload(str(tiny_model("llama", num_hidden_layers=LAYERS)), seq_len=64)


@pytest.mark.parametrize("every", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_partial_checkpointing_matches_pytorchs_accounting(workload, monkeypatch, every):
    count_as_on_cuda(monkeypatch)
    recipe = Recipe.with_presets(per_device_train_batch_size=BATCH, dtype="float32", checkpoint_every=every)
    recipe = recipe.resolved(workload)
    assert recipe.gradient_checkpointing  # implied by checkpoint_every > 1
    assert model_plan(workload, recipe).plan.how == "by-kind"
    predicted = estimate_memory(workload, recipe, GPU).anatomy

    torch.manual_seed(0)
    model = workload.build_model(recipe.attn_implementation, recipe.dtype)
    model.activation_checkpointing_enable(every_n_layers=every)
    assert [layer.gradient_checkpointing for layer in model.model.layers].count(True) == len(range(0, LAYERS, every))
    measured, _after = measure_step(workload, recipe, model, BATCH)
    assert predicted.peak_allocated - predicted.functionality == pytest.approx(measured["Total"], rel=0.03)


@pytest.mark.slow
def test_partial_checkpointing_lies_between_none_and_every_layer(workload):
    activations = {}
    for name, recipe in {"none": Recipe(), "1 in 4": Recipe.with_presets(checkpoint_every=4),
                         "1 in 2": Recipe.with_presets(checkpoint_every=2),
                         "every": Recipe(gradient_checkpointing=True)}.items():
        recipe = recipe.replace(per_device_train_batch_size=BATCH, dtype="float32")
        activations[name] = estimate_memory(workload, recipe.resolved(workload), GPU).anatomy.activations
    assert activations["none"] > activations["1 in 4"] > activations["1 in 2"] > activations["every"], activations


def _offloaded_by_transformers(workload, monkeypatch) -> int:
    """Bytes (as the CUDA allocator rounds them) of the distinct storages transformers' offloading checkpoints hand
    to save_on_cpu in one real forward and backward."""
    storages: dict[int, int] = {}

    class Recording(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self, **_kwargs) -> None:
            def pack(tensor: torch.Tensor) -> torch.Tensor:
                storages[tensor.untyped_storage().data_ptr()] = round_to_block(tensor.untyped_storage().nbytes())
                return tensor

            super().__init__(pack, lambda tensor: tensor)

    monkeypatch.setattr(modeling_utils, "save_on_cpu", Recording)
    torch.manual_seed(0)
    model = workload.build_model("sdpa", "float32")
    model.train()
    model.activation_checkpointing_enable(offload=True)
    model(**make_batch(workload, BATCH)).loss.backward()
    return sum(storages.values())


def test_offloaded_checkpoints_leave_the_device(workload, monkeypatch):
    offloaded = _offloaded_by_transformers(workload, monkeypatch)
    hidden_states = LAYERS * round_to_block(BATCH * workload.seq_len * workload.config.hidden_size * 4)
    assert offloaded >= hidden_states  # every layer's input, at least
    peaks = {}
    for offload in (False, True):
        recipe = Recipe.with_presets(per_device_train_batch_size=BATCH, dtype="float32", gradient_checkpointing=True,
                                     checkpoint_offload=offload)
        peaks[offload] = estimate_memory(workload, recipe.resolved(workload), GPU).phase_peaks["forward"]
    assert peaks[False] - peaks[True] == pytest.approx(offloaded, rel=0.02)


def test_partial_checkpointing_needs_checkpointing():
    with pytest.raises(Exception, match="needs gradient_checkpointing=True"):
        Recipe(checkpoint_every=2)
    with pytest.raises(Exception, match="at least 1"):
        Recipe(checkpoint_every=0, gradient_checkpointing=True)


def test_emitted_training_arguments_checkpoint_the_predicted_layers(workload, tmp_path):
    """The TrainingArguments `plan --emit trainer` writes, given to a real Trainer for one step: transformers picks
    the layers that checkpoint, and they are the ones the prediction checkpointed. (Its offload pins host memory,
    which a machine without an accelerator refuses: emitted, not run here.)"""
    from transformers import Trainer, TrainingArguments

    from anatomist.recipe.spellings import trainer_kwargs

    recipe = Recipe.with_presets(per_device_train_batch_size=2, checkpoint_every=3, checkpoint_offload=True)
    kwargs = trainer_kwargs(recipe) | {"optim": "adamw_torch"}
    assert kwargs["gradient_checkpointing_kwargs"] == {"every_n_layers": 3, "offload": True}
    kwargs["gradient_checkpointing_kwargs"] = {"every_n_layers": 3}
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True, **kwargs)
    torch.manual_seed(0)
    model = workload.build_model("sdpa", "float32")
    batch = make_batch(workload, 2)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(2)]
    Trainer(model=model, args=args, train_dataset=rows).train()
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [recipe.checkpointed(i) for i in range(LAYERS)]


def test_the_reasons_compare_every_setting_of_checkpointing():
    from anatomist.plan.space import SearchSpace, checkpointing_alternatives

    offloaded = Recipe.with_presets(checkpoint_every=2, checkpoint_offload=True)
    labels = [label for label, _ in checkpointing_alternatives(offloaded, SearchSpace())]
    assert labels == ["off", "on+offload", "1 in 4+offload", "1 in 2"]


def test_a_cut_steps_its_optimizer_as_the_model_cut_to_as_many_layers(workload, cache_folder):
    """The cuts of a recipe that checkpoints every 2nd layer differ from a plain cut only in which layers checkpoint,
    which the optimizer step never sees: each is served the trace of the model cut to as many layers (shared with
    every other setting of checkpointing), and that trace is the one the cut itself gives."""
    import numpy as np

    from anatomist.trace.depth.cuts import Cut
    from anatomist.trace.step.driver import trace_step
    from anatomist.trace.store.parts import trace_part

    recipe = Recipe.with_presets(per_device_train_batch_size=BATCH, dtype="float32", checkpoint_every=2)
    recipe = recipe.resolved(workload)
    cuts = [c for c in model_plan(workload, recipe).plan.cuts if isinstance(c, Cut)]
    assert cuts
    for cut in cuts:
        served = trace_part(workload, recipe, "optimizer", depth=cut, batch_size=1, compute_capability="8.0")
        plain = trace_part(workload, recipe.replace(checkpoint_every=1), "optimizer", depth=cut.blocks, batch_size=1,
                           compute_capability="8.0")
        assert served is plain
        own = trace_step(workload, recipe, depth=cut, batch_size=1, compute_capability="8.0", part="optimizer",
                         record_ops=True)
        assert own.curves.keys == served.curves.keys
        assert np.array_equal(own.curves.categories, served.curves.categories)
        assert own.ops == served.ops and own.static_bytes == served.static_bytes


@pytest.mark.parametrize(("num_gpus", "everies"), [(1, (2, 4)), pytest.param(2, (2, 3, 4), marks=pytest.mark.slow)])
def test_the_cuts_of_one_layer_in_n_are_traced_once_for_every_n(workload, cache_folder, num_gpus, everies):
    """The passes of a cut depend on which of its layers checkpoint, not on their numbers in the full model: every
    cut of a recipe checkpointing one layer in 2, 3 or 4 is served the trace of the cut that checkpoints the same ones
    of its layers one in two, and that trace is the one the cut itself gives, byte for byte (one device, and one rank
    of FSDP)."""
    import pickle

    from anatomist.trace.depth.cuts import Cut
    from anatomist.trace.store.parts import PartRequest, trace_part, trace_request

    served, patterns, cuts_seen = set(), set(), 0
    for every in everies:
        recipe = Recipe.with_presets(per_device_train_batch_size=BATCH, dtype="float32", checkpoint_every=every,
                                     **({"fsdp": "full_shard"} if num_gpus > 1 else {})).resolved(workload)
        cuts = [c for c in model_plan(workload, recipe).plan.cuts if isinstance(c, Cut)]
        assert len(cuts) == 3
        cuts_seen += len(cuts)
        for cut in cuts:
            trace = trace_part(workload, recipe, "forward-backward", depth=cut, batch_size=2, compute_capability="8.0",
                               num_gpus=num_gpus)
            own = trace_request(workload, PartRequest(recipe, "forward-backward", cut, 2, num_gpus), "8.0")
            assert pickle.dumps(own) == pickle.dumps(trace)
            served.add(id(trace))
            patterns.add(tuple(recipe.checkpointed(layer) for layer in cut.stacks[0].kept))
    # 1 in 2 and 1 in 4 leave the last of 16 layers plain and share their 3 cuts; 1 in 3 checkpoints it: 3 more
    assert len(served) == len(patterns) == (3 if 3 not in everies else 6) < cuts_seen
