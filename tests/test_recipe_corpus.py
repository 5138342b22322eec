"""Every training config vendored in tests/data (README.md there: source, commit, outcome), read or refused in one line.

Each file is a case, named by its path: `Read` lists what `--recipe FILE` must make of it (the Recipe fields the file
sets or its tool's defaults settle, its model, tokens per sample, devices and machines), `Refused` the key its one
line names and why. The values are the files' own (open the file beside the case); where a tool's default decides,
the reader's docstring cites it. Where the file's own tool is installed, it is asked too: DeepSpeed parses each ds_config
(its "auto" values filled by transformers' own HfTrainerDeepSpeedConfig) and must refuse exactly the files marked
`tool_refuses`; accelerate launch reads each accelerate config and must agree on the devices, machines, precision and
engine; TRL's parser reads its example. Reading a file is fast; estimating is not, so only a few files are estimated,
on a tiny stand-in model, and those are marked slow.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from anatomist.errors import InputError
from anatomist.recipe.files import read_recipe_file

DATA = Path(__file__).parent / "data"
LIBRARY_SOURCE = ("liger_kernel_0_8_5", "cut_cross_entropy_5f0c7a7")
"""Pinned library source kept in tests/data beside the configs (their own README and tests)."""


@dataclasses.dataclass(frozen=True)
class Read:
    """The file reads: as `kind`, with these Recipe `fields` (the rest at their defaults or not checked here)."""

    kind: str
    fields: dict[str, Any]
    model: str | None = None
    seq_len: int | None = None
    num_gpus: int | None = None
    nodes: int | None = None
    note: str = ""
    """What the README's outcome column adds (a limitation, where the read leaves one)."""


@dataclasses.dataclass(frozen=True)
class Refused:
    """The file is refused in one line naming `key`, saying `reason` (a fragment of the line)."""

    key: str
    reason: str
    why: str
    """The outcome in a few words, for the README."""
    tool_refuses: bool = False
    """The file's own tool refuses it too (checked where the tool is installed)."""


BF16 = {"bf16": True}
AXOLOTL_BF16 = {"bf16": True, "dtype": "bfloat16"}  # bf16: auto/true: autocast and weights loaded in bfloat16
QLORA = {"peft": "qlora", "load_in_4bit": True, "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"}
PACKED = {"packing": True, "padding_free": True, "attn_implementation": "flash_attention_2"}
LF_LORA = {"peft": "lora", "lora_r": 8, "lora_alpha": 16, "lora_target_modules": "all-linear", "bf16": True,
           "dtype": "bfloat16", "gradient_checkpointing": True}
"""LLaMA-Factory's LoRA defaults (rank 8, alpha 2 x rank, every linear layer, checkpointing on) in bf16."""
TRL_DEFAULTS = {"gradient_checkpointing": True, "bf16": True, "lora_dropout": 0.05}
"""What TRL's SFTConfig/DPOConfig and ModelConfig turn on where a file is silent."""
PARALLEL = "would be predicted as plain data parallel"

