"""Liger Kernel: anatomist's stand-ins save and allocate what Liger's own autograd Functions do, and
`--use-liger-kernel` is predicted, searched, emitted and refused where Liger does not apply.

The reference side is Liger's code itself: the pinned copies of liger-kernel 0.8.5's ops
(tests/data/liger_kernel_0_8_5, loaded by liger_source.py with Triton's launches doing nothing)
run on CPU tensors. Each Function's saved tensors are caught with autograd's saved-tensor hooks
and its allocations with a dispatch mode, for Liger's and for anatomist's (`trace/standins/liger_kernels.py`).
"""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
from liger_source import LIGER_VERSION, liger_ops
from torch.utils._python_dispatch import TorchDispatchMode

from anatomist.anatomy import Phase
from anatomist.axes.liger import liger_table
from anatomist.errors import InputError
from anatomist.estimate.memory import estimate_memory
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.trace.engine.op_costs import op_signature
from anatomist.trace.engine.records import CHUNK_WEIGHT_PASS
from anatomist.trace.standins import liger_kernels as liger
from anatomist.workload_loader import load_workload

Shape = tuple[tuple[int, ...], torch.dtype]


class _Allocations(TorchDispatchMode):
    """(shape, dtype) of every tensor an op returns in new storage (0-dim scalars left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[Shape] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = {t.untyped_storage()._cdata for t in _tensors((args, kwargs or {}))}
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            key = t.untyped_storage()._cdata
            if key not in before and t.dim() > 0:
                self.made.append((tuple(t.shape), t.dtype))
        return out


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for x in tree for t in _tensors(x)]
    if isinstance(tree, dict):
        return [t for x in tree.values() for t in _tensors(x)]
    return []


def _run(apply, *inputs, autocast: bool = False) -> tuple[list[Shape], set[Shape], list[Shape]]:
    """(what forward saves for backward, what forward allocates, the gradients backward returns)."""
    saved: list[Shape] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    mode = _Allocations()
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode, cast:
        out = apply(*inputs)
    first = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(first.float().sum(), [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad])
    return saved, set(mode.made), [(tuple(g.shape), g.dtype) for g in grads]


def _leaf(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def test_the_pinned_source_is_the_version_the_table_names():
    assert liger_table().version == LIGER_VERSION


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_saves_what_liger_saves(dtype):
    ops = liger_ops()["rms_norm"]
    x, w = _leaf(2, 8, 64, dtype=dtype), _leaf(64, dtype=dtype)
    theirs = _run(lambda a, b: ops.LigerRMSNormFunction.apply(a, b, 1e-6, 0.0, "llama", True, None), x, w)
    ours = _run(lambda a, b: liger.RMSNormFunction.apply(a, b, 1e-6, 0.0), x, w)
    assert ours == theirs
    # [rows, hidden] input, the weight, fp32 1/rms per row
    assert theirs[0] == [((16, 64), dtype), ((64,), dtype), ((16,), torch.float32)]


def test_swiglu_saves_what_liger_saves():
    ops = liger_ops()["swiglu"]
    a, b = _leaf(2, 8, 128, dtype=torch.bfloat16), _leaf(2, 8, 128, dtype=torch.bfloat16)
    theirs = _run(lambda x, y: ops.LigerSiLUMulFunction.apply(x, y), a, b)
    ours = _run(lambda x, y: liger.SiLUMulFunction.apply(x, y), a, b)
    assert ours == theirs
    assert theirs[0] == [((16, 128), torch.bfloat16)] * 2  # gate and up as [rows, intermediate]: no silu(gate)


def test_rope_saves_what_liger_saves():
    ops = liger_ops()["rope"]
    q = _leaf(2, 8, 4, 16).transpose(1, 2)  # [batch, heads, seq, head_dim], a view as the attention makes it
    k = _leaf(2, 8, 2, 16).transpose(1, 2)
    cos, sin = torch.randn(2, 8, 16), torch.randn(2, 8, 16)

    def run(apply):
        q1, k1 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        return _run(lambda a, b: apply(a * 1, b * 1, cos, sin), q1, k1)

    theirs = run(lambda a, b, c, s: ops.LigerRopeFunction.apply(a, b, c, s))
    ours = run(liger.RopeFunction.apply)
    assert ours == theirs
    assert ((2, 8, 16), torch.float32) in theirs[0]


@pytest.mark.parametrize(("autocast", "frozen_head"), [(False, False), (True, False), (True, True)])
def test_fused_linear_cross_entropy_saves_and_allocates_what_liger_does(autocast, frozen_head):
    """batch 2 x 64 tokens, hidden 64, vocabulary 1000: Liger's chunk is next_power_of_2(ceil(128 / 16)) = 8
    tokens, the trace's 2 x ceil(64 / 16) = 8: the same logits chunk [8, 1000]."""
    ops = liger_ops()["fused_linear_cross_entropy"]
    hidden = _leaf(128, 64)
    weight = torch.randn(1000, 64).requires_grad_(not frozen_head)
    target = torch.randint(0, 1000, (128,))
    chunk = liger.flce_chunk_tokens(2, 64, 64, 1000)
    assert chunk == 2 ** math.ceil(math.log2(math.ceil(128 / math.ceil(1000 / 64)))) == 8
    theirs = _run(lambda h, w: ops.LigerFusedLinearCrossEntropyFunction.apply(h, w, target), hidden, weight,
                  autocast=autocast)
    ours = _run(lambda h, w: liger.FusedLinearCrossEntropyFunction.apply(h, w, target, chunk, False), hidden, weight,
                autocast=autocast)
    assert ours[0] == theirs[0]  # saved: the gradients of the hidden states and (trained head) of the weight
    assert ours[2] == theirs[2]
    # every shape and dtype Liger allocates in forward (the logits chunk, the gradients, the loss per token);
    # without autocast, on CUDA Liger writes the chunk's hidden-state gradient with mm(out=) (_can_use_mm_out),
    # where on this CPU it makes an [8, 64] product first
    on_cpu_only = set() if autocast else {((8, 64), torch.float32)}
    assert ours[1] == theirs[1] - on_cpu_only, (ours[1] ^ theirs[1])
    half = torch.bfloat16 if autocast else torch.float32
    assert ((8, 1000), half) in theirs[1]
    assert not any(shape == (128, 1000) for shape, _ in theirs[1])  # the full logits never exist


