"""The passes of a traced step: the Trainer's forward and backward over the micro-batches (with
gradient checkpointing, torch.compile's blocks, fp16's loss scale, FSDP's gradient sync and TRL's
activation offloading as the recipe has them), and an inference forward; hooks mark which block runs.
`driver.trace_step` runs them under the tracer.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

from anatomist.anatomy import MemoryCategory, Phase
from anatomist.errors import InputError
from anatomist.recipe import ResolvedRecipe
from anatomist.trace.depth.cuts import Depth
from anatomist.trace.depth.layout import block_lists, checkpoint_partially
from anatomist.trace.engine.tracer import StepTracer
from anatomist.trace.step import fsdp as sharded
from anatomist.trace.step import trainers
from anatomist.trace.step.compiled import compile_blocks
from anatomist.trace.step.inputs import cache_field, make_batch
from anatomist.trace.store.keys import compile_context, traced_compile, traced_micro_batches
from anatomist.workload import Workload


def enable_checkpointing(model: torch.nn.Module, depth: Depth, recipe: ResolvedRecipe) -> None:
    """transformers' own activation_checkpointing_enable (offloading when the recipe does), then only the layers
    the recipe checkpoints (`layout.checkpoint_partially`: numbered as in the full model, not the cut).

    Raises:
        InputError: offload asked of a transformers whose checkpointing has none.
    """
    # transformers' methods (the newer name first): not nn.Module's, so typed Any
    enable: Any = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    if not recipe.checkpoint_offload:
        enable()
    elif "offload" in inspect.signature(enable).parameters:
        enable(offload=True)
    else:
        import transformers

        raise InputError(f"checkpoint_offload: transformers {transformers.__version__} cannot offload checkpoints "
                         "(activation_checkpointing_enable(offload=...)); upgrade transformers or leave it off")
    checkpoint_partially(model, depth, recipe)


def forward_backward(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    workload: Workload,
    recipe: ResolvedRecipe,
    batch_size: int,
    tracer: StepTracer,
    autocast: Any,
    reference: torch.nn.Module | None = None,
    depth: Depth = None,
) -> None:
    """The micro-batches' forward and backward passes of `model` (cut to `depth`)."""
    model.train()
    if recipe.gradient_checkpointing:
        enable_checkpointing(model, depth, recipe)
    if traced_compile(recipe):
        compile_blocks(model, tracer, compile_context(workload, recipe))
    scale: torch.Tensor | None = None
    if recipe.fp16:  # GradScaler: scale and growth tracker on the device
        tracer.phase = Phase.SETUP
        scaler_state = [torch.full((), 65536.0), torch.zeros((), dtype=torch.int32)]
        tracer.label_live(scaler_state, MemoryCategory.FUNCTIONALITY)
        scale = scaler_state[0]
    _watch_blocks(model, tracer)
    if reference is not None:
        _watch_blocks(reference, tracer)  # DPO's reference forward: its blocks as the policy's
    # Two micro-batches when gradients accumulate: the second forward runs with gradients alive.
    micro_batches = traced_micro_batches(recipe, "forward-backward")
    for micro in range(micro_batches):
        tracer.begin_micro_batch(micro)
        tracer.phase, tracer.segment, tracer.block = Phase.FORWARD, "pre", -1
        # FSDP reduces at the last micro-batch only; TRL's offloading wraps each micro-batch's forward and backward
        with sharded.gradient_sync(model, micro == micro_batches - 1), _offloading(model, recipe, tracer, batch_size):
            with autocast:
                loss = trainers.step_loss(model, reference, workload, recipe, batch_size)
            loss = loss / recipe.gradient_accumulation_steps
            tracer.label_phase_survivors(Phase.FORWARD, MemoryCategory.ACTIVATIONS)
            tracer.phase, tracer.segment, tracer.block = Phase.BACKWARD, "post", -1
            if scale is not None:
                loss = loss * scale
            loss.backward()
            del loss
        tracer.label_live([p.grad for p in params if p.grad is not None] + sharded.accumulated_gradients(model),
                          MemoryCategory.GRADIENTS)


def _offloading(model: torch.nn.Module, recipe: ResolvedRecipe, tracer: StepTracer, batch_size: int) -> Any:
    """TRL's activation offloading around one micro-batch's forward and backward, where the recipe has it."""
    if not recipe.activation_offloading:
        return contextlib.nullcontext()
    from anatomist.trace.step.offload import offloaded_activations

    return offloaded_activations(model, tracer, batch_size)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _watch_blocks(model: torch.nn.Module, tracer: StepTracer) -> None:
    """Mark the segments "pre", "blocks", "post" of forward and backward, and in "blocks" which
    block runs, through hooks (the blocks: `layout.block_lists`, in the model's order).

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


def inference_step(
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
    field = cache_field(out)
    cache = getattr(out, field) if field is not None else None
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
