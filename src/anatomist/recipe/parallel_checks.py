"""The checks of the parallel layouts that split one step over several GPUs beyond data parallel: tensor parallel
(`tp_size`), expert parallel (`ep_size`), context parallel (`cp_size`), DeepSpeed's sequence parallel (`sp_size`) and
HSDP's replicas (`dp_replicate_size`), each against itself (`check_fields` runs those), the model (`check_model`) and the GPUs it runs on (`estimate()`).

Tensor and expert parallel are both transformers' own: `from_pretrained(..., distributed_config=DistributedConfig(...))`
splits the model at load time (trace/step/tensor_parallel.py), so they share what is not traced with it
(`SPLIT_NOT_MODELLED`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from anatomist.axes.optimizers import optimizer, runs_with
from anatomist.axes.shardings import EP_ROUTINGS
from anatomist.errors import InputError

if TYPE_CHECKING:
    from anatomist.recipe.fields import RecipeFields
    from anatomist.workload import Workload


SPLIT_NOT_MODELLED: tuple[tuple[str, object, str], ...] = (
    ("zero_stage", 0, "DeepSpeed ZeRO (its AutoTP is DeepSpeed's own tensor parallel; --fsdp full_shard is modelled)"),
    ("peft", "none", "LoRA/QLoRA (PEFT's adapters would add full-width outputs to the shards transformers' tp_plan "
                     "leaves)"),
    ("fp8", "none", "FP8"),
    ("torch_compile", False, "torch.compile"),
    ("use_liger_kernel", False, "Liger Kernel"),
    ("cut_cross_entropy", False, "Cut Cross-Entropy"),
    ("offload", "none", "offload"),
    ("checkpoint_offload", False, "checkpoint_offload"),
    ("activation_offloading", False, "activation_offloading"),
)
"""What a model transformers splits (tensor or expert parallel) is not traced with (field, its value when off, how a
user names it): the first on is said."""


def check_tensor_parallel(r: RecipeFields) -> None:
    """A tensor parallel degree of 1 or more, with the methods it is traced with (SPLIT_NOT_MODELLED: not these), under
    transformers' Trainer, with FSDP's full_shard where it shards (as transformers shards a split model)."""
    _check_split(r, "tp_size", r.tp_size)


def check_expert_parallel(r: RecipeFields) -> None:
    """An expert parallel degree of 1 or more, traced as transformers runs it in training (`ep_dispatch_experts` with
    its all-to-all, the experts sharded by FSDP over the ranks that hold the same ones): with what tensor parallel is
    traced with, transformers' grouped_mm experts, and neither tensor parallel nor HSDP beside it (not modelled yet)."""
    if r.ep_routing not in EP_ROUTINGS:
        raise InputError(f"unknown ep_routing {r.ep_routing!r}; known: {', '.join(EP_ROUTINGS)}")
    _check_split(r, "ep_size", r.ep_size)
    if r.ep_size == 1:
        if r.ep_routing != "balanced":
            raise InputError(f"ep_routing={r.ep_routing} without expert parallel: where each GPU holds every expert "
                             "the routing changes no memory (grouped_mm runs every routed row); add --ep-size")
        return
    for size, value in (("tp_size", r.tp_size), ("dp_replicate_size", r.dp_replicate_size)):
        if value > 1:
            raise InputError(f"ep_size={r.ep_size} with {size}={value} is not modelled yet: drop one of them")
    if r.experts_implementation != "grouped_mm":
        raise InputError(f"ep_size={r.ep_size} with experts_implementation={r.experts_implementation} is not modelled: "
                         "expert parallel is traced with transformers' grouped_mm experts (its default)")


def _check_split(r: RecipeFields, field: str, size: int) -> None:
    """A degree `size` (`field`) of a split transformers makes at load time: 1 or more, and above 1 with the methods
    it is traced with, under transformers' Trainer, with FSDP's full_shard where it shards (as transformers shards a
    split model)."""
    what = f"{field}={size}"
    if size < 1:
        raise InputError(f"{field} must be at least 1, got {size}")
    if size == 1:
        return
    for name, off, said in SPLIT_NOT_MODELLED:
        if getattr(r, name) != off:
            raise InputError(f"{what} with {said} is not modelled yet: drop one of them")
    if optimizer(r.optim).quantized_state is not None or not runs_with(r.optim, "full_shard"):
        raise InputError(f"{what} with optim={r.optim} is not modelled: its state is not DTensors beside "
                         "the split weights' DTensor gradients (a low-bit state, or plain tensors PyTorch refuses to "
                         "mix with them): choose adamw_torch_fused, adamw_torch or sgd")
    if r.trainer != "trainer":
        raise InputError(f"{what} with TRL's {r.trainer.upper()}Trainer is not modelled yet (its fused LM "
                         "head on the split model): use --trainer trainer")
    if r.fsdp == "shard_grad_op":
        raise InputError(f"{what} with fsdp=shard_grad_op: transformers' FSDP of a split model reshards every block "
                         "after its forward (full_shard)")


