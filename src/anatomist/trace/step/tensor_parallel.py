"""Tensor parallel on the traced model, as transformers runs it, per rank under the fake process group.

A recipe with `tp_size` > 1 is traced as one rank of its world: `tp_size` GPUs, or under FSDP all of them, the
tensor parallel ranks innermost. The model is split as `from_pretrained(..., distributed_config=
DistributedConfig(tp_size=T, fsdp_size=D))` splits it at load time (transformers 5.24,
`DistributedMixin.maybe_distribute_model`), by transformers' own functions on a mesh laid out as its
`initialize_distributed_mesh` lays it out (`fake_world`):
1. the plans resolved (`_resolve_parallel_plans`: the config's `base_model_tp_plan`, the input embeddings split by
   vocabulary; the model's FSDP plan, its blocks and the head);
2. tensor parallel applied (`apply_tensor_parallelism`): the linear layers' weights become DTensors sharded colwise
   or rowwise, and forward hooks move the activations between the layouts, so the rank's step runs DTensor's
   collectives (`_c10d_functional.all_reduce`, `all_gather_into_tensor`) on fake tensors;
3. under FSDP, transformers' own FSDP2 over the `fsdp` ranks (`apply_fully_sharded_data_parallelism`), with its
   mixed precision policy where the recipe autocasts to bfloat16 (`DistributedConfig.fsdp_mixed_precision`:
   weights gathered in bfloat16, gradients reduced in float32);
4. a head tied to the input embeddings tied again (`tie_weights`): from_pretrained splits the model before it ties
   them (`_finalize_model_loading`), so the head is split as the embeddings are, by vocabulary.
The Trainer then trains the model as it is (it does not wrap it again) and gives each device mesh its own
parameter group and gradient norm (`mesh_groups`, `clip_by_mesh`).

Why transformers' path and not accelerate's `ParallelismConfig` with FSDP2: accelerate 1.15 prepares a tensor
parallel model under FSDP2 with `transformers.integrations.tensor_parallel.ReplicateParallel`, which transformers
5.24 no longer has (an ImportError); the Trainer of transformers 5.24 takes the model transformers split. A recipe
file that asks accelerate for it is refused (`recipe.files.unmodelled.TP_UNDER_ACCELERATE_FSDP`).

What the tracer sees is what the rank holds: DTensors are counted by their local shards (`fsdp.ShardedStepTracer`),
the collectives' outputs are its buffers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from anatomist.recipe import ResolvedRecipe
from anatomist.recipe.spellings import distributed_config_kwargs
from anatomist.trace.step.fsdp import fake_process_group


def distributed_config(recipe: ResolvedRecipe, world: int) -> Any:
    """The `DistributedConfig` a user of transformers gives `from_pretrained` for `recipe` on `world` GPUs."""
    from transformers.distributed import DistributedConfig

    return DistributedConfig(**distributed_config_kwargs(recipe, world))


@contextlib.contextmanager
def fake_world(world: int, tp_size: int, ep_size: int = 1) -> Iterator[Any]:
    """transformers' device meshes (`TransformersDeviceMesh`: the dense layers' `(pp, dp_replicate, fsdp, tp)`, the
    experts' `(pp, dp_replicate, efsdp, ep)`) of `world` CPU ranks, `tp_size` to a tensor parallel group and `ep_size`
    to an expert parallel one, over PyTorch's fake process group; this process is rank 0."""
    from transformers.distributed.utils import TransformersDeviceMesh

    fsdp = world // tp_size
    with fake_process_group(world), meshes_outside_fake_mode():
        dense = init_device_mesh("cpu", (1, 1, fsdp, tp_size), mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
        experts = init_device_mesh("cpu", (1, 1, world // ep_size, ep_size),
                                   mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
        yield TransformersDeviceMesh(dense, experts)


def parallelize(model: torch.nn.Module, meshes: Any, config: Any, shard: bool = True) -> None:
    """Split `model` in place as transformers does at load time for `config` on `meshes` (module docstring; its
    `maybe_distribute_model`: tensor parallel, expert parallel, then FSDP unless not `shard`: the one-device compute of
    an expert parallel rank, whose config needs FSDP's ranks to lay the experts over, `keys.one_device`)."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism
    from transformers.distributed.fsdp import apply_fully_sharded_data_parallelism
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    hf: Any = model  # a transformers model: its methods are not nn.Module's
    hf.config.distributed_config = config
    head, embeddings = hf.get_output_embeddings(), hf.get_input_embeddings()
    tied = head is not None and embeddings is not None and head.weight is embeddings.weight
    if tied:  # from_pretrained splits the model before it ties the head to the embeddings (_finalize_model_loading)
        head.weight = torch.nn.Parameter(torch.empty_like(head.weight), requires_grad=head.weight.requires_grad)
    tp_plan, ep_plan, fsdp_plan = hf._resolve_parallel_plans(config)
    if config.tp_size > 1:
        apply_tensor_parallelism(model, meshes.get_mesh("tp"), tp_plan)
    if config.ep_size > 1:
        apply_expert_parallelism(model, meshes.get_mesh("ep"), meshes.get_mesh("tp"), ep_plan,
                                 ep_implementation=config.ep_implementation)
    if config.dp_size > 1 and shard:
        apply_fully_sharded_data_parallelism(model, meshes, fsdp_plan, ep_plan)
    if tied:
        hf.tie_weights()


def mesh_groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """`params` in one group per device mesh (plain tensors: one more), as the Trainer groups them where they do not all
    share one (`Trainer.create_optimizer`, `has_mixed_dtensor`): one fused or foreach kernel cannot span two meshes."""
    groups: dict[Any, list[torch.nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return [{"params": group} for group in groups.values()]


def clip_by_mesh(params: list[torch.nn.Parameter], max_norm: float) -> None:
    """Clip the gradients of `params` to `max_norm` in all, as the Trainer does where they live on several meshes
    (`Trainer._mixed_mesh_grad_norm`): each mesh's norm, reduced over it, then one total."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    groups = [g["params"] for g in mesh_groups([p for p in params if p.grad is not None])]
    norms = []
    for group in groups:
        norm = get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in groups:
        clip_grads_with_norm_(group, max_norm, total)


@contextlib.contextmanager
def meshes_outside_fake_mode() -> Iterator[None]:
    """Within it, a device mesh FSDP2 joins from the data-parallel and tensor parallel ones (`DeviceMesh._concatenate`,
    for a parameter that is already a DTensor) is made from real tensors: a mesh's coordinates come from its ranks'
    values (`nonzero`), which fake tensors do not have."""
    original = DeviceMesh._concatenate

    def concatenate(meshes: list[DeviceMesh]) -> DeviceMesh:
        with unset_fake_temporarily():
            return original(meshes)

    setattr(DeviceMesh, "_concatenate", staticmethod(concatenate))  # noqa: B010 (a static method, replaced)
    try:
        yield
    finally:
        setattr(DeviceMesh, "_concatenate", staticmethod(original))  # noqa: B010
