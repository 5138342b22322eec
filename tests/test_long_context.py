"""Long context and large vocabularies: an estimate at the model's longest sequence costs what one at
512 tokens costs (fake tensors allocate nothing, so no step of it may scale with the length), and
when the logits of the loss are the peak, the notes say so in words."""

from __future__ import annotations

import time

import pytest

from anatomist.anatomy import GIB
from anatomist.estimate.loss_peak import LOSS_SHARE, post_segment_peak
from anatomist.estimate.memory import estimate_memory
from anatomist.estimate.predict import estimate
from anatomist.estimate.traces import step_traces
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.trace.store import cache
from anatomist.workload_loader import load_workload

GPU = get_gpu("H100-80GB")
MAX_POSITIONS = 131072


@pytest.fixture
def no_trace_cache(monkeypatch: pytest.MonkeyPatch):
    """Every estimate traces, in this process (its CPU time is what is compared): the disk cache off,
    the memory cache emptied, restored afterwards; no worker processes."""
    monkeypatch.setenv("ANATOMIST_JOBS", "1")
    enabled = cache.disk_cache_enabled()
    cache.set_disk_cache(False)
    cache.clear_memory()
    yield
    cache.clear_memory()
    cache.set_disk_cache(enabled)


def _cpu_seconds(workload, recipe) -> float:
    cache.clear_memory()
    start = time.process_time()  # CPU time of this process: what a loaded machine does not inflate much
    estimate(workload, recipe, GPU)
    return time.process_time() - start


@pytest.mark.slow
def test_longest_sequence_estimates_as_fast_as_512(tiny_model, no_trace_cache):
    """At 131,072 tokens a real [s, s] mask alone would be 16 GiB and a Python loop over positions
    would take minutes: the traces run the same ops as at 512 and take about the same CPU time."""
    folder = tiny_model("llama", max_position_embeddings=MAX_POSITIONS)
    recipe = Recipe(per_device_train_batch_size=1)
    short, longest = (load_workload(str(folder), seq_len=s) for s in (512, MAX_POSITIONS))
    _cpu_seconds(load_workload(str(folder), seq_len=64), recipe)  # first-call costs (imports, dispatch caches)
    short_s, long_s = _cpu_seconds(short, recipe), _cpu_seconds(longest, recipe)
    assert long_s <= 1.5 * short_s + 1.0, (short_s, long_s)
    ops = {w.seq_len: {k: t.op_count for k, t in step_traces(w, recipe.resolved(w), GPU.compute_capability).passes.items()}
           for w in (short, longest)}
    assert ops[512] == ops[MAX_POSITIONS]


def _llm(tiny_model, vocab_size: int, seq_len: int):
    folder = tiny_model("llama", vocab_size=vocab_size, max_position_embeddings=4096)
    return load_workload(str(folder), seq_len=seq_len)


def test_note_when_the_logits_of_the_loss_are_the_peak(tiny_model):
    """hidden 64, vocabulary 32,000: one fp32 copy of the logits is 2 x 256 x 32,000 x 4 B = 62.5 MiB,
    some 40 times a block's activations. The loss keeps the log-softmax; backward adds the gradient
    of the loss and of the log-softmax: 3 fp32 copies live at the peak, in backward, after the last block."""
    workload = _llm(tiny_model, 32000, 256)
    recipe = Recipe(per_device_train_batch_size=2)
    memory = estimate_memory(workload, recipe.resolved(workload), GPU)
    copy_bytes = 2 * 256 * 32000 * 4
    notes = [n for n in memory.notes if n.startswith("the peak is the logits of the loss")]
    assert len(notes) == 1, memory.notes
    assert f"2 x 256 tokens x 32,000 vocabulary: {copy_bytes / GIB:.1f} GiB per fp32 copy" in notes[0]
    peak = post_segment_peak(step_traces(workload, recipe.resolved(workload), GPU.compute_capability), memory.anatomy.peak_phase, 2)
    assert peak is not None
    assert 3 * copy_bytes <= peak.loss_bytes <= 3.1 * copy_bytes
    assert f"{peak.loss_bytes / GIB:.1f} GiB of the" in notes[0]
    assert str(memory.anatomy.peak_phase) == "backward"


def test_no_note_when_the_blocks_are_the_peak(tiny_model):
    """vocabulary 1,000 and 4 blocks: the peak is still after the last block, but the loss's copies
    (2 x 256 x 1,000 x 4 B = 2 MiB each) hold less than the blocks' activations; the note would mislead."""
    workload = _llm(tiny_model, 1000, 256)
    recipe = Recipe(per_device_train_batch_size=2)
    memory = estimate_memory(workload, recipe.resolved(workload), GPU)
    assert not [n for n in memory.notes if "logits of the loss" in n]
    peak = post_segment_peak(step_traces(workload, recipe.resolved(workload), GPU.compute_capability), memory.anatomy.peak_phase, 2)
    assert peak is not None and peak.loss_bytes < LOSS_SHARE * (memory.anatomy.activations + memory.anatomy.temporary)


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_no_note_under_trls_fused_head(tiny_model, trainer):
    """The same model as the note's case under TRL's trainers: their fused LM head scores the tokens in tiles and never
    holds the logits, so the note (and its Liger hint) would be false; under DPO the bytes made after the policy's last
    block are the reference model's pass (they were a half of the peak here, and the note fired)."""
    workload = _llm(tiny_model, 32000, 256)
    recipe = Recipe(per_device_train_batch_size=2, trainer=trainer)
    memory = estimate_memory(workload, recipe.resolved(workload), GPU)
    assert not [n for n in memory.notes if "logits of the loss" in n], memory.notes
    assert [n for n in memory.notes if "the logits never exist" in n]