CASES: dict[str, Read | Refused] = {
    # -- accelerate: its own example templates, DeepSpeed templates and test configs --------------------------------
    "accelerate/examples/config_yaml_templates/deepspeed.yaml": Read(
        "accelerate", {"zero_stage": 1, "fp16": True}, num_gpus=2,
        note="its deepspeed_config_file (zero_stage1_config.json) sets ZeRO-1 and fp16"),
    "accelerate/examples/config_yaml_templates/fp8.yaml": Refused(
        "fp8_config.backend", "fp8_config.backend=TE is not modelled", "Transformer Engine's FP8"),
    "accelerate/examples/config_yaml_templates/fsdp.yaml": Read("accelerate", {"fsdp": "full_shard", **BF16}, num_gpus=2),
    "accelerate/examples/config_yaml_templates/multi_gpu.yaml": Read("accelerate", BF16, num_gpus=2),
    "accelerate/examples/config_yaml_templates/multi_node.yaml": Read("accelerate", {"bf16": False}, num_gpus=8, nodes=2),
    "accelerate/examples/config_yaml_templates/single_accelerator.yaml": Read("accelerate", BF16),
    "accelerate/examples/deepspeed_config_templates/zero_stage1_config.json": Read(
        "DeepSpeed", {"zero_stage": 1, "fp16": True, "allgather_bucket_size": 200_000_000}),
    "accelerate/examples/deepspeed_config_templates/zero_stage2_config.json": Read(
        "DeepSpeed", {"zero_stage": 2, "fp16": True, "offload": "none"}),
    "accelerate/examples/deepspeed_config_templates/zero_stage2_offload_config.json": Read(
        "DeepSpeed", {"zero_stage": 2, "fp16": True, "offload": "cpu"}),
    "accelerate/examples/deepspeed_config_templates/zero_stage3_config.json": Read(
        "DeepSpeed", {"zero_stage": 3, "fp16": True, "offload": "none", "stage3_max_live_parameters": 1_000_000_000}),
    "accelerate/examples/deepspeed_config_templates/zero_stage3_offload_config.json": Read(
        "DeepSpeed", {"zero_stage": 3, "fp16": True, "offload": "cpu"}),
    "accelerate/examples/torch_native_parallelism/configs/cp.yaml": Read(
        "accelerate", {"fsdp": "full_shard", "cp_size": 8, "gradient_checkpointing": True, **BF16}, num_gpus=8),
    "accelerate/examples/torch_native_parallelism/configs/tp_hsdp.yaml": Refused(  # its HSDP replicas are read
        "tensor parallel 2 under accelerate's FSDP2", "is not modelled", "tensor parallel under accelerate's FSDP2"),
    "accelerate/tests/deepspeed/ds_config_zero2.json": Read("DeepSpeed", {"zero_stage": 2, "offload": "cpu"}),
    "accelerate/tests/test_configs/0_12_0.yaml": Read("accelerate", {"fsdp": "none", "zero_stage": 0}, num_gpus=1,
                                                      note="accelerate 0.12's format"),
    "accelerate/tests/test_configs/invalid_keys.yaml": Refused(
        "unknown key invalid_key", "accelerate launch refuses it too", "keys ClusterConfig lacks", tool_refuses=True),
    "accelerate/tests/test_configs/latest.yaml": Read("accelerate", {"bf16": False, "fp16": False}, num_gpus=1),
    "accelerate/tests/test_configs/latest_fsdp.yaml": Read("accelerate", {"fsdp": "full_shard", "offload": "none"},
                                                           num_gpus=1),
    # -- alignment handbook recipes (TRL's parsers with the handbook's own arguments) --------------------------------
    "alignment-handbook/accelerate_configs_ddp.yaml": Read("accelerate", BF16, num_gpus=8),
    "alignment-handbook/accelerate_configs_fsdp.yaml": Read("accelerate", {"fsdp": "full_shard", **BF16}, num_gpus=8),
    "alignment-handbook/accelerate_configs_zero3.yaml": Read("accelerate", {"zero_stage": 3, **BF16}, num_gpus=8),
    "alignment-handbook/constitutional-ai_dpo_config_anthropic.yaml": Refused(
        "unknown optim 'rmsprop'", "known: adamw_torch", "optim rmsprop: an optimizer not modelled"),
    "alignment-handbook/pref_align_scan_dpo_config_zephyr.yaml": Read(
        "TRL", {"trainer": "dpo", "dtype": "float32", "gradient_accumulation_steps": 2, "optim": "adamw_torch",
                **TRL_DEFAULTS}, model="alignment-handbook/zephyr-7b-sft-full", seq_len=1024),
    "alignment-handbook/smollm2_dpo_config.yaml": Read(
        "TRL", {"trainer": "dpo", "dtype": "bfloat16", "per_device_train_batch_size": 2, "gradient_accumulation_steps": 8,
                **TRL_DEFAULTS}, model="loubnabnl/smollm2-1.7B-sft", seq_len=1024),
    "alignment-handbook/smollm2_sft_config.yaml": Read(
        "TRL", {"trainer": "sft", "dtype": "bfloat16", "per_device_train_batch_size": 4, "gradient_accumulation_steps": 4,
                "attn_implementation": "flash_attention_2", **TRL_DEFAULTS}, model="HuggingFaceTB/SmolLM2-1.7B", seq_len=8192),
    "alignment-handbook/smollm3_dpo_apo.yaml": Refused(
        "DPOTrainer (trl 1.16) has no padding-free training", "leave padding_free and packing off",
        "padding_free with DPO, which trl 1.16 trains padded"),
    "alignment-handbook/smollm3_sft_mid.yaml": Read(
        "TRL", {"trainer": "sft", "use_liger_kernel": True, "packing": True, "padding_free": True, "max_grad_norm": 0.2},
        model="HuggingFaceTB/SmolLM3-3B-Base", seq_len=32768),
    "alignment-handbook/smollm3_sft_sft.yaml": Read(
        "TRL", {"trainer": "sft", "use_liger_kernel": True, "packing": True, "padding_free": True, "max_grad_norm": 0.2,
                "gradient_accumulation_steps": 2}, model="HuggingFaceTB/SmolLM3-3B-checkpoints", seq_len=65536),
    "alignment-handbook/starchat2-15b_sft_config_v0.1.yaml": Read(
        "TRL", {"trainer": "sft", "dtype": "bfloat16", "gradient_accumulation_steps": 2, **TRL_DEFAULTS},
        model="bigcode/starcoder2-15b", seq_len=2048),
    "alignment-handbook/zephyr-141b-A35b_orpo_config_full.yaml": Read(
        "TRL", {"trainer": "dpo", "optim": "adamw_bnb_8bit", "dtype": "bfloat16"},
        model="mistral-community/Mixtral-8x22B-v0.1", seq_len=2048,
        note="as trl dpo: nothing in it is ORPOConfig's alone (the handbook picks ORPO by its script), so a reference "
             "model ORPO does not keep is predicted; a known limitation"),
    "alignment-handbook/zephyr-7b-beta_dpo_config_full.yaml": Read(
        "TRL", {"trainer": "dpo", "dtype": "float32", "gradient_accumulation_steps": 2},
        model="alignment-handbook/zephyr-7b-sft-full", seq_len=1024),
    "alignment-handbook/zephyr-7b-beta_dpo_config_qlora.yaml": Read(
        "TRL", {"trainer": "dpo", "peft": "lora", "load_in_4bit": True, "lora_r": 128, "lora_alpha": 128,
                "optim": "paged_adamw_32bit", "per_device_train_batch_size": 4, "gradient_accumulation_steps": 4},
        model="alignment-handbook/zephyr-7b-sft-qlora", seq_len=1024),
    "alignment-handbook/zephyr-7b-beta_sft_config_full.yaml": Read(
        "TRL", {"trainer": "sft", "per_device_train_batch_size": 16, "dtype": "bfloat16", **TRL_DEFAULTS},
        model="mistralai/Mistral-7B-v0.1", seq_len=2048),
    "alignment-handbook/zephyr-7b-beta_sft_config_qlora.yaml": Read(
        "TRL", {"trainer": "sft", "peft": "lora", "load_in_4bit": True, "per_device_train_batch_size": 4,
                "lora_target_modules": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"},
        model="mistralai/Mistral-7B-v0.1", seq_len=2048),
    # -- axolotl examples and DeepSpeed configs ----------------------------------------------------------------------
    "axolotl/32b-qlora.yaml": Refused(
        "gradient_checkpointing='offload' with an adapter", "axolotl's own variant of TRL's offloader",
        "activation offload with an adapter"),
    "axolotl/3b-fp8-fsdp2.yaml": Refused(  # its fp8 and float8 all-gather are read; Liger's plugin under compile is not
        "use_liger_kernel with torch_compile", "Liger's kernels stand in as custom ops", "Liger's kernels with torch.compile"),
    "axolotl/3b-qat-mxfp4.yaml": Refused("qat", "quantization-aware training", "quantization-aware training"),
    "axolotl/8b-qat-fsdp2.yml": Refused("qat", "quantization-aware training", "quantization-aware training"),
    "axolotl/bigstral-ds-zero3.yaml": Refused(
        "unfrozen_parameters=", "the rest frozen", "unfrozen_parameters: a frozen subset"),
    "axolotl/deepseek-v2-fft-fsdp-16b.yaml": Read(
        "axolotl", {"fsdp": "full_shard", "offload": "cpu", "gradient_accumulation_steps": 8, **AXOLOTL_BF16, **PACKED},
        model="deepseek-ai/DeepSeek-V2-Lite", seq_len=2048),
    "axolotl/deepspeed_configs/zero1.json": Read("DeepSpeed", {"zero_stage": 1, "reduce_bucket_size": 500_000_000}),
    "axolotl/deepspeed_configs/zero1_torch_compile.json": Refused(
        "unknown key compile.disable", "not a key of DeepSpeed's compile section", "compile.disable/backend: keys "
        "DeepSpeed 0.19's compile section forbids", tool_refuses=True),
    "axolotl/deepspeed_configs/zero2.json": Read("DeepSpeed", {"zero_stage": 2, "offload": "cpu"}),
    "axolotl/deepspeed_configs/zero3.json": Read("DeepSpeed", {"zero_stage": 3, "offload": "none"}),
    "axolotl/deepspeed_configs/zero3_bf16.json": Read("DeepSpeed", {"zero_stage": 3, **BF16}),
    "axolotl/deepspeed_configs/zero3_bf16_cpuoffload_all.json": Read("DeepSpeed", {"zero_stage": 3, "offload": "cpu",
                                                                                   **BF16}),
    "axolotl/deepspeed_configs/zero3_bf16_cpuoffload_params.json": Refused(
        "zero_optimization.offload_optimizer.device='none' with zero_optimization.offload_param.device='cpu'",
        "offloads optimizer states and parameters to the same device", "parameters offloaded without the optimizer"),
    "axolotl/falcon-e-3b-dpo.yaml": Refused("use_onebitllms=True", "BitNet's ternary linear layers", "BitNet layers"),
    "axolotl/fft-8b.yaml": Read(
        "axolotl", {"peft": "none", "optim": "paged_adamw_8bit", "gradient_accumulation_steps": 8, **AXOLOTL_BF16,
                    **PACKED}, model="NousResearch/Meta-Llama-3.1-8B", seq_len=8192),
    "axolotl/fft-8b-liger-fsdp.yaml": Read(
        "axolotl", {"fsdp": "full_shard", "offload": "cpu", "use_liger_kernel": True, "per_device_train_batch_size": 2,
                    **AXOLOTL_BF16, **PACKED}, model="NousResearch/Meta-Llama-3.1-8B", seq_len=4096),
    "axolotl/gemma-3-1b-qlora.yml": Refused("unfrozen_parameters=", "the rest frozen",
                                            "unfrozen_parameters: a frozen subset"),
    "axolotl/gemma2-qlora.yml": Read(
        "axolotl", {**QLORA, "lora_r": 32, "lora_alpha": 16, "lora_target_modules": "all-linear", **AXOLOTL_BF16,
                    **PACKED}, model="google/gemma-2-9b", seq_len=2048),
    "axolotl/gpt-oss-20b-fft-deepspeed-zero3.yaml": Refused(
        "unknown attn_implementation 'kernels-community/vllm-flash-attn3'", "known: eager, sdpa, flash_attention_2",
        "a Hub kernel's attention (FlashAttention 3)"),
    "axolotl/gpt-oss-20b-fft-fsdp2.yaml": Refused(
        "activation_offloading under FSDP is not modelled yet", "use DeepSpeed ZeRO", "activation offload under FSDP"),
    "axolotl/instruct-dpo-lora-8b.yml": Read(
        "axolotl", {"trainer": "dpo", "peft": "lora", "load_in_8bit": True, "lora_r": 32},
        model="meta-llama/Meta-Llama-3-8B-Instruct", seq_len=4096),
    "axolotl/instruct-lora-8b.yml": Read(
        "axolotl", {"peft": "lora", "load_in_8bit": True, "lora_r": 32, "lora_target_modules": "all-linear",
                    "packing": False, **AXOLOTL_BF16}, model="NousResearch/Meta-Llama-3-8B-Instruct", seq_len=4096),
    "axolotl/jamba-qlora_deepspeed.yaml": Read(
        "axolotl", {**QLORA, "zero_stage": 2, "offload": "cpu", "lora_r": 8, "optim": "paged_adamw_8bit"},
        model="ai21labs/Jamba-v0.1", seq_len=4096),
    "axolotl/llama-2-gptq-lora.yml": Refused("gptq=True", "GPTQ", "a GPTQ-quantized base"),
    "axolotl/llama-2-lisa.yml": Refused("lisa_n_layers=4", "the rest frozen", "LISA: a few layers trained at a time"),
    "axolotl/llama-3-qlora.yml": Read(
        "axolotl", {**QLORA, "lora_r": 32, "optim": "paged_adamw_32bit", **AXOLOTL_BF16, **PACKED},
        model="NousResearch/Meta-Llama-3-8B", seq_len=4096),
    "axolotl/llama-3_1-8b-hsdp-tp.yaml": Refused("tensor_parallel_size=2", "tensor parallel", "tensor parallel"),
    "axolotl/llama3-8b-deepspeed-alst.yaml": Refused("context_parallel_size=8", "axolotl's context parallel",
                                                     "axolotl's context parallel"),
    "axolotl/lora-1b.yml": Read(
        "axolotl", {"peft": "lora", "lora_r": 16, "optim": "adamw_bnb_8bit", **AXOLOTL_BF16, **PACKED},
        model="NousResearch/Llama-3.2-1B", seq_len=2048),
    "axolotl/lora-8b.yml": Refused("lora_modules_to_save=", "whole modules trained beside the adapter",
                                   "lora_modules_to_save: embeddings and head trained in full"),
    "axolotl/mistral-dpo-qlora.yml": Refused("lora_modules_to_save=", "whole modules trained beside the adapter",
                                             "lora_modules_to_save: embeddings and head trained in full"),
    "axolotl/mistral-lora.yml": Read(
        "axolotl", {"peft": "lora", "load_in_8bit": True, "lora_r": 32, "per_device_train_batch_size": 2, **AXOLOTL_BF16,
                    **PACKED}, model="mistralai/Mistral-7B-v0.1", seq_len=8192),
    "axolotl/mistral-qlora-orpo.yml": Refused("rl='orpo'", "is not modelled", "ORPO"),
    "axolotl/mixtral-qlora-fsdp.yml": Read(
        "axolotl", {**QLORA, "fsdp": "full_shard", "offload": "cpu", "lora_r": 32}, model="mistralai/Mixtral-8x7B-v0.1",
        seq_len=1024),
    "axolotl/mixtral.yml": Read(
        "axolotl", {**QLORA, "zero_stage": 2, "offload": "cpu", "gradient_accumulation_steps": 2, **PACKED},
        model="mistralai/Mixtral-8x7B-v0.1", seq_len=4096, note="its deepspeed_configs/zero2.json: ZeRO-2, optimizer "
                                                                  "on the CPU"),
    "axolotl/mixtral_22.yml": Refused("unfrozen_parameters=", "the rest frozen", "unfrozen_parameters: a frozen subset"),
    "axolotl/muon-pretrain-fsdp2.yaml": Refused("unknown optim 'muon'", "(from optimizer)", "optimizer muon"),
    "axolotl/phi3-ft-fsdp.yml": Read(
        "axolotl", {"peft": "none", "fsdp": "full_shard", "offload": "cpu", "per_device_train_batch_size": 12,
                    **AXOLOTL_BF16, **PACKED}, model="microsoft/Phi-3-mini-4k-instruct", seq_len=4096),
    "axolotl/qlora-1b-gdpo.yaml": Refused("rl='gdpo'", "is not modelled", "GDPO"),
    "axolotl/qlora-1b-kto.yaml": Refused("rl='kto'", "is not modelled", "KTO"),
    "axolotl/qlora-1b.yml": Read(
        "axolotl", {**QLORA, "lora_r": 32, **PACKED}, model="NousResearch/Llama-3.2-1B", seq_len=2048),
    "axolotl/qlora-fsdp-70b.yaml": Read(
        "axolotl", {**QLORA, "fsdp": "full_shard", "offload": "cpu", "lora_r": 8}, model="casperhansen/llama-3-70b-fp16",
        seq_len=512),
    "axolotl/qwen2-dpo.yaml": Read("axolotl", {"trainer": "dpo", "peft": "none"}, model="Qwen/Qwen2.5-0.5B",
                                   seq_len=2048),
    "axolotl/qwen3-qlora-fsdp.yaml": Read(
        "axolotl", {**QLORA, "fsdp": "full_shard", "offload": "cpu", "lora_r": 32, "lora_alpha": 64, **PACKED},
        model="Qwen/Qwen3-8B", seq_len=2048),
    "axolotl/qwen3-reward-model.yaml": Refused("reward_model=True", "reward modelling", "a reward model"),
    "axolotl/sparse-finetuning.yaml": Refused(
        "plugins='axolotl.integrations.llm_compressor.LLMCompressorPlugin'", "sparse fine-tuning",
        "LLM Compressor's sparse fine-tuning"),
    "axolotl/v4-flash-nvfp4-lora.yaml": Read(
        "axolotl", {"peft": "lora", "fsdp": "full_shard", "cut_cross_entropy": True, "attn_implementation": "eager"},
        model="nvidia/DeepSeek-V4-Flash-NVFP4", seq_len=4096,
        note="lora_target_parameters (adapters on the experts) and the NVFP4 checkpoint are named as not modelled"),
    # -- DeepSpeedExamples ------------------------------------------------------------------------------------------
    "deepspeedexamples/training/BingBertSquad/1-bit_adam/nccl/deepspeed_onebitadam_bsz96_config.json": Refused(
        "optimizer.type='OnebitAdam'", "an optimizer anatomist does not model", "1-bit Adam"),
    "deepspeedexamples/training/DeepSpeed-ZenFlow/finetuning/zf_config.json": Refused(
        "zero_optimization.zenflow=", "ZenFlow", "ZenFlow"),
    "deepspeedexamples/training/autotuning/hf/dsconfigs/ds_config_fp16_z3.json": Read(
        "DeepSpeed", {"zero_stage": 3, "fp16": True, "stage3_param_persistence_threshold": 100_000}),
    "deepspeedexamples/training/autotuning/hf/dsconfigs/ds_config_z2.json": Read("DeepSpeed", {"zero_stage": 2}),
    "deepspeedexamples/training/bing_bert/deepspeed_bsz64k_lamb_config_seq128.json": Refused(
        "sparse_attention", "DeepSpeed Sparse Attention has been removed", "sparse_attention, which DeepSpeed removed",
        tool_refuses=True),
    "deepspeedexamples/training/imagenet/config/ds_fp16_z1_config.json": Read(
        "DeepSpeed", {"zero_stage": 1, "fp16": True, "max_grad_norm": 0},
        note="its cuda_visible_devices, a key DeepSpeed ignores, is ignored too"),
    "deepspeedexamples/training/tensor_parallel/hf_integration/configs/ds_config.json": Refused(
        "tensor_parallel.autotp_size=4", "tensor parallel", "tensor parallel (AutoTP)"),
    # -- LLaMA-Factory examples -------------------------------------------------------------------------------------
    "llamafactory/badam_llama3_full_sft.yaml": Refused("use_badam=True", "an optimizer anatomist does not model",
                                                       "BAdam"),
    "llamafactory/examples/accelerate/fsdp2_config.yaml": Read("accelerate", {"fsdp": "full_shard", **BF16}, num_gpus=2),
    "llamafactory/examples/accelerate/fsdp_config.yaml": Read("accelerate", {"fsdp": "full_shard", **BF16}, num_gpus=2),
    "llamafactory/examples/accelerate/fsdp_config_offload.yaml": Read(
        "accelerate", {"fsdp": "full_shard", "offload": "cpu", **BF16}, num_gpus=2),
    "llamafactory/examples/deepspeed/ds_z0_config.json": Read("DeepSpeed", {"zero_stage": 0}),
    "llamafactory/examples/deepspeed/ds_z2_autotp_config.json": Refused(
        "tensor_parallel.autotp_size=2", "tensor parallel", "tensor parallel (AutoTP)"),
    "llamafactory/examples/deepspeed/ds_z2_config.json": Read("DeepSpeed", {"zero_stage": 2, "offload": "none"}),
    "llamafactory/examples/deepspeed/ds_z2_offload_config.json": Read("DeepSpeed", {"zero_stage": 2, "offload": "cpu"}),
    "llamafactory/examples/deepspeed/ds_z3_config.json": Read("DeepSpeed", {"zero_stage": 3, "offload": "none"}),
    "llamafactory/examples/deepspeed/ds_z3_fp8_config.json": Refused(
        "zero_optimization.offload_optimizer.device='cpu' with zero_optimization.offload_param.device='none'",
        "offloads optimizer states and parameters to the same device", "optimizer offloaded without the parameters"),
    "llamafactory/examples/deepspeed/ds_z3_offload_config.json": Read("DeepSpeed", {"zero_stage": 3, "offload": "cpu"}),
    "llamafactory/fsdp_qlora_llama3_lora_sft.yaml": Read(
        "LLaMA-Factory", {**LF_LORA, "load_in_4bit": True, "bnb_4bit_use_double_quant": True},
        model="meta-llama/Meta-Llama-3-8B-Instruct", seq_len=2048),
    "llamafactory/galore_llama3_full_sft.yaml": Refused("use_galore=True", "an optimizer anatomist does not model",
                                                        "GaLore"),
    "llamafactory/llama3_fp8_deepspeed_sft.yaml": Refused("fp8=True", "FP8 training", "fp8 training"),
    "llamafactory/llama3_lora_sft_gptq.yaml": Read(
        "LLaMA-Factory", LF_LORA, model="TechxGenus/Meta-Llama-3-8B-Instruct-GPTQ", seq_len=2048,
        note="its model is a GPTQ checkpoint, said by the model, not the file; estimate stops at the name (not in the "
             "catalog)"),
    "llamafactory/llama_pro_llama3_freeze_sft.yaml": Refused("finetuning_type='freeze'", "modelled: lora, full",
                                                             "freeze tuning"),
    "llamafactory/mossvl_full_sft.yaml": Read(
        "LLaMA-Factory", {"peft": "none", "dtype": "float32", "zero_stage": 3}, model="OpenMOSS-Team/MOSS-VL-Instruct-0708",
        seq_len=4096),
    "llamafactory/pissa_llama3_lora_sft.yaml": Read(
        "LLaMA-Factory", LF_LORA, model="meta-llama/Meta-Llama-3-8B-Instruct", seq_len=2048,
        note="PiSSA's initialisation named as not modelled (the adapters it trains are LoRA's)"),
    "llamafactory/qwen3_full_sft.yaml": Read(
        "LLaMA-Factory", {"peft": "none", "dtype": "float32", "bf16": True, "zero_stage": 3},
        model="Qwen/Qwen3-4B-Instruct-2507", seq_len=2048),
    "llamafactory/qwen3_lora_dpo.yaml": Refused("stage='dpo'", "modelled: sft, pt",
                                                "DPO stage (its own trainer: fp32 logits, reference log-probabilities)"),
    "llamafactory/qwen3_lora_kto.yaml": Refused("stage='kto'", "modelled: sft, pt", "KTO stage (its own trainer)"),
    "llamafactory/qwen3_lora_pretrain.yaml": Read("LLaMA-Factory", LF_LORA, model="Qwen/Qwen3-4B-Instruct-2507",
                                                  seq_len=2048),
    "llamafactory/qwen3_lora_reward.yaml": Refused("stage='rm'", "a value head", "reward model stage"),
    "llamafactory/qwen3_lora_sft.yaml": Read("LLaMA-Factory", LF_LORA, model="Qwen/Qwen3-4B-Instruct-2507",
                                             seq_len=2048),
    "llamafactory/qwen3_lora_sft_bnb_npu.yaml": Read(
        "LLaMA-Factory", {**LF_LORA, "load_in_4bit": True, "bnb_4bit_use_double_quant": False},
        model="Qwen/Qwen3-4B-Instruct-2507", seq_len=2048),
    "llamafactory/qwen3_lora_sft_ds3.yaml": Read(
        "LLaMA-Factory", {**LF_LORA, "zero_stage": 3}, model="Qwen/Qwen3-4B-Instruct-2507", seq_len=2048),
    "llamafactory/qwen3_lora_sft_otfq.yaml": Read(
        "LLaMA-Factory", {**LF_LORA, "load_in_4bit": True, "bnb_4bit_use_double_quant": True},
        model="Qwen/Qwen3-4B-Instruct-2507", seq_len=2048),
    "llamafactory/qwen3vl_full_sft.yaml": Read(
        "LLaMA-Factory", {"peft": "none", "dtype": "float32", "zero_stage": 3}, model="Qwen/Qwen3-VL-4B-Instruct",
        seq_len=2048, note="freeze_vision_tower named as not modelled"),
    # -- PEFT, transformers, TRL ------------------------------------------------------------------------------------
    "peft/deepspeed_config_z3_qlora.yaml": Read("accelerate", {"zero_stage": 3, **BF16}, num_gpus=2),
    "peft/fsdp_config_qlora.yaml": Read("accelerate", {"fsdp": "full_shard", "offload": "cpu"}, num_gpus=2),
    "transformers/ds_config_zero2.json": Read("DeepSpeed", {"zero_stage": 2, "offload": "cpu",
                                                            "reduce_bucket_size": 200_000_000}),
    "transformers/ds_config_zero3.json": Refused(
        "zero_optimization.reduce_bucket_size must be a whole number > 0", "refuses 0",
        "reduce_bucket_size 0, which deepspeed 0.19.8 refuses", tool_refuses=True),
    "trl/examples/accelerate_configs/alst_ulysses_4gpu.yaml": Read(  # its dp_shard_size 2 is DeepSpeed's data parallel
        "accelerate", {"zero_stage": 3, "sp_size": 2, "attn_implementation": "flash_attention_2", **BF16}, num_gpus=4),
    "trl/examples/accelerate_configs/context_parallel_2gpu.yaml": Read(
        "accelerate", {"fsdp": "full_shard", "cp_size": 2, "gradient_checkpointing": True, **BF16}, num_gpus=2),
    "trl/examples/accelerate_configs/deepspeed_zero1.yaml": Read("accelerate", {"zero_stage": 1, **BF16}, num_gpus=8),
    "trl/examples/accelerate_configs/deepspeed_zero2.yaml": Read("accelerate", {"zero_stage": 2, **BF16}, num_gpus=8),
    "trl/examples/accelerate_configs/fsdp1.yaml": Read("accelerate", {"fsdp": "full_shard", **BF16}, num_gpus=8),
    "trl/examples/accelerate_configs/multi_gpu.yaml": Read("accelerate", BF16, num_gpus=8),
    "trl/examples/accelerate_configs/single_gpu.yaml": Read("accelerate", BF16, num_gpus=1),
    "trl/examples/cli_configs/example_config.yaml": Read(
        "TRL", {"trainer": "sft", "dtype": "float32", **TRL_DEFAULTS}, model="Qwen/Qwen2.5-0.5B", seq_len=1024),
    "trl/fsdp2.yaml": Read("accelerate", {"fsdp": "full_shard", **BF16}, num_gpus=8),
    "trl/zero3.yaml": Read("accelerate", {"zero_stage": 3, **BF16}, num_gpus=8),
}


def _configs() -> list[str]:
    """Every config file under tests/data (the pinned library source aside), as CASES names them."""
    return sorted(str(path.relative_to(DATA)) for path in DATA.rglob("*") if path.suffix in (".yaml", ".yml", ".json")
                  and path.parts[len(DATA.parts)] not in LIBRARY_SOURCE)


def test_every_vendored_config_is_a_case() -> None:
    assert _configs() == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_real_config_is_read_or_refused_in_one_line(name: str) -> None:
    path, case = DATA / name, CASES[name]
    if isinstance(case, Refused):
        with pytest.raises(InputError) as error:
            read_recipe_file(path)
        line = str(error.value)
        assert "\n" not in line and line.startswith(f"{path}: {case.key}"), line
        assert case.reason in line, line
        return
    source = read_recipe_file(path)
    assert source.kind == case.kind
    assert (source.model, source.seq_len, source.num_gpus, source.nodes) == (case.model, case.seq_len, case.num_gpus,
                                                                             case.nodes)
    assert {field: getattr(source.recipe, field) for field in case.fields} == case.fields


@pytest.mark.parametrize("name", sorted(name for name, case in CASES.items() if isinstance(case, Refused)))
def test_a_refused_config_is_one_line_and_exit_2(cli, name: str) -> None:
    path = DATA / name
    result = cli("estimate", "--recipe", str(path))
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"anatomist: error: {path}: {CASES[name].key}"), line  # type: ignore[union-attr]


