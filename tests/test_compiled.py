"""torch.compile predicted (trace/step/compiled.py): fused kernels' traffic, and what compiled blocks keep for
backward, checked against a real inductor step on this CPU."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from anatomist.anatomy import OpClass
from anatomist.estimate.memory import estimate_memory
from anatomist.estimate.time.device import estimate_time
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.trace.step.compiled import fusion_plan
from anatomist.trace.step.driver import trace_step
from anatomist.trace.store.keys import part_key
from anatomist.workload_loader import load_workload

GPU = get_gpu("A100-80GB")


def test_a_fused_kernel_reads_its_inputs_and_writes_its_outputs_once() -> None:
    """relu(x * 2 + 1) @ w, then tanh(.) * 3: two fused kernels around the matrix product. Bytes by hand,
    fp32: x is 64 x 32 (8,192 B), w 32 x 16 (2,048 B), the product 64 x 16 (4,096 B)."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.relu(x * 2 + 1) @ w) * 3

    graph = make_fx(f, tracing_mode="fake")(torch.ones(64, 32), torch.ones(32, 16)).graph
    plan = fusion_plan(graph)
    names = [op[0] for op in plan.ops]
    assert names == ["fused:mul+add+relu", "mm", "fused:tanh+mul"]
    moved = [op[5] for op in plan.ops]
    # first kernel: reads x, writes relu (the product's input); eager would move 3 x 16,384 B
    # mm: reads relu and w, writes its output; last kernel: reads the product, writes the result
    assert moved == [8192 + 8192, 8192 + 2048 + 4096, 4096 + 4096]
    assert [op[1] for op in plan.ops] == [OpClass.ELEMENTWISE, OpClass.CONTRACTION, OpClass.ELEMENTWISE]
    assert plan.quiet == {"mul", "add", "tanh"}  # values inside a kernel are never stored


@pytest.mark.slow
def test_compile_changes_the_trace_key_and_keeps_less(tiny_model) -> None:
    """A compiled step is its own trace; it keeps less for backward and takes less time than eager code,
    with the same matrix-product FLOPs."""
    workload = load_workload(str(tiny_model("gpt2")), seq_len=64)
    eager = Recipe(per_device_train_batch_size=4).resolved(workload)
    compiled = Recipe(per_device_train_batch_size=4, torch_compile=True).resolved(workload)
    def key(recipe):
        return part_key(workload, recipe, "forward-backward", None, 4, GPU.compute_capability)

    assert key(eager) != key(compiled)
    memory = {r.torch_compile: estimate_memory(workload, r, GPU).anatomy for r in (eager, compiled)}
    assert memory[True].activations < memory[False].activations
    time = {r.torch_compile: estimate_time(workload, r, GPU) for r in (eager, compiled)}
    assert time[True].step_s < time[False].step_s
    assert time[True].flops_per_step == pytest.approx(time[False].flops_per_step, rel=0.01)


@pytest.mark.slow
def test_under_checkpointing_compiled_blocks_are_predicted_as_eager_ones(tiny_model) -> None:
    """The documented approximation (trace/step/compiled.py): with gradient checkpointing the blocks stay eager,
    so the recomputation is in the step and the memory is the checkpointed one."""
    workload = load_workload(str(tiny_model("gpt2")), seq_len=64)
    recipes = [Recipe(per_device_train_batch_size=4, gradient_checkpointing=True, torch_compile=c).resolved(workload)
               for c in (False, True)]
    eager, compiled = (estimate_memory(workload, r, GPU) for r in recipes)
    assert compiled.anatomy.activations == eager.anatomy.activations
    assert any("with gradient checkpointing the blocks are predicted as eager" in n for n in compiled.notes)


