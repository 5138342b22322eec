"""The steps of published runs that are not today's Trainer step, traced as their code ran them.

`fit.py components` traces every published run as the product traces a Trainer step, except where a
source says its code ran another step (`step` in runs.toml and checks.toml):

- "sdpa-benchmark": the training benchmark of transformers' SDPA pull requests (fxmarty's script, which
  the BERT, GPT-NeoX and OPT pull requests name as theirs; the copies quoted in those threads run): the
  model loaded in float16 (no autocast, no master weights), a forward of the batch, `loss =
  outputs.logits.sum()`, `loss.backward()`, `model.zero_grad()`; no optimizer step, no loss scaling. The
  time per batch is CUDA events around that loop.
- "apex-o2": NVIDIA's BERT code in mixed precision (DeepLearningExamples' run_pretraining.py and run_squad.py,
  which Lambda's benchmark runs: `amp.initialize(model, optimizer, opt_level="O2", ...)`): apex's O2 casts the
  model to float16, so the forward and backward run in half precision throughout (no per-op casts, softmax and
  LayerNorm inputs in float16), while the optimizer updates float32 master weights. Traced as the passes of the
  model loaded in float16 without autocast, and the optimizer step of the recipe (fp16 autocast over float32
  weights: the loss scaler's unscale and the fused Adam over float32 parameters).
- "trainer-2022": transformers 4.16's Trainer on torch 1.10 (January 2022, the guide's V100 table): its
  forward and backward are today's (the model's own loss), its optimizer step is not. `model.zero_grad()`
  kept the gradients (torch 1.10's set_to_none=False), so every micro-batch's backward adds into them (an
  add per parameter that today's first micro-batch does not run) and the step zeroes them (a zero_ per
  parameter); `clip_grad_norm_` took a norm per parameter and multiplied each (torch 1.10 had no foreach
  path); the default optimizer was transformers' own AdamW, a Python loop over the parameters
  (mul_, add_, mul_, addcmul_, sqrt, add_, addcdiv_ per parameter), whose kernels torch's AdamW with
  foreach=False runs too (lerp_ for mul_ + add_, a div for the bias correction).

Both are traced here, directly (no trace cache: the cache's keys know only the Trainer's step), at the
model's full depth.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

STEPS = ("trainer", "sdpa-benchmark", "apex-o2", "trainer-2022")
"""The steps a published run can name (`step`); "trainer" (the default) is the product's own."""


@contextlib.contextmanager
def _patched(module: Any, **replacements: Any) -> Iterator[None]:
    saved = {name: getattr(module, name) for name in replacements}
    for name, value in replacements.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _logits_sum(model: Any, reference: Any, workload: Any, recipe: Any, batch_size: int) -> Any:
    """The SDPA benchmark's loss: the sum of the logits of a forward without labels."""
    from anatomist.trace.step.inputs import make_batch

    return model(input_ids=make_batch(workload, batch_size)["input_ids"]).logits.sum()


def sdpa_benchmark_ops(workload: Any, recipe: Any, compute_capability: str) -> Any:
    """`StepOps` of the SDPA benchmark's loop: forward and backward at the recipe's batch, no optimizer."""
    from anatomist.estimate.time.ops import ops_of
    from anatomist.trace.step import trainers
    from anatomist.trace.store.parts import trace_part

    with _patched(trainers, step_loss=_logits_sum):
        traced = trace_part(workload, recipe, "forward-backward", depth=None, batch_size=recipe.per_device_train_batch_size,
                            compute_capability=compute_capability, use_cache=False)
    return ops_of(traced.ops)


def apex_o2_ops(workload: Any, recipe: Any, compute_capability: str) -> Any:
    """`StepOps` of apex O2's step: the passes of the float16 model, the optimizer step of float32 master weights."""
    import dataclasses

    from anatomist.anatomy import Phase
    from anatomist.estimate.time.ops import StepOps, step_ops

    half = dataclasses.replace(recipe, dtype="float16", fp16=False)
    passes = [r for r in step_ops(workload, half, compute_capability).records if r.phase is not Phase.OPTIMIZER]
    master = [r for r in step_ops(workload, recipe, compute_capability).records if r.phase is Phase.OPTIMIZER]
    return StepOps(records=passes + master)


def _build_2022(recipe: Any, params: list[Any]) -> Any:
    import torch

    from anatomist.trace.step.optimizer_build import build_optimizer

    if recipe.optim == "adamw_torch":  # transformers' AdamW of 2022, weight decay 0 as the Trainer passed it
        return torch.optim.AdamW(params, lr=5e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=False)
    return build_optimizer(recipe, params)


def _optimizer_phase_2022(params: list[Any], optimizer: Any, recipe: Any, tracer: Any) -> None:
    """The Trainer's optimizer step of January 2022 (module docstring), and the gradient accumulation into kept
    gradients that today's first micro-batch does not run (in the backward phase)."""
    import torch

    from anatomist.anatomy import Phase

    grads = [p.grad for p in params if p.grad is not None]
    tracer.phase, tracer.segment, tracer.block = Phase.BACKWARD, "post", -1
    for g in grads:  # AccumulateGrad into a kept gradient: grad += new (the same bytes: read two, write one)
        g.add_(g)
    tracer.phase, tracer.segment, tracer.block = Phase.OPTIMIZER, "pre", -1
    if recipe.fp16:
        torch._foreach_mul_(grads, 1.0 / 65536.0)  # GradScaler.unscale_: one foreach kernel
    if recipe.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, recipe.max_grad_norm, foreach=False)
    del grads
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def trainer_2022_optimizer_ops(workload: Any, recipe: Any, compute_capability: str) -> Any:
    """`StepOps` of the January 2022 Trainer's optimizer step (and the accumulation it adds to backward)."""
    from anatomist.estimate.time.ops import ops_of
    from anatomist.trace.step import driver

    with _patched(driver, build_optimizer=_build_2022, optimizer_phase=_optimizer_phase_2022):
        traced = driver.trace_step(workload, recipe, depth=None, batch_size=1, compute_capability=compute_capability,
                                   part="optimizer", record_ops=True)
    return ops_of(traced.ops)
