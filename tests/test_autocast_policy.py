"""Op by op: the tensors saved for backward have the dtypes CUDA autocast gives them.

The expectation comes from PyTorch's CUDA autocast op reference (docs/source/amp.rst,
"CUDA Ops that can autocast to float16" and "... to float32", transcribed below), a source
apart from the header lists the implementation reads (trace/engine/autocast.py). A real forward of
tiny BERT, GPT-2 and Llama runs under bf16 autocast with fp32 weights and eager attention;
every autograd node whose op the reference lists must hold its floating-point saved tensors
in bf16 (float16 list: the half dtype) or fp32 (float32 list).
"""

from __future__ import annotations

import re

import pytest
import torch

from anatomist.trace.engine.autocast import cuda_autocast_policy
from anatomist.trace.step.inputs import make_batch
from anatomist.workload_loader import load_workload

# https://pytorch.org/docs/stable/amp.html#cuda-ops-that-can-autocast-to-float16
CUDA_TO_HALF = {
    "__matmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "multi_dot", "conv1d",
    "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "GRUCell", "linear",
    "LSTMCell", "matmul", "mm", "mv", "prelu", "RNNCell",
}
# https://pytorch.org/docs/stable/amp.html#cuda-ops-that-can-autocast-to-float32
CUDA_TO_FP32 = {
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits", "cosh",
    "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv",
    "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log", "log_softmax",
    "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss", "multilabel_margin_loss", "multi_margin_loss",
    "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh",
    "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
    "triplet_margin_loss",
}
# Backward node -> the op the reference names (autograd names the ATen op the Python API calls).
NODE_ALIASES = {"native_layer_norm": "layer_norm", "_softmax": "softmax", "_log_softmax": "log_softmax"}


def _op_of(node: torch.autograd.graph.Node) -> str:
    """`NativeLayerNormBackward0` -> `layer_norm`."""
    name = re.sub(r"Backward\d*$", "", type(node).__name__)
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
    return NODE_ALIASES.get(snake, snake)


def _saved_dtypes(workload_path, *, cuda_policy: bool) -> list[tuple[str, str, torch.dtype]]:
    """(op, saved attribute, dtype) of every floating saved tensor of one real forward."""
    workload = load_workload(str(workload_path), seq_len=16)
    torch.manual_seed(0)
    model = workload.build_model("eager", "float32")
    model.train()
    policy = cuda_autocast_policy() if cuda_policy else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with policy, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**make_batch(workload, 2)).loss
    found, seen, stack = [], set(), [loss.grad_fn]
    explicit_dtype = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
        if _op_of(node) == "nll_loss":
            # cross_entropy calls at::log_softmax(self, class_dim, self.scalar_type()) (LossNLL.cpp):
            # an explicit dtype, which the reference's "Op Eligibility" exempts from autocast.
            # Under autocast a cast to fp32 (nll_loss's policy) stands between the two.
            inputs = [n for n, _ in node.next_functions if n is not None]
            inputs += [m for n in inputs if _op_of(n) == "to_copy" for m, _ in n.next_functions if m is not None]
            explicit_dtype.update(n for n in inputs if _op_of(n) == "log_softmax")
        if node in explicit_dtype:
            continue
        for attr in dir(node):
            if attr.startswith("_saved_"):
                value = getattr(node, attr)
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    found.append((_op_of(node), attr, value.dtype))
    return found


def _mismatches(found: list[tuple[str, str, torch.dtype]]) -> tuple[list[tuple[str, str, torch.dtype]], set[str]]:
    wrong, checked = [], set()
    for op, attr, dtype in found:
        want = torch.bfloat16 if op in CUDA_TO_HALF else torch.float32 if op in CUDA_TO_FP32 else None
        if want is None:
            continue
        checked.add(op)
        if dtype != want:
            wrong.append((op, attr, dtype))
    return wrong, checked


@pytest.mark.parametrize("model", ["bert", "gpt2", "llama"])
def test_saved_tensors_have_cuda_autocast_dtypes(tiny_model, model):
    wrong, checked = _mismatches(_saved_dtypes(tiny_model(model, num_hidden_layers=2, n_layer=2), cuda_policy=True))
    assert not wrong, wrong
    # The check has teeth: matrix products and the fp32 ops of each model were seen.
    assert {"mm", "bmm"} & checked or "addmm" in checked
    expected_fp32 = {"bert": {"softmax", "layer_norm"}, "gpt2": {"softmax", "layer_norm"}, "llama": {"softmax", "pow"}}
    assert expected_fp32[model] <= checked, checked


def test_cpu_autocast_alone_would_save_other_dtypes(tiny_model):
    """Without the policy, CPU autocast keeps BERT's attention probabilities in bf16: the test above can fail."""
    wrong, _ = _mismatches(_saved_dtypes(tiny_model("bert", num_hidden_layers=2), cuda_policy=False))
    assert ("softmax", "_saved_result", torch.bfloat16) in wrong
