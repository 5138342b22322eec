"""What the pre-flight adds to `trainer.train()`, against one estimate, on this machine.

In one process that has torch and transformers loaded (a training script's), for Qwen2.5-0.5B's
config (the model built from it with random weights, sequence classification, 512 tokens, batch 8,
on an A100-80GB): the median of REPEATS
  - `estimate()` warm (its traces in the in-memory cache), and
  - `AnatomistCallback(preflight="warn", ...).attach(trainer)` on a fresh Trainer (reads the live
    model and TrainingArguments, then the same estimate),
the first pre-flight in a fresh trace cache (what a first run on a machine pays once), and one with
the traces on disk but not in memory (what every later run, a new process, pays).

    PYTHONPATH=src python benchmarks/preflight_overhead.py
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time

os.environ["ANATOMIST_CACHE_DIR"] = tempfile.mkdtemp(prefix="anatomist-preflight-bench-")

from transformers import Trainer, TrainingArguments  # noqa: E402

from anatomist.bench.worker import build_dataset  # noqa: E402
from anatomist.estimate.predict import estimate  # noqa: E402
from anatomist.hardware import get_gpu  # noqa: E402
from anatomist.measure import AnatomistCallback  # noqa: E402
from anatomist.measure.live import live_recipe  # noqa: E402
from anatomist.trace.store import cache  # noqa: E402
from anatomist.workload_loader import load_workload  # noqa: E402

REPEATS = 5
MODEL, SEQ, GPU = "Qwen2.5-0.5B", 512, "A100-80GB"


def main() -> None:
    logging.getLogger("anatomist").setLevel(logging.ERROR)  # the table, once per repeat: not timed output
    workload = load_workload(MODEL, seq_len=SEQ, task="sequence-classification")
    model = workload.build_model("sdpa", "float32")
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, report_to="none", use_cpu=True,
                                 save_strategy="no")
        data = build_dataset(workload, 8)

        def attach() -> float:
            trainer = Trainer(model=model, args=args, train_dataset=data)
            t0 = time.perf_counter()
            AnatomistCallback(tokens_per_sample=SEQ, gpu=GPU, record=False).attach(trainer)
            return time.perf_counter() - t0

        cold = attach()
        cache.clear_memory()  # as a new process finds it: the traces on disk only
        disk_warm = attach()
        recipe, _ = live_recipe(args, model)
        warm_estimate, warm_preflight = [], []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            estimate(workload, recipe, get_gpu(GPU))
            warm_estimate.append(time.perf_counter() - t0)
            warm_preflight.append(attach())
    print(json.dumps({"model": MODEL, "seq_len": SEQ, "first_preflight_s": round(cold, 3),
                      "disk_warm_preflight_s": round(disk_warm, 3),
                      "warm_estimate_median_s": round(statistics.median(warm_estimate), 4),
                      "warm_preflight_median_s": round(statistics.median(warm_preflight), 4),
                      "ratio": round(statistics.median(warm_preflight) / statistics.median(warm_estimate), 2)}))


if __name__ == "__main__":
    main()
