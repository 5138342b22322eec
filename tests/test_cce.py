"""Cut Cross-Entropy: anatomist's stand-in allocates and saves what CCE's own Python does, and
`cut_cross_entropy` is predicted, read from axolotl, emitted and refused where CCE does not run.

The reference side is CCE's code itself: the pinned copy of the fork axolotl installs
(tests/data/cut_cross_entropy_5f0c7a7, loaded by cce_source.py with Triton's launches doing nothing) runs on CPU
tensors, called as its transformers patch calls it (`linear_cross_entropy(e, c, labels, shift=True)` with
cce_patch's defaults). Each side's allocations are caught with a dispatch mode, forward and backward apart, and what
the autograd Function saves with autograd's saved-tensor hooks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cce_source import cce_module
from test_liger import _Allocations

from anatomist.errors import InputError
from anatomist.estimate.memory import estimate_memory
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.recipe.files import read_recipe_file
from anatomist.trace.standins import cce
from anatomist.workload_loader import load_workload

DATA = Path(__file__).parent / "data"
Shape = tuple[tuple[int, ...], torch.dtype]


def _run(loss_of, e: torch.Tensor, c: torch.Tensor, labels: torch.Tensor) -> tuple[list[Shape], ...]:
    """(what the loss saves for backward, what its forward allocates, what its backward allocates, the gradients)."""
    saved: list[Shape] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    forward, backward = _Allocations(), _Allocations()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), forward:
        loss = loss_of(e, c, labels)
    leaves = [t for t in (e, c) if t.requires_grad]
    with backward:
        grads = torch.autograd.grad(loss, leaves)
    return saved, forward.made, backward.made, [(tuple(g.shape), g.dtype) for g in grads]


@pytest.fixture
def bf16_capable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # CCE's own check of the GPU


@pytest.mark.parametrize("head_trained", [True, False], ids=["full", "frozen head"])
def test_the_stand_in_allocates_and_saves_what_cce_does(bf16_capable, head_trained: bool) -> None:
    theirs = cce_module().cce_linear_cross_entropy
    rows, seq, hidden, vocab = 3, 40, 96, 300

    def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        leaf = torch.randn(rows, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
        e = leaf * 1  # the backbone's output: not a leaf
        c = torch.randn(vocab, hidden, dtype=torch.bfloat16, requires_grad=head_trained)
        return e, c, torch.randint(0, vocab, (rows, seq))

    reference = _run(lambda e, c, y: theirs(e, c, y, shift=True), *inputs())
    ours = _run(cce.linear_cross_entropy, *inputs())
    assert ours == reference
    scored = rows * (seq - 1)
    saved, forward, backward, grads = ours
    assert ((scored,), torch.float32) in forward and ((vocab,), torch.float32) in forward  # lse; average logit
    assert ((rows * seq, hidden), torch.bfloat16) in backward  # the hidden states' gradient
    assert (((vocab, hidden), torch.bfloat16) in backward) == head_trained
    assert not any(shape == (scored, vocab) or shape == (rows, seq, vocab) for shape, _ in forward + backward)


def test_the_stand_in_refuses_an_fp32_head_as_cce_s_backward_does(bf16_capable) -> None:
    e = torch.randn(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(InputError, match="takes bfloat16 or float16 hidden states and head weights"):
        cce.linear_cross_entropy(e, torch.randn(32, 16), torch.randint(0, 32, (2, 8)))


def test_cut_cross_entropy_removes_the_logits_from_the_peak(tiny_model) -> None:
    """On a causal LM whose peak is the loss's logits, CCE lowers it by more than four copies of them; the step's
    FLOPs keep the head's product in forward and count three in backward (the recomputed one, one per gradient)."""
    from anatomist.estimate.time.ops import step_flops

    workload = load_workload(str(tiny_model("llama", num_hidden_layers=2, vocab_size=32000)), seq_len=128)
    gpu = get_gpu("A100-80GB")
    plain = Recipe(dtype="bfloat16", bf16=True, per_device_train_batch_size=4).resolved(workload)
    cut = plain.replace(cut_cross_entropy=True)
    peaks = {r.cut_cross_entropy: estimate_memory(workload, r, gpu).anatomy.peak_allocated for r in (plain, cut)}
    logits = 4 * 128 * 32000 * 2  # one bf16 copy of the logits
    assert peaks[False] - peaks[True] > 4 * logits
    flops = {r.cut_cross_entropy: step_flops(workload, r, gpu.compute_capability).hardware for r in (plain, cut)}
    head = 2 * 4 * 128 * 32000 * 64  # one product of the head: tokens x vocabulary x hidden
    assert flops[True] - flops[False] == pytest.approx(head, rel=0.1)  # 1 + 3 products where the logits took 1 + 2


