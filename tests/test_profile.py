"""`anatomist profile` on CPU: real profiler events, the class split and bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from anatomist.measure.profile import profile_training
from anatomist.recipe import Recipe
from anatomist.workload_loader import load_workload

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# One block whose MLP is a big Linear pair (512 -> 4096 -> 512) over 8 x 128 = 1024 tokens:
# by construction the matrix products are ~99.9% of the FLOPs (6 x 4.2 M MLP params x 1024
# tokens ~ 26 GFLOP, against ~25 MFLOP of element-wise and normalization work). Hidden 512,
# not 128: the products' time grows with the hidden size, the element-wise ops' does not, and
# at 128 element-wise ops took as much CPU time as the products (39% each), a coin toss.
CONFIG = {
    "model_type": "bert", "hidden_size": 512, "num_hidden_layers": 1, "num_attention_heads": 2,
    "intermediate_size": 4096, "vocab_size": 100, "max_position_embeddings": 256, "type_vocab_size": 2,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bigmlp")
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder


@pytest.mark.slow
def test_profile_splits_a_real_run(model_dir: Path) -> None:
    w = load_workload(str(model_dir), seq_len=128, task="sequence-classification")
    r = profile_training(w, Recipe(per_device_train_batch_size=8), steps=2)
    flops = {c: v["flops_pct"] for c, v in r.classes.items()}
    times = {c: v["time_pct"] for c, v in r.classes.items()}
    assert max(flops, key=flops.get) == "contraction" and flops["contraction"] > 99
    assert max(times, key=times.get) == "contraction"
    assert sum(times.values()) == pytest.approx(100)
    assert sum(flops.values()) == pytest.approx(100)
    # The times are the profiler's: real ATen events with nonzero self time, inside the ranges.
    assert r.op_time_s > 0 and r.device.startswith("cpu")
    assert {op["name"] for op in r.top_ops} & {"aten::mm", "aten::addmm"}
    assert all(r.phases[k] > 0 for k in ("forward_s", "backward_s", "optimizer_s"))
    assert r.op_time_s <= r.step_s * 1.05  # the op self times fit inside the timed ranges
    assert r.phases["backward_s"] > r.phases["forward_s"]  # seeds: backward ~2x forward
    assert r.unknown_ops == []


@pytest.mark.parametrize("flags, message", [
    (["--fp16"], "fp16 mixed precision needs a CUDA GPU"),
    (["--attn-implementation", "flash_attention_2"], "flash_attention_2 needs"),
    (["--steps", "0"], "--steps must be greater than 0"),
    (["--steps", "-2"], "--steps must be greater than 0"),
])
def test_bad_input_exits_2(model_dir: Path, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["profile", str(model_dir), "--seq-len", "16", *flags], message, capsys)


@pytest.mark.parametrize("flags, message", [
    (["--trainer", "sft"], "not TRL's SFTTrainer"),
    (["--trainer", "dpo"], "not TRL's DPOTrainer"),
    (["--activation-offloading"], "not TRL's activation offloading"),
    (["--fsdp", "full_shard"], "profile runs one process"),
    (["--use-liger-kernel"], "profile does not apply Liger Kernel"),
])
def test_a_step_profile_does_not_run_is_refused(tiny_model, flags: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Before, these were profiled as the Trainer's plain step of one process, which they are not."""
    _refused(["profile", str(tiny_model("llama")), "--seq-len", "16", *flags], message, capsys)


def _refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from anatomist.cli import main

    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    assert captured.out == ""


@pytest.mark.slow  # over 15 s on 2 cores
def test_cli_json(cli, model_dir: Path) -> None:
    proc = cli("profile", str(model_dir), "--seq-len", "32", "--batch-size", "2", "--steps", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data["classes"]) == {"contraction", "normalization", "elementwise", "other"}
    assert set(data["phases"]) == {"forward_s", "backward_s", "optimizer_s"}
    assert data["device"].startswith("cpu") and data["top_ops"]


@pytest.mark.parametrize("peft", ["lora", pytest.param("qlora", marks=pytest.mark.slow)])
def test_the_profiled_step_trains_the_adapters(tiny_model, monkeypatch: pytest.MonkeyPatch, peft: str) -> None:
    """--peft lora / qlora profile get_peft_model's adapters (over bitsandbytes' 4-bit base for qlora), as a user
    makes them: the optimizer steps the parameters PEFT leaves trainable. Before, the step trained every weight of a
    plain model while the FLOPs were counted for the adapters."""
    import peft as peft_library

    from anatomist.measure import profile as profiling

    stepped: list[int] = []
    real = profiling._optimizer

    def counted(model, recipe, cpu):  # type: ignore[no-untyped-def]
        stepped.append(sum(p.numel() for p in model.parameters() if p.requires_grad))
        return real(model, recipe, cpu)

    monkeypatch.setattr(profiling, "_optimizer", counted)
    workload = load_workload(str(tiny_model("llama", num_hidden_layers=2)), seq_len=32)
    recipe = Recipe.with_presets(peft=peft, per_device_train_batch_size=2)
    result = profile_training(workload, recipe, steps=1)
    assert result.step_s > 0
    adapters = peft_library.get_peft_model(workload.build_model(), peft_library.LoraConfig(
        r=recipe.lora_r, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    assert stepped == [adapters.get_nb_trainable_parameters()[0]]
