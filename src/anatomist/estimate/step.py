"""Trace one training (or inference) step of a real Transformers model on fake tensors.

The step is the Trainer's: forward under autocast, loss / accumulation steps, backward
(loss-scaled under fp16), gradient clipping, optimizer step, zero_grad(set_to_none=True).
The optimizer state a first step would create is made before the traced step, so the step
is a steady-state one; two micro-batches run when gradients accumulate, so that a forward
pass happens with gradients already alive.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from anatomist.anatomy import TENSOR_CATEGORIES, MemoryCategory, Phase
from anatomist.estimate.allocator import CachingAllocator, round_size
from anatomist.estimate.cuda_model import cublas_workspace_bytes, cuda_code_paths, fake_parameters
from anatomist.estimate.optimizers import build_optimizer
from anatomist.estimate.tracer import MemoryTracer, Trace
from anatomist.recipe import Recipe
from anatomist.workload import Workload

Mode = Literal["train", "inference"]

LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers")
SEGMENTS = ("pre", "blocks", "post")


@dataclass(kw_only=True, slots=True)
class PhasePeak:
    """The highest allocated bytes within one phase, what was live then, and the reserve."""

    allocated: int
    reserved: int
    categories: dict[MemoryCategory, int]

    def as_vector(self) -> list[float]:
        return [self.allocated, self.reserved, *(self.categories[c] for c in TENSOR_CATEGORIES)]

    @classmethod
    def from_vector(cls, v: list[float]) -> PhasePeak:
        rounded = [max(0, round(x)) for x in v]
        categories = dict(zip(TENSOR_CATEGORIES, rounded[2:], strict=True))
        allocated = sum(categories.values())  # equal to rounded[0] but for rounding
        return cls(allocated=allocated, reserved=max(rounded[1], allocated), categories=categories)


@dataclass(kw_only=True, slots=True)
class StepTrace:
    """What one traced step at a given depth and batch size came to."""

    phases: dict[tuple[Phase, str], PhasePeak]
    """Peak of each (phase, segment): segments are before, inside and after the repeated blocks."""
    parameters: int
    trainable_parameters: int
    op_count: int
    curves: Curves
    """The allocation curve, for extrapolation in batch size."""
    static_bytes: dict[MemoryCategory, int] = dataclasses.field(default_factory=dict)
    """Bytes alive through the whole step that the trace made at set-up (optimizer state)."""


def model_at_depth(workload: Workload, num_layers: int) -> Workload:
    """A copy of the workload whose model has `num_layers` repeated blocks."""
    config = copy.deepcopy(workload.config)
    for name in LAYER_COUNT_FIELDS:
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, num_layers)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list) and layer_types:
        config.layer_types = (layer_types * num_layers)[:num_layers]
    mlp_only = getattr(config, "mlp_only_layers", None)
    if isinstance(mlp_only, list):
        config.mlp_only_layers = [i for i in mlp_only if i < num_layers]
    return dataclasses.replace(workload, config=config)


def num_layers(workload: Workload) -> int:
    """Repeated blocks of the model (encoder and decoder stacks count once each)."""
    for name in LAYER_COUNT_FIELDS:
        value = getattr(workload.config, name, None)
        if isinstance(value, int):
            return value
    return 1


def lower_dtype(recipe: Recipe) -> torch.dtype | None:
    return torch.float16 if recipe.fp16 else torch.bfloat16 if recipe.bf16 else None


def make_batch(workload: Workload, batch_size: int) -> dict[str, torch.Tensor]:
    """Inputs as the seeds' dataset gives them: random token ids, labels for the task."""
    shape = (batch_size, workload.seq_len)
    ids = torch.randint(100, 30000, shape) if workload.config.vocab_size > 30000 else torch.randint(
        0, workload.config.vocab_size, shape
    )
    if workload.task == "sequence-classification":
        return {"input_ids": ids, "labels": torch.zeros(batch_size, dtype=torch.long)}
    return {"input_ids": ids, "labels": ids.clone()}


Part = Literal["forward-backward", "optimizer", "inference", "train-step"]