@pytest.mark.parametrize(("fields", "message"), [
    ({"use_liger_kernel": True}, "both replace the LM head's loss"),
    ({"trainer": "sft"}, "modelled under transformers' Trainer"),
    ({"dtype": "float32"}, "needs the weights in bfloat16 or float16"),
])
def test_cut_cross_entropy_is_refused_where_it_does_not_run(fields: dict, message: str) -> None:
    with pytest.raises(InputError, match=message):
        Recipe(cut_cross_entropy=True, **fields)


def test_cut_cross_entropy_needs_an_ampere_gpu(cli) -> None:
    result = cli("estimate", "Llama-3.2-1B", "--cut-cross-entropy", "--gpu", "T4", "--dtype", "float16")
    assert result.returncode == 2
    assert result.stderr.strip() == "anatomist: error: Cut Cross-Entropy needs an Ampere or newer GPU; T4 is older"


def test_axolotl_s_plugin_is_cut_cross_entropy(tmp_path: Path) -> None:
    """axolotl's QLoRA example with the CutCrossEntropyPlugin (its offloaded checkpointing aside): read as
    cut_cross_entropy, the head turned back to bfloat16 as axolotl's loader does for CCE, and predicted."""
    import yaml

    raw = yaml.safe_load((DATA / "axolotl/32b-qlora.yaml").read_text())
    raw["gradient_checkpointing"] = True  # "offload" under an adapter: axolotl's own offloader, not modelled
    path = tmp_path / "qlora-cce.yaml"
    path.write_text(yaml.safe_dump(raw))
    source = read_recipe_file(path)
    assert source.recipe.cut_cross_entropy and "plugins" not in source.not_modelled
    without = tmp_path / "fp32.yaml"
    without.write_text(yaml.safe_dump({**raw, "bf16": False}))
    with pytest.raises(InputError, match="the CutCrossEntropyPlugin needs bf16 or fp16 training"):
        read_recipe_file(without)
    off = tmp_path / "off.yaml"
    off.write_text(yaml.safe_dump({**raw, "cut_cross_entropy": False}))
    assert not read_recipe_file(off).recipe.cut_cross_entropy
    no_plugin = tmp_path / "no-plugin.yaml"
    no_plugin.write_text(yaml.safe_dump({**raw, "plugins": [], "cut_cross_entropy": True}))
    dropped = read_recipe_file(no_plugin)  # axolotl loads the plugin's arguments only with the plugin
    assert not dropped.recipe.cut_cross_entropy and "cut_cross_entropy" in dropped.not_modelled


def test_the_trainer_snippet_patches_the_model() -> None:
    from anatomist.plan.caveats import launch_warnings
    from anatomist.plan.emit import trainer_snippet

    recipe = Recipe.with_presets(peft="qlora", bf16=True, dtype="bfloat16", cut_cross_entropy=True)
    snippet = trainer_snippet(recipe, model="m", task="causal-lm")
    patched = snippet.index("model = cce_patch(model)")
    assert snippet.index("from_pretrained") < patched < snippet.index("get_peft_model(model")
    assert "module.to(torch.bfloat16)" in snippet  # the head back in bfloat16 after prepare_model_for_kbit_training
    compile(snippet, "snippet", "exec")
    assert any("cce_patch" in w for w in launch_warnings(recipe, "trl"))


def test_the_plan_s_reasons_compare_only_recipes_that_can_run_cce() -> None:
    """The reasons' alternatives of a recipe held at cut_cross_entropy (plan --recipe) leave out fp32 weights and
    Liger, which CCE refuses, instead of failing the plan."""
    from anatomist.plan.reasons import _axes
    from anatomist.plan.space import SearchSpace

    workload = load_workload("Llama-3.2-1B", seq_len=512)
    gpu = get_gpu("RTX-4090")
    space = SearchSpace(fixed={"cut_cross_entropy": True}).for_workload(workload.model_type, workload.task)
    recipe = Recipe(dtype="bfloat16", bf16=True, cut_cross_entropy=True).resolved(workload)
    alternatives = {axis: alts(recipe) for axis, _, alts in _axes(space, gpu, workload)}
    assert alternatives["precision"] == []  # the other precisions searched keep fp32 weights (bf16, fp16 autocast)
    assert alternatives["Liger Kernel"] == []
    assert alternatives["optimizer"]  # the axes CCE allows still compare


def test_the_note_of_missing_packages_installs_the_fork(capsys: pytest.CaptureFixture[str]) -> None:
    from anatomist.cli.common import note_missing_packages

    note_missing_packages(Recipe(dtype="bfloat16", bf16=True, cut_cross_entropy=True))  # not installed here
    assert "ml-cross-entropy.git@5f0c7a7" in capsys.readouterr().err