# -- the tools' own reading ------------------------------------------------------------------------------------------

def _deepspeed_refusal(path: Path) -> str | None:
    """What DeepSpeed says of a ds_config (None: it takes it), its "auto" values first filled by transformers'
    HfTrainerDeepSpeedConfig from TrainingArguments that agree with the file's own values (DeepSpeedExamples' configs
    name a global batch of several GPUs and their own learning rates)."""
    import contextlib
    import io

    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    config = json.loads(path.read_text())
    filler = HfTrainerDeepSpeedConfig(config)
    try:
        args = _training_arguments_agreeing_with(config)
        filler.trainer_config_process(args)
        filler.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=64)),
                                       _number(config.get("scheduler", {}).get("params", {}).get("total_num_steps"), 10))
        with contextlib.redirect_stdout(io.StringIO()):
            DeepSpeedConfig(filler.config)
    except Exception as error:  # DeepSpeedConfigError, pydantic's ValidationError, ValueError
        return f"{type(error).__name__}: {error}"
    finally:
        unset_hf_deepspeed_config()
    return None


def _number(value: Any, default: Any) -> Any:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _training_arguments_agreeing_with(config: dict[str, Any]) -> SimpleNamespace:
    """TrainingArguments' defaults (its fields, not its __post_init__, which refuses fp16 on a CPU) where the file says
    "auto", the file's own values where it sets them."""
    from transformers import TrainingArguments

    fields = {f.name: f.default for f in dataclasses.fields(TrainingArguments) if f.default is not dataclasses.MISSING}
    micro = _number(config.get("train_micro_batch_size_per_gpu"), 1)
    accumulation = _number(config.get("gradient_accumulation_steps"), 1)
    optimizer = config.get("optimizer", {}).get("params", {})
    scheduler = config.get("scheduler", {}).get("params", {})
    betas = optimizer.get("betas") if isinstance(optimizer.get("betas"), list) else [0.9, 0.999]
    warmup = _number(scheduler.get("warmup_num_steps"), 0)
    return SimpleNamespace(**{
        **fields, "per_device_train_batch_size": micro, "gradient_accumulation_steps": accumulation,
        "world_size": _number(config.get("train_batch_size"), micro * accumulation) // (micro * accumulation),
        "max_grad_norm": _number(config.get("gradient_clipping"), fields["max_grad_norm"]),
        "learning_rate": _number(optimizer.get("lr"), _number(scheduler.get("warmup_max_lr"), fields["learning_rate"])),
        "adam_beta1": betas[0], "adam_beta2": betas[1], "adam_epsilon": _number(optimizer.get("eps"), 1e-8),
        "weight_decay": _number(optimizer.get("weight_decay"), 0.0),
        "fp16": (config.get("fp16") or {}).get("enabled") is True, "bf16": (config.get("bf16") or {}).get("enabled") is True,
        "get_warmup_steps": lambda steps: warmup})


