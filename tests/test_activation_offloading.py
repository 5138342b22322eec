"""TRL's activation offloading (`Recipe.activation_offloading`, trace/step/offload.py).

Truth: TRL's own `get_act_offloading_ctx_manager` (trl/models/activation_offloading.py) in a real step of the same
model on this CPU, told that the CPU is its accelerator (it needs one to start), without pinned memory (which
needs CUDA) and with empty_cache, a stream's synchronize and record_stream doing nothing (CUDA's; torch.cpu has none); its side stream is torch.cpu's, whose events do nothing. Each tensor autograd hands it is recorded
with TRL's decision (its tracker: copied to the host, or kept), so what the stand-in copies in the trace is compared
with what TRL's code copies in a real step, tensor by tensor: which sizes leave, in which order.
"""

from __future__ import annotations

import pytest
import torch

from anatomist.estimate.memory import estimate_memory
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.trace.step import offload
from anatomist.trace.step.driver import trace_step
from anatomist.trace.step.inputs import make_batch
from anatomist.workload_loader import load_workload

trl_offloading = pytest.importorskip("trl.models.activation_offloading")

GPU = get_gpu("A100-80GB")
BATCH = 2


@pytest.fixture
def workload(tiny_model):
    return load_workload(str(tiny_model("llama", num_hidden_layers=3)), seq_len=64)


def _trl_decisions(workload, recipe, monkeypatch) -> list[int]:
    """The bytes of each tensor TRL's offloader copies to the host in one real step (0: kept on the device)."""
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu"))
    monkeypatch.setattr(torch.cpu, "empty_cache", lambda: None, raising=False)  # called once bitsandbytes is imported
    monkeypatch.setattr(torch.cpu.Stream, "synchronize", lambda self: None, raising=False)  # called on leaving
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)  # CUDA's, for a kept copy
    torch.manual_seed(0)
    model = workload.build_model(recipe.attn_implementation, recipe.dtype)
    if recipe.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    context = trl_offloading.get_act_offloading_ctx_manager(model, use_pin_memory=False)
    decisions = []
    pack = context.pack_hook

    def recorded(tensor: torch.Tensor) -> int:
        tensor_id = pack(tensor)
        kept, moved, *_ = context.tracker[tensor_id]
        decisions.append(kept.untyped_storage().nbytes() if moved else 0)
        return tensor_id

    context.pack_hook = recorded
    with context:
        model(**make_batch(workload, BATCH)).loss.backward()
    return decisions


def _traced_decisions(workload, recipe, monkeypatch) -> list[int]:
    """The same, of the stand-in in the fake-tensor trace."""
    decisions = []
    pack = offload.OffloadedActivations._pack

    def recorded(self, tensor: torch.Tensor) -> int:
        tensor_id = pack(self, tensor)
        kept, layout = self.tracked[tensor_id]
        decisions.append(kept.untyped_storage().nbytes() if layout is not None else 0)
        return tensor_id

    monkeypatch.setattr(offload.OffloadedActivations, "_pack", recorded)
    trace_step(workload, recipe, depth=None, batch_size=BATCH, compute_capability=GPU.compute_capability)
    return decisions


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_trace_offloads_what_trls_offloader_offloads(workload, monkeypatch, checkpointing):
    recipe = Recipe(per_device_train_batch_size=BATCH, dtype="float32", attn_implementation="eager",
                    gradient_checkpointing=checkpointing, activation_offloading=True).resolved(workload)
    real = _trl_decisions(workload, recipe, monkeypatch)
    traced = _traced_decisions(workload, recipe, monkeypatch)
    assert sum(1 for b in real if b) >= 3  # the test sees offloading happen (with checkpointing: the layers' inputs)
    assert traced == real


def test_offloading_frees_the_saved_activations(workload):
    """Without checkpointing, what forward keeps for backward leaves the device but for the last five copies (the
    side stream's stash) and what the output head saves; backward brings it back a node at a time."""
    plain = Recipe(per_device_train_batch_size=BATCH, dtype="float32")
    off = estimate_memory(workload, plain.replace(activation_offloading=True).resolved(workload), GPU).anatomy
    on = estimate_memory(workload, plain.resolved(workload), GPU).anatomy
    assert off.activations < 0.5 * on.activations
    assert off.peak_allocated < on.peak_allocated


def test_not_modelled_under_fsdp():
    from anatomist.errors import InputError

    with pytest.raises(InputError, match="activation_offloading under FSDP is not modelled"):
        Recipe(fsdp="full_shard", activation_offloading=True)


@pytest.mark.slow  # a full-depth trace (14 s)
def test_copied_bytes_extrapolate_to_the_full_model(tiny_model):
    """What a micro-batch copies to the host, from the cuts at batches 2 and 3, is what the full model's trace at
    another batch copies (6 layers, batch 5: neither traced). 256 tokens: at 64, RMSNorm's fp32 [batch, tokens, 1]
    statistics cross TRL's 1 KiB threshold between batches 3 and 5 (kept at 2 and 3, copied at 5), and are 1.8% of
    the bytes copied there; at real lengths every per-token tensor is above it."""
    from anatomist.estimate.traces import offloaded_bytes, step_traces

    workload = load_workload(str(tiny_model("llama", num_hidden_layers=6, max_position_embeddings=256)), seq_len=256)
    recipe = Recipe(per_device_train_batch_size=5, dtype="float32", activation_offloading=True).resolved(workload)
    traces = step_traces(workload, recipe, GPU.compute_capability)
    assert traces.plan.how == "uniform"
    full = trace_step(workload, recipe, depth=None, batch_size=5, compute_capability=GPU.compute_capability)
    assert full.offloaded_bytes > 0
    assert offloaded_bytes(traces, 5) == full.offloaded_bytes


