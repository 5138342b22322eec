"""Drive one part of a training (or inference) step of a real Transformers model under the tracer.

The step is the Trainer's: forward under autocast, loss / accumulation steps, backward
(loss-scaled under fp16), gradient clipping, optimizer step, zero_grad(set_to_none=True).
The optimizer state a first step would create is made before the traced step, so the step
is a steady-state one; two micro-batches run when gradients accumulate, so that a forward
pass happens with gradients already alive (`keys.traced_micro_batches`).

What the model is (`configs.traced_config`), what it is fed (`inputs.make_batch`) and which
traces are kept (`parts`, `keys`, `cache`) live beside this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from anatomist.anatomy import MemoryCategory, Phase
from anatomist.errors import InputError
from anatomist.hardware import cublas_workspace_bytes
from anatomist.recipe import ResolvedRecipe
from anatomist.recipe.axis_values import autocast_dtype
from anatomist.trace.depth.configs import traced_config
from anatomist.trace.depth.lengths import kept_events
from anatomist.trace.engine.autocast import cuda_autocast_policy
from anatomist.trace.engine.cuda_paths import (
    cuda_code_paths,
    cuda_grouped_mm,
    fake_parameters,
    flash_attention_casts,
    saved_on_host,
)
from anatomist.trace.engine.records import RankEvents, StepTrace, Trace, curves_of
from anatomist.trace.engine.tracer import StepTracer
from anatomist.trace.standins.zero3_linear import zero3_linear
from anatomist.trace.step import context_parallel, sequence_parallel, tensor_parallel, trainers
from anatomist.trace.step import fsdp as sharded
from anatomist.trace.step.experts import build_kwargs, check_traceable, compiled_experts_path, routed_as
from anatomist.trace.step.fp8 import convert_to_fp8
from anatomist.trace.step.inputs import make_batch, rows_not_packed
from anatomist.trace.step.optimizer_build import build_optimizer, import_optimizer_module
from anatomist.trace.step.passes import forward_backward, inference_step
from anatomist.trace.step.peft import apply_peft, counted_parameters
from anatomist.trace.store.keys import (
    Depth,
    Part,
    flash_attention_cast,
    traced_attention,
    traced_compile,
    traced_world,
    traced_zero3_linear,
)
from anatomist.workload import Workload


def lower_dtype(recipe: ResolvedRecipe) -> torch.dtype | None:
    """The autocast dtype of `recipe` (None: no autocast)."""
    name = autocast_dtype(recipe)
    return getattr(torch, name) if name else None


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
    num_gpus: int = 1,
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
        num_gpus: the devices; an FSDP recipe is traced as one rank of that many (`trace.step.fsdp`), a tensor
            parallel one as one rank of its world (`keys.traced_world`), any other as one device.
    """
    if part in ("optimizer", "train-step"):
        import_optimizer_module(recipe)  # not under the tracer: see OptimizerSpec.optimizer_class
    fake_mode: Any = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    if recipe.sequence_parts > 1:  # a rank holds its part of each sequence (context_parallel.py, sequence_parallel.py)
        workload = dataclasses.replace(workload, seq_len=workload.seq_len // recipe.sequence_parts)
    with contextlib.ExitStack() as world:
        model, tracer = _model_and_tracer(world, workload, recipe, depth, fake_mode if fake else None, num_gpus,
                                          record_ops)
        reference = traced_reference(workload, recipe, depth, fake_mode if fake else None) if part != "optimizer" else None
        params = [p for p in model.parameters() if p.requires_grad]  # what the Trainer's optimizer gets
        _register_weights(tracer, model, reference)
        ring = _ring(model, recipe) if part != "optimizer" else None
        if recipe.sp_size > 1 and part != "optimizer":
            world.enter_context(sequence_parallel.ulysses_attention(model, recipe.sp_size, batch_size))
        with _tracing(workload, recipe, tracer, fake_mode, observers, ring), routed_as(workload, recipe), \
                _kernels(model, workload, recipe, part, compute_capability, fake):
            # cuBLAS workspaces live from the first matrix product on: one for the main thread's
            # handle and, in training, one for the autograd engine's device thread. A steady-state
            # step starts with both.
            tracer.phase = Phase.SETUP
            for _ in range(1 if part == "inference" else 2):
                tracer.allocate_extra(cublas_workspace_bytes(compute_capability), MemoryCategory.FUNCTIONALITY)
            phases, static = _run_part(part, model, params, workload, recipe, batch_size, tracer, reference, depth)
        tracer.stop()
        return _step_trace(tracer, model, params, phases, static, part, traced_world(recipe, num_gpus))


def _model_and_tracer(world: contextlib.ExitStack, workload: Workload, recipe: ResolvedRecipe, depth: Depth,
                      fake_mode: Any | None, num_gpus: int, record_ops: bool) -> tuple[torch.nn.Module, StepTracer]:
    """The traced model (`traced_model`) and its tracer: one device's, or one rank's of a fake world entered on `world`
    (FSDP: trace/step/fsdp.py; tensor parallel, with or without FSDP: trace/step/tensor_parallel.py)."""
    split = recipe.split_by_transformers
    if (split or recipe.sequence_parts > 1) and fake_mode is None:
        raise InputError("a tensor, expert, context or sequence parallel step is traced on fake tensors only: a real "
                         "CPU step of one rank needs the other ranks")
    tracer = StepTracer(lower_precision_dtype=lower_dtype(recipe), record_ops=record_ops)
    if fake_mode is None or (recipe.fsdp == "none" and not split and recipe.sequence_parts == 1):
        return traced_model(workload, recipe, depth, fake_mode), tracer
    ranks = traced_world(recipe, num_gpus)
    if recipe.fsdp == "none" and not split:  # a sequence's group alone (one device's ops; ZeRO's Ulysses): its ranks
        world.enter_context(sharded.fake_process_group(ranks))
        return traced_model(workload, recipe, depth, fake_mode), tracer
    if split:
        meshes = world.enter_context(tensor_parallel.fake_world(ranks, recipe.tp_size, recipe.ep_size))
        model = traced_model(workload, recipe, depth, fake_mode,
                             (meshes, tensor_parallel.distributed_config(recipe, ranks), recipe.fsdp != "none"))
    else:
        model = traced_model(workload, recipe, depth, fake_mode)
        mesh = world.enter_context(sharded.fake_world(ranks))
        with fake_mode:
            sharded.wrap(model, recipe, mesh)
    tracer = sharded.ShardedStepTracer(lower_precision_dtype=lower_dtype(recipe), record_ops=record_ops,
                                       offload=recipe.offload == "cpu").watching(model)
    return model, tracer


def _ring(model: torch.nn.Module, recipe: ResolvedRecipe) -> Any:
    """Under context parallel, SDPA's ring attention over this rank's group, the model's attention hooked as accelerate
    hooks it (trace/step/context_parallel.py); else None."""
    if recipe.cp_size == 1:
        return None
    context_parallel.attach_hooks(model)
    return context_parallel.ring_attention(context_parallel.ring_group(recipe.cp_size))


def _register_weights(tracer: StepTracer, *models: torch.nn.Module | None) -> None:
    """Every parameter and buffer of `models` (the policy, DPO's reference model) as weights."""
    for held in (m for m in models if m is not None):
        for p in held.parameters():
            tracer.register(p, MemoryCategory.WEIGHTS)
        for b in held.buffers():
            tracer.register(b, MemoryCategory.WEIGHTS)


def traced_model(workload: Workload, recipe: ResolvedRecipe, depth: Depth, fake_mode: Any | None,
                 tp_world: tuple[Any, Any, bool] | None = None) -> torch.nn.Module:
    """The model of `workload` cut to `depth` as `recipe` trains it (split as transformers splits it at load time where
    `tp_world` gives the meshes, the DistributedConfig and whether FSDP shards: `tensor_parallel.parallelize`; PEFT applied, FP8 layers
    converted): on fake tensors in `fake_mode` (built on the meta device first: no memory), else real CPU tensors."""
    config = traced_config(workload, depth)
    experts = build_kwargs(workload, recipe)
    if fake_mode is None:
        base = workload.build_model(traced_attention(recipe), recipe.dtype, config=config, **experts)
        model = apply_peft(base, recipe, workload.task)
        trainers.prepare(model, recipe)
        convert_to_fp8(model, recipe)
        return model
    check_traceable(workload, recipe)
    with torch.device("meta"), contextlib.redirect_stderr(None):
        base = workload.build_model(traced_attention(recipe), recipe.dtype, config=config, **experts)
        model = apply_peft(base, recipe, workload.task)
    fake_parameters(model, fake_mode)
    if tp_world is not None:
        with fake_mode:
            tensor_parallel.parallelize(model, *tp_world)
    trainers.prepare(model, recipe)
    convert_to_fp8(model, recipe)  # as accelerate's prepare does, after PEFT and before FSDP
    return model


def traced_reference(workload: Workload, recipe: ResolvedRecipe, depth: Depth, fake_mode: Any | None) -> Any:
    """DPO's reference model where the trainer holds a copy (`trainers.needs_reference_copy`), built as the
    policy's base in its load dtype; else None."""
    if not trainers.needs_reference_copy(recipe):
        return None
    config = traced_config(workload, depth)
    experts = build_kwargs(workload, recipe)
    with torch.device("meta") if fake_mode is not None else contextlib.nullcontext(), contextlib.redirect_stderr(None):
        reference = workload.build_model(traced_attention(recipe), recipe.dtype, config=config, **experts)
    if fake_mode is not None:
        fake_parameters(reference, fake_mode)
    trainers.prepare_reference(reference)
    return reference


def _kernels(model: torch.nn.Module, workload: Workload, recipe: ResolvedRecipe, part: Part, compute_capability: str,
             fake: bool) -> Any:
    """The training kernels the recipe swaps in (Liger's, Cut Cross-Entropy's), as stand-ins; nothing
    otherwise."""
    if not (recipe.use_liger_kernel or recipe.cut_cross_entropy) or part == "inference":
        return contextlib.nullcontext()
    if not fake:
        what = "Liger Kernel's" if recipe.use_liger_kernel else "Cut Cross-Entropy's"
        raise InputError(f"{what} Triton kernels need a GPU: a real CPU step cannot run them")
    if recipe.cut_cross_entropy:
        from anatomist.trace.standins.cce import cut_cross_entropy

        return cut_cross_entropy(model)
    from anatomist.trace.standins.liger_kernels import liger_kernels

    return liger_kernels(model, workload.model_type, compute_capability, fused_loss=recipe.trainer == "trainer")


@contextlib.contextmanager
def _tracing(workload: Workload, recipe: ResolvedRecipe, tracer: StepTracer, fake_mode: Any,
             observers: tuple[Any, ...], ring: Any = None) -> Iterator[None]:
    """The dispatch modes a traced step runs in, outermost first: errors made readable, CUDA's autocast
    policy, fake tensors, CUDA's grouped products (Mixture of Experts), the observers, the tracer, CUDA's code
    paths (with context parallel's `ring` attention, under torch's ring options)."""
    with contextlib.ExitStack() as modes:
        modes.enter_context(data_dependent_code_is_input_error(workload, recipe))
        if flash_attention_cast(recipe):
            modes.enter_context(flash_attention_casts())
        if isinstance(fake_mode, FakeTensorMode):
            modes.enter_context(rows_not_packed(recipe))
            if recipe.checkpoint_offload:
                modes.enter_context(saved_on_host(tracer))
        if lower_dtype(recipe) is not None:
            modes.enter_context(cuda_autocast_policy())  # autocast casts as on CUDA, not as on CPU
        modes.enter_context(fake_mode)
        if workload.is_moe and isinstance(fake_mode, FakeTensorMode):
            modes.enter_context(cuda_grouped_mm())  # the experts' products in float32 too, as on CUDA
        if workload.is_moe and traced_compile(recipe):
            modes.enter_context(compiled_experts_path())  # what transformers runs under dynamo
        if ring is not None:
            modes.enter_context(context_parallel.ring_options())
        if traced_zero3_linear(recipe):
            modes.enter_context(zero3_linear())
        for mode in (*observers, tracer, cuda_code_paths(tracer, ring)):
            modes.enter_context(mode)
        yield


def _run_part(part: Part, model: torch.nn.Module, params: list[torch.nn.Parameter], workload: Workload,
              recipe: ResolvedRecipe, batch_size: int, tracer: StepTracer, reference: torch.nn.Module | None = None,
              depth: Depth = None) -> tuple[list[Phase], dict[MemoryCategory, int]]:
    """Run `part` of the step; (the phases it ran, the static bytes it made: the optimizer state)."""
    lower = lower_dtype(recipe)
    autocast = torch.autocast("cpu", dtype=lower) if lower is not None else contextlib.nullcontext()
    if part == "inference":
        inference_step(model, workload, batch_size, tracer, autocast)
        return [Phase.FORWARD], {}
    if part == "forward-backward":
        forward_backward(model, params, workload, recipe, batch_size, tracer, autocast, reference, depth)
        return [Phase.FORWARD, Phase.BACKWARD], {}
    optimizer, state_bytes = create_state(params, recipe, tracer)
    if part == "train-step":
        forward_backward(model, params, workload, recipe, batch_size, tracer, autocast, reference, depth)
        phases = [Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER]
    else:
        likes = _gradients_as_backward_leaves_them(model, params, workload, tracer) if recipe.split_by_transformers else params
        for p, like in zip(params, likes, strict=True):
            p.grad = torch.zeros_like(like)  # what backward leaves behind
        tracer.label_live([p.grad for p in params if p.grad is not None], MemoryCategory.GRADIENTS)
        phases = [Phase.OPTIMIZER]
    optimizer_phase(params, optimizer, recipe, tracer)
    return phases, {MemoryCategory.OPTIMIZER_STATES: state_bytes}


def _gradients_as_backward_leaves_them(model: torch.nn.Module, params: list[torch.nn.Parameter], workload: Workload,
                                       tracer: StepTracer) -> list[torch.Tensor]:
    """The gradient backward leaves in each of `params`, from one unrecorded pass of one sample: under tensor parallel
    a weight's gradient may be placed otherwise than the weight (the input embeddings split by vocabulary get a whole
    gradient on every rank: DTensor's embedding backward), so a gradient made like its weight would be too small."""
    with tracer.paused():
        model(**make_batch(workload, 1)).loss.backward()
        likes = [p.grad if p.grad is not None else p for p in params]
        for p in params:
            p.grad = None
    return likes


def _step_trace(tracer: StepTracer, model: torch.nn.Module, params: list[torch.nn.Parameter], phases: list[Phase],
                static: dict[MemoryCategory, int], part: Part, world: int) -> StepTrace:
    """What a trace keeps: the curves and ops, the parameters, and, of a forward-backward trace of two
    micro-batches, the first micro-batch on its own; its events: of the passes on one device (to other sequence
    lengths), of one rank of FSDP (on `world` ranks, to other world sizes)."""
    traced = StepTrace(
        phases=phases,
        curves=curves_of(tracer.trace),
        ops=tuple(tracer.trace.ops),
        parameters=counted_parameters(model),
        trainable_parameters=sum(p.numel() for p in params),
        op_count=tracer.trace.op_count,
        static_bytes=static,
        offloaded_bytes=tracer.trace.offloaded_bytes,
    )
    one_device = not isinstance(tracer, sharded.ShardedStepTracer)
    if one_device and part != "optimizer":
        traced.events = kept_events(tracer.trace.allocations, tracer.trace.events)
    if part == "forward-backward" and tracer.second_micro_batch is not None:
        events, op_count = tracer.second_micro_batch
        first = Trace(allocations=tracer.trace.allocations, events=tracer.trace.events[:events])
        traced.first_micro_batch = dataclasses.replace(
            traced, curves=curves_of(first), op_count=op_count,
            events=kept_events(first.allocations, first.events) if one_device else None)
    if isinstance(tracer, sharded.ShardedStepTracer):
        traced.rank = RankEvents(world=world, rows_divisor=sharded.rows_divisor(model),
                                 trace=dataclasses.replace(tracer.trace, ops=[]), states=tracer.state_storages)
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
                   if workload.is_moe else "")
        raise InputError(
            f"{workload.name}: cannot be estimated without data: its code{where} calls {getattr(exc, 'func', exc)}, "
            f"whose output size depends on the values; if that is its attention code, try "
            f"--attn-implementation {other}{experts}"
        ) from None


def create_state(
    params: list[torch.nn.Parameter], recipe: ResolvedRecipe, tracer: StepTracer
) -> tuple[torch.optim.Optimizer, int]:
    """The optimizer, with the state a first step creates (from zero gradients)."""
    optimizer = build_optimizer(recipe, tensor_parallel.mesh_groups(params) if recipe.split_by_transformers else params)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    tracer.label_live(states, MemoryCategory.OPTIMIZER_STATES)
    return optimizer, tracer.state_bytes(states)


def optimizer_phase(
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, recipe: ResolvedRecipe, tracer: StepTracer
) -> None:
    """Unscale (fp16), clip and step, then free the gradients, as the Trainer does."""
    tracer.phase, tracer.segment, tracer.block = Phase.OPTIMIZER, "pre", -1
    grads = [p.grad for p in params if p.grad is not None]
    if recipe.fp16:
        torch._foreach_mul_(grads, 1.0 / 65536.0)  # GradScaler.unscale_ works in place
    if recipe.max_grad_norm > 0:
        if recipe.split_by_transformers:
            tensor_parallel.clip_by_mesh(params, recipe.max_grad_norm)
        else:
            torch.nn.utils.clip_grad_norm_(params, recipe.max_grad_norm, foreach=True)
    del grads
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