DEEPSPEED_FILES = sorted(name for name in CASES if name.endswith(".json"))


@pytest.mark.parametrize("name", DEEPSPEED_FILES)
def test_deepspeed_itself_refuses_exactly_the_files_marked_so(name: str) -> None:
    import deepspeed

    from anatomist.recipe.files.known import deepspeed_release

    if deepspeed.__version__ != deepspeed_release():
        pytest.skip(f"the keys anatomist knows are deepspeed {deepspeed_release()}'s")
    case = CASES[name]
    refusal = _deepspeed_refusal(DATA / name)
    assert (refusal is not None) == (isinstance(case, Refused) and case.tool_refuses), refusal


def _accelerate_files() -> list[str]:
    from anatomist.recipe.files.accelerate import looks_like_accelerate

    return sorted(name for name in CASES if name.endswith((".yaml", ".yml"))
                  and looks_like_accelerate(yaml.safe_load((DATA / name).read_text())))


ACCELERATE_FILES = _accelerate_files()


@pytest.mark.parametrize("name", ACCELERATE_FILES)
def test_accelerate_launch_reads_the_same_devices_precision_and_engine(name: str, monkeypatch) -> None:
    """accelerate launch's own reading of the file (ClusterConfig.from_yaml_file, then _validate_launch_command), run
    from the file's folder as accelerate opens the DeepSpeed file it names."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    path, case = DATA / name, CASES[name]
    monkeypatch.chdir(path.parent)
    try:
        args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", path.name, "x.py"]))
    except ValueError as error:
        assert isinstance(case, Refused) and case.tool_refuses, error
        return
    assert not (isinstance(case, Refused) and case.tool_refuses)
    if isinstance(case, Refused):
        return
    recipe = read_recipe_file(path)
    assert (recipe.num_gpus or 1) == (args.num_processes or 1) and (recipe.nodes or 1) == args.num_machines
    assert (recipe.recipe.fsdp != "none") == bool(args.use_fsdp)
    assert (recipe.recipe.zero_stage > 0) == bool(args.use_deepspeed)
    if args.use_deepspeed and args.zero_stage is not None:  # else the DeepSpeed file it names says
        assert recipe.recipe.zero_stage == args.zero_stage
    if args.mixed_precision in ("fp16", "bf16"):
        assert (recipe.recipe.fp16, recipe.recipe.bf16) == (args.mixed_precision == "fp16", args.mixed_precision == "bf16")


def test_trl_s_own_parser_reads_its_example_as_anatomist_does(tmp_path: Path) -> None:
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

    path = DATA / "trl/examples/cli_configs/example_config.yaml"
    script, sft, model = TrlParser((ScriptArguments, SFTConfig, ModelConfig)).parse_args_and_config(
        ["--config", str(path), "--output_dir", str(tmp_path), "--use_cpu", "true"])
    source = read_recipe_file(path)
    assert (source.model, source.seq_len) == (model.model_name_or_path, sft.max_length)
    r = source.recipe
    assert (r.gradient_checkpointing, r.per_device_train_batch_size, r.dtype) == (
        sft.gradient_checkpointing, sft.per_device_train_batch_size, model.dtype)
    assert r.lora_dropout == model.lora_dropout and r.peft == ("lora" if model.use_peft else "none")
    assert script.dataset_name == yaml.safe_load(path.read_text())["dataset_name"]


# -- the README's table ----------------------------------------------------------------------------------------------

def _readme_rows() -> dict[str, str]:
    """tests/data/README.md's outcome table: file -> its outcome cell."""
    rows = {}
    for line in (DATA / "README.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = cells[2]
    return rows


def test_the_readme_table_names_every_file_and_its_outcome() -> None:
    rows = _readme_rows()
    assert sorted(rows) == sorted(CASES)
    for name, case in CASES.items():
        assert re.match("read" if isinstance(case, Read) else "refused", rows[name]), (name, rows[name])


# -- a few estimated, on a tiny stand-in ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["axolotl/qwen3-qlora-fsdp.yaml", "llamafactory/qwen3_lora_sft_ds3.yaml",
                                  "accelerate/examples/config_yaml_templates/deepspeed.yaml"])
def test_a_read_config_is_estimated_with_what_it_read(cli, tiny_model, name: str) -> None:
    path = DATA / name
    result = cli("estimate", str(tiny_model("llama")), "--recipe", str(path), "--seq-len", "64", "--gpu", "A100-80GB",
                 "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    source = read_recipe_file(path)
    for field, value in CASES[name].fields.items():  # type: ignore[union-attr]
        assert out["recipe"][field] == value, field
    assert out["memory"]["device_total"] > 0 and out["seq_len"] == 64
    assert out["num_gpus"] == (source.num_gpus or 1)
