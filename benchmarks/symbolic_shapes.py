"""Spike for symbolic batch and sequence dimensions: one fake-tensor training step of a tiny model traced with
the batch and the sequence length as symbols (torch's ShapeEnv, as torch.compile's dynamic shapes make them),
against the same step on concrete fake tensors.

It measures what a symbolic trace would cost the estimator: the seconds of one step each way (the second run of
each, so imports and first-call caches are paid before), how many of the step's new storages have a size
that is an expression of the symbols, and which guards the step put on them (a guard is a branch on a size: the
expressions hold only where it holds). Run: PYTHONPATH=src python benchmarks/symbolic_shapes.py
"""

from __future__ import annotations

import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
import transformers
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from conftest import write_config  # noqa: E402  (the test suite's tiny configs)

MODELS = (("llama", "sdpa"), ("llama", "eager"), ("gpt2", "eager"), ("bert", "sdpa"))


class NewStorages(TorchDispatchMode):
    """The size of every storage an op creates (storages kept alive by a weak set, so no id is reused)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[object] = []
        self.seen: weakref.WeakSet = weakref.WeakSet()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage not in self.seen:
                    self.seen.add(storage)
                    self.sizes.append(storage.nbytes())
        return out


def step(name: str, attention: str, symbolic: bool) -> tuple[float, NewStorages, ShapeEnv | None]:
    config = transformers.AutoConfig.from_pretrained(write_config(Path(tempfile.mkdtemp()), name))
    config._attn_implementation = attention
    env = ShapeEnv() if symbolic else None
    mode = FakeTensorMode(shape_env=env, static_shapes=not symbolic)
    real = torch.zeros(3, 17, dtype=torch.long)
    head = transformers.AutoModelForMaskedLM if name == "bert" else transformers.AutoModelForCausalLM
    with mode:
        model = head.from_config(config)
    start = time.perf_counter()
    with mode:
        context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 2) if symbolic else None
        ids = mode.from_tensor(real, source=ConstantSource("input_ids"), symbolic_context=context)
        recorder = NewStorages()
        with recorder:
            logits = model(input_ids=ids).logits[:, :-1].float()
            torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    return time.perf_counter() - start, recorder, env


def main() -> None:
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for name, attention in MODELS:
        step(name, attention, symbolic=False)
        step(name, attention, symbolic=True)
        concrete, _, _ = step(name, attention, symbolic=False)
        symbolic, recorder, env = step(name, attention, symbolic=True)
        expressions = sum(1 for size in recorder.sizes if isinstance(size, torch.SymInt))
        guards = sorted({str(g.expr) for g in env.guards}) if env else []
        print(f"{name}/{attention}: concrete {concrete:.2f} s, symbolic {symbolic:.2f} s ({symbolic / concrete:.1f}x); "
              f"{expressions} of {len(recorder.sizes)} new storages sized by an expression; guards {guards}")


if __name__ == "__main__":
    main()
