"""`plan --peft lora,qlora` and what it writes: LoraConfig, BitsAndBytesConfig, the Trainer
snippet and TRL's `trl sft --config` YAML, each loaded by the real library."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from anatomist.hardware import get_gpu
from anatomist.plan import SearchSpace, plan
from anatomist.plan.emit import render, trainer_snippet, write
from anatomist.plan.space import enumerate_recipes, method_of
from anatomist.recipe import Recipe
from anatomist.recipe.axis_values import precision_of
from anatomist.recipe.spellings import bnb_config, lora_config, trl_config
from anatomist.workload_loader import load_workload

TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "max_position_embeddings": 256, "tie_word_embeddings": False,
}
QLORA = Recipe.with_presets(peft="qlora", per_device_train_batch_size=2, gradient_accumulation_steps=4, bf16=True, dtype="bfloat16",
                            lora_r=8, lora_target_modules="q_proj,v_proj")
LORA = Recipe(peft="lora", per_device_train_batch_size=4, lora_r=32, lora_alpha=64, lora_dropout=0.05,
              lora_target_modules="all-linear")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return path


@pytest.fixture(scope="module")
def peft_plan(folder: Path):
    workload = load_workload(str(folder), seq_len=64, task="causal-lm")
    space = SearchSpace(global_batch_size=8, optims=("adamw_torch_fused",), compile_options=(False,),
                        precisions=("bf16-weights",), methods=("full", "lora", "qlora"))
    return plan(workload, get_gpu("A100-80GB"), space=space)


@pytest.mark.slow
def test_peft_methods_join_the_search_only_as_asked(peft_plan, folder: Path) -> None:
    methods = {method_of(c.recipe) for c in peft_plan.candidates}
    assert methods == {"full", "lora", "qlora"}
    qlora = [c.recipe for c in peft_plan.candidates if method_of(c.recipe) == "qlora"]
    assert {precision_of(r) for r in qlora} == {"nf4+bf16"}  # QLoRA's one precision on a bf16 GPU
    assert all(r.bnb_4bit_use_double_quant and r.bnb_4bit_compute_dtype == "bfloat16" for r in qlora)
    assert {r.gradient_checkpointing for r in qlora} == {False, True}  # the axis is searched, not preset
    adapters = [c.recipe for c in peft_plan.candidates if c.recipe.peft != "none"]
    assert all(r.zero_stage == 0 and r.offload == "none" for r in adapters)
    assert any("fine-tuning: searched full, lora, qlora" in n for n in peft_plan.notes)
    assert any(r.startswith("fine-tuning ") for r in peft_plan.best.reasons)
    assert {method_of(r) for r in enumerate_recipes(SearchSpace(), get_gpu("A100-80GB"))} == {"full"}


@pytest.mark.slow
def test_adapters_shrink_the_trained_state(peft_plan) -> None:
    """Same batch, checkpointing and optimizer: LoRA and QLoRA keep optimizer states for the same
    adapters only. (Their weights are compared in test_peft.py: in a model this small the fp32
    embeddings of `prepare_model_for_kbit_training` outweigh the 4-bit saving.)"""
    def pick(method: str):
        return next(c for c in peft_plan.candidates if method_of(c.recipe) == method
                    and c.recipe.per_device_train_batch_size == 8 and c.recipe.gradient_checkpointing
                    and c.recipe.dtype == "bfloat16")

    full, lora, qlora = (pick(m).memory.anatomy for m in ("full", "lora", "qlora"))
    assert lora.optimizer_states < full.optimizer_states / 5  # r=16 q/v adapters: 1/9 of this tiny model
    assert qlora.optimizer_states == lora.optimizer_states


@pytest.mark.parametrize("recipe", [LORA, QLORA], ids=["lora", "qlora"])
def test_emitted_peft_configs_load_in_peft_and_transformers(recipe: Recipe, tmp_path: Path) -> None:
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    written = write(recipe, "trainer", tmp_path / "args.json", model="meta-llama/Llama-3.1-8B", task="causal-lm")
    names = sorted(p.name for p in written)
    assert names == sorted(["args.json", "args.py", "args.lora.json"] + (["args.bnb.json"] if recipe.quantized else []))
    lora = LoraConfig(**json.loads((tmp_path / "args.lora.json").read_text()))
    assert (lora.r, lora.lora_alpha, lora.lora_dropout) == (recipe.lora_r, recipe.lora_alpha, recipe.lora_dropout)
    assert lora.task_type == "CAUSAL_LM"
    if recipe.lora_target_modules == "all-linear":
        assert lora.target_modules == "all-linear"
    else:
        assert set(lora.target_modules) == set(recipe.lora_target_modules.split(","))
    if recipe.quantized:
        bnb = BitsAndBytesConfig(**json.loads((tmp_path / "args.bnb.json").read_text()))
        assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "nf4" and bnb.bnb_4bit_use_double_quant
        assert str(bnb.bnb_4bit_compute_dtype) == "torch.bfloat16"
    snippet = (tmp_path / "args.py").read_text()
    calls = {getattr(n.func, "id", getattr(n.func, "attr", "")): n for n in ast.walk(ast.parse(snippet))
             if isinstance(n, ast.Call)}
    assert "get_peft_model" in calls and "LoraConfig" in calls
    assert ("prepare_model_for_kbit_training" in calls) == recipe.quantized
    assert ("BitsAndBytesConfig" in calls) == recipe.quantized


@pytest.mark.slow
def test_the_lora_snippet_runs_and_trains_what_the_estimate_counts(folder: Path, tmp_path: Path) -> None:
    """Execute the emitted snippet against a tiny local checkpoint: PEFT's trainable parameters
    are the ones the estimator traced."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from anatomist.estimate.memory import estimate_memory

    checkpoint = tmp_path / "ckpt"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(checkpoint)
    recipe = LORA.replace(dtype="float32", bf16=False)
    namespace: dict = {}
    exec(compile(trainer_snippet(recipe, model=str(checkpoint), task="causal-lm"), "snippet.py", "exec"), namespace)
    model = namespace["model"]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    workload = load_workload(str(folder), seq_len=64, task="causal-lm")
    estimate = estimate_memory(workload, recipe.resolved(workload), get_gpu("A100-80GB"))
    assert estimate.trainable_parameters == trainable
    assert namespace["args"].per_device_train_batch_size == recipe.per_device_train_batch_size


