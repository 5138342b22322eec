"""Tracing side by side (trace.store.pool): forked workers trace what this process would, byte for byte;
no trace depends on when the cyclic collector runs (the CLI raises its thresholds)."""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import operator
import os
import pickle
import time
from functools import partial
from pathlib import Path

import pytest
from conftest import stored_kinds

from anatomist.recipe import Recipe
from anatomist.trace.engine.records import StepTrace
from anatomist.trace.step import driver
from anatomist.trace.store import parts, pool
from anatomist.workload_loader import load_workload

CC = "8.0"


@pytest.fixture
def traced_here(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The parts `trace_step` traced in this process (a forked worker counts in its own copy)."""
    calls: list[str] = []
    real = driver.trace_step

    def counted(*args, **kwargs):
        calls.append(kwargs["part"])
        return real(*args, **kwargs)

    monkeypatch.setattr(driver, "trace_step", counted)
    return calls


def _requests(folder: Path) -> tuple[object, list[parts.PartRequest]]:
    workload = load_workload(str(folder), seq_len=32)
    recipe = Recipe(bf16=True).resolved(workload)
    two = dataclasses.replace(recipe, gradient_accumulation_steps=2)  # its first micro-batch: the first request
    sharded = dataclasses.replace(recipe, fsdp="full_shard")  # one rank of 4 (trace/step/fsdp.py)
    request = parts.PartRequest
    return workload, [request(recipe, "forward-backward", 2, 2, 1), request(recipe, "forward-backward", 3, 2, 1),
                      request(recipe, "optimizer", 2, 1, 1), request(two, "forward-backward", 2, 2, 1),
                      request(sharded, "forward-backward", 2, 2, 4)]


@pytest.mark.slow
def test_workers_trace_what_this_process_would(tiny_model, cache_folder: Path, traced_here: list[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANATOMIST_JOBS", "2")
    workload, requests = _requests(tiny_model("llama"))
    parts.trace_parts(workload, requests, CC)
    assert traced_here == []  # all in the workers
    assert stored_kinds(cache_folder)["StepTrace"] == len(requests)  # stored by this process
    for r in requests:
        recipe, part, depth, batch, num_gpus = r.recipe, r.part, r.depth, r.batch_size, r.num_gpus
        from_worker = parts.trace_part(workload, recipe.resolved(workload), part, depth=depth, batch_size=batch,
                                       compute_capability=CC, num_gpus=num_gpus)
        here = parts.trace_part(workload, recipe.resolved(workload), part, depth=depth, batch_size=batch, compute_capability=CC,
                               use_cache=False, num_gpus=num_gpus)
        assert pickle.dumps(from_worker) == pickle.dumps(here)
    assert len(traced_here) == len(requests)  # the uncached ones only
    parts.trace_parts(workload, requests, CC)  # all cached: nothing to trace
    assert len(traced_here) == len(requests)


def test_one_job_traces_nothing_ahead(tiny_model, cache_folder: Path, traced_here: list[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """ANATOMIST_JOBS=1: nothing forked, nothing stored; trace_part traces each part when asked."""
    monkeypatch.setenv("ANATOMIST_JOBS", "1")
    workload, requests = _requests(tiny_model("gpt2"))
    parts.trace_parts(workload, requests, CC)
    assert traced_here == [] and "StepTrace" not in stored_kinds(cache_folder)


def test_a_failed_job_comes_back_as_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANATOMIST_JOBS", "2")
    assert dict(pool.run_all([partial(int, 1), partial(operator.floordiv, 1, 0), partial(int, 3)])) == {
        0: 1, 1: None, 2: 3}


def test_a_job_that_does_not_pickle_comes_back_as_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not sent to a worker: the caller runs it in-process."""
    monkeypatch.setenv("ANATOMIST_JOBS", "2")
    assert dict(pool.run_all([partial(int, 1), lambda: 2])) == {0: 1, 1: None}


def _sleep_then(value: int) -> int:
    time.sleep(0.5)
    return value


def _pid_after(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def test_kept_workers_serve_every_batch_of_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first run_all of a kept() block forks the workers; the next ones are sent to the same
    processes, which end with the block."""
    monkeypatch.setenv("ANATOMIST_JOBS", "2")
    pids = [partial(_pid_after, 0.2)] * 4

    def children() -> set[int]:
        return {p.pid for p in multiprocessing.active_children() if p.pid is not None}

    with pool.kept():
        first = set(dict(pool.run_all(pids)).values())
        workers = children()
        assert first <= workers and os.getpid() not in first
        second = set(dict(pool.run_all(pids)).values())
        assert second <= workers and children() == workers  # no process started, none replaced
        assert dict(pool.run_all([partial(operator.floordiv, 1, 0), partial(int, 3)])) == {0: None, 1: 3}
    assert not children() & workers


@pytest.mark.parametrize("value", ["not a number", "0", "-2", "1.5"])
def test_bad_anatomist_jobs_is_one_line_and_exit_2(cli, tiny_model, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("ANATOMIST_JOBS", value)
    result = cli("estimate", str(tiny_model("gpt2")), "--seq-len", "32", "--no-cache")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"anatomist: error: ANATOMIST_JOBS must be a whole number of processes, 1 or more; got {value!r}"]


def test_a_dead_worker_ends_the_pool_without_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that dies (killed, out of memory) takes its job with it: run_all stops and the caller
    traces what it did not get, in-process."""
    monkeypatch.setenv("ANATOMIST_JOBS", "2")
    got = dict(pool.run_all([partial(os._exit, 3), partial(_sleep_then, 2), partial(int, 3)]))
    assert 0 not in got and set(got) <= {1, 2}


@pytest.mark.parametrize("request_index", [0, -1])  # one device; one rank of FSDP
def test_no_trace_depends_on_the_cyclic_collector(tiny_model, request_index: int) -> None:
    """A storage kept alive by a reference cycle would die when the collector runs: collecting as
    often as it can and not at all must give the same trace."""
    workload, requests = _requests(tiny_model("llama"))
    r = requests[request_index]
    recipe, part, depth, batch, num_gpus = r.recipe, r.part, r.depth, r.batch_size, r.num_gpus

    def traced() -> bytes:
        return pickle.dumps(driver.trace_step(workload, recipe.resolved(workload), part=part, depth=depth, batch_size=batch,
                                            compute_capability=CC, record_ops=True, num_gpus=num_gpus))

    thresholds = gc.get_threshold()
    try:
        gc.set_threshold(1, 1, 1)
        eager = traced()
        gc.disable()
        never = traced()
    finally:
        gc.enable()
        gc.set_threshold(*thresholds)
    assert eager == never


@pytest.mark.parametrize("request_index", [0, -1])
def test_a_trace_ends_with_its_step(tiny_model, request_index: int) -> None:
    """The model dies after trace_step returns, when the collector frees FSDP's reference cycles: its
    frees are no events of the step (they were appended to one rank's events, so that a trace pickled
    after a collection differed from one pickled before)."""
    workload, requests = _requests(tiny_model("llama"))
    r = requests[request_index]
    recipe, part, depth, batch, num_gpus = r.recipe, r.part, r.depth, r.batch_size, r.num_gpus
    gc.disable()
    try:
        trace = driver.trace_step(workload, recipe.resolved(workload), part=part, depth=depth, batch_size=batch,
                                  compute_capability=CC, num_gpus=num_gpus)
        returned = pickle.dumps(trace)
        gc.collect()
    finally:
        gc.enable()
    assert pickle.dumps(trace) == returned


@pytest.mark.parametrize(("name", "recipe"), [
    ("llama", Recipe(bf16=True, gradient_accumulation_steps=4)),
    ("bert", Recipe(fp16=True, gradient_checkpointing=True, gradient_accumulation_steps=2)),
])
def test_one_micro_batch_is_the_first_of_two(tiny_model, name: str, recipe: Recipe) -> None:
    """The passes of one micro-batch are kept from a trace of two (trace_parts does not trace them
    again): byte for byte what tracing one micro-batch gives."""
    workload = load_workload(str(tiny_model(name)), seq_len=32)
    recipe = recipe.resolved(workload)
    one = dataclasses.replace(recipe, gradient_accumulation_steps=1)

    def traced(r: Recipe) -> StepTrace:
        return driver.trace_step(workload, r.resolved(workload), part="forward-backward", depth=2, batch_size=2, compute_capability=CC,
                               record_ops=True)

    two = traced(recipe)
    assert two.first_micro_batch is not None and two.op_count > two.first_micro_batch.op_count
    assert pickle.dumps(two.first_micro_batch) == pickle.dumps(traced(one))
