"""FP8 training (torchao's float8 layers, as accelerate's mixed_precision="fp8" converts a model).

Independent sides:
- memory: PyTorch's MemTracker over a real steady-state CPU step of the full-depth model converted by accelerate's own
  `convert_model_to_fp8_ao` (torchao's CPU kernels run torch._scaled_mm on real float8 tensors), against the
  prediction, which extrapolates shallow fake traces (2-3 blocks, batch 2-3) to 5 blocks at batch 5;
- which layers multiply in FP8: the real converted model's Float8Linear layers, against the FP8 products the fake
  trace records;
- time: torchao's published torchtitan runs (torchao/float8/README.md, "Training benchmarks", NVIDIA H100: Llama3-8B
  on 8 x H100, FSDP2, torch.compile, batch 1 x 8192): float8 tensorwise 1.2503x and rowwise 1.1005x the bf16 tokens/s.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml
from memtracker_step import count_as_on_cuda, measure_step

from anatomist.estimate import estimate
from anatomist.estimate.memory import estimate_memory
from anatomist.estimate.time.ops import step_ops
from anatomist.hardware import get_gpu
from anatomist.plan.caveats import launch_warnings
from anatomist.plan.emit import accelerate_config
from anatomist.recipe import Recipe
from anatomist.recipe.spellings import training_arguments_kwargs
from anatomist.workload_loader import load_workload

pytest.importorskip("torchao")
from accelerate.utils import AORecipeKwargs  # noqa: E402  (after the skip: it needs torchao)
from accelerate.utils.ao import convert_model_to_fp8_ao  # noqa: E402
from torchao.float8 import Float8LinearConfig  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

H100 = get_gpu("H100-SXM")
BATCH = 5


@pytest.fixture
def counted_as_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    count_as_on_cuda(monkeypatch)


def _converted(workload, recipe: Recipe) -> torch.nn.Module:
    torch.manual_seed(0)
    model = workload.build_model(recipe.attn_implementation, recipe.dtype)
    # What accelerate's Accelerator converts with when the script passes no AORecipeKwargs (the Trainer passes none):
    # its defaults (padded inner dimensions, float8 all-gather, which acts under FSDP2 only) for tensorwise.
    config = AORecipeKwargs().config if recipe.fp8 == "tensorwise" else Float8LinearConfig.from_recipe_name(recipe.fp8)
    convert_model_to_fp8_ao(model, config=config)
    return model


@pytest.mark.parametrize(("fp8", "dtype"), [
    ("tensorwise", "float32"), pytest.param("rowwise", "bfloat16", marks=pytest.mark.slow),  # the default suite's time
    pytest.param("rowwise", "float32", marks=pytest.mark.slow), pytest.param("tensorwise", "bfloat16", marks=pytest.mark.slow),
])
def test_fp8_step_matches_pytorchs_accounting(tiny_model, counted_as_on_cuda, fp8, dtype):
    workload = load_workload(str(tiny_model("llama", num_hidden_layers=5)), seq_len=64)
    recipe = Recipe(per_device_train_batch_size=BATCH, dtype=dtype, bf16=True, fp8=fp8).resolved(workload)
    predicted = estimate_memory(workload, recipe, H100).anatomy
    measured, after = measure_step(workload, recipe, _converted(workload, recipe), BATCH)
    workspaces = predicted.functionality  # the two cuBLAS workspaces: nothing on a CPU
    assert predicted.peak_allocated - workspaces == pytest.approx(measured["Total"], rel=0.05)
    assert predicted.optimizer_states == pytest.approx(after["OPT"], rel=0.05)


@pytest.mark.slow  # 8-9 s on 2 cores: the default suite's time
def test_the_trace_multiplies_in_fp8_where_accelerate_converts(tiny_model):
    workload = load_workload(str(tiny_model("llama", num_hidden_layers=3)), seq_len=64)
    recipe = Recipe(per_device_train_batch_size=2, dtype="float32", bf16=True, fp8="tensorwise").resolved(workload)
    converted = [n for n, m in _converted(workload, recipe).named_modules() if isinstance(m, Float8Linear)]
    linears = [n for n, m in workload.build_model(None, "float32").named_modules() if isinstance(m, torch.nn.Linear)]
    assert converted and len(converted) == len(linears) - 2  # all but the first and the last
    records = step_ops(workload, recipe, H100.compute_capability).records
    fp8 = [r for r in records if r.dtype.startswith("float8") and r.op_class.value == "contraction"]
    assert {r.name for r in fp8} == {"mm"}  # torchao's float8 tensor's mm, which it runs as torch._scaled_mm
    forward = sum(r.calls_per_step(1) for r in fp8 if r.phase.value == "forward")
    backward = sum(r.calls_per_step(1) for r in fp8 if r.phase.value == "backward")
    assert (forward, backward) == (len(converted), 2 * len(converted))  # the output; then grad input and grad weight


@pytest.mark.slow  # 8-9 s on 2 cores: the default suite's time
def test_the_fp8_products_run_at_the_fp8_peak(tiny_model):
    """The same FP8 step on an H100 whose FP8 peak were its bf16 one: its products take longer, the rest no time more."""
    workload = load_workload(str(tiny_model("llama", num_hidden_layers=3)), seq_len=64)
    recipe = Recipe(per_device_train_batch_size=2, dtype="bfloat16", bf16=True, fp8="tensorwise")
    fast = estimate(workload, recipe, H100).time.classes_s
    slow = estimate(workload, recipe, dataclasses.replace(H100, fp8_tflops=H100.bf16_tflops)).time.classes_s
    assert slow["contraction"] > fast["contraction"]
    assert slow["elementwise"] == pytest.approx(fast["elementwise"])


@pytest.mark.parametrize(("flags", "said"), [
    (["--gpu", "A100-80GB", "--bf16", "--fp8", "tensorwise"], "needs FP8 tensor cores"),
    (["--gpu", "H100", "--fp8", "tensorwise"], "add --bf16"),
    (["--gpu", "H100", "--fp16", "--fp8", "rowwise"], "drop --fp16"),
    (["--gpu", "H100", "--bf16", "--fp8", "tensorwise", "--peft", "qlora"], "4-bit or 8-bit base"),
    (["--gpu", "H100", "--bf16", "--fp8", "tensorwise", "--zero-stage", "2"], "DeepSpeed"),
    (["--gpu", "H100", "--bf16", "--fp8", "rowwise", "--fp8-all-gather"], "fp8_all_gather needs --fp8 tensorwise"),
])
def test_fp8_bad_input_is_one_line(cli, tiny_model, flags, said):
    run = cli("estimate", str(tiny_model("llama")), *flags)
    assert run.returncode == 2
    assert said in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_accelerate_fp8_files_read_and_written(cli, tmp_path, tiny_model):
    from anatomist.recipe.files import read_recipe_file

    ao = tmp_path / "fp8.yaml"
    ao.write_text("distributed_type: 'NO'\nmixed_precision: fp8\nfp8_config:\n  backend: AO\n"
                  "  enable_fsdp_float8_all_gather: false\n  pad_inner_dim: true\n  use_autocast_during_eval: false\n"
                  "num_processes: 1\n")
    read = read_recipe_file(str(ao))
    assert (read.fields["bf16"], read.fields["fp8"], read.fields["fp8_all_gather"]) == (True, "tensorwise", False)
    assert read.not_modelled == ()  # padded inner dimensions are what the trace runs; the eval key is at its default
    te = tmp_path / "te.yaml"
    te.write_text("distributed_type: 'NO'\nmixed_precision: fp8\nfp8_config:\n  backend: TE\n")
    run = cli("estimate", str(tiny_model("llama")), "--gpu", "H100", "--recipe", str(te))
    assert run.returncode == 2 and "backend=TE is not modelled" in run.stderr

    recipe = Recipe(bf16=True, fp8="tensorwise")
    config = accelerate_config(recipe)
    assert (config["mixed_precision"], config["fp8_config"]) == ("fp8", {"backend": "AO"})
    assert training_arguments_kwargs(recipe)["bf16"] is False  # set, it would replace the launch's fp8
    assert any("accelerate launch --mixed_precision fp8" in w for w in launch_warnings(recipe, "trainer"))
    for gathered in (None, False):  # written for FSDP, and read back as written
        sharded = Recipe(bf16=True, fp8="tensorwise", fsdp="full_shard", fp8_all_gather=gathered)
        path = tmp_path / "sharded.yaml"
        path.write_text(yaml.safe_dump(accelerate_config(sharded)))
        assert accelerate_config(sharded)["fp8_config"]["enable_fsdp_float8_all_gather"] is (gathered is None)
        assert read_recipe_file(str(path)).fields["fp8_all_gather"] is (gathered is None)


def test_axolotl_fp8_reads_as_its_trainer_converts(tmp_path):
    """axolotl's fp8 (AxolotlTrainer.additional_accelerator_args): accelerate's mixed precision fp8, bf16 autocast,
    torchao's default recipe (tensorwise), its weights gathered in float8 only where the config asks."""
    from anatomist.recipe.files import read_recipe_file

    path = tmp_path / "ax.yml"
    for extra, gathered in (("", False), ("fp8_enable_fsdp_float8_all_gather: true\n", True)):
        path.write_text(f"base_model: x\nfp8: true\nmicro_batch_size: 2\n{extra}")
        fields = read_recipe_file(str(path)).fields
        assert (fields["fp8"], fields["bf16"], fields["dtype"], fields["fp8_all_gather"]) == (
            "tensorwise", True, "float32", gathered)