class _Traffic(TorchDispatchMode):
    """Every op's bytes: the tensors it reads and writes (views none), and, with `signatures`, anatomist's record."""

    def __init__(self, signatures: bool = False) -> None:
        super().__init__()
        self.bytes = 0
        self.signatures: list | None = [] if signatures else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.signatures is not None:
            self.signatures.append(op_signature(func, args, kwargs or {}, out, Phase.FORWARD))
        elif not func.is_view:
            self.bytes += sum(t.numel() * t.element_size() for t in _tensors((args, kwargs or {}, out)))
        return out


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_linear_cross_entropy_moves_what_liger_s_chunks_move(tiny_model, autocast):
    """3 x 50 tokens, hidden 64, vocabulary 1000: Liger runs them in ceil(150 / next_power_of_2(ceil(150 / 16))) = 10
    chunks of 16, each reading the head's weight twice and its gradient once each way; the trace runs one chunk of
    3 x ceil(50 / 16) = 12 tokens and states the rest, and the time model repeats the weight's pass for Liger's chunks.
    Liger's side is its own loop (torch's ops counted as they run) plus its Triton cross-entropy kernel, launched as
    nothing here, at what its source says it moves: "Online softmax: 2 loads + 1 store" of each logit."""
    from anatomist.estimate.time.ops import passes_with_chunks

    ops = liger_ops()["fused_linear_cross_entropy"]
    hidden, weight = _leaf(150, 64), _leaf(1000, 64)
    target = torch.randint(0, 1000, (150,))
    logit_size = 2 if autocast else 4
    theirs, ours = _Traffic(), _Traffic(signatures=True)
    for mode, apply in ((theirs, lambda: ops.LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, target)),
                        (ours, lambda: liger.FusedLinearCrossEntropyFunction.apply(hidden, weight, target, 12, False))):
        with mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            apply()
    cross_entropy = 150 * 1000 * logit_size * 3
    workload = load_workload(str(tiny_model("llama", hidden_size=64, vocab_size=1000)), seq_len=50)
    repeated = passes_with_chunks(tuple(ours.signatures), workload, batch=3)
    assert sum(op.name == CHUNK_WEIGHT_PASS for op in repeated) == 10 - 1  # the traced chunk reads it itself
    total = sum(op.bytes for op in repeated)
    assert total == pytest.approx(theirs.bytes + cross_entropy, rel=0.05)
    once = sum(op.bytes for op in ours.signatures)  # the weight's pass not repeated: what the time model had before
    assert once < 0.6 * (theirs.bytes + cross_entropy)


GPU = get_gpu("A100-80GB")


@pytest.fixture
def llama(tiny_model):
    return load_workload(str(tiny_model("llama", num_hidden_layers=3)), seq_len=64)