def trace_step(
    workload: Workload,
    recipe: Recipe,
    *,
    depth: int | None,
    batch_size: int,
    compute_capability: str,
    part: Part = "forward-backward",
    fake: bool = True,
) -> StepTrace:
    """Trace one part of a step of `workload` cut to `depth` blocks (None: the full model).

    The estimator traces a training step in two independent parts, so that recipes that
    differ only in the optimizer share the forward/backward trace (and vice versa):
      forward-backward: the micro-batches' forward and backward passes, without optimizer
        state (the caller adds it: it is static through forward and backward);
      optimizer: unscale, clip and step over gradients of every parameter, after a first
        step has created the state.
    "train-step" runs the whole steady-state step in one go (state, passes, optimizer), as
    the Trainer does; with `fake=False` it runs on real CPU tensors, which is what the
    accuracy tests measure against.
    """
    shallow = model_at_depth(workload, depth) if depth is not None else workload
    attn = "sdpa" if recipe.attn_implementation == "flash_attention_2" else recipe.attn_implementation
    fake_mode: Any = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    if fake:
        with torch.device("meta"), contextlib.redirect_stderr(None):
            model = shallow.build_model(attn)
        fake_parameters(model, fake_mode)
    else:
        model = shallow.build_model(attn)
    lower = lower_dtype(recipe)
    tracer = MemoryTracer(lower_precision_dtype=lower)
    params = [p for p in model.parameters()]
    for p in params:
        tracer.register(p, MemoryCategory.WEIGHTS)
    for b in model.buffers():
        tracer.register(b, MemoryCategory.WEIGHTS)
    workspace = cublas_workspace_bytes(compute_capability)
    autocast = torch.autocast("cpu", dtype=lower) if lower is not None else contextlib.nullcontext()
    static: dict[MemoryCategory, int] = {}
    with fake_mode, tracer, cuda_code_paths():
        # cuBLAS workspaces live from the first matrix product on: one for the main thread's
        # handle and, in training, one for the autograd engine's device thread. A steady-state
        # step starts with both.
        tracer.phase = Phase.SETUP
        for _ in range(1 if part == "inference" else 2):
            tracer.allocate_extra(workspace, MemoryCategory.FUNCTIONALITY)
        if part == "inference":
            _inference_step(model, workload, batch_size, tracer, autocast)
            phases = [Phase.FORWARD]
        elif part == "forward-backward":
            forward_backward(model, params, workload, recipe, batch_size, tracer, autocast)
            phases = [Phase.FORWARD, Phase.BACKWARD]
        else:
            optimizer, state_bytes = create_state(params, recipe, tracer)
            static = {MemoryCategory.OPTIMIZER_STATES: state_bytes}
            if part == "train-step":
                forward_backward(model, params, workload, recipe, batch_size, tracer, autocast)
                phases = [Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER]
            else:
                for p in params:
                    p.grad = torch.zeros_like(p)  # what backward leaves behind
                tracer.label_live([p.grad for p in params], MemoryCategory.GRADIENTS)
                phases = [Phase.OPTIMIZER]
            optimizer_phase(params, optimizer, recipe, tracer)
    return StepTrace(
        phases=(curves := _curves(tracer.trace)).peaks(phases),
        curves=curves,
        parameters=sum(p.numel() for p in params),
        trainable_parameters=sum(p.numel() for p in params if p.requires_grad),
        op_count=tracer.trace.op_count,
        static_bytes=static,
    )


def create_state(
    params: list[torch.nn.Parameter], recipe: Recipe, tracer: MemoryTracer
) -> tuple[torch.optim.Optimizer, int]:
    """The optimizer, with the state a first step creates (from zero gradients)."""
    optimizer = build_optimizer(recipe, params)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    tracer.label_live(states, MemoryCategory.OPTIMIZER_STATES)
    return optimizer, sum(round_size(t.untyped_storage().nbytes()) for t in states)


