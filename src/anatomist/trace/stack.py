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
- `Cut` keeps chosen layer indices of each stack; `cut_config` writes the config of that model,
  cutting with the depth the fields that say what each layer is (per-layer lists, index lists,
  `first_k_dense_replace`, `decoder_sparse_step`). `cut_matches` builds the cut on the meta
  device and checks that its blocks are the kinds asked for: a config whose layers follow a rule
  this module does not rewrite (Jamba's periods) fails the check instead of being traced wrong.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from anatomist.recipe import ResolvedRecipe
from anatomist.workload import LAYER_FIELDS, Workload

LAYER_COUNT_FIELDS = (*LAYER_FIELDS, "num_decoder_layers", "encoder_layers", "decoder_layers")
"""Config fields that hold the depth of a stack (as the config classes store or alias them)."""
INDEX_LIST_FIELDS = ("mlp_only_layers", "moe_layers", "full_attn_idxs")
"""Config fields that list layer indices (Qwen-MoE's dense layers, Llama 4's MoE layers, LFM2's attention)."""
_INDEX_NAMES = ("idx", "index", "layer_id", "layer_num", "layer_number")
"""Module attributes that number a layer rather than describe it: left out of a block's kind."""

Scalar = bool | int | float | str | None


@dataclass(frozen=True, slots=True)
class CutStack:
    """The layers one stack keeps."""

    fields: tuple[str, ...]
    """The config fields that hold this stack's depth (one stack may be several ModuleLists of one depth)."""
    depth: int
    """The stack's depth in the full model."""
    kept: tuple[int, ...]
    """Layer indices of the full model kept, ascending."""


@dataclass(frozen=True, slots=True)
class Cut:
    """A model cut to some of its layers, by index: hashable, and all `cut_config` needs."""

    stacks: tuple[CutStack, ...]

    @property
    def blocks(self) -> int:
        return sum(len(s.kept) for s in self.stacks)


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

    @property
    def blocks(self) -> int:
        return sum(s.depth for s in self.stacks)

    def uniform(self) -> bool:
        """One stack (or stacks that share one depth field) whose blocks after the first are all alike:
        what cutting every depth field to 2 and 3 layers extrapolates exactly."""
        return len(self.stacks) == 1 and len(set(self.stacks[0].kinds[1:])) <= 1


def depth_fields(config: Any) -> dict[str, int]:
    """The config's layer counts by the name they are stored under (T5's num_hidden_layers is num_layers)."""
    aliases = getattr(config, "attribute_map", {}) or {}
    out: dict[str, int] = {}
    for name in LAYER_COUNT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            out[aliases.get(name, name)] = value
    return out


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


def _scalar(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_scalar(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def block_signature(block: torch.nn.Module) -> dict[tuple[str, str], Any]:
    """What a block is made of: module classes, parameter shapes and dtypes, scalar settings."""
    items: dict[tuple[str, str], Any] = {}
    for path, module in block.named_modules():
        items[path, "class"] = type(module).__name__
        for name, p in module.named_parameters(recurse=False):
            items[path, "param " + name] = (tuple(p.shape), str(p.dtype))
        for name, value in vars(module).items():
            if (not name.startswith("_") and name != "training" and _scalar(value)
                    and not any(s in name for s in _INDEX_NAMES)):
                items[path, name] = value
    return items


def per_layer_fields(config: Any, depth: int) -> dict[str, list[Any]]:
    """Config fields that say something of each of `depth` layers: lists of that length whose name says
    layer (`layer_types`, `mlp_layer_types`, `no_rope_layers`)."""
    out = {}
    for name, value in vars(config).items():
        if ("layer" in name and isinstance(value, list) and len(value) == depth and depth > 0
                and all(_scalar(v) for v in value)):
            out[name] = value
    return out


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


def _varying(rows: list[dict[tuple[str, str], Any]]) -> list[tuple[str, str]]:
    """The signature items that differ between some blocks of a stack: what tells kinds apart."""
    keys = sorted({k for row in rows for k in row}, key=repr)
    return [k for k in keys if len({repr(row.get(k)) for row in rows}) > 1]


def _kinds(rows: list[dict[tuple[str, str], Any]], varying: list[tuple[str, str]]) -> tuple[int, ...]:
    seen: dict[str, int] = {}
    return tuple(seen.setdefault(repr([row.get(k) for k in varying]), len(seen)) for row in rows)


def traced_attention(recipe: ResolvedRecipe) -> str:
    """The attention the traced model is built with: SDPA stands in for flash_attention_2 (which needs
    CUDA and its package); SDPA's flash kernel keeps the same output and log-sum-exp."""
    return "sdpa" if recipe.attn_implementation == "flash_attention_2" else recipe.attn_implementation


def meta_model(workload: Workload, recipe: ResolvedRecipe) -> torch.nn.Module:
    """The base model on the meta device, from a copy of the config (building sets num_labels and
    pad_token_id on the config it is given)."""
    import contextlib

    attn = traced_attention(recipe)
    own = dataclasses.replace(workload, config=copy.deepcopy(workload.config))
    from anatomist.trace.experts import build_kwargs

    with torch.device("meta"), contextlib.redirect_stderr(None):
        return own.build_model(attn, recipe.dtype, **build_kwargs(workload, recipe))


def layout_of(workload: Workload, recipe: ResolvedRecipe) -> Layout:
    """The stacks and block kinds of the full model, and its exact parameter count as `recipe` trains
    it (PEFT adapters, quantized layout), built on the meta device."""
    import contextlib

    from anatomist.trace.peft import apply_peft, counted_parameters

    model = meta_model(workload, recipe)
    found = _stacks_of(model, model.config)
    signatures = _signatures(model.config, found) if found is not None else []
    with torch.device("meta"), contextlib.redirect_stderr(None):
        model = apply_peft(model, recipe, workload.task)
    parameters = counted_parameters(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if found is None:
        return Layout(stacks=(), parameters=parameters, trainable_parameters=trainable, signatures=())
    stacks = tuple(
        Stack(fields=fields, paths=tuple(p for p, _ in members), kinds=_kinds(rows, _varying(rows)))
        for (fields, members), rows in zip(found, signatures, strict=True)
    )
    return Layout(stacks=stacks, parameters=parameters, trainable_parameters=trainable,
                  signatures=tuple(tuple(rows) for rows in signatures))


def cut_config(config: Any, cut: Cut) -> Any:
    """A copy of `config` whose stacks keep the layers `cut` names, each still the kind it was."""
    config = copy.deepcopy(config)
    for stack in cut.stacks:
        kept = list(stack.kept)
        rank = {i: r for r, i in enumerate(kept)}
        step = getattr(config, "decoder_sparse_step", None)
        if isinstance(step, int) and step > 1 and isinstance(getattr(config, "mlp_only_layers", None), list):
            # Qwen-MoE: layer i is sparse iff (i + 1) % step == 0 and i is not in mlp_only_layers. Kept
            # layers are renumbered, so the rule is written out as the list of dense layers.
            config.mlp_only_layers = sorted(set(config.mlp_only_layers) | {i for i in range(stack.depth)
                                                                           if (i + 1) % step})
            config.decoder_sparse_step = 1
        for name, values in per_layer_fields(config, stack.depth).items():
            setattr(config, name, [values[i] for i in kept])
        for name in INDEX_LIST_FIELDS:
            listed = getattr(config, name, None)
            if isinstance(listed, list):
                setattr(config, name, [rank[i] for i in sorted(listed) if i in rank])
        first_dense = getattr(config, "first_k_dense_replace", None)
        if isinstance(first_dense, int) and not isinstance(first_dense, bool):
            config.first_k_dense_replace = sum(1 for i in kept if i < first_dense)
        for name in stack.fields:
            setattr(config, name, len(kept))
    return config


def cut_workload(workload: Workload, cut: Cut) -> Workload:
    return dataclasses.replace(workload, config=cut_config(workload.config, cut))


def cut_matches(workload: Workload, recipe: ResolvedRecipe, layout: Layout, cut: Cut) -> bool:
    """Whether the model `cut` builds has, in each stack, blocks of the kinds of the layers it keeps.

    Compared are the signature items that tell the full model's kinds apart; items alike in every
    block may change with the depth (a layer count a block keeps) without making the cut wrong."""
    from anatomist.errors import InputError

    try:
        model = meta_model(cut_workload(workload, cut), recipe)
        found = [(s.fields, [(p, model.get_submodule(p)) for p in s.paths]) for s in layout.stacks]
    except (InputError, ValueError, TypeError, AttributeError, IndexError, KeyError, RuntimeError):
        return False  # a config the cut left inconsistent (layer indices past the new depth, ...)
    for stack, rows, got in zip(cut.stacks, layout.signatures, _signatures(model.config, found), strict=True):
        if len(got) != len(stack.kept):
            return False
        varying = _varying(list(rows))
        for i, row in zip(stack.kept, got, strict=True):
            if [repr(rows[i].get(k)) for k in varying] != [repr(row.get(k)) for k in varying]:
                return False
    return True