@pytest.mark.parametrize("recipe", [LORA, QLORA, Recipe(per_device_train_batch_size=2, bf16=True)],
                         ids=["lora", "qlora", "full"])
def test_trl_config_is_read_by_trl_sft(recipe: Recipe, tmp_path: Path) -> None:
    """The YAML is parsed by TRL's own parser as `trl sft --config` parses it, and TRL's helpers
    build the LoraConfig and BitsAndBytesConfig from it."""
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser, get_peft_config, get_quantization_config

    path = tmp_path / "sft.yaml"
    write(recipe, "trl", path, model="Qwen/Qwen2.5-0.5B", seq_len=2048)
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig))
    script, sft, model = parser.parse_args_and_config(args=["--config", str(path), "--use_cpu", "true"])
    assert script.dataset_name == "DATASET" and model.model_name_or_path == "Qwen/Qwen2.5-0.5B"
    assert sft.max_length == 2048
    assert sft.per_device_train_batch_size == recipe.per_device_train_batch_size
    assert sft.gradient_accumulation_steps == recipe.gradient_accumulation_steps
    assert sft.gradient_checkpointing == recipe.gradient_checkpointing  # SFTConfig's own default is True
    assert sft.bf16 == recipe.bf16 and sft.optim == recipe.optim
    peft_config = get_peft_config(model)
    if recipe.peft == "none":
        assert peft_config is None
    else:
        assert (peft_config.r, peft_config.lora_alpha) == (recipe.lora_r, recipe.lora_alpha)
    quantization = get_quantization_config(model)
    assert (quantization is not None) == recipe.quantized
    if quantization is not None:
        assert quantization.bnb_4bit_quant_type == "nf4" and quantization.bnb_4bit_use_double_quant
        assert str(quantization.bnb_4bit_compute_dtype) == "torch.bfloat16"


def test_full_fine_tuning_writes_no_peft_config(tmp_path: Path) -> None:
    recipe = Recipe(per_device_train_batch_size=2)
    assert lora_config(recipe) is None and bnb_config(recipe) is None
    assert [p.name for p in write(recipe, "trainer", tmp_path / "a.json")] == ["a.json", "a.py"]
    assert "use_peft" not in trl_config(recipe)
    assert "peft" not in render(recipe, "trainer")


