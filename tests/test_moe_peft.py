"""LoRA and QLoRA of Mixture-of-Experts models as transformers 5 and PEFT run them.

The truth is never anatomist's tracer: the real transformers and PEFT objects built on the meta device
(`replace_with_bnb_linear`, `prepare_model_for_kbit_training`, `get_peft_model`: trainable counts, what is
quantized and what stays in which dtype), and PyTorch's MemTracker on a real CPU step of a tiny MoE model made as
its user makes it (`bench.worker.training_model`: from_pretrained with a BitsAndBytesConfig, get_peft_model).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import torch
from memtracker_step import count_as_on_cuda, measure_step, round_to_block

from anatomist.axes.quantization import BLOCK_4BIT, NESTED_BLOCK
from anatomist.bench.worker import training_model
from anatomist.estimate.memory import estimate_memory
from anatomist.hardware import get_gpu
from anatomist.recipe import LORA_FALLBACK_TARGETS, Recipe
from anatomist.trace.depth.plan import model_plan
from anatomist.trace.engine.cuda_paths import _grouped_mm_output
from anatomist.workload_loader import load_workload

GPU = get_gpu("A100-80GB")
SEQ = 64
MIXTRAL = {
    "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
    "num_experts_per_tok": 2, "vocab_size": 500, "max_position_embeddings": 256, "dtype": "bfloat16",
    "tie_word_embeddings": False,
}
QWEN3_MOE = {
    "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 500, "max_position_embeddings": 256,
    "dtype": "bfloat16",
}
EXPERTS = "mlp.experts.gate_up_proj,mlp.experts.down_proj"


def _model(tmp_path: Path, config: dict) -> Path:
    folder = tmp_path / config["model_type"]
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


class _NoHooks(dict):
    """A hooks dict a RemovableHandle can point to (it keeps a weak reference)."""


def _frozen_parameters_take_no_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """MemTracker hooks every parameter's gradient, which torch refuses on a frozen one (as tests/test_peft.py)."""
    for name in ("register_hook", "register_post_accumulate_grad_hook"):
        original = getattr(torch.Tensor, name)

        def only_if_trainable(self, hook, _original=original):
            return _original(self, hook) if self.requires_grad else torch.utils.hooks.RemovableHandle(_NoHooks())

        monkeypatch.setattr(torch.Tensor, name, only_if_trainable)


# -- the experts' grouped products in every dtype CUDA takes ------------------------------------------------------

@pytest.mark.parametrize(("dtype", "padded"), [(torch.float32, 12), (torch.float16, 16)])
def test_grouped_mm_answers_as_cuda_for_float32_and_float16(dtype, padded):
    """torch's meta kernel of _grouped_mm takes bf16 only; CUDA's takes fp32 and fp16 too (one mm per group). The
    fake step's output has the real kernel's shape and dtype (a CPU run of the same product) and CUDA's strides: rows
    padded to 16 bytes (10 columns: 12 of 4-byte floats, 16 of 2-byte ones)."""
    a, b = torch.randn(12, 16), torch.randn(3, 16, 12)
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)
    real = torch.nn.functional.grouped_mm(a, b, offs=offs)  # CPU's kernel (float32 here)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fake = _grouped_mm_output(torch.empty(12, 16, dtype=dtype), torch.empty(3, 16, 12, dtype=dtype), offs)
        narrow = _grouped_mm_output(torch.empty(12, 16, dtype=dtype), torch.empty(3, 16, 10, dtype=dtype), offs)
    assert fake.shape == real.shape and fake.dtype == dtype
    assert narrow.shape == (12, 10) and narrow.stride() == (padded, 1)


@pytest.mark.slow
def test_moe_qlora_traces_with_the_experts_in_float32(tmp_path):
    """QLoRA of a Mixture of Experts: prepare_model_for_kbit_training casts the unquantized experts to fp32, and
    their grouped products run in fp32 (a traceback before: the meta kernel's 'Expected inputs of BF16 type')."""
    workload = load_workload(str(_model(tmp_path, MIXTRAL)), seq_len=SEQ)
    result = estimate_memory(workload, Recipe.with_presets(peft="qlora", per_device_train_batch_size=1)
                             .resolved(workload), GPU)
    assert result.anatomy.peak_allocated > 0
    assert any("quantizes nn.Linear layers only" in n and "cast to float32" in n for n in result.notes)


