"""The repeated blocks of a model: which kinds of layer it stacks, and configs cut to a few of them.

The estimator traces models cut to a few blocks and extrapolates (`estimate/traces.py`). That is
exact only where every block it leaves out is like one it traced, and many models break the
assumption: encoder-decoders whose depths differ (T5-Efficient), dense-then-MoE stacks
(DeepSeek's first_k_dense_replace), interleaved MoE and dense layers (Qwen-MoE's
decoder_sparse_step), sliding-window and global attention (Gemma 2/3, gpt-oss), hybrids of
attention and convolution / linear attention / state-space layers (LFM2, Qwen3-Next, Jamba),
ALBERT's shared layers. This module says what the blocks are, from the model itself:

- `layout_of` builds the full model on the meta device (no memory, about 50 ms for an 8B model),
  finds its stacks (the ModuleLists as long as a layer-count field of the config) and gives each
  block a kind: the structure of its modules (classes, parameter shapes, scalar settings such as
  a sliding window or rope on/off) plus what the config declares for its index (`layer_types`,
  `mlp_only_layers`, ...). It also counts the model's parameters exactly.
- `cut_matches` builds a `Cut` (`keys.Cut`: chosen layer indices of each stack; its config is
  `configs.cut_config`) on the meta device and checks that its blocks are the kinds asked for: a
  config whose layers follow a rule `cutting` does not rewrite (Jamba's periods) fails the check
  instead of being traced wrong.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from anatomist.recipe import ResolvedRecipe
from anatomist.trace.depth.configs import INDEX_LIST_FIELDS, cut_config, depth_fields, is_scalar, per_layer_fields
from anatomist.trace.depth.cuts import Cut, Depth
from anatomist.trace.store.keys import traced_attention
from anatomist.workload import Workload

_INDEX_NAMES = ("idx", "index", "layer_id", "layer_num", "layer_number")
"""Module attributes that number a layer rather than describe it: left out of a block's kind."""

@dataclass(frozen=True, slots=True)
class Stack:
    """One stack of repeated blocks of the full model."""

    fields: tuple[str, ...]
    paths: tuple[str, ...]
    """Module paths of its ModuleLists, in the model's order (T5's encoder.block, ...)."""
    kinds: tuple[int, ...]
    """The kind of each layer: equal numbers, blocks alike."""

    @property
    def depth(self) -> int:
        return len(self.kinds)


@dataclass(frozen=True, slots=True)
class Layout:
    """The full model as the estimator needs to know it: its stacks and its exact size."""

    stacks: tuple[Stack, ...]
    """Empty where no ModuleList matches the config's depth (ALBERT's shared layers): no cut is exact."""
    parameters: int
    """Parameters as the traces count them (`peft.counted_parameters`), of the model as the recipe trains it."""
    trainable_parameters: int
    signatures: tuple[tuple[Any, ...], ...] = dataclasses.field(repr=False, compare=False)
    """Per stack, the structural signature of each block (what `kinds` numbers)."""
    parameter_numels: tuple[int, ...] = ()
    """Elements of each parameter, ascending (`plan.ModelPlan.parameter_numels`)."""
    block_parameters: int = 0
    """Parameters of the largest repeated block."""
    quantized_codes: int = 0
    """Elements (bytes) of the 4-/8-bit codes of a quantized base: counted in `parameter_numels` too."""
    quantized_parameters: int = 0
    """Parameters of the base that bitsandbytes quantizes (its linear layers' weights), as its authors count them."""
    adapted_parameters: tuple[str, ...] = ()
    """The parameters PEFT adapts directly (target_parameters: a Mixture of Experts' fused experts), named within
    their layer (`peft.in_layer`)."""
    rows_divisor: int = 1
    """The greatest common divisor of every parameter's rows (dim 0; `plan.ModelPlan.rows_divisor`)."""
    trainable_bytes: int = 0
    """Bytes of the trainable parameters in their dtypes (`plan.ModelPlan.trainable_bytes`)."""
    parameter_bytes: int = 0
    """Bytes of every parameter in its dtype (`plan.ModelSize.parameter_bytes`)."""
    fp8_weights: int = 0
    """Elements of the weights converted to torchao's Float8Linear (`plan.ModelSize.fp8_weights`)."""
    expert_parameters: int = 0
    """Elements of the routed experts' weights (`plan.ModelSize.expert_parameters`)."""

    @property
    def blocks(self) -> int:
        return sum(s.depth for s in self.stacks)

    def uniform(self) -> bool:
        """One stack (or stacks that share one depth field) whose blocks after the first are all alike:
        what cutting every depth field to 2 and 3 layers extrapolates exactly."""
        return len(self.stacks) == 1 and len(set(self.stacks[0].kinds[1:])) <= 1