@pytest.mark.slow
def test_liger_removes_the_logits_from_the_peak(tiny_model):
    """A vocabulary of 32,000 at hidden 64: the logits and their fp32 copies are most of the peak; with
    Liger the head's chunk is batch x ceil(64 / 500) = 4 x 1 tokens."""
    workload = load_workload(str(tiny_model("llama", num_hidden_layers=3, vocab_size=32000)), seq_len=64)
    plain = estimate_memory(workload, Recipe(per_device_train_batch_size=4, dtype="float32").resolved(workload), GPU)
    fused = estimate_memory(workload, Recipe(per_device_train_batch_size=4, dtype="float32",
                                             use_liger_kernel=True).resolved(workload), GPU)
    logits_fp32 = 4 * 64 * 32000 * 4  # one fp32 copy of the logits: 31.25 MiB
    assert plain.anatomy.peak_allocated - fused.anatomy.peak_allocated > logits_fp32
    assert fused.anatomy.peak_allocated < plain.anatomy.peak_allocated


def test_liger_keeps_the_step_s_flops(llama):
    from anatomist.estimate.time.device import estimate_time

    plain, fused = (estimate_time(llama, Recipe(per_device_train_batch_size=3, use_liger_kernel=on).resolved(llama), GPU)
                    for on in (False, True))
    assert fused.flops_per_step == plain.flops_per_step


@pytest.mark.parametrize(("config", "task", "message"), [
    ({"model": "gpt2"}, None, r"does not support model_type='gpt2'"),
    ({"model": "gemma-3-1b-pt"}, None, r"gemma3_text.* anatomist does not trace yet"),
    ({"model": "bert-base-uncased"}, None, r"patches causal language models"),
])
def test_liger_for_a_model_it_does_not_patch_is_one_line(cli, config, task, message):
    proc = cli("estimate", config["model"], "--use-liger-kernel", "--seq-len", "64", "--json")
    assert proc.returncode == 2
    said = [line for line in proc.stderr.splitlines() if not (line[:1] in "WI" and line[1:5].isdigit())]  # torch's logs
    assert len(said) == 1 and "Traceback" not in proc.stderr
    assert pytest.importorskip("re").search(message, proc.stderr), proc.stderr


@pytest.mark.slow  # over 15 s on 2 cores
def test_with_torch_compile_it_is_refused_in_one_line_unless_the_blocks_checkpoint(cli, llama):
    """Liger's stand-ins are custom ops that the compiled blocks' trace cannot run (it stopped with a traceback);
    checkpointed blocks are traced eager (trace/step/compiled.py), so that combination is estimated."""
    proc = cli("estimate", llama.name, "--use-liger-kernel", "--torch-compile", "--seq-len", "64", "--json")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "use_liger_kernel with torch_compile is not modelled yet" in proc.stderr.splitlines()[-1]
    proc = cli("estimate", llama.name, "--use-liger-kernel", "--torch-compile", "--gradient-checkpointing",
               "--seq-len", "64", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["memory"]["peak_allocated"] > 0 and result["time"]["step_s"] > 0


@pytest.mark.slow  # a full plan search (45 s on 2 cores)
def test_a_plan_holding_liger_and_checkpointing_searches_compile_too(cli, llama, tmp_path):
    """The plan's compiled candidates of a held Liger recipe are checkpointed, so modelled; their model FLOPs are
    read from the eager step without checkpointing (a compiled one would not be modelled: it stopped the plan)."""
    held = tmp_path / "args.json"
    held.write_text(json.dumps({"use_liger_kernel": True, "gradient_checkpointing": True,
                                "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1}))
    plans = []
    for compile_flags in ([], ["--no-compile"]):
        proc = cli("plan", llama.name, "--recipe", str(held), "--gpu", "A100-80GB", "--seq-len", "64", "--optims",
                   "adamw_torch_fused", *compile_flags, "--json")
        assert proc.returncode == 0, proc.stderr
        plans.append(json.loads(proc.stdout))
    searched, eager = plans
    assert searched["candidates"] == 2 * eager["candidates"]  # compile on and off
    assert searched["best"]["recipe"]["use_liger_kernel"] and searched["best"]["recipe"]["gradient_checkpointing"]


def test_the_emitted_configs_set_it(llama):
    from anatomist.plan.emit import render

    recipe = Recipe(per_device_train_batch_size=2, use_liger_kernel=True)
    assert json.loads(render(recipe, "trainer"))["use_liger_kernel"] is True
    import yaml

    assert yaml.safe_load(render(recipe, "trl"))["use_liger_kernel"] is True
    from transformers import TrainingArguments

    assert TrainingArguments(output_dir="out", **json.loads(render(recipe, "trainer"))).use_liger_kernel


def test_bad_value_in_a_recipe_file_names_the_field(tmp_path):
    from anatomist.recipe.files import read_recipe_file

    path = tmp_path / "args.json"
    path.write_text(json.dumps({"per_device_train_batch_size": 2, "use_liger_kernel": "yes"}))
    with pytest.raises(InputError, match="use_liger_kernel must be bool"):
        read_recipe_file(path)