@pytest.mark.slow
def test_compiled_fp32_experts_take_transformers_fallback(tmp_path):
    """Under torch.compile transformers runs non-bf16 experts through its own custom op (grouped_mm_fallback),
    not torch's grouped product (a traceback of the compiled QLoRA trace before: the meta kernel's bf16 check);
    outside a compiled trace the patch is gone."""
    from transformers.integrations import moe

    original = moe._can_use_grouped_mm
    workload = load_workload(str(_model(tmp_path, MIXTRAL)), seq_len=SEQ)
    recipe = Recipe.with_presets(peft="qlora", per_device_train_batch_size=1, gradient_checkpointing=False,
                                 torch_compile=True).resolved(workload)
    assert estimate_memory(workload, recipe, GPU).anatomy.peak_allocated > 0
    assert moe._can_use_grouped_mm is original


# -- what is trained, what is quantized: the real objects on the meta device -------------------------------------

def _real_model(workload, recipe):
    """The model as transformers + bitsandbytes + PEFT make it, on the meta device: transformers' own
    replace_with_bnb_linear (what from_pretrained(quantization_config=...) runs before loading), peft's
    prepare_model_for_kbit_training and get_peft_model."""
    import peft
    import transformers
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import HfQuantizer

    from anatomist.recipe.spellings import bnb_config, lora_config

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(workload.config, dtype=getattr(torch, recipe.dtype))
    quantization = bnb_config(recipe)
    if quantization is not None:
        config = transformers.BitsAndBytesConfig(**quantization)
        skip = HfQuantizer.get_modules_to_not_convert(model, config.llm_int8_skip_modules, model._keep_in_fp32_modules)
        model = replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=config)
        model.is_loaded_in_4bit = True
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=recipe.gradient_checkpointing)
    with torch.device("meta"):
        return peft.get_peft_model(model, peft.LoraConfig(**lora_config(recipe, workload.task)))


def _four_bit_bytes(elements: int) -> int:
    """What bitsandbytes keeps of one 4-bit weight with double quantization (`quantize_4bit` with
    compress_statistics): packed codes, a uint8 absmax per block, and its QuantState's own tensors: the nested fp32
    absmax per NESTED_BLOCK blocks and offset, the 256-entry code of the nested state and the 16-entry NF4 code
    (each a copy of its own); every tensor in the allocator's 512-byte blocks."""
    blocks = math.ceil(elements / BLOCK_4BIT)
    tensors = (math.ceil(elements / 2), blocks, 4 * math.ceil(blocks / NESTED_BLOCK), 4, 4 * 256, 4 * 16)
    return sum(round_to_block(n) for n in tensors)


SLOW = pytest.mark.slow


@pytest.mark.parametrize(("config", "peft_method", "targets", "parameters"), [
    (MIXTRAL, "qlora", None, None),
    pytest.param(MIXTRAL, "lora", None, None, marks=SLOW),
    pytest.param(MIXTRAL, "lora", "q_proj,v_proj", None, marks=SLOW),
    pytest.param(MIXTRAL, "qlora", "q_proj", EXPERTS, marks=SLOW),
    pytest.param(QWEN3_MOE, "lora", None, None, marks=SLOW),
    pytest.param(QWEN3_MOE, "qlora", None, EXPERTS, marks=SLOW),
])
def test_trained_and_quantized_parameters_are_those_of_the_real_objects(tmp_path, config, peft_method, targets,
                                                                        parameters):
    """Trainable and total counts, the quantized linear layers' elements and the bytes of everything left
    unquantized (experts, embeddings, norms, head: fp32 after prepare_model_for_kbit_training) are the real
    objects'; the traced weights are their bytes, 4-bit codes as bitsandbytes stores them."""
    import bitsandbytes as bnb

    workload = load_workload(str(_model(tmp_path, config)), seq_len=SEQ)
    recipe = Recipe.with_presets(peft=peft_method, per_device_train_batch_size=1, lora_target_modules=targets,
                                 lora_target_parameters=parameters).resolved(workload)
    real = _real_model(workload, recipe)
    trainable, _ = real.get_nb_trainable_parameters()
    total = sum(p.numel() for p in real.parameters())  # a 4-bit weight not yet loaded holds its full shape on meta
    predicted = estimate_memory(workload, recipe, GPU)
    assert (predicted.trainable_parameters, predicted.parameters) == (trainable, total)
    four_bit = [m for m in real.modules() if isinstance(m, bnb.nn.Linear4bit)]
    quantized = sum(m.in_features * m.out_features for m in four_bit)
    assert model_plan(workload, recipe).size.quantized_parameters == quantized
    codes = {id(m.weight) for m in four_bit}
    rest = sum(round_to_block(p.numel() * p.element_size()) for p in real.parameters() if id(p) not in codes)
    if peft_method == "qlora":
        experts = [p for n, p in real.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))]
        assert experts and all(p.dtype == torch.float32 for p in experts)  # prepare_model_for_kbit_training's cast
    weights = rest + sum(_four_bit_bytes(m.in_features * m.out_features) for m in four_bit)
    assert predicted.anatomy.weights == pytest.approx(weights, rel=0.005)