def block_lists(model: torch.nn.Module, config: Any) -> list[tuple[str, torch.nn.ModuleList]]:
    """The outermost ModuleLists whose length is one of the config's layer counts, in the model's order."""
    lengths = {v for v in depth_fields(config).values() if v > 0}
    found: list[tuple[str, torch.nn.ModuleList]] = []
    for path, module in model.named_modules():
        if (isinstance(module, torch.nn.ModuleList) and len(module) in lengths
                and not any(path.startswith(p + ".") for p, _ in found)):
            found.append((path, module))
    return found


def _stacks_of(model: torch.nn.Module, config: Any) -> list[tuple[tuple[str, ...], list[tuple[str, Any]]]] | None:
    """(depth fields, ModuleLists) of each stack; None where a depth field has no ModuleList."""
    fields = depth_fields(config)
    lists = block_lists(model, config)
    by_depth: dict[int, list[str]] = {}
    for name, value in fields.items():
        by_depth.setdefault(value, []).append(name)
    stacks = []
    for value, names in by_depth.items():
        members = [(p, m) for p, m in lists if len(m) == value]
        if not members:
            return None
        stacks.append((tuple(names), members))
    stacks.sort(key=lambda s: [p for p, _ in lists].index(s[1][0][0]))
    return stacks


def block_signature(block: torch.nn.Module) -> dict[tuple[str, str], Any]:
    """What a block is made of: module classes, parameter shapes and dtypes, scalar settings."""
    items: dict[tuple[str, str], Any] = {}
    for path, module in block.named_modules():
        items[path, "class"] = type(module).__name__
        for name, p in module.named_parameters(recurse=False):
            items[path, "param " + name] = (tuple(p.shape), str(p.dtype))
        for name, value in vars(module).items():
            if (not name.startswith("_") and name != "training" and is_scalar(value)
                    and not any(s in name for s in _INDEX_NAMES)):
                items[path, name] = value
    return items


def _declared(config: Any, depth: int, index: int) -> dict[tuple[str, str], Any]:
    """What the config declares for layer `index` of a stack of `depth` layers."""
    items: dict[tuple[str, str], Any] = {("config", k): v[index] for k, v in per_layer_fields(config, depth).items()}
    for name in INDEX_LIST_FIELDS:
        listed = getattr(config, name, None)
        if isinstance(listed, list):
            items["config", name] = index in listed
    return items


def _signatures(config: Any, stacks: list[tuple[tuple[str, ...], list[tuple[str, Any]]]]) -> list[list[dict]]:
    """Per stack, the signature of each layer: its blocks' structure and what the config declares of it."""
    signatures = []
    for _names, members in stacks:
        depth = len(members[0][1])
        rows = []
        for i in range(depth):
            row: dict[tuple[str, str], Any] = _declared(config, depth, i)
            for path, modules in members:
                row.update({(f"{path}:{k[0]}", k[1]): v for k, v in block_signature(modules[i]).items()})
            rows.append(row)
        signatures.append(rows)
    return signatures


CHECKPOINTED = ("recipe", "checkpointed")
"""The signature item of a layer that gradient checkpointing recomputes while others keep their activations
(`Recipe.checkpoint_every`): layers alike but checkpointed or not are kinds of their own."""


