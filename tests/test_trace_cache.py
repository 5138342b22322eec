"""The on-disk trace cache: a cached estimate is the uncached one, damage is survived, size is bounded."""

from __future__ import annotations

import multiprocessing
import pickle
import zlib
from pathlib import Path

import pytest
from conftest import stored_kinds

from anatomist.estimate.predict import estimate
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.trace.store import cache
from anatomist.trace.store.keys import part_key
from anatomist.trace.store.parts import trace_part
from anatomist.workload_loader import load_workload

GPU = get_gpu("A100-80GB")


def _estimate(folder: Path, **recipe: object) -> dict:
    workload = load_workload(str(folder), seq_len=32)
    return estimate(workload, Recipe(per_device_train_batch_size=3, **recipe), GPU).to_dict()


@pytest.mark.slow
def test_cached_and_uncached_estimates_are_identical(tiny_model, cache_folder: Path) -> None:
    model = tiny_model("llama")
    cache.set_disk_cache(False)
    uncached = _estimate(model, gradient_checkpointing=True)
    assert not cache_folder.exists()  # --no-cache: nothing written
    cache.clear_memory()
    cache.set_disk_cache(True)
    first = _estimate(model, gradient_checkpointing=True)  # traces, writes the disk cache
    written = sorted(p.name for p in cache_folder.glob("*.trace"))
    # passes at 2 depths x 2 batches, with checkpointing and without (the model FLOPs of MFU),
    # optimizer at 2 depths; the trace plan; what the estimate reads of the config
    assert stored_kinds(cache_folder) == {"StepTrace": 2 * 4 + 2, "ModelPlan": 1, "ModelFacts": 1}
    cache.clear_memory()
    second = _estimate(model, gradient_checkpointing=True)  # reads every trace from disk
    assert sorted(p.name for p in cache_folder.glob("*.trace")) == written
    assert uncached == first == second


def test_a_damaged_entry_is_ignored_with_a_warning(tiny_model, cache_folder: Path, capsys) -> None:
    model = tiny_model("gpt2")
    want = _estimate(model)
    for path in cache_folder.glob("*.trace"):
        path.write_bytes(b"not a trace")
    cache.clear_memory()
    assert _estimate(model) == want
    assert "ignoring an unreadable trace cache entry" in capsys.readouterr().err
    cache.clear_memory()  # the damaged entries were replaced by good ones
    assert _estimate(model) == want
    assert "unreadable" not in capsys.readouterr().err


def test_the_key_names_what_shapes_the_trace(tiny_model) -> None:
    workload = load_workload(str(tiny_model("bert")), seq_len=32)
    base = Recipe()

    def key(recipe: Recipe, part: str = "forward-backward", **kw: object) -> tuple:
        args = {"depth": 2, "batch_size": 2, "compute_capability": "8.0", **kw}
        return part_key(workload, recipe.resolved(workload), part, args["depth"], args["batch_size"], args["compute_capability"])

    assert key(base) != key(base.replace(gradient_checkpointing=True))
    assert key(base) != key(base, batch_size=3)
    assert key(base) != key(base, compute_capability="9.0")  # a larger cuBLAS workspace on Hopper
    assert key(base) == key(base.replace(optim="adafactor"))  # the passes do not see the optimizer
    assert key(base, "optimizer") != key(base.replace(optim="adafactor"), "optimizer")
    assert key(base) == key(base.replace(per_device_train_batch_size=16))  # batch size is extrapolated
    assert key(base) != key(base.replace(attn_implementation="eager"))
    assert key(base) == key(base.replace(attn_implementation="flash_attention_2"))  # traced as SDPA
    longer = load_workload(str(tiny_model("bert")), seq_len=64)
    assert part_key(longer, base.resolved(longer), "forward-backward", 2, 2, "8.0") != key(base)


def test_the_disk_cache_is_bounded(tiny_model, cache_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    workload = load_workload(str(tiny_model("bert")), seq_len=16)
    trace_part(workload, Recipe().resolved(workload), "optimizer", depth=2, batch_size=1, compute_capability="8.0")
    one = next(cache_folder.glob("*.trace")).stat().st_size
    monkeypatch.setattr(cache, "MAX_DISK_BYTES", int(2.5 * one))
    for optim in ("adafactor", "sgd", "adamw_torch_fused"):
        trace_part(workload, Recipe(optim=optim).resolved(workload), "optimizer", depth=2, batch_size=1, compute_capability="8.0")
    assert sum(p.stat().st_size for p in cache_folder.glob("*.trace")) <= int(2.5 * one) + one
    assert len(list(cache_folder.glob("*.trace"))) <= 3


def _write_same_entry(folder: str, payload: bytes, rounds: int) -> None:
    import os

    os.environ["ANATOMIST_CACHE_DIR"] = folder
    from anatomist.trace.store import cache as child_cache

    for _ in range(rounds):
        child_cache._store("same.trace", pickle.loads(zlib.decompress(payload)))


def test_two_processes_writing_one_entry_leave_a_whole_file(tiny_model, cache_folder: Path) -> None:
    workload = load_workload(str(tiny_model("bert")), seq_len=16)
    value = trace_part(workload, Recipe().resolved(workload), "optimizer", depth=2, batch_size=1, compute_capability="8.0")
    payload = zlib.compress(pickle.dumps(value))
    root = str(cache_folder.parent)
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_write_same_entry, args=(root, payload, 20)) for _ in range(2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
        assert w.exitcode == 0
    loaded = cache._load("same.trace")
    assert loaded is not None and loaded.ops == value.ops
    assert not list(cache_folder.glob(".tmp-*"))  # no temporary file left behind
