"""Step a library's own optimizer once, as the Trainer builds it, and print its state tensors.

Run as a script (`python optimizer_state.py OPTIM:DTYPE ...`) in a fresh interpreter with
TORCHDYNAMO_DISABLE=1: torchao's optimizers torch.compile their update, which this CPU would
take a minute per shape to build; disabled, the same code runs eagerly and allocates the same state.
Prints a JSON object: for each OPTIM:DTYPE, a list of [dtype, numel] per distinct state tensor
(shared tables once), sorted.
"""

from __future__ import annotations

import json
import sys
import tempfile

SHAPES = ((64, 256), (70, 70), (10, 256), (300,))
"""A parameter of 16,384 elements (whole 256-element blocks), one of 4,900 (>= 4,096, a partial
block), one of 2,560 and one of 300 (under the 4,096 below which no library quantizes)."""


def parameters(dtype_name: str) -> list:
    import torch

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    return [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in SHAPES]


def state_tensors(optimizer) -> list[tuple[str, int]]:
    """(dtype, numel) of every distinct tensor in the optimizer's state; a tensor subclass
    (torchao's OptimState4bit/8bit) by the tensors it is made of."""
    import torch

    seen, found = set(), []

    def add(tensor) -> None:
        inner = getattr(tensor, "__tensor_flatten__", None)
        if inner is not None and type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            for name in inner()[0]:
                add(getattr(tensor, name))
            return
        key = (tensor.untyped_storage().data_ptr(), tensor.dtype, tensor.numel())
        if key not in seen:
            seen.add(key)
            found.append((str(tensor.dtype).removeprefix("torch."), tensor.numel()))

    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                add(value)
    return sorted(found)


def library_state(optim: str, dtype_name: str) -> list[tuple[str, int]]:
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, optim=optim, use_cpu=True, report_to="none")
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    params = parameters(dtype_name)
    optimizer = cls(params, **kwargs)
    for p in params:
        p.grad = p.detach().clone()
    optimizer.step()
    return state_tensors(optimizer)


if __name__ == "__main__":
    json.dump({case: library_state(*case.split(":")) for case in sys.argv[1:]}, sys.stdout)