def optimizer_phase(
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, recipe: Recipe, tracer: MemoryTracer
) -> None:
    """Unscale (fp16), clip and step, then free the gradients, as the Trainer does."""
    tracer.phase, tracer.segment = Phase.OPTIMIZER, "pre"
    grads = [p.grad for p in params if p.grad is not None]
    if recipe.fp16:
        torch._foreach_mul_(grads, 1.0 / 65536.0)  # GradScaler.unscale_ works in place
    if recipe.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, recipe.max_grad_norm, foreach=True)
    del grads
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def forward_backward(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    workload: Workload,
    recipe: Recipe,
    batch_size: int,
    tracer: MemoryTracer,
    autocast: Any,
) -> None:
    model.train()
    if recipe.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    scale: torch.Tensor | None = None
    if recipe.fp16:  # GradScaler: scale and growth tracker on the device
        tracer.phase = Phase.SETUP
        scaler_state = [torch.full((), 65536.0), torch.zeros((), dtype=torch.int32)]
        tracer.label_live(scaler_state, MemoryCategory.FUNCTIONALITY)
        scale = scaler_state[0]
    _watch_blocks(model, tracer)
    # Two micro-batches when gradients accumulate: the second forward runs with gradients alive.
    for micro in range(min(recipe.gradient_accumulation_steps, 2)):
        tracer.micro_step = micro
        tracer.phase, tracer.segment = Phase.FORWARD, "pre"
        batch = make_batch(workload, batch_size)
        with autocast:
            loss = model(**batch).loss
        loss = loss / recipe.gradient_accumulation_steps
        del batch
        tracer.label_phase_survivors(Phase.FORWARD, MemoryCategory.ACTIVATIONS)
        tracer.phase, tracer.segment = Phase.BACKWARD, "post"
        if scale is not None:
            loss = loss * scale
        loss.backward()
        del loss
        tracer.label_live([p.grad for p in params if p.grad is not None], MemoryCategory.GRADIENTS)


