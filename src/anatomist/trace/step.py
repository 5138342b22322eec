"""Drive one training (or inference) step of a real Transformers model under the tracer.

What prediction and measurement share: building the model cut to a depth, the inputs, and
the step itself. The step is the Trainer's: forward under autocast, loss / accumulation steps, backward
(loss-scaled under fp16), gradient clipping, optimizer step, zero_grad(set_to_none=True).
The optimizer state a first step would create is made before the traced step, so the step
is a steady-state one; two micro-batches run when gradients accumulate, so that a forward
pass happens with gradients already alive.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from anatomist.anatomy import MemoryCategory, Phase
from anatomist.axes.optimizers import optimizer as optimizer_spec
from anatomist.axes.precisions import autocast_dtype
from anatomist.errors import InputError
from anatomist.recipe import ResolvedRecipe
from anatomist.trace.allocator import round_size
from anatomist.trace.autocast import cuda_autocast_policy
from anatomist.trace.cuda_model import cublas_workspace_bytes, cuda_code_paths, fake_parameters
from anatomist.trace.experts import build_kwargs, check_traceable
from anatomist.trace.peft import apply_peft, counted_parameters
from anatomist.trace.records import StepTrace, Trace, curves_of
from anatomist.trace.stack import LAYER_COUNT_FIELDS, Cut, block_lists, cut_workload, traced_attention
from anatomist.trace.tracer import StepTracer
from anatomist.workload import Workload

Depth = int | Cut | None
"""What a trace keeps of the model: every stack cut to that many blocks (int), the layers a `Cut`
names, or the whole model (None)."""


def model_at_depth(workload: Workload, num_layers: int) -> Workload:
    """A copy of the workload whose model has `num_layers` repeated blocks in every stack (the
    per-layer lists repeated, the index lists cut): right for stacks of blocks all alike."""
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


def lower_dtype(recipe: ResolvedRecipe) -> torch.dtype | None:
    """The autocast dtype of `recipe` (None: no autocast)."""
    name = autocast_dtype(recipe)
    return getattr(torch, name) if name else None


def build_optimizer(recipe: ResolvedRecipe, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer the Trainer builds for `recipe` (as it behaves on CUDA: `axes.optimizers`)."""
    return optimizer_spec(recipe.optim).build(params)


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

PEFT_FIELDS = ("peft", "lora_r", "lora_dropout", "lora_target_modules", "load_in_4bit", "load_in_8bit",
               "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype")
"""What changes the model a trace builds under PEFT (which layers, which adapters, what is trainable)."""
PART_FIELDS: dict[str, tuple[str, ...]] = {
    "forward-backward": ("dtype", "gradient_checkpointing", "fp16", "bf16", "attn_implementation",
                         "experts_implementation", *PEFT_FIELDS),
    "inference": ("dtype", "fp16", "bf16", "attn_implementation", "experts_implementation", *PEFT_FIELDS),
    "optimizer": ("dtype", "optim", "fp16", "max_grad_norm", *PEFT_FIELDS),
}
"""The recipe fields that change each part's trace. Recipes that differ only in the
optimizer share the passes' traces and the other way round; batch size, accumulation beyond
2 micro-batches and sharding change no trace (they are arithmetic on it); flash_attention_2
shares SDPA's (`stack.traced_attention`)."""


def part_key(workload: Workload, recipe: ResolvedRecipe, part: Part, depth: Depth, batch_size: int,
             compute_capability: str) -> tuple[Any, ...]:
    """Everything that decides the trace of `part`: the key of the trace caches."""
    if not isinstance(recipe, ResolvedRecipe):  # "auto" would key the same trace twice
        raise TypeError("trace keys take a ResolvedRecipe: recipe.resolved(workload)")
    micro_batches = min(recipe.gradient_accumulation_steps, 2) if part == "forward-backward" else 1
    fields = tuple(traced_attention(recipe) if f == "attn_implementation" else getattr(recipe, f)
                   for f in PART_FIELDS[part])
    return (
        *workload.trace_key(), part, fields, micro_batches,
        depth, batch_size if part != "optimizer" else 1, cublas_workspace_bytes(compute_capability),
    )