def check_hybrid_shard(r: RecipeFields) -> None:
    """HSDP: FSDP's shards replicated `dp_replicate_size` times (1: plain FSDP); where it needs FSDP is said at the
    GPU count (`check_hybrid_shard_gpus`), as a file may set the replicas before its FSDP section."""
    if r.dp_replicate_size < 1:
        raise InputError(f"dp_replicate_size must be at least 1, got {r.dp_replicate_size}")
    if r.dp_replicate_size > 1 and r.tp_size > 1:
        raise InputError(f"dp_replicate_size={r.dp_replicate_size} with tp_size={r.tp_size} is not modelled yet: drop "
                         "one of them")


def check_hybrid_shard_gpus(r: RecipeFields, num_gpus: int) -> None:
    """HSDP's replicas replicate FSDP's shard groups, which they divide the GPUs into, of two or more GPUs."""
    if r.dp_replicate_size > 1 and r.fsdp == "none":
        raise InputError(f"dp_replicate_size={r.dp_replicate_size} replicates FSDP's shards (HSDP): add --fsdp full_shard "
                         "or shard_grad_op")
    if r.dp_replicate_size > 1 and (num_gpus % r.dp_replicate_size or num_gpus // r.dp_replicate_size < 2):
        raise InputError(f"dp_replicate_size={r.dp_replicate_size} on {num_gpus} GPU(s): the replicas must divide the "
                         "GPUs into shard groups of 2 or more (with one GPU to a group it is DDP: drop --fsdp)")


def check_tensor_parallel_gpus(r: RecipeFields, num_gpus: int, nodes: int = 1) -> None:
    """The GPUs a tensor parallel recipe runs on, `num_gpus` over `nodes` machines (a whole number each,
    `network.check_cluster`): a multiple of tp_size, either tp_size itself or FSDP over the groups (accelerate's
    ParallelismConfig refuses tensor parallel with plain replication: dp_replicate without dp_shard), and a group
    within one node (its collectives are priced at the node's own bandwidth)."""
    if r.tp_size == 1:
        return
    if r.tp_size > num_gpus // nodes:
        raise InputError(f"tp_size={r.tp_size} is more than a node's {num_gpus // nodes} GPU(s): tensor "
                         "parallel across nodes is not modelled (its all-reduces would cross the network)")
    if num_gpus % r.tp_size:
        raise InputError(f"tp_size={r.tp_size} does not divide the {num_gpus} GPUs: the GPUs are tp_size x the "
                         "FSDP ranks")
    if num_gpus > r.tp_size and r.fsdp == "none":
        raise InputError(f"tp_size={r.tp_size} on {num_gpus} GPUs is modelled with FSDP over the {num_gpus // r.tp_size} "
                         "groups (DistributedConfig's fsdp_size; accelerate refuses tensor parallel with plain "
                         f"replication): add --fsdp full_shard, or --gpus {r.tp_size}")



def check_tensor_parallel_model(tp_size: int, workload: Workload) -> None:
    """A model transformers can split `tp_size` ways: one with a tp_plan, whose attention heads (and key/value heads)
    divide by it, and not a Mixture of Experts (its experts are expert parallel's, not modelled yet)."""
    config = workload.config.get_text_config()
    if not getattr(config, "base_model_tp_plan", None):
        raise InputError(f"{workload.name}: its config has no tensor parallel plan (base_model_tp_plan), so "
                         "transformers cannot split it: use --fsdp instead of --tp-size")
    if workload.is_moe:
        raise InputError(f"{workload.name}: tensor parallel of a Mixture of Experts (its experts split by expert "
                         "parallel) is not modelled yet")
    for name, what in (("num_attention_heads", "attention heads"), ("num_key_value_heads", "key/value heads")):
        heads = getattr(config, name, None)
        if isinstance(heads, int) and heads % tp_size:
            raise InputError(f"{workload.name}: tp_size={tp_size} does not divide its {heads} {what}: each GPU "
                             "computes whole heads")


def check_expert_parallel_gpus(r: RecipeFields, num_gpus: int) -> None:
    """The GPUs an expert parallel recipe runs on: transformers' DistributedConfig lays the experts over
    `ep_size` x the ranks that hold the same ones (`efsdp_size` = fsdp_size / ep_size), so FSDP over every GPU, and
    `ep_size` dividing them. A group may span nodes: its all-to-all is priced through the network where it does."""
    if r.ep_size == 1:
        return
    if r.fsdp == "none":
        raise InputError(f"ep_size={r.ep_size} is modelled with FSDP over the GPUs (DistributedConfig's fsdp_size, over "
                         "which transformers lays the experts' groups): add --fsdp full_shard")
    if num_gpus % r.ep_size:
        raise InputError(f"ep_size={r.ep_size} does not divide the {num_gpus} GPUs: each GPU holds 1/ep_size of the "
                         "experts, the GPUs holding the same experts shard them")


def check_expert_parallel_model(ep_size: int, workload: Workload) -> None:
    """A Mixture of Experts transformers can split `ep_size` ways: one with an expert parallel plan
    (`base_model_ep_plan`) whose routed experts divide by it."""
    if not workload.is_moe:
        raise InputError(f"{workload.name}: ep_size={ep_size} is expert parallel, for a Mixture of Experts; this "
                         "model has no experts to split (drop --ep-size, or use --fsdp / --tp-size)")
    config = workload.config.get_text_config()
    if not getattr(config, "base_model_ep_plan", None):
        raise InputError(f"{workload.name}: its config has no expert parallel plan (base_model_ep_plan), so "
                         "transformers cannot split its experts: drop --ep-size")
    experts = workload.facts.experts
    if experts is not None and experts[1] % ep_size:
        raise InputError(f"{workload.name}: ep_size={ep_size} does not divide its {experts[1]} routed experts: each "
                         "GPU holds an equal share of them")


CP_NOT_MODELLED: tuple[tuple[str, object, str], ...] = (
    *((name, off, said) for name, off, said in SPLIT_NOT_MODELLED if name not in ("zero_stage", "peft")),
    ("load_in_4bit", False, "QLoRA"),
    ("load_in_8bit", False, "8-bit weights"),
    ("tp_size", 1, "tensor parallel"),
    ("ep_size", 1, "expert parallel"),
    ("padding_free", False, "padding-free batches (the ring needs every rank's part of one causal sequence)"),
    ("packing", False, "packing (accelerate's hooks make every row one causal sequence)"),
)
"""What a context parallel recipe is not traced with: QLoRA, FP8, compile, the fused kernels, offloads, the other splits
(field, its value when off, how a user names it). LoRA is: PEFT's adapters under FSDP2, the ring in the attention; so
are HSDP's replicas (accelerate's dp_replicate x dp_shard x cp mesh, FSDP over a replica's dp_shard x cp)."""


def check_context_parallel(r: RecipeFields) -> None:
    """A context parallel degree of 1 or more, traced as the Trainer runs it under accelerate (torch's ring attention
    over SDPA, FSDP2 over every GPU): transformers' Trainer, SDPA, none of CP_NOT_MODELLED."""
    if r.cp_size < 1:
        raise InputError(f"cp_size must be at least 1, got {r.cp_size}")
    if r.cp_size == 1:
        return
    what = f"cp_size={r.cp_size}"
    for name, off, said in CP_NOT_MODELLED:
        if getattr(r, name) != off:
            raise InputError(f"{what} with {said} is not modelled yet: drop one of them")
    if r.zero_stage:
        raise InputError(f"{what} is accelerate's context parallel over FSDP2: use --fsdp full_shard (under DeepSpeed, "
                         "its Ulysses sequence parallel splits a sequence: --sp-size)")
    if r.trainer != "trainer":
        raise InputError(f"{what} with TRL's {r.trainer.upper()}Trainer is not modelled yet: use --trainer trainer")
    if r.attn_implementation not in (None, "sdpa"):
        raise InputError(f"{what} needs attn_implementation=sdpa: torch's ring attention replaces SDPA's kernels (the "
                         f"Trainer refuses {r.attn_implementation} under context parallel)")
    if not runs_with(r.optim, "full_shard"):
        raise InputError(f"{what} with optim={r.optim}: it runs under FSDP2, which this optimizer does not")


def check_context_parallel_gpus(r: RecipeFields, num_gpus: int, nodes: int = 1) -> None:
    """The GPUs a context parallel recipe runs on: FSDP over all of them (accelerate shards over dp_shard x cp), a
    multiple of cp_size, and a group within one node (its ring is priced at the node's own bandwidth)."""
    if r.cp_size == 1:
        return
    if r.fsdp != "full_shard":
        raise InputError(f"cp_size={r.cp_size} runs under FSDP2 (accelerate shards over dp_shard x cp): add --fsdp "
                         "full_shard")
    group = num_gpus // r.dp_replicate_size  # a replica's GPUs: FSDP's dp_shard x cp
    if group % r.cp_size:
        raise InputError(f"cp_size={r.cp_size} does not divide the {group} GPUs of "
                         f"{'a replica' if r.dp_replicate_size > 1 else 'the run'}: the GPUs are cp_size x the data "
                         "parallel ranks")
    if r.dp_replicate_size > 1 and group == r.cp_size:
        raise InputError(f"cp_size={r.cp_size} with dp_replicate_size={r.dp_replicate_size} on {num_gpus} GPUs leaves "
                         "each replica no FSDP shard of its own (dp_shard_size 1), which accelerate's ParallelismConfig "
                         "refuses: fewer replicas, or a smaller cp_size")
    if r.cp_size > num_gpus // nodes:
        raise InputError(f"cp_size={r.cp_size} is more than a node's {num_gpus // nodes} GPU(s): a ring across nodes "
                         "is not modelled")


def check_context_parallel_model(cp_size: int, workload: Workload) -> None:
    """A model whose sequences torch's ring can split `cp_size` ways as accelerate runs it: a causal LM, every layer
    attending to the whole causal prefix (accelerate refuses sliding-window and chunked layers), not a Mixture of
    Experts (not modelled yet), and a sequence length torch's load balancing splits into 2 x cp_size equal parts."""
    if workload.task != "causal-lm":
        raise InputError(f"{workload.name}: context parallel splits causal LM sequences (is_causal attention); this "
                         f"is a {workload.task} model")
    windowed = _not_full_attention(workload)
    if windowed:
        raise InputError(f"{workload.name}: context parallel with {', '.join(sorted(windowed))} layers: accelerate "
                         "refuses them (its hooks can only express full causal attention)")
    if workload.is_moe:
        raise InputError(f"{workload.name}: context parallel of a Mixture of Experts is not modelled yet")
    if workload.seq_len % (2 * cp_size):
        raise InputError(f"{workload.name}: --seq-len {workload.seq_len} does not split into 2 x cp_size = "
                         f"{2 * cp_size} equal parts (torch's load balancing of the causal ring): pad to a multiple "
                         f"of {2 * cp_size}")


SP_NOT_MODELLED: tuple[tuple[str, object, str], ...] = (
    *((name, off, said) for name, off, said in SPLIT_NOT_MODELLED if name not in ("zero_stage", "peft", "offload")),
    ("load_in_4bit", False, "QLoRA"),
    ("load_in_8bit", False, "8-bit weights"),
    ("fsdp", "none", "FSDP (DeepSpeed's Ulysses runs under DeepSpeed; accelerate's context parallel is FSDP's: --cp-size)"),
    ("tp_size", 1, "tensor parallel"),
    ("ep_size", 1, "expert parallel"),
    ("cp_size", 1, "context parallel (accelerate refuses both at once)"),
    ("dp_replicate_size", 1, "HSDP replicas"),
    ("padding_free", False, "padding-free batches (SDPA would attend across the packed sequences)"),
    ("packing", False, "packing (SDPA would attend across the packed sequences)"),
)
"""What a sequence parallel recipe is not traced with (field, its value when off, how a user names it). LoRA is (PEFT's
adapters on the rank's tokens, DeepSpeed's attention in between), and so are ZeRO's offloads (arithmetic over the
rank's trace, as without sequence parallel)."""


def check_sequence_parallel(r: RecipeFields) -> None:
    """A sequence parallel degree of 1 or more, traced as the Trainer runs it under accelerate's ParallelismConfig(
    sp_backend="deepspeed"): DeepSpeed ZeRO, transformers' Trainer, SDPA, none of SP_NOT_MODELLED."""
    if r.sp_size < 1:
        raise InputError(f"sp_size must be at least 1, got {r.sp_size}")
    if r.sp_size == 1:
        return
    what = f"sp_size={r.sp_size}"
    if not r.zero_stage:
        raise InputError(f"{what} is DeepSpeed's Ulysses sequence parallel (accelerate's sp_backend 'deepspeed'), which "
                         "runs under DeepSpeed: add --zero-stage 1, 2 or 3 (under FSDP, context parallel splits a "
                         "sequence: --cp-size)")
    for name, off, said in SP_NOT_MODELLED:
        if getattr(r, name) != off:
            raise InputError(f"{what} with {said} is not modelled yet: drop one of them")
    if r.trainer != "trainer":
        raise InputError(f"{what} with TRL's {r.trainer.upper()}Trainer is not modelled yet: use --trainer trainer")
    if r.attn_implementation not in (None, "sdpa", "flash_attention_2"):
        raise InputError(f"{what} needs attn_implementation sdpa or flash_attention_2: DeepSpeed refuses eager (its "
                         "4-D mask)")


def check_sequence_parallel_gpus(r: RecipeFields, num_gpus: int, nodes: int = 1) -> None:
    """The GPUs a sequence parallel recipe runs on: a multiple of sp_size (DeepSpeed's groups of consecutive ranks, the
    rest data parallel), a group within one node (its all-to-alls are priced at the node's own bandwidth)."""
    if r.sp_size == 1:
        return
    if num_gpus % r.sp_size:
        raise InputError(f"sp_size={r.sp_size} does not divide the {num_gpus} GPU(s): DeepSpeed makes groups of "
                         "sp_size consecutive ranks, the GPUs are sp_size x the data parallel ranks")
    if r.sp_size > num_gpus // nodes:
        raise InputError(f"sp_size={r.sp_size} is more than a node's {num_gpus // nodes} GPU(s): all-to-alls across "
                         "nodes are not modelled")


def check_sequence_parallel_model(sp_size: int, workload: Workload) -> None:
    """A model DeepSpeed's Ulysses can split `sp_size` ways (ulysses_sp.py `UlyssesSPAttentionHF`): a causal LM (its
    data loader adapter shifts the labels), every layer full causal attention (SDPA runs `is_causal`, the mask dropped:
    a sliding window would be lost; accelerate refuses recurrent layers), a config that names its key/value heads
    (`register_with_transformers` reads num_key_value_heads), query heads divisible by sp_size, key and value heads
    dividing it or divisible by it, and a sequence of sp_size equal parts."""
    if workload.task != "causal-lm":
        raise InputError(f"{workload.name}: DeepSpeed's Ulysses splits causal LM sequences; this is a {workload.task} "
                         "model")
    other = _not_full_attention(workload)
    if other:
        raise InputError(f"{workload.name}: sequence parallel with {', '.join(sorted(other))} layers is not modelled "
                         "(DeepSpeed's Ulysses drops the mask, and SDPA would attend to the whole prefix)")
    config = workload.config.get_text_config()
    if getattr(config, "num_key_value_heads", None) is None:
        raise InputError(f"{workload.name}: DeepSpeed's Ulysses reads the config's num_key_value_heads, which this "
                         f"{config.model_type} config has not (DeepSpeed stops on it)")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % sp_size:
        raise InputError(f"{workload.name}: sp_size={sp_size} does not divide its {heads} attention heads (DeepSpeed's "
                         "Ulysses gives each GPU a share of the heads)")
    if kv_heads % sp_size and sp_size % kv_heads:
        raise InputError(f"{workload.name}: sp_size={sp_size} and its {kv_heads} key/value heads: one must divide the "
                         "other (DeepSpeed's Ulysses splits or repeats them)")
    if workload.seq_len % sp_size:
        raise InputError(f"{workload.name}: --seq-len {workload.seq_len} does not split into sp_size = {sp_size} equal "
                         f"parts: pad to a multiple of {sp_size} (pad_to_multiple_of in the data collator)")


def _not_full_attention(workload: Workload) -> set[str]:
    """The kinds of the model's layers other than full causal attention (its `layer_types`, or a sliding window)."""
    config = workload.config.get_text_config()
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return {t for t in layer_types if t != "full_attention"}
    return {"sliding_attention"} if getattr(config, "sliding_window", None) else set()