# -- a real CPU step, measured by MemTracker ----------------------------------------------------------------------

@pytest.mark.parametrize(("config", "targets", "parameters"), [
    (MIXTRAL, None, None),  # PEFT has no default: all-linear, whose v5 conversion adapts the experts too
    pytest.param(MIXTRAL, "q_proj", EXPERTS, marks=SLOW),  # the experts through target_parameters
    pytest.param(QWEN3_MOE, "q_proj,v_proj", None, marks=SLOW),  # the experts frozen
])
def test_lora_step_of_a_moe_matches_pytorchs_accounting(tmp_path, monkeypatch, config, targets, parameters):
    """A real LoRA step of a tiny MoE (bf16 base, grouped_mm's CPU kernel, fp32 adapters, AdamW) built as its user
    builds it, measured by MemTracker with the CUDA allocator's 512-byte blocks: the predicted peak (less the
    cuBLAS workspaces, which a CPU step has not) within 3%, the weights and optimizer states within 1%."""
    count_as_on_cuda(monkeypatch)
    _frozen_parameters_take_no_hooks(monkeypatch)
    workload = load_workload(str(_model(tmp_path, config)), seq_len=SEQ)
    recipe = Recipe(per_device_train_batch_size=4, peft="lora", lora_target_modules=targets,
                    lora_target_parameters=parameters).resolved(workload)
    predicted = estimate_memory(workload, recipe, GPU).anatomy
    torch.manual_seed(0)
    kinds, after = measure_step(workload, recipe, training_model(workload, recipe), 4)
    assert predicted.peak_allocated - predicted.functionality == pytest.approx(kinds["Total"], rel=0.03)
    assert predicted.weights == pytest.approx(kinds["PARAM"] + kinds["BUFFER"], rel=0.01)
    assert predicted.optimizer_states == pytest.approx(after["OPT"], rel=0.01)


@pytest.mark.slow
def test_qlora_step_of_a_moe_matches_pytorchs_accounting(tmp_path, monkeypatch):
    """The same of QLoRA: from_pretrained with BitsAndBytesConfig(load_in_4bit) quantizes the attention on CPU
    (bitsandbytes' CPU backend), the experts stay bf16 and prepare_model_for_kbit_training casts them to fp32."""
    count_as_on_cuda(monkeypatch)
    _frozen_parameters_take_no_hooks(monkeypatch)
    workload = load_workload(str(_model(tmp_path, MIXTRAL)), seq_len=SEQ)
    recipe = Recipe.with_presets(per_device_train_batch_size=4, peft="qlora",
                                 gradient_checkpointing=False).resolved(workload)
    predicted = estimate_memory(workload, recipe, GPU).anatomy
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        model = training_model(workload, recipe, folder)
    kinds, after = measure_step(workload, recipe, model, 4)
    assert predicted.peak_allocated - predicted.functionality == pytest.approx(kinds["Total"], rel=0.03)
    assert predicted.weights == pytest.approx(kinds["PARAM"] + kinds["BUFFER"], rel=0.02)
    assert predicted.optimizer_states == pytest.approx(after["OPT"], rel=0.01)


# -- targets, attention, bad input ---------------------------------------------------------------------------------

