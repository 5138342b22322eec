"""torch.compile predicted on fake tensors: what inductor keeps for backward, and what its fused
kernels move.

With `recipe.torch_compile` each repeated block of the traced model (`layout.block_lists`) runs as
inductor would run it, traced on the same fake tensors as the rest of the step:

- Graph and partition: the block's forward and backward are captured by AOTAutograd
  (`aot_function`, inductor's decompositions) and split by inductor's own partition function
  (`torch._inductor.compile_fx.partition_fn`: its joint-graph passes, then the min-cut
  rematerialization partitioner). What the forward graph returns besides the block's output is
  what the compiled block keeps for backward; the memory trace sees exactly those tensors live.
- Kernels (`fusion_plan`): inductor's code generation is not run (it needs Triton and a GPU for
  a CUDA target). Its fusion is approximated: matrix products and attention are separate
  (extern) kernels; the other ops between them fuse, a group being the ops connected by
  producer-consumer edges with no extern kernel between them (`_levels`). A fused kernel reads
  its inputs and writes the outputs used outside it once; the values inside it are never stored.
  The memory trace therefore skips the tensors inside a group (they live in registers), and the
  time trace records one op per kernel: its bytes moved, its approximate FLOPs.
- One graph per kind of block: blocks with the same code, parameter shapes and inputs share the
  compiled graphs (torch.compile reuses one graph for identical layers the same way). The graphs also
  outlive the trace, for the next trace of the same recipe in this process (`KEPT_GRAPHS`): the traces
  of a recipe at two depths run the same blocks on the same inputs, and capturing and partitioning them
  is most of a compiled trace's time.

Known limitations (approximations): inductor's scheduler and autotuning are not run, so its real
kernel boundaries (a reduction it will not fuse with a differently shaped one, a pointwise epilogue it
fuses into a matrix product under max-autotune) differ from the groups here; the embeddings, the
head and the loss run eager (torch.compile of the whole model would compile them too); a block is
compiled once per kind, so graph breaks and recompilations are not modelled; under gradient
checkpointing the blocks stay eager (passes.forward_backward): AOTAutograd's compiled function run
inside transformers' non-reentrant checkpoint on fake tensors kept its saved tensors and skipped the
recomputation, so a checkpointed compiled step is predicted as the checkpointed eager one (its memory
is right: a checkpointed block keeps only its inputs either way; its time lacks fusion's saving, an
upper bound); compile time is not part of the step. Independent check:
tests/test_compiled.py compares the bytes kept for backward with a real inductor step on CPU tensors
(every block compiled, saved-tensor hooks), and the fused traffic of a small graph with bytes counted
by hand.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree
from transformers.cache_utils import Cache

from anatomist.anatomy import OpClass, Phase
from anatomist.op_classes import base_name, classify, is_view
from anatomist.trace.depth.layout import block_lists
from anatomist.trace.engine.op_costs import op_signature, per_element_flops, tensors_in
from anatomist.trace.engine.tracer import StepTracer

EXTERN_OPS: tuple[str, ...] = ("_scaled_dot_product_flash_attention_for_cpu",
                               "_scaled_dot_product_flash_attention_for_cpu_backward",
                               "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
                               "_grouped_mm", "sort", "topk", "nonzero")
"""Ops inductor runs as their own kernels besides the contraction class (op_classes.toml): attention
and grouped products call their library kernels, sorting and data-dependent ops fall back to ATen
(torch/_inductor/lowering.py: `make_fallback`)."""
_PLAIN_VALUES = (type(None), bool, int, float, str, torch.dtype, torch.device)
"""Non-tensor arguments a block may take and still be compiled (they become part of the graph's key)."""


@dataclass(frozen=True, slots=True)
class FusionPlan:
    """How one AOT graph runs as inductor's kernels (see the module docstring)."""

    quiet: frozenset[str]
    """Nodes whose values stay inside a fused kernel (and views of them): never stored."""
    ops: tuple[tuple[Any, ...], ...]
    """One cost signature per kernel, in graph order, without its phase (`Signature` less field 2)."""


KEPT_GRAPHS = 16
"""Compiled graphs kept for later traces in this process, the most recently used (a long-lived process, `serve`,
traces many recipes)."""


@dataclass(slots=True)
class _Graph:
    """A kind of block's compiled forward (its backward inside), and the tracer of the step that runs it now."""

    tracer: StepTracer
    run: Callable[..., Any] | None = None


_graphs: collections.OrderedDict[tuple[Any, ...], _Graph] = collections.OrderedDict()


def compile_blocks(model: torch.nn.Module, tracer: StepTracer, context: tuple[Any, ...]) -> None:
    """Make every repeated block of `model` run compiled, as the module docstring says. The model is the
    traced copy (`driver.traced_model`): its blocks' `forward` are replaced for good. `context` is what else
    shapes the blocks' code (the model's config, the recipe): a graph serves later traces of the same context."""
    for _, modules in block_lists(model, model.config):
        for block in modules:
            block.forward = _CompiledBlock(block, tracer, context)  # type: ignore[method-assign]


class _CompiledBlock:
    """A block's forward through the compiled graphs of its kind (`_graphs`)."""

    def __init__(self, block: torch.nn.Module, tracer: StepTracer, context: tuple[Any, ...]):
        self.block, self.tracer, self.context = block, tracer, context
        self.eager = type(block).forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        # The KV cache a training forward fills (transformers makes one unless told not to) dies with
        # the model's output, before backward: the compiled block does not fill it.
        flat = [None if isinstance(v, Cache) else v for v in flat]
        if not all(isinstance(v, (torch.Tensor, *_PLAIN_VALUES)) for v in flat):
            return self.eager(self.block, *args, **kwargs)  # a cache object or the like: left eager
        names = [n for n, _ in self.block.named_parameters()] + [n for n, _ in self.block.named_buffers()]
        state = [t for _, t in self.block.named_parameters()] + [t for _, t in self.block.named_buffers()]
        inputs = [v for v in flat if isinstance(v, torch.Tensor)]
        key = (self.context, type(self.block), spec, tuple(None if isinstance(v, torch.Tensor) else v for v in flat),
               tuple(names), tuple(_meta(t) for t in state + inputs), torch.is_grad_enabled(),
               torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        graph = _graphs.get(key)
        if graph is None:
            graph = _Graph(self.tracer)
            graph.run = self._compile(names, flat, spec, state, inputs, graph)
            _graphs[key] = graph
            while len(_graphs) > KEPT_GRAPHS:
                _graphs.popitem(last=False)
        _graphs.move_to_end(key)
        graph.tracer = self.tracer
        assert graph.run is not None
        return graph.run(*state, *inputs)

    def _compile(self, names: list[str], flat: list[Any], spec: pytree.TreeSpec, state: list[torch.Tensor],
                 inputs: list[torch.Tensor], graph: _Graph) -> Callable[..., Any]:
        from torch._functorch.aot_autograd import aot_function
        from torch._guards import detect_fake_mode
        from torch._inductor.compile_fx import partition_fn
        from torch._inductor.decomposition import select_decomp_table
        from torch._inductor.virtualized import V

        positions = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        plain = [None if isinstance(v, torch.Tensor) else v for v in flat]  # the graph keeps no tensor of this step
        block, eager = self.block, self.eager

        def run(*values: torch.Tensor) -> Any:
            full = list(plain)
            for i, value in zip(positions, values[len(state):], strict=True):
                full[i] = value
            args, kwargs = pytree.tree_unflatten(full, spec)
            with torch.nn.utils.stateless._reparametrize_module(block, dict(zip(names, values[:len(state)], strict=True))):
                return eager(block, *args, **kwargs)

        compiler = functools.partial(_fused_runner, graph=graph)
        compiled = aot_function(run, fw_compiler=compiler, bw_compiler=compiler, partition_fn=partition_fn,
                                decompositions=select_decomp_table(), num_params_buffers=len(state))
        with _tracer_paused(), self.tracer.paused(), V.set_fake_mode(detect_fake_mode(inputs)):
            # The first run traces and partitions, unrecorded, on stand-ins: AOTAutograd keeps what it first ran on,
            # which would hold a tensor of this step (the first block's input) to its end.
            compiled(*(_stand_in(t) for t in (*state, *inputs)))
        return compiled


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A new tensor of `t`'s shape, strides, dtype and requires_grad."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).requires_grad_(t.requires_grad)


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad)


@contextlib.contextmanager
def _tracer_paused() -> Iterator[None]:
    """Take the dispatch modes above the fake-tensor mode off the stack (the tracer, observers) while
    AOTAutograd traces, so they see the compiled graphs run but not their tracing."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    popped = []
    while _get_current_dispatch_mode_stack() and not isinstance(_get_current_dispatch_mode_stack()[-1], FakeTensorMode):
        popped.append(_pop_mode())
    try:
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)


def _fused_runner(gm: fx.GraphModule, example_inputs: Any, *, graph: _Graph) -> Callable[..., Any]:
    """AOTAutograd's compiler for the forward and the backward graph: run it op by op under the tracer of the
    step that runs it, the values inside fused kernels unrecorded, one op signature per kernel (`fusion_plan`)."""
    plan = fusion_plan(gm.graph)

    def call(args: list[Any]) -> Any:
        tracer = graph.tracer
        if tracer.is_paused:
            return fx.Interpreter(gm).boxed_run(args)
        with tracer.kernels(plan.ops):
            return _Quiet(gm, plan.quiet, tracer).boxed_run(args)

    call._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd passes a list it may clear
    return call


class _Quiet(fx.Interpreter):
    """Runs a graph node by node, the nodes of `quiet` without the tracer recording their tensors."""

    def __init__(self, gm: fx.GraphModule, quiet: frozenset[str], tracer: StepTracer) -> None:
        super().__init__(gm)
        self.quiet, self.tracer = quiet, tracer

    def run_node(self, n: fx.Node) -> Any:
        if n.name not in self.quiet:
            return super().run_node(n)
        with self.tracer.paused():
            return super().run_node(n)


# --- fusion --------------------------------------------------------------------------------------

def _op_name(n: fx.Node) -> str:
    """`aten::mul.Tensor` -> `mul`, `prims::convert_element_type` -> `convert_element_type`."""
    target = n.target
    if isinstance(target, torch._ops.OpOverload):
        return base_name(str(target.name()).split("::")[-1])
    return getattr(target, "__name__", str(target))


def _is_view(n: fx.Node) -> bool:
    """No kernel: a view of its first input (or an element of a multi-output op's result)."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return True
    return isinstance(n.target, torch._ops.OpOverload) and (is_view(_op_name(n)) or bool(n.target.is_view))


def _is_extern(n: fx.Node) -> bool:
    return n.op == "call_function" and not _is_view(n) and (
        classify(_op_name(n)) is OpClass.CONTRACTION or _op_name(n) in EXTERN_OPS)


def _source(n: fx.Node) -> fx.Node:
    """The node whose storage `n` shows: itself, or through views the node that made it."""
    while _is_view(n) and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(value))


def _levels(graph: fx.Graph) -> dict[fx.Node, int]:
    """Extern kernels on the longest path from the graph's inputs to each node. Ops fused into one
    kernel must share a level: a path from one to the other through an extern kernel would make the
    fused kernel depend on itself."""
    level: dict[fx.Node, int] = {}
    for n in graph.nodes:
        level[n] = max((level[u] + int(_is_extern(u)) for u in n.all_input_nodes), default=0)
    return level


def fusion_plan(graph: fx.Graph) -> FusionPlan:
    """Group the graph's ops into kernels as the module docstring says, and cost each kernel."""
    level = _levels(graph)
    kernels = [n for n in graph.nodes if n.op == "call_function" and not _is_view(n)]
    fusible = {n for n in kernels if not _is_extern(n)}
    parent = {n: n for n in fusible}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in fusible:
        for u in n.all_input_nodes:
            s = _source(u)
            if s in fusible and level[s] == level[n]:
                parent[find(n)] = find(s)
    group_of = {n: find(n) for n in fusible}

    def escapes(n: fx.Node, group: fx.Node) -> bool:
        """Whether a value made in `group` is needed outside it (then it is stored)."""
        return any(user.op == "output" or (escapes(user, group) if _is_view(user) else group_of.get(user) is not group)
                   for user in n.users)

    stored = {n for n in fusible if escapes(n, group_of[n])}
    quiet = {n.name for n in fusible if n not in stored}
    quiet |= {n.name for n in graph.nodes if _is_view(n) and _source(n).name in quiet}
    ops: list[tuple[Any, ...]] = []
    seen: set[fx.Node] = set()
    for n in kernels:
        if n in fusible:
            group = group_of[n]
            if group not in seen:
                seen.add(group)
                ops.append(_kernel_signature([m for m in kernels if group_of.get(m) is group], stored))
        else:
            ops.append(_extern_signature(n))
    return FusionPlan(quiet=frozenset(quiet), ops=tuple(ops))


def _value(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else n


def _extern_signature(n: fx.Node) -> tuple[Any, ...]:
    args = pytree.tree_map(_value, n.args)
    kwargs = pytree.tree_map(_value, n.kwargs)
    sig = op_signature(n.target, args, kwargs, n.meta.get("val"), Phase.FORWARD)
    return sig[:2] + sig[3:]


def _kernel_signature(members: list[fx.Node], stored: set[fx.Node]) -> tuple[Any, ...]:
    """One fused kernel: reads every value from outside it once, writes what leaves it once."""
    inside = set(members)
    read = {u for n in members for u in n.all_input_nodes if _source(u) not in inside}
    moved = sum(min(_nbytes(_value(u)), _nbytes(_value(_source(u)))) for u in read)
    moved += sum(_nbytes(_value(n)) for n in members if n in stored)
    names = list(dict.fromkeys(_op_name(n) for n in members))
    classes = {classify(name) for name in names}
    op_class = next((c for c in (OpClass.NORMALIZATION, OpClass.ELEMENTWISE) if c in classes), OpClass.OTHER)
    outputs = [t for n in members for t in tensors_in(_value(n)) if t.is_floating_point()]
    dtype = str(max(outputs, key=lambda t: t.numel()).dtype).removeprefix("torch.") if outputs else "none"
    flops = per_element_flops()
    approx = sum(flops.get(classify(_op_name(n)), 0) * sum(t.numel() for t in tensors_in(_value(n)) if t.is_floating_point())
                 for n in members)
    name = "fused:" + "+".join(names[:6]) + (f"+{len(names) - 6}" if len(names) > 6 else "")
    return (name, op_class, dtype, 0, approx, moved, False, True)