def _repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of every ModuleList whose length is the model's layer count, in order."""
    config = getattr(model, "config", None)
    counts = {getattr(config, name, None) for name in LAYER_COUNT_FIELDS} - {None}
    blocks: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) in counts and len(module) > 0:
            blocks.extend(module)
    return blocks


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _watch_blocks(model: torch.nn.Module, tracer: MemoryTracer) -> None:
    """Mark the segments "pre", "blocks", "post" of forward and backward through hooks.

    Forward enters "blocks" at the first block's input and "post" after the last block.
    Backward runs the other way: it enters "blocks" when the gradient of the last block's
    output exists, and "pre" when the gradient of the first block's input does.
    """
    blocks = _repeated_blocks(model)
    if not blocks:
        return
    first, last = blocks[0], blocks[-1]

    def set_segment(name: str) -> Any:
        def hook(*_: Any) -> None:
            tracer.segment = name

        return hook

    def enter_blocks(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if tracer.phase is not Phase.FORWARD:
            return  # recomputation under gradient checkpointing
        tracer.segment = "blocks"
        hidden = _first_tensor(args) if args else _first_tensor(kwargs.get("hidden_states"))
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(set_segment("pre"))

    def leave_blocks(_module: Any, _args: Any, output: Any) -> None:
        if tracer.phase is not Phase.FORWARD:
            return
        tracer.segment = "post"
        hidden = _first_tensor(output)
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(set_segment("blocks"))

    first.register_forward_pre_hook(enter_blocks, with_kwargs=True)
    last.register_forward_hook(leave_blocks)


def _inference_step(
    model: torch.nn.Module, workload: Workload, batch_size: int, tracer: MemoryTracer, autocast: Any
) -> None:
    model.eval()
    tracer.phase = Phase.FORWARD
    batch = make_batch(workload, batch_size)
    batch.pop("labels")
    kwargs: dict[str, Any] = {}
    if workload.task == "causal-lm":
        kwargs["use_cache"] = True
    if workload.task == "seq2seq-lm":
        kwargs["decoder_input_ids"] = batch["input_ids"]
    with torch.no_grad(), autocast:
        out = model(**batch, **kwargs)
    cache = getattr(out, "past_key_values", None)
    if cache is not None:
        from torch.utils._pytree import tree_flatten

        cache_tensors = [t for t in tree_flatten(_cache_tensors(cache))[0] if isinstance(t, torch.Tensor)]
        tracer.label_live(cache_tensors, MemoryCategory.FUNCTIONALITY)
    tracer.label_phase_survivors(Phase.FORWARD, MemoryCategory.ACTIVATIONS)
    del out, batch


def _cache_tensors(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [[getattr(layer, "keys", None), getattr(layer, "values", None)] for layer in layers]
    if hasattr(cache, "to_legacy_cache"):
        return list(cache.to_legacy_cache())
    return list(cache) if isinstance(cache, (list, tuple)) else []


@dataclass(kw_only=True, slots=True)
class Curves:
    """Allocated bytes after every allocation of a trace, in total and per category.

    Traces of the same model and depth at two batch sizes run the same ops, so their
    curves line up event by event, and each point is affine in the batch size.
    """

    keys: list[tuple[Phase, str, int]]
    """(phase, segment, micro-step) of each point."""
    allocated: np.ndarray
    """[points] live bytes (each tensor rounded to the allocator's 512 B) after the allocation.

    The allocator's own `allocated` also counts the slack of cached blocks it did not
    split, which depends on the whole history of the process; it is left to the reserve."""
    categories: np.ndarray
    """[points, len(TENSOR_CATEGORIES)] the same bytes by category."""
    reserve_ratio: float
    """Peak reserved over peak live bytes of the allocator replay."""
    index: dict[tuple[Phase, str, int], np.ndarray] = dataclasses.field(init=False)
    """The positions of each key's points, in order."""

    def __post_init__(self) -> None:
        positions: dict[tuple[Phase, str, int], list[int]] = {}
        for i, key in enumerate(self.keys):
            positions.setdefault(key, []).append(i)
        self.index = {key: np.array(where, dtype=np.int64) for key, where in positions.items()}

    def peaks(self, phases: list[Phase]) -> dict[tuple[Phase, str], PhasePeak]:
        """The peak of every (phase, segment) of `phases`."""
        return peaks_of(self.keys, self.allocated, self.categories, self.reserve_ratio, phases)


def peaks_of(
    keys: list[tuple[Phase, str, int]],
    allocated: np.ndarray,
    categories: np.ndarray,
    reserve_ratio: float,
    phases: list[Phase],
) -> dict[tuple[Phase, str], PhasePeak]:
    out: dict[tuple[Phase, str], PhasePeak] = {}
    best: dict[tuple[Phase, str], int] = {}
    for i, (phase, segment, _micro) in enumerate(keys):
        key = (phase, segment)
        if phase in phases and (key not in best or allocated[i] > allocated[best[key]]):
            best[key] = i
    for key, i in best.items():
        value = int(round(float(allocated[i])))
        out[key] = PhasePeak(
            allocated=value,
            reserved=round(value * reserve_ratio),
            categories={c: int(round(float(categories[i, j]))) for j, c in enumerate(TENSOR_CATEGORIES)},
        )
    for phase in phases:
        for segment in SEGMENTS:
            out.setdefault(
                (phase, segment), PhasePeak(allocated=0, reserved=0, categories=dict.fromkeys(TENSOR_CATEGORIES, 0))
            )
    return out


def _curves(trace: Trace) -> Curves:
    """Replay the events through the allocator model, recording the curve after each allocation."""
    allocator = CachingAllocator()
    blocks: dict[int, Any] = {}
    index = {c: j for j, c in enumerate(TENSOR_CATEGORIES)}
    current = [0] * len(TENSOR_CATEGORIES)
    keys: list[tuple[Phase, str, int]] = []
    totals: list[int] = []
    rows: list[list[int]] = []
    live = 0
    for event in trace.events:
        category = index[trace.allocations[event.alloc_id].category]
        if event.nbytes > 0:
            blocks[event.alloc_id] = allocator.malloc(event.nbytes)
            size = round_size(event.nbytes)
            current[category] += size
            live += size
            keys.append((event.phase, event.segment, event.micro_step))
            totals.append(live)
            rows.append(list(current))
        else:
            block = blocks.pop(event.alloc_id, None)
            if block is not None:
                size = round_size(-event.nbytes)
                current[category] -= size
                live -= size
                allocator.free(block)
    return Curves(
        keys=keys,
        allocated=np.asarray(totals, dtype=np.float64),
        categories=np.asarray(rows, dtype=np.float64).reshape(len(rows), len(TENSOR_CATEGORIES)),
        reserve_ratio=max(1.0, allocator.peak_reserved / max(max(totals, default=0), 1)),
    )


def phase_peaks(trace: Trace, phases: list[Phase]) -> dict[tuple[Phase, str], PhasePeak]:
    """The peak of every (phase, segment) of a recorded trace (also used on real runs)."""
    return _curves(trace).peaks(phases)