def trace_part(workload: Workload, recipe: ResolvedRecipe, part: Part, *, depth: Depth, batch_size: int,
               compute_capability: str, use_cache: bool = True) -> StepTrace:
    """The fake-tensor trace of one part of a step (see `trace_step`), with its ops recorded.

    Served from the trace cache (memory, then disk: `trace.cache`) when the same part was
    traced before with everything that shapes it equal (`part_key`).
    """
    from anatomist.trace import cache

    def run() -> StepTrace:
        return _trace_request(workload, (recipe, part, depth, batch_size), compute_capability)

    if not use_cache:
        return dataclasses.replace(run(), first_micro_batch=None)
    return cache.get_or_trace(part_key(workload, recipe, part, depth, batch_size, compute_capability),
                              lambda: _keep_first_micro_batch(workload, (recipe, part, depth, batch_size),
                                                              compute_capability, run()))


PartRequest = tuple[ResolvedRecipe, Part, Depth, int]
"""A part of a recipe's step at a depth and batch size: what `trace_part` is asked for."""


def trace_parts(workload: Workload, requests: Iterable[PartRequest], compute_capability: str) -> None:
    """Put into the trace cache the parts `requests` name that it lacks, traced side by side in forked
    processes (`trace.pool`). Where they cannot be (one core, not Linux, a job that failed), nothing
    is stored: `trace_part` traces each when asked, in this process. The passes of one micro-batch
    are not traced where those of two are: they are the first of the two."""
    from anatomist.trace import cache, pool

    wanted: dict[tuple[Any, ...], PartRequest] = {}
    derived: set[tuple[Any, ...]] = set()
    for request in requests:
        recipe, part, depth, batch = request
        key = part_key(workload, recipe, part, depth, batch, compute_capability)
        if key in wanted or cache.has(key):
            continue
        wanted[key] = request
        if part == "forward-backward" and recipe.gradient_accumulation_steps > 1:
            derived.add(_first_micro_batch_key(workload, request, compute_capability))
    jobs = sorted(((key, request) for key, request in wanted.items() if key not in derived),
                  key=lambda job: -_size_guess(job[1]))  # the longest first: no long job left for the end
    work = [functools.partial(_trace_request, workload, request, compute_capability) for _, request in jobs]
    for index, trace in pool.run_all(work):
        if trace is not None:
            key, request = jobs[index]
            cache.put(key, _keep_first_micro_batch(workload, request, compute_capability, trace))


def _trace_request(workload: Workload, request: PartRequest, compute_capability: str) -> StepTrace:
    """The trace of `request`, with its ops recorded: what `trace_part` stores, and a worker's job (`trace_parts`)."""
    recipe, part, depth, batch = request
    return trace_step(workload, recipe, depth=depth, batch_size=batch, compute_capability=compute_capability,
                      part=part, record_ops=True)


def _size_guess(request: PartRequest) -> float:
    """How long a part takes to trace, roughly (its ops): blocks, micro-batches, recomputation."""
    recipe, part, depth, _ = request
    blocks = depth if isinstance(depth, int) else depth.blocks if isinstance(depth, Cut) else 100
    if part == "optimizer":
        return blocks
    micro = min(recipe.gradient_accumulation_steps, 2) if part == "forward-backward" else 1
    return 2 * blocks * micro * (1.5 if recipe.gradient_checkpointing else 1)


def _first_micro_batch_key(workload: Workload, request: PartRequest, compute_capability: str) -> tuple[Any, ...]:
    recipe, part, depth, batch = request
    one = dataclasses.replace(recipe, gradient_accumulation_steps=1)
    return part_key(workload, one, part, depth, batch, compute_capability)


def _keep_first_micro_batch(workload: Workload, request: PartRequest, compute_capability: str,
                            traced: StepTrace) -> StepTrace:
    """Store the passes of one micro-batch that a trace of two holds under their own key; the trace without them."""
    from anatomist.trace import cache

    if traced.first_micro_batch is None:
        return traced
    cache.put(_first_micro_batch_key(workload, request, compute_capability), traced.first_micro_batch)
    return dataclasses.replace(traced, first_micro_batch=None)