@pytest.mark.slow  # three traces of Llama-3.1-8B (FSDP rank of 8, compiled): about a minute each on 2 cores
def test_fp8_speedups_of_torchaos_published_runs():
    """Speed-ups of float8 over bf16 predicted within 20% of torchao's torchtitan runs (its README's table; those ran
    per-op selective checkpointing, which is not modelled: the prediction is without checkpointing, where the
    compiled blocks fuse the casts; tensorwise gathered the FSDP shards in float8, as the prediction's default does)."""
    workload = load_workload("meta-llama/Llama-3.1-8B", seq_len=8192)
    speed = {}
    for fp8 in ("none", "tensorwise", "rowwise"):
        recipe = Recipe(per_device_train_batch_size=1, dtype="float32", bf16=True, fp8=fp8, torch_compile=True,
                        fsdp="full_shard")
        speed[fp8] = estimate(workload, recipe, H100, num_gpus=8).time.samples_per_second
    published = {"tensorwise": 7689.5 / 6150, "rowwise": 6768 / 6150}
    for fp8, ratio in published.items():
        predicted = speed[fp8] / speed["none"]
        print(f"{fp8}: predicted {predicted:.3f}x, published {ratio:.3f}x")
        assert predicted == pytest.approx(ratio, rel=0.20), (fp8, predicted, ratio)
