"""A step at a sequence length derived from its traces at three others (trace/depth/lengths.py), and the search for
the longest sequence that fits (estimate/longest.py, `estimate --longest-seq-len`).

Proof of sameness (issue 46): estimates whose every part is derived from three lengths against estimates traced
directly at the same length, at random (batch, length) points of three models (a causal Llama on SDPA, GPT-2 on
eager attention, whose scores grow with the square of the length, BERT's masked LM): device total, allocated peak,
largest batch and step time. Direct traces are today's (themselves checked by PyTorch's MemTracker in
test_estimate_accuracy.py); the derivation never reads them. The search's answer is checked against direct traces
at that length and the next one up.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from conftest import refused_in_one_line, write_config

from anatomist.errors import InputError
from anatomist.estimate.longest import longest_sequence
from anatomist.estimate.predict import estimate
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.trace.depth.lengths import derive_length, quadratic_at
from anatomist.trace.store import cache, parts
from anatomist.workload_loader import load_workload

GPU = get_gpu("A100-80GB")
LIMIT = 2048
BASIS = (512, 1024, 1536)
MODELS = {
    "llama": ("llama", {"max_position_embeddings": LIMIT}, {"bf16": True, "gradient_checkpointing": True,
                                                           "gradient_accumulation_steps": 2}),
    "gpt2 eager": ("gpt2", {"n_positions": LIMIT}, {"attn_implementation": "eager", "fp16": True}),
    "bert": ("bert", {"max_position_embeddings": LIMIT}, {"peft": "lora", "lora_target_modules": "query,value"}),
}


def _estimate(path, fields: dict, length: int, batch: int):
    workload = load_workload(str(path), seq_len=length)
    return estimate(workload, Recipe.from_dict({**fields, "per_device_train_batch_size": batch}), GPU)


def _both_ways(tiny_model, name: str, points: int, seed: int) -> None:
    model, config, fields = MODELS[name]
    path = tiny_model(model, **config)
    draw = random.Random(seed)
    for _ in range(points):
        length, batch = draw.randrange(16, LIMIT + 1), draw.randrange(1, 9)
        with parts.lengths_derived_from(BASIS):
            derived = _estimate(path, fields, length, batch)
        direct = _estimate(path, fields, length, batch)
        got, want = derived.memory.anatomy, direct.memory.anatomy
        assert got.device_total == pytest.approx(want.device_total, rel=1e-3), (length, batch)
        assert got.peak_allocated == pytest.approx(want.peak_allocated, rel=1e-3), (length, batch)
        assert derived.memory.max_batch_size == direct.memory.max_batch_size, (length, batch)
        assert derived.time.step_s == pytest.approx(direct.time.step_s, rel=1e-3), (length, batch)


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name == "llama" else name
                                  for name in MODELS])  # the Llama's recipe traces most: slow, as its 20 points below
def test_an_estimate_derived_from_three_lengths_is_the_direct_one(tiny_model, cache_folder, name):
    _both_ways(tiny_model, name, points=1, seed=46)


@pytest.mark.slow  # 20 points of each model, each traced directly: 1-2 minutes a model on 2 cores
@pytest.mark.parametrize("name", MODELS)
def test_twenty_random_points_derived_are_the_direct_ones(tiny_model, cache_folder, name):
    _both_ways(tiny_model, name, points=20, seed=2046)


def test_what_does_not_line_up_is_not_derived(tiny_model, cache_folder, tmp_path):
    """Three traces of different models do not pair allocation by allocation: refused, so the caller traces."""
    recipe = Recipe().resolved(load_workload(str(tiny_model("llama")), seq_len=64))

    def traced(path, length):
        workload = load_workload(str(path), seq_len=length)
        return parts.trace_part(workload, recipe, "forward-backward", depth=2, batch_size=2, compute_capability="8.0")

    llama, wider = tiny_model("llama"), write_config(tmp_path / "wider", "llama", intermediate_size=256)
    same = [traced(llama, n) for n in (32, 64, 96)]
    assert derive_length(same, (32, 64, 96), 128) is not None
    assert derive_length([same[0], same[1], traced(wider, 96)], (32, 64, 96), 128) is None
    assert derive_length(same, (32, 64, 64), 128) is None  # two lengths alike: no quadratic through them


def test_a_size_that_is_no_quadratic_in_the_length_is_refused_where_it_shows():
    assert quadratic_at([4 * 32 * 32, 4 * 64 * 64, 4 * 96 * 96], (32, 64, 96), 1000) == 4 * 1000 * 1000
    # a size padded to a multiple of 32 that jumps between the lengths traced (96 -> 128): a fraction at 100, refused
    assert quadratic_at([32, 64, 128], (32, 64, 96), 100) is None
    # where it does not jump between them it looks linear: 100 where the padded size is 128. The whole-number check
    # cannot see that; a search's answer is checked against direct traces for it (`estimate.longest`), and the
    # proof-of-sameness tests above show the models traced here have no such size
    assert quadratic_at([32, 64, 96], (32, 64, 96), 100) == 100


def test_the_longest_sequence_is_the_longest_that_direct_traces_fit(tiny_model, cache_folder):
    """On a GPU sized between two lengths, the search answers the shorter; direct traces agree: the answer fits,
    the next length up does not; and a later estimate at another length derives its parts from the cache."""
    path = tiny_model("llama", max_position_embeddings=LIMIT)
    fields = {"per_device_train_batch_size": 4}
    at = {n: _estimate(path, fields, n, 4).memory.anatomy.device_total for n in (1152, 1280)}
    gpu = dataclasses.replace(GPU, memory_bytes=(at[1152] + at[1280]) // 2)
    workload = load_workload(str(path), seq_len=64)
    found = longest_sequence(workload, Recipe.from_dict(fields), gpu, margin=0.0)
    assert found.tokens == 1152 and (found.next_tokens, found.next_device_total) == (1280, at[1280])
    assert found.derived_from == BASIS and found.traced == (1152, 1280) and found.derived >= 3
    with found.derivation():
        _estimate(path, fields, 1152, 4)
    cache.clear_memory()

    def trace_request(*args):
        raise AssertionError("traced where the kept lengths derive")

    original, parts.trace_request = parts.trace_request, trace_request
    try:
        later = _estimate(path, fields, 700, 4)
    finally:
        parts.trace_request = original
    assert later.memory.anatomy.device_total == _estimate(path, fields, 700, 4).memory.anatomy.device_total


def test_the_last_length_tried_is_the_models_limit_where_it_is_no_multiple_of_the_step(tiny_model, cache_folder):
    """A model of 1,000 positions: after 896 the search tries 1,000, not 1,024, and says so."""
    path = tiny_model("llama", max_position_embeddings=1000)
    fields = {"per_device_train_batch_size": 4}
    at = {n: _estimate(path, fields, n, 4).memory.anatomy.device_total for n in (896, 1000)}
    gpu = dataclasses.replace(GPU, memory_bytes=(at[896] + at[1000]) // 2)
    found = longest_sequence(load_workload(str(path), seq_len=64), Recipe.from_dict(fields), gpu, margin=0.0)
    assert (found.tokens, found.next_tokens, found.next_device_total) == (896, 1000, at[1000])


def test_a_recipe_not_derived_across_lengths_is_searched_on_direct_traces(tiny_model, cache_folder):
    path = tiny_model("llama", max_position_embeddings=1024)
    fields = {"per_device_train_batch_size": 2, "use_liger_kernel": True}
    workload = load_workload(str(path), seq_len=64)
    limit = _estimate(path, fields, 640, 2).memory.anatomy.device_total
    found = longest_sequence(workload, Recipe.from_dict(fields), dataclasses.replace(GPU, memory_bytes=limit), margin=0.0)
    assert found.derived_from is None and found.derived == 0 and "not derived" in found.why_traced
    assert found.tokens == 640 and found.traced == (512, 640, 768)  # halving 128..1024 on direct traces
    assert found.next_device_total == _estimate(path, fields, 768, 2).memory.anatomy.device_total > limit


def test_padding_free_has_no_length_to_search(tiny_model):
    workload = load_workload(str(tiny_model("llama")), seq_len=64)
    with pytest.raises(InputError, match="padding_free trains on the data's own lengths"):
        longest_sequence(workload, Recipe.from_dict({"padding_free": True, "attn_implementation": "flash_attention_2"}), GPU, margin=0.0)


def test_the_cli_estimates_at_the_longest_sequence_and_says_how_it_was_found(tiny_model, cache_folder, cli):
    path = str(tiny_model("llama", max_position_embeddings=LIMIT))
    result = cli("estimate", path, "--gpu", "A100-80GB", "--longest-seq-len", "--batch-size", "2", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    found = data["longest_seq_len"]
    # a tiny model fits an A100 at its longest: the estimate is made there, nothing above it
    assert data["seq_len"] == found["tokens"] == found["limit"] == LIMIT and found["next_tokens"] is found["next_device_total"] is None
    assert found["derived_from"] == list(BASIS) and found["traced"] == [LIMIT]
    text = cli("estimate", path, "--gpu", "A100-80GB", "--longest-seq-len", "--batch-size", "2").stdout
    assert (f"longest sequence that fits: {LIMIT:,} tokens at batch 2 (multiples of 128 up to the model's {LIMIT:,}); "
            f"{found['derived']} lengths derived from traces at 512, 1,024, 1,536 tokens, the answer checked by direct "
            f"traces at {LIMIT:,}") in " ".join(text.split())


def test_the_cli_refuses_a_length_search_without_a_length_in_one_line(tiny_model, cli):
    result = cli("estimate", str(tiny_model("llama")), "--longest-seq-len", "--padding-free", "--avg-seq-len", "40",
                 "--attn-implementation", "flash_attention_2", "--gpu", "A100-80GB")
    refused_in_one_line(result, "--longest-seq-len searches the length every sample is padded or packed to")