@pytest.mark.slow
def test_cli_plan_peft_and_emit_trl(cli, peft_plan, folder: Path, tmp_path: Path) -> None:
    """The CLI searches the space of `peft_plan` (its traces come from the cache) and writes the
    pick as TRL's YAML."""
    out = tmp_path / "sft.yaml"
    proc = cli("plan", str(folder), "--task", "causal-lm", "--seq-len", "64", "--gpu", "A100-80GB",
               "--global-batch-size", "8", "--optims", "adamw_torch_fused", "--no-compile", "--precisions", "bf16-weights",
               "--peft", "lora,qlora", "--lora-alpha", "64", "--json", "--emit", "trl", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["candidates"] == len(peft_plan.candidates)
    best = data["best"]["recipe"]
    assert best["lora_alpha"] == 64 and best == peft_plan.best.recipe.replace(lora_alpha=64).to_dict()
    text = out.read_text()
    assert "max_length: 64" in text and ("lora_alpha: 64" in text) == (best["peft"] != "none")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--peft", "dora"], "--peft: unknown method(s) dora; known: lora, qlora"),
        (["--lora-r", "8"], "--lora-r needs --peft lora and/or qlora"),
        (["--peft", "lora", "--lora-r", "0"], "lora_r must be greater than 0"),
        (["--precisions", "int4"], "--precisions: unknown precision(s) int4"),
    ],
)
def test_cli_plan_peft_bad_input(cli, folder: Path, args: list[str], message: str) -> None:
    proc = cli("plan", str(folder), "--task", "causal-lm", "--gpu", "A100-80GB", *args)
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("recipe", [LORA, QLORA], ids=["lora", "qlora"])
def test_what_emit_trl_writes_reads_back_as_the_same_recipe(recipe: Recipe, tmp_path: Path) -> None:
    """`plan --emit trl` and `--recipe sft.yaml` agree: what the plan picked is what is estimated."""
    from anatomist.recipe.files import read_recipe_file

    path = tmp_path / "sft.yaml"
    write(recipe, "trl", path, model="Qwen/Qwen2.5-0.5B", seq_len=2048)
    source = read_recipe_file(path)
    assert source.kind == "TRL" and source.model == "Qwen/Qwen2.5-0.5B" and source.seq_len == 2048
    assert method_of(source.recipe) == method_of(recipe)  # TRL says use_peft + load_in_4bit, not "qlora"
    fields = ("lora_r", "lora_alpha", "lora_dropout", "load_in_4bit", "bnb_4bit_quant_type",
              "bnb_4bit_use_double_quant", "per_device_train_batch_size", "gradient_accumulation_steps",
              "gradient_checkpointing", "bf16", "fp16", "optim")
    assert {f: getattr(source.recipe, f) for f in fields} == {f: getattr(recipe, f) for f in fields}
    if recipe.lora_target_modules != "all-linear":
        assert set(source.recipe.lora_target_modules.split(",")) == set(recipe.lora_target_modules.split(","))


def test_lora_on_a_gpu_without_bf16_searches_an_fp16_base() -> None:
    """On a T4 or a V100 LoRA is searched with the frozen base in fp16 (fp16-weights), full fine-tuning never (the
    GradScaler refuses to unscale fp16 gradients); where bf16 is as fast, bf16-weights stands for it."""
    from anatomist.plan.space import searched_precisions

    space = SearchSpace(global_batch_size=8)
    for name in ("T4", "V100-16GB"):
        assert "fp16-weights" in searched_precisions(space, get_gpu(name), "lora")
        assert "fp16-weights" not in searched_precisions(space, get_gpu(name), "full")
    assert "fp16-weights" not in searched_precisions(space, get_gpu("RTX-4090"), "lora")
    assert "fp16-weights" not in searched_precisions(SearchSpace(global_batch_size=8, precisions=("fp16-weights",)),
                                                     get_gpu("T4"), "full")


def test_peft_trains_fp32_adapters_on_an_fp16_base(folder: Path) -> None:
    """What makes fp16-weights trainable under the GradScaler: PEFT makes the adapters in fp32 on a base loaded in fp16
    (its autocast_adapter_dtype), so every gradient the scaler unscales is fp32. Real transformers and peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float16)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and {p.dtype for p in trained} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.float16}


def test_an_fp16_base_is_lora_only() -> None:
    """A full fine-tune on an fp16 base is refused as the recipe is made (the GradScaler's refusal); LoRA on one is a
    recipe `check` can search around."""
    from anatomist.errors import InputError
    from anatomist.measure.preflight import search_space

    with pytest.raises(InputError, match="cannot train float16-loaded weights"):
        Recipe(dtype="float16", fp16=True)
    around = search_space(Recipe(peft="lora", dtype="float16", fp16=True), 1, set(), get_gpu("T4"))
    assert not isinstance(around, str) and around.precisions == ("fp16-weights",)