def trace_step(
    workload: Workload,
    recipe: ResolvedRecipe,
    *,
    depth: Depth,
    batch_size: int,
    compute_capability: str,
    part: Part = "forward-backward",
    fake: bool = True,
    record_ops: bool = False,
    observers: tuple[Any, ...] = (),
) -> StepTrace:
    """Trace one part of a step of `workload` cut to `depth` (an int: blocks per stack; a Cut: those
    layers; None: the full model).

    The estimator traces a training step in two independent parts, so that recipes that
    differ only in the optimizer share the forward/backward trace (and vice versa):
      forward-backward: the micro-batches' forward and backward passes, without optimizer
        state (the caller adds it: it is static through forward and backward);
      optimizer: unscale, clip and step over gradients of every parameter, after a first
        step has created the state.
    "train-step" runs the whole steady-state step in one go (state, passes, optimizer), as
    the Trainer does; with `fake=False` it runs on real CPU tensors.

    Args:
        record_ops: also record each op's cost signature (for the FLOPs and time model).
        observers: further dispatch modes to run inside the trace (e.g. a FlopCounterMode).
    """
    if depth is None:  # a copy all the same: building sets num_labels and pad_token_id on the config
        shallow = dataclasses.replace(workload, config=copy.deepcopy(workload.config))
    else:
        shallow = model_at_depth(workload, depth) if isinstance(depth, int) else cut_workload(workload, depth)
    if workload.task == "sequence-classification" and getattr(shallow.config, "problem_type", None) is None:
        # The loss the Trainer's integer labels get. Left unset, DeBERTa picks the labelled rows
        # with nonzero(), whose size depends on the labels' values: a trace without data cannot
        # follow it. The memory differs by a few bytes per sample.
        shallow.config.problem_type = "single_label_classification" if workload.num_labels > 1 else "regression"
    attn = traced_attention(recipe)
    experts = build_kwargs(workload, recipe)
    fake_mode: Any = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    if fake:
        check_traceable(workload, recipe)
        with torch.device("meta"), contextlib.redirect_stderr(None):
            model = apply_peft(shallow.build_model(attn, recipe.dtype, **experts), recipe, workload.task)
        fake_parameters(model, fake_mode)
    else:
        model = apply_peft(shallow.build_model(attn, recipe.dtype, **experts), recipe, workload.task)
    lower = lower_dtype(recipe)
    tracer = StepTracer(lower_precision_dtype=lower, record_ops=record_ops)
    params = [p for p in model.parameters() if p.requires_grad]  # what the Trainer's optimizer gets
    for p in model.parameters():
        tracer.register(p, MemoryCategory.WEIGHTS)
    for b in model.buffers():
        tracer.register(b, MemoryCategory.WEIGHTS)
    workspace = cublas_workspace_bytes(compute_capability)
    autocast = torch.autocast("cpu", dtype=lower) if lower is not None else contextlib.nullcontext()
    static: dict[MemoryCategory, int] = {}
    with contextlib.ExitStack() as modes:
        modes.enter_context(data_dependent_code_is_input_error(workload, recipe))
        if lower is not None:
            modes.enter_context(cuda_autocast_policy())  # autocast casts as on CUDA, not as on CPU
        for mode in (fake_mode, *observers, tracer, cuda_code_paths()):
            modes.enter_context(mode)
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
                tracer.label_live([p.grad for p in params if p.grad is not None], MemoryCategory.GRADIENTS)
                phases = [Phase.OPTIMIZER]
            optimizer_phase(params, optimizer, recipe, tracer)
    traced = StepTrace(
        phases=phases,
        curves=curves_of(tracer.trace),
        ops=tuple(tracer.trace.ops),
        parameters=counted_parameters(model),
        trainable_parameters=sum(p.numel() for p in params),
        op_count=tracer.trace.op_count,
        static_bytes=static,
    )
    if part == "forward-backward" and tracer.second_micro_batch is not None:
        events, op_count = tracer.second_micro_batch
        first = Trace(allocations=tracer.trace.allocations, events=tracer.trace.events[:events])
        traced.first_micro_batch = dataclasses.replace(traced, curves=curves_of(first), op_count=op_count)
    return traced