def repeated_layers(model: torch.nn.Module, depth: Depth) -> list[tuple[torch.nn.Module, int]]:
    """Each repeated layer of `model` (the model cut to `depth`) with its index among the full model's repeated
    layers, counted in the model's order over every stack (as transformers numbers them for every_n_layers)."""
    order = [p for p, _ in block_lists(model, model.config)]
    lists = []
    for fields, members in _stacks_of(model, model.config) or []:
        cut = next((c for c in depth.stacks if c.fields == fields), None) if isinstance(depth, Cut) else None
        for path, modules in members:
            kept = cut.kept if cut is not None else range(len(modules))
            lists.append((order.index(path), modules, kept, cut.depth if cut is not None else len(modules)))
    layers, offset = [], 0
    for _, modules, kept, full_depth in sorted(lists, key=lambda entry: entry[0]):
        layers += [(module, offset + k) for module, k in zip(modules, kept, strict=True)]
        offset += full_depth
    return layers


def _mark_checkpointed(model: torch.nn.Module, depth: Depth, stacks: list[tuple[tuple[str, ...], list[tuple[str, Any]]]],
                       signatures: list[list[dict[tuple[str, str], Any]]], recipe: ResolvedRecipe) -> None:
    """Add to each layer's signature whether it checkpoints (in each of its stack's ModuleLists)."""
    if recipe.checkpoint_every == 1:
        return
    number = {id(module): layer for module, layer in repeated_layers(model, depth)}
    for (_fields, members), rows in zip(stacks, signatures, strict=True):
        for i, row in enumerate(rows):
            row[CHECKPOINTED] = tuple(recipe.checkpointed(number[id(modules[i])]) for _, modules in members)


def checkpoint_partially(model: torch.nn.Module, depth: Depth, recipe: ResolvedRecipe) -> None:
    """After the model's activation_checkpointing_enable: checkpoint only the layers `recipe` checkpoints, numbered
    as in the full model (transformers' every_n_layers numbers the layers of the model it is given: a cut's).

    Raises:
        InputError: a model whose layers do not checkpoint one by one (transformers' GradientCheckpointingLayer).
    """
    from anatomist.errors import InputError

    if recipe.checkpoint_every == 1:
        return
    layers = repeated_layers(model, depth)
    if not layers or not all(hasattr(type(m), "gradient_checkpointing") for m, _ in layers):
        raise InputError(f"checkpoint_every={recipe.checkpoint_every}: {type(model).__name__} does not checkpoint "
                         "layer by layer (transformers' GradientCheckpointingLayer); use checkpoint_every=1")
    for module, layer in layers:
        setattr(module, "gradient_checkpointing", recipe.checkpointed(layer))  # noqa: B010 (nn.Module types it Tensor | Module)


def _varying(rows: list[dict[tuple[str, str], Any]]) -> list[tuple[str, str]]:
    """The signature items that differ between some blocks of a stack: what tells kinds apart."""
    keys = sorted({k for row in rows for k in row}, key=repr)
    return [k for k in keys if len({repr(row.get(k)) for row in rows}) > 1]


def _kinds(rows: list[dict[tuple[str, str], Any]], varying: list[tuple[str, str]]) -> tuple[int, ...]:
    seen: dict[str, int] = {}
    return tuple(seen.setdefault(repr([row.get(k) for k in varying]), len(seen)) for row in rows)


def meta_model(workload: Workload, recipe: ResolvedRecipe, config: Any = None) -> torch.nn.Module:
    """The base model on the meta device: of the workload's config, or of `config` (a cut of it)."""
    import contextlib

    from anatomist.trace.step.experts import build_kwargs

    with torch.device("meta"), contextlib.redirect_stderr(None):
        return workload.build_model(traced_attention(recipe), recipe.dtype, config=config,
                                    **build_kwargs(workload, recipe))


def rows_divisor(parameters: Iterable[torch.Tensor]) -> int:
    """The greatest common divisor of the rows (dim 0) of `parameters` (1 where one has no rows, or there are none):
    FSDP2 pads a parameter's rows to a multiple of the world size, so at a world size that divides this no shard is
    padded (`trace.depth.worlds`)."""
    return math.gcd(*(p.shape[0] if p.dim() else 1 for p in parameters)) or 1


