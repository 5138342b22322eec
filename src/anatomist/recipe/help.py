"""What `--help` and the page say of each Recipe field, kept apart from the fields themselves.

The words a user reads change more often than what shapes a trace: the fields (`recipe/fields.py`) are in the
trace code digest (`trace/store/keys.py` TRACE_SOURCES), this file is not, so an edited help text keeps the cached
traces. The flags (`cli/recipe_flags.py`) and the page (`web/service.py`) read it; a test checks that every field
has its entry and no entry lacks its field.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FieldHelp:
    """The description of one Recipe field, and how its flag is shown."""

    text: str
    """What the field does, in the user's words (TrainingArguments' `metadata["help"]` plays this part there)."""
    metavar: str | None = None
    """The flag's placeholder where its type's (N, X, TEXT) says too little."""
    aliases: tuple[str, ...] = ()
    """Further names of the flag."""


FIELD_HELP: dict[str, FieldHelp] = {
    "per_device_train_batch_size": FieldHelp(
        "Samples per forward/backward pass on each device.", aliases=("--batch-size",)),
    "gradient_accumulation_steps": FieldHelp(
        "Micro-batches whose gradients are summed before one optimizer step."),
    "gradient_checkpointing": FieldHelp(
        "Recompute each layer's activations in backward instead of keeping them."),
    "checkpoint_every": FieldHelp(
        "With gradient checkpointing, checkpoint every N-th repeated layer only (transformers' "
        "activation_checkpointing_kwargs every_n_layers): layers 0, N, 2N, ... recompute, the others keep "
        "their activations; 1: every layer. Above 1 it turns gradient_checkpointing on.", metavar="N"),
    "checkpoint_offload": FieldHelp(
        "With gradient checkpointing, hold what the checkpointed layers save (their inputs) in pinned host "
        "memory (transformers' activation_checkpointing_kwargs offload; axolotl's activation_offloading: "
        "hidden_states, LLaMA-Factory's use_unsloth_gc): frees about layers x tokens x hidden x dtype "
        "bytes, and copies them to the host in forward and back in backward, on the compute stream. It "
        "turns gradient_checkpointing on."),
    "activation_offloading": FieldHelp(
        "TRL's activation offloading (SFTConfig/DPOConfig.activation_offloading; axolotl's "
        "activation_offloading: true): every tensor autograd saves of 1 KiB or more, but the parameters' "
        "and the output head's, is copied to pinned host memory in forward and back in backward, on a side "
        "stream (trl/models/activation_offloading.py); with gradient checkpointing that is each "
        "checkpointed layer's input."),
    "dtype": FieldHelp(
        "The dtype the weights are loaded in, as from_pretrained(dtype=...): auto is the config's dtype "
        "(float32 where it names none). Half-precision weights train in pure half precision: gradients and "
        "optimizer states in that dtype, no fp32 master weights."),
    "fp16": FieldHelp(
        "fp16 autocast + GradScaler (mixed precision: fp32 master weights when loaded in float32)."),
    "bf16": FieldHelp(
        "bf16 autocast (mixed precision: fp32 master weights when loaded in float32); Ampere or newer."),
    "tf32": FieldHelp(
        "Allow TF32 tensor cores for fp32 matrix products; Ampere or newer."),
    "fp8": FieldHelp(
        "FP8 training with torchao's float8 linear layers, as accelerate's mixed_precision='fp8' (AO backend) "
        "runs it: bf16 autocast (needs --bf16), every linear layer whose sizes are multiples of 16 but the "
        "model's first and last converted; tensorwise (accelerate's default) or rowwise scales; Ada, Hopper "
        "or Blackwell (compute capability 8.9+)."),
    "fp8_all_gather": FieldHelp(
        "Under FSDP with --fp8 tensorwise: all-gather the converted layers' weights in float8, not bf16 (torchao's "
        "enable_fsdp_float8_all_gather; half the bytes gathered and held unsharded); unset: on, as accelerate's "
        "AO backend defaults it (AORecipeKwargs, `accelerate launch --fp8_enable_fsdp_float8_all_gather`)."),
    "optim": FieldHelp(
        "Optimizer, as TrainingArguments.optim names it (axes/optimizers.py)."),
    "attn_implementation": FieldHelp(
        "Attention kernel: eager keeps the [b, heads, s, s] probabilities, sdpa and flash_attention_2 do "
        "not; unset: transformers' own choice for the model, sdpa where it supports it, else eager."),
    "experts_implementation": FieldHelp(
        "Mixture-of-Experts kernel, as from_pretrained(experts_implementation=...); no effect on dense "
        "models. grouped_mm (transformers' default) runs a layer's routed tokens as grouped matrix "
        "products; batched_mm copies each routed token's expert weights (meant for decoding); eager loops "
        "over the experts the router picked, whose sizes follow the data: it cannot be estimated (refused)."),
    "torch_compile": FieldHelp(
        "Compile the model with torch.compile (inductor)."),
    "dataloader_num_workers": FieldHelp(
        "DataLoader worker processes feeding the GPU."),
    "dataloader_pin_memory": FieldHelp(
        "Stage batches in page-locked host memory for faster host-to-device copies."),
    "zero_stage": FieldHelp(
        "DeepSpeed ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also weights."),
    "offload": FieldHelp(
        "Where DeepSpeed ZeRO offloads optimizer states (and, at stage 3, parameters); with FSDP, cpu is "
        "its CPUOffloadPolicy (sharded parameters, gradients, optimizer states and step on the host)."),
    "max_grad_norm": FieldHelp(
        "Gradient clipping, as the Trainer does by default (0 turns it off)."),
    "peft": FieldHelp(
        "Parameter-efficient fine-tuning with the peft library: lora trains low-rank adapters on a frozen "
        "base; qlora is the QLoRA recipe as people run it: a 4-bit NF4 base with double quantization and "
        "bf16 compute, LoRA adapters, prepare_model_for_kbit_training (fp32 copies of the non-quantized "
        "parameters, input gradients, gradient checkpointing)."),
    "lora_r": FieldHelp(
        "LoRA rank: each adapted d_out x d_in layer gains r x (d_in + d_out) trainable parameters."),
    "lora_alpha": FieldHelp(
        "LoRA scaling numerator (no memory effect; written to the emitted LoraConfig)."),
    "lora_dropout": FieldHelp(
        "Dropout on each adapter's input (PEFT's default 0): above 0 it keeps a mask and a copy."),
    "lora_target_modules": FieldHelp(
        "Comma-separated module names, or all-linear; unset: PEFT's default for the architecture, or "
        "all-linear where PEFT has none (said in the notes).", metavar="A,B|all-linear"),
    "lora_target_parameters": FieldHelp(
        "Comma-separated parameter names that LoRA adapts directly (PEFT's target_parameters): the fused 3D "
        "expert weights of a Mixture of Experts, which are not nn.Linear modules, e.g. "
        "mlp.experts.gate_up_proj,mlp.experts.down_proj. Each forward adds the adapters' product to the "
        "whole weight (a temporary the size of the experts of one layer).", metavar="A,B"),
    "load_in_4bit": FieldHelp(
        "BitsAndBytesConfig(load_in_4bit=True): the base's linear weights as packed 4-bit codes."),
    "load_in_8bit": FieldHelp(
        "BitsAndBytesConfig(load_in_8bit=True): the base's linear weights as int8 with row scales."),
    "llm_int8_skip_modules": FieldHelp(
        "Comma-separated modules bitsandbytes leaves unquantized, 4-bit or 8-bit alike "
        "(BitsAndBytesConfig's llm_int8_skip_modules: they replace transformers' own, the output head); "
        "unset: transformers' own, and for a sequence classifier its head too (classifier,score), which "
        "PEFT trains in full and a 4-bit weight could not.", metavar="A,B"),
    "bnb_4bit_quant_type": FieldHelp(
        "4-bit data type: nf4 (QLoRA's NormalFloat) or fp4; the same memory."),
    "bnb_4bit_use_double_quant": FieldHelp(
        "Quantize the per-block fp32 scales again (QLoRA's double quantization): ~0.37 fewer bits/param."),
    "bnb_4bit_compute_dtype": FieldHelp(
        "The dtype 4-bit weights are dequantized to for each matrix product (BitsAndBytesConfig's default "
        "float32)."),
    "fsdp": FieldHelp(
        "PyTorch FSDP sharding across data-parallel devices (TrainingArguments.fsdp): full_shard shards "
        "weights, gradients and optimizer states (like ZeRO-3); shard_grad_op shards gradients and "
        "optimizer states (like ZeRO-2). Exclusive with DeepSpeed ZeRO."),
    "tp_size": FieldHelp(
        "Tensor parallel degree (accelerate's ParallelismConfig tp_size): each block's linear layers split "
        "across this many GPUs by the model's own tp_plan, as transformers applies it (colwise, rowwise, the "
        "embeddings by vocabulary); the GPUs of one group see the same batch. Composed with --fsdp over the "
        "rest of the GPUs (dp_shard = GPUs / tp_size); without FSDP it takes every GPU."),
    "ep_size": FieldHelp(
        "Expert parallel degree of a Mixture of Experts (transformers' DistributedConfig ep_size): each GPU holds "
        "1/ep_size of every MoE layer's experts and sends each token to the GPUs of the experts it picked with an "
        "all-to-all (and back); the GPUs holding the same experts shard them with FSDP. Needs --fsdp full_shard."),
    "ep_routing": FieldHelp(
        "The routing an expert parallel estimate assumes: balanced (as the load-balancing loss aims; the default) "
        "or skewed (every token sent to as many of one GPU's experts as it can: the most that GPU receives). The "
        "estimate reports both ends."),
    "cp_size": FieldHelp(
        "Context parallel degree (accelerate's ParallelismConfig cp_size, PyTorch's ring attention): each sequence "
        "split into this many parts, one per GPU, attention exchanging the keys and values around the group; the "
        "GPUs of a group see the same samples, and FSDP shards over every GPU. For long sequences of causal LMs "
        "under transformers' Trainer; needs --fsdp and SDPA."),
    "sp_size": FieldHelp(
        "Sequence parallel degree under DeepSpeed (accelerate's ParallelismConfig sp_size with sp_backend deepspeed: "
        "DeepSpeed's Ulysses, ALST): each sequence split into this many parts, one per GPU, attention run on the whole "
        "sequence for a share of the heads after an all-to-all; the GPUs of a group see the same samples, and ZeRO "
        "partitions over every GPU. For long sequences of causal LMs under transformers' Trainer; needs --zero-stage "
        "and SDPA."),
    "dp_replicate_size": FieldHelp(
        "Hybrid sharding, HSDP (accelerate's ParallelismConfig dp_replicate_size): FSDP shards over GPUs / "
        "dp_replicate_size GPUs (dp_shard) and keeps that many replicas of the shards, whose gradients are "
        "all-reduced; a node's GPUs to a shard group keeps the all-gathers and reduce-scatters inside the node. "
        "Needs --fsdp."),
    "use_liger_kernel": FieldHelp(
        "Liger Kernel's Triton kernels (TrainingArguments.use_liger_kernel): fused linear + cross-entropy "
        "that never holds the logits, RMSNorm, SwiGLU and RoPE; causal LMs Liger supports (axes/liger.py). "
        "Predicted without liger-kernel installed. Under TRL's trainers only the layer kernels apply (TRL's "
        "own fused LM head computes the loss)."),
    "cut_cross_entropy": FieldHelp(
        "Cut Cross-Entropy (cut_cross_entropy's cce_patch, axolotl's CutCrossEntropyPlugin): the causal "
        "LM's loss from its last hidden states and head weight, block by block, without the logits; under "
        "the Trainer, with weights in bfloat16 or float16, on Ampere or newer (trace/standins/cce.py)."),
    "trainer": FieldHelp(
        "Which trainer runs the step: transformers' Trainer (the model's own head and loss: the logits "
        "exist), TRL's SFTTrainer (sft) or DPOTrainer (dpo), whose fused LM head never holds the logits; "
        "dpo runs chosen and rejected sequences as one batch of twice the pairs and a reference model "
        "(trace/step/trainers.py)."),
    "padding_free": FieldHelp(
        "Flatten each micro-batch into one row without padding (SFTConfig.padding_free, transformers' "
        "DataCollatorWithFlattening): position_ids restart per sequence, flash_attention_2's varlen kernel; "
        "a micro-batch is then batch x the data's mean length in tokens (--avg-seq-len or --lengths)."),
    "packing": FieldHelp(
        "Pack sequences into rows of max_length (--seq-len) tokens (SFTConfig.packing, best-fit decreasing, "
        "which is padding-free): every row full, several sequences in each."),
    "precompute_ref_log_probs": FieldHelp(
        "DPO: the reference model's log-probabilities are computed before training (DPOConfig), so no "
        "reference model is held nor run during it."),
    "reduce_bucket_size": FieldHelp(
        "DeepSpeed zero_optimization.reduce_bucket_size: elements per gradient-reduction bucket (ZeRO >= "
        "1); unset: the Trainer's auto, hidden_size^2.", metavar="N"),
    "allgather_bucket_size": FieldHelp(
        "DeepSpeed zero_optimization.allgather_bucket_size (ZeRO-1/2); unset: DeepSpeed's 5e8.", metavar="N"),
    "stage3_prefetch_bucket_size": FieldHelp(
        "DeepSpeed ZeRO-3: parameter elements fetched ahead; unset: the Trainer's auto, 0.9 x "
        "hidden_size^2.", metavar="N"),
    "stage3_max_live_parameters": FieldHelp(
        "DeepSpeed ZeRO-3: gathered parameter elements kept on a device before releasing; unset: "
        "DeepSpeed's 1e9.", metavar="N"),
    "stage3_max_reuse_distance": FieldHelp(
        "DeepSpeed ZeRO-3: a gathered parameter used again within this many parameter elements is kept "
        "gathered; unset: DeepSpeed's 1e9.", metavar="N"),
    "stage3_param_persistence_threshold": FieldHelp(
        "DeepSpeed ZeRO-3: parameters of at most this many elements stay whole on every device; unset: the "
        "Trainer's auto, 10 x hidden_size.", metavar="N"),
    "bf16_master_weights_and_grads": FieldHelp(
        "DeepSpeed bf16.bf16_master_weights_and_grads: ZeRO keeps its master weights and gradient "
        "partitions in bf16, not fp32 (2 B/param less per partition); DeepSpeed needs --offload cpu for it "
        "unless the optimizer states are bf16 too (--bf16-optimizer-states)."),
    "bf16_optimizer_states": FieldHelp(
        "DeepSpeed bf16.bf16_optimizer_states: the optimizer's states on ZeRO's partitions in bf16, not "
        "fp32 (AdamW: 4 B/param less per partition); needs --bf16-master-weights-and-grads."),
}
"""Each Recipe field's FieldHelp, by field name, in the fields' order."""
