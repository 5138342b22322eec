"""Overhead of AnatomistCallback per optimizer step, measured two ways on this machine.

1. Side by side: the same tiny-BERT Trainer run (seeds' data: random ids, binary labels)
   without and with the callback, alternated, REPEATS times; median train_runtime each.
   (attribute_step=None: the one attributed step is deliberately slow and is left out of
   the callback's throughput; this measures the cost on every other step.)
2. In isolation: the callback's on_step_begin + on_step_end pair called CALLS times,
   divided by the median step time of run 1: the overhead as a fraction of a step.

    PYTHONPATH=src python benchmarks/callback_overhead.py
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from transformers import Trainer, TrainerCallback

from anatomist.bench.worker import build_dataset
from anatomist.measure import AnatomistCallback
from anatomist.recipe import Recipe
from anatomist.recipe.spellings import training_arguments
from anatomist.workload_loader import load_workload

REPEATS = 5
CALLS = 20000
CONFIG = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "intermediate_size": 128, "vocab_size": 30522, "max_position_embeddings": 128}


class StepTimes(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_begin(self, *a, **k):
        self.t0 = time.perf_counter()

    def on_step_end(self, *a, **k):
        self.times.append(time.perf_counter() - self.t0)


def run(workload, ds, out: str, with_callback: bool) -> tuple[float, float]:
    recipe = Recipe(per_device_train_batch_size=4)
    args = training_arguments(recipe, out, num_train_epochs=1, report_to="none", save_strategy="no",
                                        logging_strategy="no", disable_tqdm=True, use_cpu=True)
    times = StepTimes()
    callbacks = [times] + ([AnatomistCallback(attribute_step=None, print_at_end=False)] if with_callback else [])
    result = Trainer(model=workload.build_model("sdpa"), args=args, train_dataset=ds, callbacks=callbacks).train()
    return float(result.metrics["train_runtime"]), statistics.median(times.times)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(CONFIG))
        workload = load_workload(tmp, seq_len=64, task="sequence-classification")
        ds = build_dataset(workload, 64)
        run(workload, ds, tmp + "/o", False)  # warm-up
        base, with_cb, steps = [], [], []
        for _ in range(REPEATS):
            r, s = run(workload, ds, tmp + "/o", False)
            base.append(r)
            steps.append(s)
            with_cb.append(run(workload, ds, tmp + "/o", True)[0])
    cb = AnatomistCallback(attribute_step=None, print_at_end=False)
    args = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=1, world_size=1, fp16=False, bf16=False)
    cb.on_train_begin(args, None, None)
    t0 = time.perf_counter()
    for _ in range(CALLS):
        cb.on_step_begin(args, None, None)
        cb.on_pre_optimizer_step(args, None, None)
        cb.on_step_end(args, None, None)
    per_step_s = (time.perf_counter() - t0) / CALLS
    step_s = statistics.median(steps)
    b, w = statistics.median(base), statistics.median(with_cb)
    print(f"side by side ({REPEATS} alternated runs of 16 steps): median train_runtime "
          f"{b:.3f} s without, {w:.3f} s with the callback ({(w - b) / b:+.2%}, run-to-run noise included)")
    print(f"in isolation: {per_step_s * 1e6:.1f} us per step of callback code; median step {step_s * 1e3:.1f} ms "
          f"-> {per_step_s / step_s:.3%} of a step")


if __name__ == "__main__":
    main()