def test_under_checkpointing_compile_on_and_off_share_one_trace(tiny_model) -> None:
    """The planner traces a checkpointed recipe's passes once for compile on and off (`keys.traced_compile`):
    traced apart, the two are the same events and ops."""
    workload = load_workload(str(tiny_model("gpt2")), seq_len=32)
    recipes = [Recipe(per_device_train_batch_size=4, gradient_accumulation_steps=2, gradient_checkpointing=True,
                      torch_compile=c).resolved(workload) for c in (False, True)]
    eager, compiled = (trace_step(workload, r, depth=2, batch_size=2, compute_capability=GPU.compute_capability,
                                  record_ops=True) for r in recipes)
    assert compiled.ops == eager.ops
    assert compiled.curves.keys == eager.curves.keys
    assert (compiled.curves.categories == eager.curves.categories).all()
    assert (compiled.static_bytes, compiled.op_count) == (eager.static_bytes, eager.op_count)
    def key(recipe):
        return part_key(workload, recipe, "forward-backward", 2, 2, GPU.compute_capability)

    assert key(recipes[0]) == key(recipes[1])
    plain = [r.replace(gradient_checkpointing=False) for r in recipes]
    assert key(plain[0]) != key(plain[1])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None, reason="inductor needs a C++ compiler on CPU")
def test_saved_for_backward_matches_a_real_inductor_step(tiny_model) -> None:
    """The bytes a real step keeps for backward (saved-tensor hooks: every tensor autograd saves, weights
    left out), with every GPT-2 block compiled by inductor on this CPU, against anatomist's activations
    traced on fake tensors, eager and compiled. Measured here: eager 36.17 MB real vs 36.17 MB traced,
    compiled 23.59 MB real vs 23.85 MB traced (dropout off: inductor's CPU random numbers and the
    trace's differ only in how masks are drawn, not kept)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tiny_model("gpt2", n_embd=128, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    batch, seq = 4, 128

    def saved_bytes(compile_blocks: bool) -> int:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), attn_implementation="eager").train()
        if compile_blocks:
            for block in model.transformer.h:
                block.compile(backend="inductor")
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        ids = torch.randint(0, 1000, (batch, seq))
        seen: dict[int, int] = {}
        for _ in range(2):  # the first step compiles
            seen.clear()

            def pack(t: torch.Tensor) -> torch.Tensor:
                storage = t.untyped_storage()
                if storage.data_ptr() not in weights:
                    seen[storage.data_ptr()] = storage.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
        return sum(seen.values())

    workload = load_workload(str(folder), seq_len=seq)
    for compile_blocks in (False, True):
        recipe = Recipe(per_device_train_batch_size=batch, attn_implementation="eager",
                        torch_compile=compile_blocks).resolved(workload)
        traced = estimate_memory(workload, recipe, GPU).anatomy.activations
        assert traced == pytest.approx(saved_bytes(compile_blocks), rel=0.03), compile_blocks


@pytest.mark.slow  # two compiles (15 s)
def test_a_trace_reusing_another_trace_s_compiled_graphs_is_the_one_a_fresh_compile_gives(tiny_model) -> None:
    """The graphs compiled for one trace serve the next trace of the same recipe in the process (`KEPT_GRAPHS`: a
    plan's worker traces a recipe at two depths), and must give the trace a compile of its own gives, allocation by
    allocation. A graph that held a tensor of the step it was compiled in (the first block's input, alive to the end
    of that step only) broke that."""
    from anatomist.trace.step import compiled

    workload = load_workload(str(tiny_model("gpt2")), seq_len=64)
    recipe = Recipe(per_device_train_batch_size=2, torch_compile=True).resolved(workload)

    def trace(depth: int):
        return trace_step(workload, recipe, depth=depth, batch_size=2, compute_capability=GPU.compute_capability,
                          record_ops=True)

    compiled._graphs.clear()
    trace(2)
    reused = trace(3)
    compiled._graphs.clear()
    fresh = trace(3)
    assert reused.ops == fresh.ops
    assert reused.curves.keys == fresh.curves.keys
    assert (reused.curves.allocated == fresh.curves.allocated).all()
    assert (reused.curves.categories == fresh.curves.categories).all()
