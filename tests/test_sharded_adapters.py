"""LoRA and QLoRA sharded: FSDP full_shard and ZeRO-3 shard the frozen base (what fits a 70B model on two
24 GB cards), searched by the plan and written as PEFT's and bitsandbytes' FSDP-QLoRA guides run it.

LoRA under FSDP is checked against PyTorch's FSDPMemTracker in test_fsdp_accuracy.py ("lora+bf16").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from anatomist.anatomy import MemoryCategory
from anatomist.estimate.memory import estimate_memory
from anatomist.estimate.time.collectives import communication_s
from anatomist.hardware import get_gpu
from anatomist.plan import SearchSpace
from anatomist.plan.emit import accelerate_config, write
from anatomist.plan.space import enumerate_recipes, method_of
from anatomist.recipe import Recipe
from anatomist.recipe.axis_values import sharding_of
from anatomist.recipe.spellings import bnb_config, lora_config_kwargs
from anatomist.trace.depth.plan import model_plan
from anatomist.workload_loader import load_workload

GPU = get_gpu("A100-80GB")
QLORA_FSDP = Recipe.with_presets(peft="qlora", fsdp="full_shard", bf16=True, dtype="bfloat16")


def test_the_plan_searches_adapters_with_the_shardings_of_the_base():
    space = SearchSpace(num_gpus=2, global_batch_size=8, optims=("adamw_torch",), compile_options=(False,),
                        checkpointing_options=(True,), methods=("lora", "qlora"))
    found = {(method_of(r), sharding_of(r, 2)) for r in enumerate_recipes(space, GPU)}
    assert {s for _, s in found} == {"ddp", "zero3", "fsdp_full_shard"}
    assert {m for m, _ in found} == {"lora", "qlora"}


@pytest.mark.slow
def test_fsdp_shards_a_qlora_base(tiny_model):
    workload = load_workload(str(tiny_model("llama", hidden_size=256, intermediate_size=512)), seq_len=64)

    def weights(recipe: Recipe, gpus: int) -> int:
        anatomy = estimate_memory(workload, recipe.resolved(workload), GPU, num_gpus=gpus).anatomy
        return anatomy.category_bytes(MemoryCategory.WEIGHTS)

    one = weights(QLORA_FSDP.replace(fsdp="none"), 1)
    assert weights(QLORA_FSDP, 4) < weights(QLORA_FSDP, 2) < one


def test_qlora_under_fsdp_is_written_as_the_fsdp_qlora_guides_run_it(tmp_path: Path):
    import torch
    from accelerate.commands.config.config_args import load_config_from_file
    from transformers import BitsAndBytesConfig

    bnb = BitsAndBytesConfig(**bnb_config(QLORA_FSDP))  # the codes in the float dtype FSDP shards with the rest
    assert bnb.bnb_4bit_quant_storage == torch.bfloat16 == bnb.bnb_4bit_compute_dtype
    assert "bnb_4bit_quant_storage" not in bnb_config(QLORA_FSDP.replace(fsdp="none"))
    path = tmp_path / "accelerate.yaml"
    write(QLORA_FSDP, "accelerate", path, num_gpus=2)
    fsdp = load_config_from_file(str(path)).fsdp_config  # read back by accelerate
    # PEFT's examples/sft/configs/fsdp_config_qlora.yaml loads the base on rank 0 only; FSDP2 needs no use_orig_params
    assert fsdp["fsdp_cpu_ram_efficient_loading"] is True and fsdp["fsdp_version"] == 2
    assert accelerate_config(QLORA_FSDP.replace(offload="cpu"), 2)["fsdp_config"]["fsdp_offload_params"] is True
    assert accelerate_config(Recipe(fsdp="full_shard"), 2)["fsdp_config"]["fsdp_cpu_ram_efficient_loading"] is False


def test_a_sharded_base_is_gathered_every_step(tiny_model):
    """Under full_shard every weight, the frozen base's included, is all-gathered in forward and backward: two
    ring all-gathers ((N-1)/N x the bytes each: the linear layers' 4-bit codes, 0.5 B per weight, the rest in
    bf16, the adapters included) beside the adapters' reduce-scatter ((N-1)/N x their fp32 gradients, half
    the all-reduce's volume). The model counted here as bitsandbytes stores it, independently of anatomist."""
    from anatomist.estimate.time.constants import constants

    workload = load_workload(str(tiny_model("llama")), seq_len=64)
    recipe = QLORA_FSDP.resolved(workload)
    bus = constants()["interconnect"]["bus_gbps"] * 1e9
    ring = (4 - 1) / 4
    size = model_plan(workload, recipe).size
    all_reduce = communication_s(recipe.replace(fsdp="none"), size, num_gpus=4)  # 2 x ring x gradient bytes
    gradient_bytes = all_reduce * bus / (2 * ring)
    import torch
    from peft import LoraConfig, get_peft_model

    model = workload.build_model()
    linear = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head"))  # bitsandbytes skips the head
    adapters = get_peft_model(model, LoraConfig(**lora_config_kwargs(recipe, "CAUSAL_LM")))
    rest = sum(p.numel() for p in adapters.parameters()) - linear
    gathered = 0.5 * linear + 2 * rest
    expected = ring * (gradient_bytes + 2 * gathered) / bus
    assert communication_s(recipe, size, num_gpus=4) == pytest.approx(expected, rel=1e-9)