def test_targets_peft_lacks_a_default_for_are_all_linear_and_said(tmp_path, tiny_model):
    """PEFT's own default where it has one (llama: q_proj, v_proj, left to PEFT); all-linear where get_peft_model
    finds none (mixtral: its v4-to-v5 conversion empties the default), said in the notes and written into the
    emitted LoraConfig."""
    from anatomist.recipe.spellings import lora_config

    llama = load_workload(str(tiny_model("llama")), seq_len=SEQ)
    assert llama.lora_default_targets() == ("q_proj", "v_proj")
    assert Recipe(peft="lora").resolved(llama).lora_target_modules is None
    mixtral = load_workload(str(_model(tmp_path, MIXTRAL)), seq_len=SEQ)
    assert mixtral.lora_default_targets() is None
    recipe = Recipe(peft="lora", per_device_train_batch_size=1).resolved(mixtral)
    assert recipe.lora_target_modules == LORA_FALLBACK_TARGETS
    assert lora_config(recipe, "causal-lm")["target_modules"] == "all-linear"
    notes = estimate_memory(mixtral, recipe, GPU).notes
    assert any(n.startswith("LoRA targets: PEFT has no default for mixtral models") for n in notes)
    assert any("PEFT adapts mlp.experts.down_proj, mlp.experts.gate_up_proj" in n for n in notes)
    assert Recipe(peft="lora", lora_target_parameters=EXPERTS).resolved(mixtral).lora_target_modules is None


def test_target_parameters_the_model_lacks_are_one_line(cli, tmp_path):
    model = str(_model(tmp_path, MIXTRAL))
    result = cli("estimate", model, "--gpu", "H100", "--seq-len", str(SEQ), "--peft", "lora",
                 "--lora-target-parameters", "mlp.experts.w1")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "anatomist: error: --lora-target-parameters: the model has no parameter mlp.experts.w1; its fused 3D "
        "parameters: mlp.experts.down_proj, mlp.experts.gate_up_proj"]
    dropout = cli("estimate", model, "--gpu", "H100", "--seq-len", str(SEQ), "--peft", "lora", "--lora-dropout", "0.1",
                  "--lora-target-parameters", EXPERTS)
    assert dropout.returncode == 2 and len(dropout.stderr.strip().splitlines()) == 1
    assert "does not work with lora_dropout != 0" in dropout.stderr


def test_target_parameters_from_a_recipe_file_and_trl_s_config(tmp_path):
    from anatomist.recipe.files import read_recipe_file

    ours = tmp_path / "recipe.yaml"
    ours.write_text(f"peft: lora\nlora_target_parameters: {EXPERTS}\n")
    assert read_recipe_file(ours).recipe.lora_target_parameters == EXPERTS
    trl = tmp_path / "sft.yaml"
    trl.write_text("model_name_or_path: Qwen/Qwen3-30B-A3B\nmax_length: 512\nuse_peft: true\n"
                   "lora_target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj]\n")
    assert read_recipe_file(trl).recipe.lora_target_parameters == EXPERTS


def test_default_attention_is_transformers_own(cli):
    """DeBERTa-v2 has no SDPA: transformers' default (attn_implementation unset) falls back to eager, and so does
    the recipe, said in its line; asked for, SDPA is refused in one line as transformers refuses it."""
    deberta = load_workload("deberta-v3-base", seq_len=128)
    assert Recipe().resolved(deberta).attn_implementation == "eager"
    assert Recipe().resolved(load_workload("bert-base-uncased", seq_len=128)).attn_implementation == "sdpa"
    asked = cli("estimate", "deberta-v3-base", "--seq-len", "128", "--attn-implementation", "sdpa")
    assert asked.returncode == 2 and len(asked.stderr.strip().splitlines()) == 1
    assert "does not support an attention implementation through torch.nn.functional.scaled_dot_product" in asked.stderr


@pytest.mark.slow
def test_quantized_classifier_keeps_its_head_out_of_4_bit(tiny_model):
    """transformers skips only the module of the last parameter (an encoder's classifier.bias: nothing), so
    PEFT's modules_to_save would set requires_grad on the 4-bit classifier (a traceback before); the head is
    kept unquantized, as QLoRA users of classifiers do, in the recipe and the emitted BitsAndBytesConfig."""
    from anatomist.recipe.spellings import bnb_config

    workload = load_workload(str(tiny_model("bert", architectures=["BertForSequenceClassification"])), seq_len=SEQ)
    recipe = Recipe.with_presets(peft="qlora", per_device_train_batch_size=1).resolved(workload)
    assert bnb_config(recipe)["llm_int8_skip_modules"] == ["classifier", "score"]
    result = estimate_memory(workload, recipe, GPU)
    assert any(n.startswith("the classifier's head stays unquantized") for n in result.notes)
