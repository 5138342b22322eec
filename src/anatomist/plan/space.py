"""The recipe space `anatomist plan` searches, and how it is enumerated.

Axes are split by cost (Liger Kernel, for the causal LMs whose kernels anatomist traces, is a
traced axis like checkpointing). Batch size, accumulation, ZeRO/FSDP sharding, CPU offload and
torch.compile do not change what the memory tracer records (the estimator extrapolates batch
size and applies sharding arithmetically), so they are enumerated in full. Checkpointing,
precision and optimizer each need a new fake-tensor trace (1-3 s for bert-large), so only
their useful values are searched; attention kernels other than SDPA are compared at the top
pick only (`search.py`), since eager attention keeps the [b, heads, s, s] probabilities and is
never faster in any model anatomist has (the seeds' "SDPA / Flash Attention" section).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from anatomist.axes.liger import liger_modelled
from anatomist.axes.optimizers import DEFAULT_SEARCH, runs_with
from anatomist.axes.precisions import precision, qlora_precision, searchable_on
from anatomist.axes.shardings import SHARDING_NAMES, ShardingSpec, shardings_for
from anatomist.errors import InputError
from anatomist.hardware import GPU
from anatomist.recipe import Recipe
from anatomist.recipe.parallel_checks import (
    check_context_parallel_model,
    check_expert_parallel_model,
    check_sequence_parallel_model,
    check_tensor_parallel_model,
)
from anatomist.workload import Workload

UNBOUNDED_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
"""Per-device batch sizes tried when no global batch size is asked for (accumulation 1)."""

METHODS: dict[str, dict[str, object]] = {
    "full": {"peft": "none", "load_in_4bit": False, "load_in_8bit": False},
    "lora": {"peft": "lora", "load_in_4bit": False, "load_in_8bit": False},
    "qlora": {"peft": "qlora", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
              "bnb_4bit_use_double_quant": True},
}
"""What is trained: every weight, or LoRA adapters on a frozen base (bf16/fp32, or QLoRA's
4-bit NF4 base with double quantization). Only "full" is searched unless asked: LoRA and QLoRA
change what the model learns, not just what it costs."""
PEFT_TRADE_OFF = (
    "{method} trains r={r} adapters on a frozen base, not every weight: a different fine-tune, usually "
    "close to full fine-tuning on instruction data but not always; compare on your own evaluation"
)

BF16_WEIGHTS_TRADE_OFF = (
    "numerics: bf16 weights keep no fp32 master copy, so updates below bf16's resolution (~0.4% of a "
    "weight) are rounded away; if the loss stalls, load in float32 with bf16 autocast instead"
)


@dataclass(kw_only=True, slots=True)
class SearchSpace:
    """What the planner may vary; everything else keeps `base`'s value."""

    global_batch_size: int | None = None
    """Samples per optimizer step over all devices; None: any per-device batch, no accumulation."""
    num_gpus: int = 1
    """Data-parallel devices, every node's."""
    nodes: int = 1
    """Machines the devices are spread over: the collectives cross `network` (estimate/time/cluster.py)."""
    network: str | None = None
    """The network between the nodes (a name of `network.networks()`); None: the default."""
    optims: tuple[str, ...] = DEFAULT_SEARCH
    compile_options: tuple[bool, ...] = (False, True)
    checkpointing_options: tuple[bool, ...] = (False, True)
    partial_checkpointing: tuple[int, ...] = (2, 4)
    """`checkpoint_every` values tried where checkpointing every layer fits and none does not (`search.
    checkpointing_variants`): one layer in N recomputes, the others keep their activations."""
    offload_checkpoints: bool = True
    """Try offloading the checkpoints to the host where checkpointing every layer does not fit (`search.
    checkpointing_variants`): less device memory for PCIe copies."""
    offload_activations: bool = True
    """Under TRL's trainers, try their activation offloading where the recipe does not fit (`search.
    checkpointing_variants`): less device memory for PCIe copies."""
    tensor_parallel: bool = True
    """On more than one GPU, try tensor parallel (transformers' tp_plan, under FSDP where there are more GPUs than a
    group) where the recipes without it do not fit (`splits.tensor_parallel_variants`), in groups of 2, 4 ... a node's
    GPUs (`tensor_parallel_sizes`); and, for a Mixture of Experts, expert parallel (`splits.expert_parallel_variants`,
    `expert_parallel_sizes`)."""
    shardings: tuple[str, ...] | None = None
    """Names from `axes.shardings.SHARDING_NAMES` (`plan --shardings`); None: all. Searched on `num_gpus` devices: those
    of them that run there (`shardings_for`)."""
    precisions: tuple[str, ...] | None = None
    """Names from `axes.precisions.FULL_PRECISIONS`; None: every one the GPU supports (`searchable_on`)."""
    methods: tuple[str, ...] = ("full",)
    """Names from METHODS: what is trained. LoRA and QLoRA are searched with the shardings that shard the
    frozen base (`ShardingSpec.for_adapters`: FSDP full_shard, ZeRO-3) or none."""
    base: Recipe = field(default_factory=Recipe)
    """Fields the search does not vary (dataloader workers, max_grad_norm ...)."""
    fixed: dict[str, Any] = field(default_factory=dict)
    """Recipe fields held at the values a recipe file sets (`plan --recipe`): every enumerated recipe takes
    them, so the search varies only what the file leaves open; a combination they make invalid is dropped."""
    # -- LLM fine-tuning kernels ------------------------------------------------------------------------
    liger_options: tuple[bool, ...] | None = None
    """Liger Kernel off/on; None: both for a causal LM whose kernels anatomist traces (`axes.liger`), else off
    (settled by `for_workload`)."""

    def for_workload(self, model_type: str, task: str) -> SearchSpace:
        """This space with what depends on the model settled: Liger searched where it applies."""
        if self.liger_options is not None:
            return self
        return dataclasses.replace(self, liger_options=(False, True) if liger_modelled(model_type, task) else (False,))

    def __post_init__(self) -> None:
        unknown_methods = [m for m in self.methods if m not in METHODS]
        if unknown_methods or not self.methods:
            raise InputError(f"fine-tuning methods are {', '.join(METHODS)}; got {', '.join(unknown_methods) or 'none'}")
        if self.num_gpus <= 0:
            raise InputError(f"--gpus must be greater than 0, got {self.num_gpus}")
        unknown = [name for name in self.shardings or () if name not in SHARDING_NAMES]
        if unknown or self.shardings == ():
            raise InputError(f"--shardings: the options are {', '.join(SHARDING_NAMES)}; got {', '.join(unknown) or 'none'}")
        if self.global_batch_size is not None:
            if self.global_batch_size <= 0:
                raise InputError(f"--global-batch-size must be greater than 0, got {self.global_batch_size}")
            if self.global_batch_size % self.num_gpus:
                raise InputError(
                    f"a global batch of {self.global_batch_size} cannot be split evenly over {self.num_gpus} GPUs "
                    f"(every device needs the same micro-batch x accumulation); use a multiple of {self.num_gpus}, "
                    f"e.g. {max(self.num_gpus, self.global_batch_size // self.num_gpus * self.num_gpus)}"
                )

    def batch_options(self, tp_size: int = 1) -> list[tuple[int, int]]:
        """(per-device batch, accumulation) pairs that form the global batch exactly; under tensor parallel of
        `tp_size`, the pairs of a group, whose GPUs share one batch.

        Per-device batches are divisors of the per-device share that are powers of two or
        multiples of 8: the seeds advise multiples of 8 for tensor-core friendly shapes.
        """
        if self.global_batch_size is None:
            return [(b, 1) for b in UNBOUNDED_BATCH_SIZES]
        share = self.global_batch_size // (self.num_gpus // tp_size)
        sizes = [b for b in range(1, share + 1) if share % b == 0 and (b & (b - 1) == 0 or b % 8 == 0)]
        return [(b, share // b) for b in sizes]

    def sharding_options(self, method: str = "full") -> list[ShardingSpec]:
        """The searched sharding options for `method` (adapters: those `for_adapters` only)."""
        return [spec for name, spec in shardings_for(self.num_gpus, self.nodes).items()
                if (self.shardings is None or name in self.shardings) and (method == "full" or spec.for_adapters)]


def searched_precisions(space: SearchSpace, gpu: GPU, method: str = "full") -> list[str]:
    """The precisions the search varies for `method`: the space's own choice, else all the GPU
    supports (an adapters-only one not for full fine-tuning); QLoRA's one (`axes.precisions.qlora_precision`)
    whatever the space says."""
    if method == "qlora":
        return [qlora_precision(gpu)]
    supported, _ = searchable_on(gpu)
    return [p for p in supported if (space.precisions is None or p in space.precisions)
            and (method != "full" or not precision(p).adapters_only)]


def enumerate_recipes(space: SearchSpace, gpu: GPU) -> Iterator[Recipe]:
    """Every recipe of the space, expensive axes outermost (so traces are made in order), each once."""
    seen: set[Recipe] = set()
    for method in space.methods:
        precisions = searched_precisions(space, gpu, method)
        for ckpt, name, optim, liger in itertools.product(space.checkpointing_options, precisions, space.optims,
                                                          space.liger_options or (False,)):
            for recipe in _recipes(space, method, ckpt, name, optim, liger):
                held = _held(space, recipe)
                if held is not None and held not in seen:
                    seen.add(held)
                    yield held


def _held(space: SearchSpace, recipe: Recipe) -> Recipe | None:
    """`recipe` with the space's fixed fields; None where they make it invalid or break the global batch."""
    if not space.fixed:
        return recipe
    try:
        recipe = recipe.replace(**space.fixed)
    except InputError:  # e.g. a fixed bf16 on a candidate that set fp16
        return None
    samples = recipe.per_device_train_batch_size * recipe.gradient_accumulation_steps * space.num_gpus
    if space.global_batch_size is not None and samples != space.global_batch_size:
        return None
    return recipe


def _recipes(space: SearchSpace, method: str, ckpt: bool, precision_name: str, optim: str,
             liger: bool = False) -> Iterator[Recipe]:
    """The cheap axes (batch, sharding, compile) of one traced combination."""
    for (batch, accum), sharding, compiled in itertools.product(
        space.batch_options(), space.sharding_options(method), space.compile_options
    ):
        if compiled and liger or not runs_with(optim, sharding.fsdp):
            continue  # compile over Liger's stand-ins does not trace yet
        fields: dict[str, object] = {
            "per_device_train_batch_size": batch,
            "gradient_accumulation_steps": accum,
            "gradient_checkpointing": ckpt,
            "optim": optim,
            # packed rows: the varlen kernel; else the base's (None: transformers' default for the model)
            "attn_implementation": "flash_attention_2" if space.base.padding_free else space.base.attn_implementation,
            "torch_compile": compiled,
            "zero_stage": 0, "offload": "none", "fsdp": "none", "dp_replicate_size": 1,
            "use_liger_kernel": liger,
        }
        yield space.base.replace(**{**fields, **METHODS[method], **precision(precision_name).fields,
                                    **sharding.fields})


R = TypeVar("R", bound=Recipe)


def partial_variants(recipes: list[R], space: SearchSpace) -> list[R]:
    """The recipes among `recipes` that checkpoint every layer, checkpointing one layer in N instead (N from
    `space.partial_checkpointing`)."""
    return list(dict.fromkeys(r.replace(checkpoint_every=n) for r in recipes
                              if r.gradient_checkpointing and r.checkpoint_every == 1
                              for n in space.partial_checkpointing))


def checkpointing_alternatives(recipe: R, space: SearchSpace) -> list[tuple[str, R]]:
    """What the plan's reasons compare `recipe`'s checkpointing with: on/off where both are searched, and a
    checkpointed recipe's other fractions of layers (`partial_variants`) and offload, where `recipe` can take it."""
    alternatives = []
    if len(space.checkpointing_options) > 1:
        toggled = recipe.replace(gradient_checkpointing=not recipe.gradient_checkpointing, checkpoint_every=1,
                                 checkpoint_offload=False)
        alternatives.append((toggled.checkpointing, toggled))
    if recipe.gradient_checkpointing:
        every_layer = recipe.replace(checkpoint_every=1)
        for other in [every_layer, *partial_variants([every_layer], space)]:
            if other.checkpoint_every != recipe.checkpoint_every:
                alternatives.append((other.checkpointing, other))
        if space.offload_checkpoints:
            alternatives += [(r.checkpointing, r) for r in valid(recipe, checkpoint_offload=not recipe.checkpoint_offload)]
    if space.offload_activations and can_offload_activations(recipe):
        toggled = recipe.replace(activation_offloading=not recipe.activation_offloading)
        alternatives.append((toggled.checkpointing, toggled))
    return alternatives


def valid(recipe: R, **fields: Any) -> list[R]:
    """`recipe` with `fields`, or none where the Recipe's checks refuse the combination (tensor parallel with an
    offload, a fixed precision with another ...)."""
    try:
        return [recipe.replace(**fields)]
    except InputError:
        return []


def tensor_parallel_fsdp(space: SearchSpace, tp_size: int) -> str:
    """The FSDP a tensor parallel recipe of groups of `tp_size` runs with on `space`'s GPUs, as transformers shards a
    split model: full_shard over the groups where there are more GPUs than one group, else none."""
    return "full_shard" if space.num_gpus > tp_size else "none"


def tensor_parallel_sizes(space: SearchSpace, workload: Workload) -> list[int]:
    """The tensor parallel group sizes the search tries on `space`'s GPUs (`SearchSpace.tensor_parallel`): powers of
    two from 2 up to a node's GPUs that divide the GPUs, where the model can be split that way
    (`checks.check_tensor_parallel_model`: a tp_plan, its heads divisible, not a Mixture of Experts), and where the
    sharding a group runs under (`tensor_parallel_fsdp`) is searched."""
    if not space.tensor_parallel or space.num_gpus == 1 or "tp_size" in space.fixed:
        return []
    sizes = _split_sizes(space.num_gpus, space.num_gpus // space.nodes,
                         lambda size: check_tensor_parallel_model(size, workload))
    return [size for size in sizes if _searches(space, tensor_parallel_fsdp(space, size))]


def expert_parallel_sizes(space: SearchSpace, workload: Workload) -> list[int]:
    """The expert parallel degrees the search tries on `space`'s GPUs (`SearchSpace.tensor_parallel`: both are set
    where transformers loads the model, which only `--emit trainer` writes): powers of two from 2 up to the GPUs that
    divide them and the model's routed experts (`parallel_checks.check_expert_parallel_model`: a Mixture of Experts
    with an ep_plan), where FSDP's full_shard is searched."""
    if not space.tensor_parallel or space.num_gpus == 1 or "ep_size" in space.fixed or not workload.is_moe \
            or not _searches(space, "full_shard"):
        return []
    return _split_sizes(space.num_gpus, space.num_gpus, lambda size: check_expert_parallel_model(size, workload))


def context_parallel_sizes(space: SearchSpace, workload: Workload) -> list[int]:
    """The context parallel degrees the search tries on `space`'s GPUs (`SearchSpace.tensor_parallel` covers every
    split): powers of two from 2 up to a node's GPUs that divide the GPUs, where the model's sequences split that way
    (`parallel_checks.check_context_parallel_model`: a causal LM of full attention, its length into 2 x C parts), where
    FSDP's full_shard is searched."""
    if not space.tensor_parallel or space.num_gpus == 1 or "cp_size" in space.fixed or not _searches(space, "full_shard"):
        return []
    return _split_sizes(space.num_gpus, space.num_gpus // space.nodes,
                        lambda size: check_context_parallel_model(size, workload))


def sequence_parallel_sizes(space: SearchSpace, workload: Workload) -> list[int]:
    """The degrees of DeepSpeed's sequence parallel the search tries: as `context_parallel_sizes`, where DeepSpeed's
    Ulysses splits the model that way (`parallel_checks.check_sequence_parallel_model`: a causal LM of full attention,
    its heads and its length into P parts), where ZeRO is searched and DeepSpeed is there to run it."""
    if not space.tensor_parallel or space.num_gpus == 1 or "sp_size" in space.fixed or not _searches(space, zero=True) \
            or not _deepspeed_installed():
        return []
    return _split_sizes(space.num_gpus, space.num_gpus // space.nodes,
                        lambda size: check_sequence_parallel_model(size, workload))


def _searches(space: SearchSpace, fsdp: str = "none", *, zero: bool = False) -> bool:
    """Whether `space` searches a sharding whose FSDP is `fsdp` ("none": data parallel or ZeRO), under a ZeRO stage
    where `zero`, else without."""
    return any(spec.fields.get("fsdp", "none") == fsdp and bool(spec.fields.get("zero_stage")) == zero
               for spec in space.sharding_options())


def _deepspeed_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def _split_sizes(num_gpus: int, most: int, check: Callable[[int], None]) -> list[int]:
    """Powers of two from 2 up to `most` that divide `num_gpus`, up to the first the model refuses (`check` raises
    InputError: a larger power divides its heads or experts no better)."""
    sizes = []
    size = 2
    while size <= most:
        if num_gpus % size == 0:
            try:
                check(size)
            except InputError:
                break
            sizes.append(size)
        size *= 2
    return sizes


def can_offload_activations(recipe: Recipe) -> bool:
    """Whether TRL's activation offloading is a setting of `recipe` the plan can try: its trainers only, and what the
    Recipe models it with (no FSDP, no torch.compile)."""
    return recipe.trainer != "trainer" and recipe.fsdp == "none" and not recipe.torch_compile


def method_of(recipe: Recipe) -> str:
    """The METHODS name of `recipe`: full, lora (incl. an 8-bit base) or qlora (a 4-bit base)."""
    return "full" if recipe.peft == "none" else "qlora" if recipe.load_in_4bit else "lora"