@contextlib.contextmanager
def data_dependent_code_is_input_error(workload: Workload, recipe: ResolvedRecipe) -> Iterator[None]:
    """Turn a fake tensor's refusal of a data-dependent op into one clear line (exit code 2).

    Fake tensors have shapes but no values: an op whose output size depends on the values
    (nonzero, masked_select, unique) cannot be traced. Model code that calls one on the step's
    path cannot be estimated offline; the message names the op and the line of model code.

    Raises:
        InputError: in place of torch's DynamicOutputShapeException / DataDependentOutputException.
    """
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        yield
    except (DynamicOutputShapeException, DataDependentOutputException) as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "transformers" in f.filename]
        where = f" in {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
        other = "sdpa" if recipe.attn_implementation == "eager" else "eager"
        experts = (" (if it is a Mixture-of-Experts loop over the experts the router picked: only transformers' "
                   "grouped_mm and batched_mm experts kernels can be estimated)"
                   if workload.config is not None and workload.is_moe else "")
        raise InputError(
            f"{workload.name}: cannot be estimated without data: its code{where} calls {getattr(exc, 'func', exc)}, "
            f"whose output size depends on the values; if that is its attention code, try "
            f"--attn-implementation {other}{experts}"
        ) from None


def create_state(
    params: list[torch.nn.Parameter], recipe: ResolvedRecipe, tracer: StepTracer
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
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, recipe: ResolvedRecipe, tracer: StepTracer
) -> None:
    """Unscale (fp16), clip and step, then free the gradients, as the Trainer does."""
    tracer.phase, tracer.segment, tracer.block = Phase.OPTIMIZER, "pre", -1
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
    recipe: ResolvedRecipe,
    batch_size: int,
    tracer: StepTracer,
    autocast: Any,
) -> None:
    model.train()
    if recipe.gradient_checkpointing:
        # transformers' methods (the newer name first): not nn.Module's, so typed Any
        enable: Any = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
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
        tracer.begin_micro_batch(micro)
        tracer.phase, tracer.segment, tracer.block = Phase.FORWARD, "pre", -1
        batch = make_batch(workload, batch_size)
        with autocast:
            loss = model(**batch).loss
        loss = loss / recipe.gradient_accumulation_steps
        del batch
        tracer.label_phase_survivors(Phase.FORWARD, MemoryCategory.ACTIVATIONS)
        tracer.phase, tracer.segment, tracer.block = Phase.BACKWARD, "post", -1
        if scale is not None:
            loss = loss * scale
        loss.backward()
        del loss
        tracer.label_live([p.grad for p in params if p.grad is not None], MemoryCategory.GRADIENTS)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _watch_blocks(model: torch.nn.Module, tracer: StepTracer) -> None:
    """Mark the segments "pre", "blocks", "post" of forward and backward, and in "blocks" which
    block runs, through hooks (the blocks: `stack.block_lists`, in the model's order).

    Forward enters block i at its input. Backward runs the other way: it enters the last block
    when the gradient of its output exists, block i - 1 when the gradient of block i's input
    does, and "pre" at the gradient of the first block's input.
    """
    blocks = [b for _, modules in block_lists(model, model.config) for b in modules]
    if not blocks:
        return
    last = len(blocks) - 1

    def enter(block: int) -> Any:
        def hook(*_: Any) -> None:
            tracer.segment, tracer.block = ("blocks", block) if block >= 0 else ("pre", -1)

        return hook

    def enter_block(block: int) -> Any:
        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if tracer.phase is not Phase.FORWARD:
                return  # recomputation under gradient checkpointing
            tracer.segment, tracer.block = "blocks", block
            hidden = _first_tensor(args) if args else _first_tensor(kwargs.get("hidden_states"))
            if hidden is not None and hidden.requires_grad:
                hidden.register_hook(enter(block - 1))

        return hook

    def leave_blocks(_module: Any, _args: Any, output: Any) -> None:
        if tracer.phase is not Phase.FORWARD:
            return
        tracer.segment, tracer.block = "post", -1
        hidden = _first_tensor(output)
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(enter(last))

    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(enter_block(i), with_kwargs=True)
    blocks[last].register_forward_hook(leave_blocks)


def _inference_step(
    model: torch.nn.Module, workload: Workload, batch_size: int, tracer: StepTracer, autocast: Any
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