def test_a_mask_near_the_threshold_does_not_change_the_ops_with_the_batch(tiny_model):
    """TRL's loss saves a [batch, 511] bool mask at 512 tokens: 1,022 bytes at batch 2 (kept on the device), 1,533 at 3
    (TRL copies it). Judged at 2 samples in both traces (offload.JUDGED_AT_BATCH), the two traces the estimate
    extrapolates from run the same ops; before, the estimate stopped with "the traced op sequence changed"."""
    from anatomist.estimate.traces import TRACE_BATCHES, step_traces

    workload = load_workload(str(tiny_model("gpt2", n_positions=512)), seq_len=512)
    recipe = Recipe(trainer="sft", per_device_train_batch_size=8, activation_offloading=True).resolved(workload)
    traces = step_traces(workload, recipe, GPU.compute_capability)
    assert TRACE_BATCHES[0] == offload.JUDGED_AT_BATCH
    for cut in traces.plan.cuts:
        lo, hi = (traces.passes[cut, b].curves.keys for b in TRACE_BATCHES)
        assert lo == hi
    assert estimate_memory(workload, recipe, GPU).anatomy.peak_allocated > 0


@pytest.mark.slow  # over 15 s on 2 cores
def test_the_copies_cost_time_over_pcie(workload):
    """The way out hides under the forward up to its compute; the way back adds its whole transfer."""
    from anatomist.estimate.time.cluster import predict_time
    from anatomist.estimate.time.constants import constants
    from anatomist.estimate.time.transfers import activation_offloading_s
    from anatomist.estimate.traces import offloaded_bytes, step_traces

    recipe = Recipe(per_device_train_batch_size=BATCH, dtype="float32", gradient_accumulation_steps=2,
                    activation_offloading=True).resolved(workload)
    copied = offloaded_bytes(step_traces(workload, recipe, GPU.compute_capability), BATCH)
    one_way = copied * 2 / (constants()["offload"]["pcie_gbps"] * 1e9)
    assert activation_offloading_s(recipe, copied, forward_s=0.0) == pytest.approx(2 * one_way)
    assert activation_offloading_s(recipe, copied, forward_s=10 * one_way) == pytest.approx(one_way)
    plain = predict_time(workload, recipe.replace(activation_offloading=False), GPU)
    assert predict_time(workload, recipe, GPU).step_s > plain.step_s


def test_read_from_trl_and_written_for_trl(tmp_path):
    """SFTConfig's activation_offloading is read from a `trl sft --config` YAML and written by `--emit trl`, which
    TRL's own parser reads back; the other targets cannot say it, and the plan warns so."""
    import yaml
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

    from anatomist.plan.caveats import launch_warnings
    from anatomist.plan.emit import write
    from anatomist.recipe.files import read_recipe_file

    path = tmp_path / "sft.yaml"
    path.write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nactivation_offloading: true\nmax_length: 1024\n")
    recipe = read_recipe_file(path).recipe
    assert (recipe.trainer, recipe.activation_offloading) == ("sft", True)
    out = tmp_path / "trl.yaml"
    write(recipe, "trl", out, model="Qwen/Qwen2.5-0.5B", seq_len=1024)
    assert yaml.safe_load(out.read_text())["activation_offloading"] is True
    _, args, _ = TrlParser((ScriptArguments, SFTConfig, ModelConfig)).parse_args_and_config(
        args=["--config", str(out), "--use_cpu", "true"])
    assert args.activation_offloading
    assert launch_warnings(recipe, "trl") == launch_warnings(recipe, "trainer") == []  # SFTConfig's field in both
    (warning,) = launch_warnings(Recipe(activation_offloading=True), "trainer")  # TrainingArguments have none
    assert "activation_offloading is TRL's" in warning


def test_a_training_arguments_file_with_a_trl_field_is_trls(tmp_path):
    """TrainingArguments' keys beside SFTConfig's activation_offloading (which TrainingArguments lacks): TRL's file,
    read with TRL's defaults and its SFTTrainer, not as the Trainer's with the model's own loss."""
    from anatomist.recipe.files import read_recipe_file

    path = tmp_path / "sft.yaml"
    path.write_text("learning_rate: 2.0e-5\nper_device_train_batch_size: 2\nactivation_offloading: true\n")
    source = read_recipe_file(path)
    assert (source.kind, source.recipe.trainer, source.recipe.activation_offloading) == ("TRL", "sft", True)
    path.write_text("per_device_train_batch_size: 2\nactivation_offloading: true\n")  # anatomist's own keys only
    assert read_recipe_file(path).kind == "anatomist"