def layout_of(workload: Workload, recipe: ResolvedRecipe) -> Layout:
    """The stacks and block kinds of the full model, and its exact parameter count as `recipe` trains
    it (PEFT adapters, quantized layout), built on the meta device."""
    import contextlib

    from anatomist.trace.step.peft import QuantizedLinearLayout, apply_peft, counted_parameters, in_layer

    model = meta_model(workload, recipe)
    experts = expert_parameters(model)
    found = _stacks_of(model, model.config)
    signatures = _signatures(model.config, found) if found is not None else []
    with torch.device("meta"), contextlib.redirect_stderr(None):
        model = apply_peft(model, recipe, workload.task)
    parameters = counted_parameters(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainable_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    numels = tuple(sorted(p.numel() for p in model.parameters()))
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinearLayout)]
    codes = sum(m.weight.numel() for m in quantized)
    adapted = tuple(sorted({in_layer(n) for n in getattr(model, "targeted_parameter_names", None) or ()}))
    sizes: dict[str, Any] = {"quantized_codes": codes, "quantized_parameters": sum(m.original_numel for m in quantized),
                             "adapted_parameters": adapted, "rows_divisor": rows_divisor(model.parameters()),
                             "trainable_bytes": trainable_bytes,
                             "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                             "fp8_weights": _fp8_weights(model, recipe), "expert_parameters": experts}
    if found is None:
        return Layout(stacks=(), parameters=parameters, trainable_parameters=trainable, signatures=(),
                      parameter_numels=numels, **sizes)
    block = max((sum(p.numel() for p in b.parameters()) for _, lists in found for _, blocks in lists for b in blocks),
                default=0)
    _mark_checkpointed(model, None, found, signatures, recipe)
    stacks = tuple(
        Stack(fields=fields, paths=tuple(p for p, _ in members), kinds=_kinds(rows, _varying(rows)))
        for (fields, members), rows in zip(found, signatures, strict=True)
    )
    return Layout(stacks=stacks, parameters=parameters, trainable_parameters=trainable, parameter_numels=numels,
                  block_parameters=block, signatures=tuple(tuple(rows) for rows in signatures), **sizes)


def expert_parameters(model: torch.nn.Module) -> int:
    """Elements of the routed experts' weights: the parameters the model's expert parallel plan shards by expert
    (`base_model_ep_plan`'s "grouped_gemm" entries, whose `*` is a layer's index); 0 for a model without one."""
    config: Any = model.config
    plan = getattr(config.get_text_config(), "base_model_ep_plan", None) or {}
    patterns = [re.compile(r"(^|\.)" + re.escape(name).replace(r"\*", r"\d+") + "$")
                for name, style in plan.items() if style == "grouped_gemm"]
    if not patterns:
        return 0
    return sum(p.numel() for n, p in model.named_parameters() if any(r.search(n) for r in patterns))


def _fp8_weights(model: torch.nn.Module, recipe: ResolvedRecipe) -> int:
    """Elements of the weights accelerate converts to Float8Linear (`trace.step.fp8`), converting the meta `model`."""
    if recipe.fp8 == "none":
        return 0
    from torchao.float8.float8_linear import Float8Linear

    from anatomist.trace.step.fp8 import convert_to_fp8

    convert_to_fp8(model, recipe)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, Float8Linear))


def cut_matches(workload: Workload, recipe: ResolvedRecipe, layout: Layout, cut: Cut) -> bool:
    """Whether the model `cut` builds has, in each stack, blocks of the kinds of the layers it keeps.

    Compared are the signature items that tell the full model's kinds apart; items alike in every
    block may change with the depth (a layer count a block keeps) without making the cut wrong."""
    from anatomist.errors import InputError

    try:
        model = meta_model(workload, recipe, cut_config(workload.config, cut))
        found = [(s.fields, [(p, model.get_submodule(p)) for p in s.paths]) for s in layout.stacks]
    except (InputError, ValueError, TypeError, AttributeError, IndexError, KeyError, RuntimeError):
        return False  # a config the cut left inconsistent (layer indices past the new depth, ...)
    signatures = _signatures(model.config, found)
    _mark_checkpointed(model, cut, found, signatures, recipe)
    for stack, rows, got in zip(cut.stacks, layout.signatures, signatures, strict=True):
        if len(got) != len(stack.kept):
            return False
        varying = _varying(list(rows))
        for i, row in zip(stack.kept, got, strict=True):
            if [repr(rows[i].get(k)) for k in varying] != [repr(row.get(k)) for k in varying]:
                return False
    return True
